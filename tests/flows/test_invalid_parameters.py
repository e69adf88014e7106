"""Invalid parameters fail with the field's name before Ray, MLflow or storage is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import train_model
from prefect_ml.integrations.settings import PrefectMLSettings

pytestmark = pytest.mark.empty_home  # each test asserts MLflow's database was never created


def _task_names(flow_run_id: str) -> list[str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return [run.name.rsplit("-", 1)[0] for run in runs]


def _assert_nothing_written(home: PrefectMLSettings) -> None:
    assert not (home.home_dir / "mlflow.db").exists()
    assert not (home.home_dir / "storage").exists()
    assert not (home.home_dir / "ray_results").exists()


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({"training": {"workers": 0}}, "training.workers"),
        ({"training": {"epochs": 0}}, "training.epochs"),
        ({"training": {"lr": -1.0}}, "training.lr"),
        ({"data": {"dataset": "imagenet"}}, "unknown dataset 'imagenet'"),
        ({"model": {"model": "missing_pkg.mod:build"}}, "PREFECT_ML_ALLOWED_MODULES"),
        (
            {"model": {"model": "tests.fixtures.missing:build"}},
            "cannot import module 'tests.fixtures.missing'",
        ),
        (
            {"data": {"dataset": "tabular", "url": "s3://b/x/..%2fy.csv", "label_column": "y"}},
            "keys must stay inside their prefix",
        ),
    ],
)
def test_parameter_errors_fail_the_flow_before_any_task(
    home: PrefectMLSettings, parameters: dict[str, Any], expected: str
) -> None:
    state = train_model(params=parameters, return_state=True)
    assert state.is_failed()
    assert expected in str(state.message) + str(state.result(raise_on_failure=False))
    assert _task_names(str(state.state_details.flow_run_id)) == []
    _assert_nothing_written(home)


def test_data_errors_fail_in_inspection_before_anything_is_written(
    home: PrefectMLSettings, tmp_path: Path, ray_cluster: None
) -> None:
    csv = tmp_path / "flowers.csv"
    pd.DataFrame({"petal": [1.0, 2.0] * 20, "kind": ["a", "b"] * 20}).to_csv(csv, index=False)
    cases = [
        (
            {"data": {"dataset": "tabular", "url": csv.as_uri(), "label_column": "species"}},
            "data.label_column: column 'species' is not in",
        ),
        (
            {"training": {"batch_size": 4000}},
            "training.batch_size: 4000 is larger than the training split",
        ),
    ]
    for parameters, expected in cases:
        state = train_model(params=parameters, return_state=True)
        assert state.is_failed()
        assert expected in str(state.result(raise_on_failure=False))
        assert _task_names(str(state.state_details.flow_run_id)) == ["inspect-data"]
    _assert_nothing_written(home)


@pytest.mark.parametrize(
    ("flow", "parameters", "field", "expected"),
    [
        (
            train_model,
            {"training": {"use_gpu": True, "accelerator_type": "H100"}},
            "training.accelerator_type",
            "the cluster has 0 H100 GPUs",
        ),
        (
            hpo_campaign,
            {"sweep": {"trial_gpus": 1}},
            "sweep.trial_gpus",
            "the cluster has 0 GPU in total",
        ),
    ],
)
def test_requests_the_cluster_cannot_place_fail_the_flow_before_any_task(
    home: PrefectMLSettings,
    ray_cluster: None,
    flow: Any,
    parameters: dict[str, Any],
    field: str,
    expected: str,
) -> None:
    """The local Ray has 2 CPUs and no GPU: the check fails in seconds instead of pending."""
    state = flow(params=parameters, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert message.startswith(f"{field}: ") and expected in message
    assert _task_names(str(state.state_details.flow_run_id)) == []
    _assert_nothing_written(home)


@pytest.mark.parametrize(
    ("storage_url", "expected"),
    [
        ("s3://no-such-bucket/prefect-ml", "bucket 'no-such-bucket'"),
        ("s3://prefect-ml-test/team/../other-team", "PREFECT_ML_STORAGE_URL"),
    ],
)
def test_storage_errors_fail_the_flow_before_any_task(
    home: PrefectMLSettings,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    storage_url: str,
    expected: str,
) -> None:
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", storage_url)
    state = train_model(params={"training": {"epochs": 1}}, return_state=True)
    assert state.is_failed()
    assert expected in str(state.result(raise_on_failure=False))
    assert _task_names(str(state.state_details.flow_run_id)) == []
    assert not (home.home_dir / "mlflow.db").exists()


def test_refused_s3_credentials_fail_the_flow_before_any_task(
    home: PrefectMLSettings, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moto.settings
    from s3fs import S3FileSystem

    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", f"{s3_bucket}/prefect-ml")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys
    S3FileSystem.clear_instance_cache()
    state = train_model(params={"training": {"epochs": 1}}, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "S3 refused the credentials" in message and "AWS_ACCESS_KEY_ID" in message
    assert _task_names(str(state.state_details.flow_run_id)) == []
    assert not (home.home_dir / "mlflow.db").exists()
