"""The flow-start check that the Ray cluster can place every worker, trial and replica a flow
asks for: an impossible request fails in seconds, naming the parameter, instead of leaving Ray
actors pending forever."""

from __future__ import annotations

from collections.abc import Sequence

from prefect_ml.integrations.compute import (
    check_fits,
    cluster_nodes,
    flag_of,
    mixed_gpu_types,
    ray_session,
)
from prefect_ml.integrations.config.resources import RequestFields, Reserving
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import run_logger
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import CampaignParams, TrainingSections
from prefect_ml.tasks.quotas import check_caps


def require_fits(
    name: str, section: Reserving, count: int, nodes: Sequence[dict[str, float]], *, what: str
) -> int:
    """:func:`check_fits` of ``count`` copies of ``section``'s request, as the settings want
    it: an error, or with ``PREFECT_ML_CHECK_RESOURCES=false`` (an autoscaling cluster) a
    warning. ``name`` is the section's in the flow parameters (``serving``), so an error names
    ``serving.replica_cpus``. Returns how many copies fit now."""
    fields = RequestFields.of(name, type(section))
    try:
        return check_fits(section.resources(), count, nodes, what=what, fields=fields)
    except ConfigurationError as exc:
        if get_settings().check_resources:
            raise
        run_logger().warning("%s (not enforced: PREFECT_ML_CHECK_RESOURCES=false)", exc)
        return 0


def require_one_gpu_type(
    name: str,
    section: Reserving,
    count: int,
    nodes: Sequence[dict[str, float]],
    *,
    what: str,
    allowed: bool,
) -> None:
    """Refuse a GPU group that Ray could spread over GPU types, unless ``allowed`` (a warning)."""
    types = mixed_gpu_types(section.resources(), count, nodes)
    if not types:
        return
    problem = (
        f"{count} {what} with GPUs could land on nodes of different GPU types "
        f"({', '.join(types)}); the group would train at the pace of its slowest GPU"
    )
    if allowed:
        run_logger().warning("%s (allowed: --allow-mixed-gpu-types)", problem)
        return
    field = RequestFields.of(name, type(section)).accelerator_type
    raise ConfigurationError(
        field,
        f"{problem}; set {flag_of(field)} to one of them, or --allow-mixed-gpu-types to accept it",
    )


def check_placement(params: TrainingSections) -> None:
    """Check a training, campaign or pipeline flow's requests against the cluster's nodes:
    the minimum training workers, one campaign trial, and the minimum serving replicas.

    A campaign alone trains no final model, so its training section places nothing. The
    tenant's caps (``PREFECT_ML_TENANT_MAX_*``) are checked first, without touching Ray.
    """
    check_caps(params)
    sweep = getattr(params, "sweep", None)
    serving = getattr(params, "serving", None)
    # (the section's name, the section, copies at once, what the copies are)
    requests: list[tuple[str, Reserving, int, str]] = []
    groups: list[tuple[str, Reserving, int, str]] = []  # data-parallel groups
    training = params.training
    if not isinstance(params, CampaignParams):
        requests.append(("training", training, training.worker_range[0], "worker(s)"))
        groups.append(("training", training, training.worker_range[1], "worker(s)"))
    if sweep is not None:
        what = "trial worker(s)" if sweep.trial_workers > 1 else "trial(s)"
        requests.append(("sweep", sweep, sweep.trial_workers, what))
        groups.append(("sweep", sweep, sweep.trial_workers, what))
    if serving is not None:
        requests.append(("serving", serving, serving.min_replicas, "replica(s)"))
    with ray_session(get_settings()):
        nodes = cluster_nodes()
        for name, section, count, what in requests:
            require_fits(name, section, count, nodes, what=what)
        for name, section, count, what in groups:
            allowed = training.allow_mixed_gpu_types
            require_one_gpu_type(name, section, count, nodes, what=what, allowed=allowed)
