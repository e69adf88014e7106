"""A tenant's caps per run: each parameter that asks for more than its cap is named, with the
setting that caps it; no cap set, nothing is refused."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import CampaignParams, PipelineParams, ServeModelParams
from prefect_ml.tasks.quotas import apply_ray_slots, check_caps

_BIG = PipelineParams.model_validate(
    {
        "training": {"workers": "2-4", "use_gpu": True},
        "sweep": {"campaign": "c", "concurrency": 3, "trial_workers": 2, "trial_gpus": 0.5},
        "serving": {"max_replicas": 3, "replica_gpus": 2},
    }
)


@pytest.mark.parametrize(
    ("caps", "field", "setting"),
    [
        ({"tenant_max_workers": 3}, "training.workers", "PREFECT_ML_TENANT_MAX_WORKERS"),
        ({"tenant_max_gpus": 3.5}, "training.use_gpu", "PREFECT_ML_TENANT_MAX_GPUS"),
        ({"tenant_max_gpus": 5}, "serving.replica_gpus", "PREFECT_ML_TENANT_MAX_GPUS"),
        (
            {"tenant_max_concurrent_trials": 2},
            "sweep.concurrency",
            "PREFECT_ML_TENANT_MAX_CONCURRENT_TRIALS",
        ),
        ({"tenant_max_replicas": 2}, "serving.max_replicas", "PREFECT_ML_TENANT_MAX_REPLICAS"),
    ],
)
def test_a_parameter_over_its_cap_is_refused_naming_it_and_the_setting(
    caps: dict[str, Any], field: str, setting: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_caps(_BIG, PrefectMLSettings(tenant="acme", **caps))
    assert caught.value.field == field
    assert setting in caught.value.message and "tenant 'acme'" in caught.value.message


def test_caps_at_what_is_asked_pass_and_a_campaign_alone_places_no_final_training() -> None:
    check_caps(_BIG, PrefectMLSettings())
    at_the_caps = PrefectMLSettings(
        tenant_max_workers=4,
        tenant_max_gpus=6,
        tenant_max_concurrent_trials=3,
        tenant_max_replicas=3,
    )
    check_caps(_BIG, at_the_caps)
    campaign = CampaignParams(training={"workers": 8}, sweep={"trial_workers": 1})
    check_caps(campaign, PrefectMLSettings(tenant_max_workers=1, tenant_max_concurrent_trials=2))
    with pytest.raises(ConfigurationError, match="sweep.trial_workers"):
        check_caps(
            CampaignParams(sweep={"trial_workers": 2}), PrefectMLSettings(tenant_max_workers=1)
        )
    with pytest.raises(ConfigurationError, match="serving.max_replicas"):
        check_caps(
            ServeModelParams(serving={"max_replicas": 2}), PrefectMLSettings(tenant_max_replicas=1)
        )


def test_ray_slots_without_a_tenant_are_refused() -> None:
    with pytest.raises(ConfigurationError) as caught:
        apply_ray_slots(PrefectMLSettings(tenant_ray_slots=1))
    assert caught.value.field == "PREFECT_ML_TENANT_RAY_SLOTS"
