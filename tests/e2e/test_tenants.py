"""Two tenants in one home, on the real Prefect, Ray, MLflow (SQLite) and Optuna: each trains,
registers and runs a campaign under its own names; neither sees nor moves the other's champion,
campaign or checkpoints, and one tenant's quota does not hold the other back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import train_model
from prefect_ml.integrations import tenancy, tracking
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import RAY_TAG
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import CampaignParams, TrainModelParams

pytestmark = pytest.mark.usefixtures("ray_cluster")

TINY = {"training": {"epochs": 1, "workers": 1, "batch_size": 128}}


@pytest.fixture
def as_tenant(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Switch tenants by environment, as two separately configured processes would; the
    tenants' concurrency limits on the session's Prefect server are removed afterwards."""
    yield monkeypatch
    with get_client(sync_client=True) as client:
        for tenant in ("acme", "beta"):
            try:
                client.delete_concurrency_limit_by_tag(tenancy.tag(tenant))
            except Exception:  # noqa: BLE001 - no limit was set for this one
                pass


def _task_tags(flow_run_id: object) -> dict[str, set[str]]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: set(run.tags) for run in runs}


def test_tenants_keep_their_own_champions_and_checkpoints_and_quotas(
    home: PrefectMLSettings, as_tenant: pytest.MonkeyPatch
) -> None:
    params = TrainModelParams.model_validate(TINY)

    # acme's quota is 0 Ray slots: its training is refused by Prefect, not queued forever...
    as_tenant.setenv("PREFECT_ML_TENANT", "acme")
    as_tenant.setenv("PREFECT_ML_TENANT_RAY_SLOTS", "0")
    refused = train_model(params=params, return_state=True)
    assert not refused.is_completed()
    assert "tenant:acme" in str(refused.result(raise_on_failure=False))
    # ... and a run over its caps fails at flow start, naming the parameter and the setting.
    as_tenant.setenv("PREFECT_ML_TENANT_MAX_WORKERS", "1")
    with pytest.raises(ConfigurationError, match="PREFECT_ML_TENANT_MAX_WORKERS") as caught:
        train_model(params=TrainModelParams.model_validate({"training": {"workers": 2}}))
    assert caught.value.field == "training.workers"

    # beta, configured apart, is held back by neither.
    as_tenant.setenv("PREFECT_ML_TENANT", "beta")
    as_tenant.delenv("PREFECT_ML_TENANT_RAY_SLOTS")
    as_tenant.delenv("PREFECT_ML_TENANT_MAX_WORKERS")
    beta_state = train_model(params=params, return_state=True)
    assert beta_state.is_completed(), beta_state
    beta = beta_state.result()
    tags = _task_tags(beta_state.state_details.flow_run_id)
    assert {RAY_TAG, "tenant:beta"} <= tags["train"]
    assert "tenant:beta" not in tags["evaluate"], "the quota counts Ray-occupying tasks only"

    # acme, given a slot, trains the same data and model: its own run, its own champion.
    as_tenant.setenv("PREFECT_ML_TENANT", "acme")
    as_tenant.setenv("PREFECT_ML_TENANT_RAY_SLOTS", "1")
    acme = train_model(params=params)
    for outcome, tenant in ((acme, "acme"), (beta, "beta")):
        assert outcome.registration.model_name == f"{tenant}.digits-classifier"
        assert (outcome.registration.version, outcome.registration.promoted) == ("1", True)
    assert acme.trained.run_id != beta.trained.run_id, "acme did not resume beta's run"

    client = tracking.client_for(home.resolved_tracking_uri)
    names = {m.name for m in client.search_registered_models()}
    assert names == {"acme.digits-classifier", "beta.digits-classifier"}
    experiments = {e.name for e in client.search_experiments()}
    assert {"acme.prefect-ml", "beta.prefect-ml"} <= experiments
    assert "prefect-ml" not in experiments
    storage_root = home.home_dir / "storage"
    assert not (storage_root / "checkpoints").exists(), "nothing outside the tenants' folders"
    for outcome, tenant in ((acme, "acme"), (beta, "beta")):
        checkpoints = storage_root / "tenants" / tenant / "checkpoints"
        assert list(checkpoints.glob(f"*/{outcome.trained.run_id}/epoch-000001/MANIFEST.json"))

    # acme can neither find beta's model nor move its alias, whatever name it gives.
    with pytest.raises(ConfigurationError) as caught:
        tracking.registered_version(
            client, "beta.digits-classifier", alias="champion", version=None
        )
    assert "beta.digits-classifier'" not in caught.value.message.split("registered:")[1]
    with pytest.raises(Exception, match="acme.beta.digits-classifier"):
        tracking.set_alias(client, "beta.digits-classifier", "champion", "1")
    assert tracking.champion(client, "digits-classifier", "champion") == (
        "1",
        acme.trained.run_id,
    )
    as_tenant.setenv("PREFECT_ML_TENANT", "beta")
    assert tracking.champion(client, "digits-classifier", "champion") == (
        "1",
        beta.trained.run_id,
    )


def _trial_dirs(home: PrefectMLSettings, tenant: str) -> list[Path]:
    return list((home.home_dir / "storage" / "tenants" / tenant / "campaigns").glob("*/*/trial-*"))


def test_tenants_running_a_campaign_of_the_same_name_share_nothing(
    home: PrefectMLSettings, as_tenant: pytest.MonkeyPatch
) -> None:
    params = CampaignParams.model_validate(
        {**TINY, "sweep": {"campaign": "shared", "n_trials": 1, "concurrency": 1}}
    )
    results = {}
    for tenant in ("acme", "beta"):
        as_tenant.setenv("PREFECT_ML_TENANT", tenant)
        results[tenant] = hpo_campaign(params)
        assert results[tenant].finished == 1, "a fresh campaign, not the other tenant's"
    assert results["acme"].parent_run_id != results["beta"].parent_run_id
    studies = optuna.get_all_study_names(home.resolved_optuna_storage)
    assert sorted(studies) == ["acme.shared", "beta.shared"]
    for tenant in ("acme", "beta"):
        assert len(_trial_dirs(home, tenant)) == 1
