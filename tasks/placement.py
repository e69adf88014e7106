"""The flow-start check that the Ray cluster can place every worker, trial and replica a flow
asks for: an impossible request fails in seconds, naming the parameter, instead of leaving Ray
actors pending forever."""

from __future__ import annotations

from collections.abc import Sequence

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.prefect_server import run_logger
from prefect_ml.integrations.ray_cluster import ray_session
from prefect_ml.integrations.resources import (
    RequestFields,
    ResourceRequest,
    check_fits,
    cluster_nodes,
    flag_of,
    mixed_gpu_types,
)
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import (
    REPLICA_FIELDS,
    TRIAL_FIELDS,
    WORKER_FIELDS,
    CampaignParams,
    TrainingSections,
)
from prefect_ml.tasks.quotas import check_caps


def require_fits(
    request: ResourceRequest,
    count: int,
    nodes: Sequence[dict[str, float]],
    *,
    what: str,
    fields: RequestFields,
) -> int:
    """:func:`check_fits` as the settings want it: an error, or with
    ``PREFECT_ML_CHECK_RESOURCES=false`` (an autoscaling cluster) a warning. Returns how many
    copies fit now."""
    try:
        return check_fits(request, count, nodes, what=what, fields=fields)
    except ConfigurationError as exc:
        if get_settings().check_resources:
            raise
        run_logger().warning("%s (not enforced: PREFECT_ML_CHECK_RESOURCES=false)", exc)
        return 0


def require_one_gpu_type(
    request: ResourceRequest,
    count: int,
    nodes: Sequence[dict[str, float]],
    *,
    what: str,
    fields: RequestFields,
    allowed: bool,
) -> None:
    """Refuse a GPU group that Ray could spread over GPU types, unless ``allowed`` (a warning)."""
    types = mixed_gpu_types(request, count, nodes)
    if not types:
        return
    problem = (
        f"{count} {what} with GPUs could land on nodes of different GPU types "
        f"({', '.join(types)}); the group would train at the pace of its slowest GPU"
    )
    if allowed:
        run_logger().warning("%s (allowed: --allow-mixed-gpu-types)", problem)
        return
    raise ConfigurationError(
        fields.accelerator_type,
        f"{problem}; set {flag_of(fields.accelerator_type)} to one of them, or "
        "--allow-mixed-gpu-types to accept it",
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
    requests: list[tuple[ResourceRequest, int, str, RequestFields]] = []
    groups: list[tuple[ResourceRequest, int, str, RequestFields]] = []  # data-parallel groups
    training = params.training
    if not isinstance(params, CampaignParams):
        requests.append(
            (training.worker_request(), training.worker_range[0], "worker(s)", WORKER_FIELDS)
        )
        groups.append(
            (training.worker_request(), training.worker_range[1], "worker(s)", WORKER_FIELDS)
        )
    if sweep is not None:
        what = "trial worker(s)" if sweep.trial_workers > 1 else "trial(s)"
        trials = (sweep.trial_request(), sweep.trial_workers, what, TRIAL_FIELDS)
        requests.append(trials)
        groups.append(trials)
    if serving is not None:
        requests.append(
            (serving.replica_request(), serving.min_replicas, "replica(s)", REPLICA_FIELDS)
        )
    with ray_session(get_settings()):
        nodes = cluster_nodes()
        for request, count, what, fields in requests:
            require_fits(request, count, nodes, what=what, fields=fields)
        for request, count, what, fields in groups:
            require_one_gpu_type(
                request,
                count,
                nodes,
                what=what,
                fields=fields,
                allowed=training.allow_mixed_gpu_types,
            )
