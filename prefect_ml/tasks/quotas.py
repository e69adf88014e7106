"""A tenant's quotas, applied at flow start: caps per run on what parameters ask for, and the
Prefect concurrency limit on the tenant's tag that its training and campaign tasks carry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings, get_settings
from prefect_ml.tasks.params import CampaignParams, ServingParams, SweepParams, TrainingParams


def check_caps(params: Any, settings: PrefectMLSettings | None = None) -> None:
    """Refuse a flow's parameters that ask for more than the ``PREFECT_ML_TENANT_MAX_*`` caps,
    naming the parameter and the setting; ``params`` is any flow's parameters (training,
    campaign, pipeline or serving sections)."""
    settings = settings or get_settings()
    training: TrainingParams | None = getattr(params, "training", None)
    sweep: SweepParams | None = getattr(params, "sweep", None)
    serving: ServingParams | None = getattr(params, "serving", None)
    # (field, amount asked, cap): the cap is the setting PREFECT_ML_TENANT_MAX_<CAP>.
    asks: list[tuple[str, float, str]] = []
    if training is not None and not isinstance(params, CampaignParams):  # a campaign alone
        workers = training.worker_range[1]  # trains no final model
        asks += [
            ("training.workers", workers, "workers"),
            ("training.use_gpu", workers * training.resources().gpus, "gpus"),
        ]
    if sweep is not None:
        trial_gpus = sweep.concurrency * sweep.trial_workers * sweep.trial_gpus
        asks += [
            ("sweep.trial_workers", sweep.trial_workers, "workers"),
            ("sweep.concurrency", sweep.concurrency, "concurrent_trials"),
            ("sweep.trial_gpus", trial_gpus, "gpus"),
        ]
    if serving is not None:
        asks += [
            ("serving.max_replicas", serving.max_replicas, "replicas"),
            ("serving.replica_gpus", serving.max_replicas * serving.replica_gpus, "gpus"),
        ]
    whose = f"tenant {settings.tenant!r}" if settings.tenant else "this home"
    for field, asked, cap_name in asks:
        cap = getattr(settings, f"tenant_max_{cap_name}")
        if cap is not None and asked > cap:
            raise ConfigurationError(
                field,
                f"asks for {asked:g}, more than the {cap:g} a run of {whose} may use "
                f"(PREFECT_ML_TENANT_MAX_{cap_name.upper()}); ask for less, or have the "
                "operator raise it",
            )


def apply_ray_slots(settings: PrefectMLSettings | None = None) -> None:
    """Set the tenant's Prefect concurrency limit from ``PREFECT_ML_TENANT_RAY_SLOTS``, if set."""
    from prefect_ml.integrations.services import set_tag_quota

    settings = settings or get_settings()
    if settings.tenant_ray_slots is None:
        return
    if settings.tenant is None:
        raise ConfigurationError(
            "PREFECT_ML_TENANT_RAY_SLOTS", "is a tenant's quota: set PREFECT_ML_TENANT as well"
        )
    set_tag_quota(tenancy.tag(settings.tenant), settings.tenant_ray_slots)


@contextlib.contextmanager
def tenant_tags(settings: PrefectMLSettings | None = None) -> Iterator[None]:
    """Tasks started inside carry the tenant's tag (``tenant:<name>``), whose Prefect
    concurrency limit is the tenant's quota; nothing changes without a tenant."""
    from prefect import tags

    settings = settings or get_settings()
    if settings.tenant is None:
        yield
        return
    with tags(tenancy.tag(settings.tenant)):
        yield
