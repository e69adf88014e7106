"""Parameters from the UI, the API or the CLI cannot run code or leave the project's folders."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner

from prefect_ml.flows.cli import app
from prefect_ml.flows.predict import batch_predict
from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.flows.train import train_model
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.flows.test_invalid_parameters import _assert_nothing_written, _task_names

pytestmark = pytest.mark.empty_home  # each test asserts MLflow's database was never created


def _os_system(canary: Path) -> dict[str, object]:
    return {"dataset": "os:system", "dataset_options": {"command": f"touch {canary}"}}


def test_a_command_as_dataset_is_refused_by_the_flow_before_any_task(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    state = train_model(params={"data": _os_system(canary)}, return_state=True)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert "data.dataset" in message and "PREFECT_ML_ALLOWED_MODULES" in message
    assert _task_names(str(state.state_details.flow_run_id)) == []
    _assert_nothing_written(home)
    assert not canary.exists()


def test_a_command_as_dataset_is_refused_by_the_cli(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    canary = tmp_path / "canary"
    options = json.dumps(_os_system(canary)["dataset_options"])
    result = CliRunner().invoke(
        app, ["train", "--dataset", "os:system", "--dataset-options", options]
    )
    assert result.exit_code == 2
    assert "data.dataset" in result.output and "is not allowed" in result.output
    assert not canary.exists()


def test_a_model_factory_outside_the_allow_list_is_refused(home: PrefectMLSettings) -> None:
    state = train_model(params={"model": {"model": "shutil:rmtree"}}, return_state=True)
    assert state.is_failed()
    assert "model.model" in str(state.result(raise_on_failure=False))
    _assert_nothing_written(home)


def test_an_experiment_name_that_leaves_the_artifact_root_is_refused(
    home: PrefectMLSettings,
) -> None:
    state = train_model(params={"experiment": "../../../../elsewhere/x"}, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "experiment" in message and "'..'" in message
    _assert_nothing_written(home)


def _bobs_predictions(home: PrefectMLSettings) -> Path:
    """Tenant bob's scored output: data files and the manifest that commits them."""
    folder = home.home_dir / "storage" / "tenants" / "bob" / "predictions" / "f00d"
    folder.mkdir(parents=True)
    (folder / "0_000000.parquet").write_bytes(b"bob's predictions")
    (folder / "_SUCCESS").write_text("{}")
    return folder


def test_a_tenant_cannot_score_into_or_read_another_tenant_s_folders(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_TENANT", "alice")
    bob = _bobs_predictions(home)
    rows = home.home_dir / "storage" / "tenants" / "alice" / "rows.csv"
    for params, field in (
        ({"url": str(rows), "output": str(bob)}, "output"),
        ({"url": str(bob / "0_000000.parquet")}, "url"),
        ({"url": str(rows), "output": str(bob / ".." / ".." / ".." / "bob")}, "output"),
    ):
        state = batch_predict(params=params, return_state=True)
        assert state.is_failed()
        message = str(state.message) + str(state.result(raise_on_failure=False))
        assert field in message and ("not yours" in message or "outside" in message), message
    train = train_model(
        params={"data": {"dataset": "tabular", "url": str(bob), "label_column": "y"}},
        return_state=True,
    )
    assert train.is_failed() and "data.url" in str(train.result(raise_on_failure=False))
    assert sorted(p.name for p in bob.iterdir()) == ["0_000000.parquet", "_SUCCESS"]
    assert not (home.home_dir / "mlflow.db").exists()


def test_with_data_prefixes_a_url_elsewhere_or_through_a_link_is_refused(
    home: PrefectMLSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allowed, secret = tmp_path / "allowed", tmp_path / "private" / "secrets.csv"
    allowed.mkdir()
    secret.parent.mkdir()
    secret.write_text("password,hunter2\n1,2\n")
    (allowed / "link.csv").symlink_to(secret)
    (allowed / "linked-folder").symlink_to(secret.parent)
    monkeypatch.setenv("PREFECT_ML_DATA_PREFIXES", f"{allowed},s3://lake/shared")
    for url in (
        str(secret),
        str(allowed / "link.csv"),
        str(allowed / "linked-folder"),
        f"file://{allowed}/../private/secrets.csv",
        f"{allowed}-other/a.csv",
        "s3://lake/shared-other/a.csv",
        "s3://lake/sharedx",
        "zip://a.csv::s3://lake/private/a.zip",
    ):
        state = train_model(
            params={"data": {"dataset": "tabular", "url": url, "label_column": "y"}},
            return_state=True,
        )
        assert state.is_failed(), url
        message = str(state.result(raise_on_failure=False))
        assert "data.url" in message and "hunter2" not in message, (url, message)
    _assert_nothing_written(home)


@pytest.mark.parametrize(
    ("first_line", "label", "hint"),
    [
        ("AKIAEXAMPLE,wJalrXUtnFEMI/K7MDENG", "y", "which has 2 columns."),
        ("hunter2", "hunter", "which has 1 column."),  # the only name: not shown
        ("id,secret-token-1,targit", "target", "which has 3 columns; the closest: ['targit']"),
    ],
)
def test_a_missing_label_column_names_the_count_never_the_header(
    home: PrefectMLSettings, tmp_path: Path, first_line: str, label: str, hint: str
) -> None:
    """Issue 36, finding 4: the error quoted the file's first line whole, so a data URL naming
    a file that is not data (a credentials file) showed its secret."""
    secret = tmp_path / "credentials.csv"
    secret.write_text(f"{first_line}\n" + ",".join(["1"] * (first_line.count(",") + 1)) + "\n")
    state = train_model(
        params={"data": {"dataset": "tabular", "url": str(secret), "label_column": label}},
        return_state=True,
    )
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert f"data.label_column: column {label!r} is not in" in message, message
    assert hint in message, message
    for name in first_line.split(","):
        assert name == "targit" or name not in message.replace(str(tmp_path), ""), message
    _assert_nothing_written(home)


def test_a_file_among_the_data_with_other_columns_is_reported_without_its_header(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    """Issue 36, finding 4, the same shape: a glob that reaches a credentials file beside the
    data quoted the columns that differ, the secret among them."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a-data.csv").write_text("x,y\n" + "1.0,0\n2.0,1\n" * 10)
    (folder / "b-credentials.csv").write_text("AKIAEXAMPLE,y\n1,0\n")
    state = train_model(
        params={"data": {"dataset": "tabular", "url": f"{folder}/*.csv", "label_column": "y"}},
        return_state=True,
    )
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "b-credentials.csv has other columns than" in message, message
    assert "2 columns against 2, 2 not in both" in message and "AKIA" not in message, message
    _assert_nothing_written(home)


def test_a_grid_too_large_to_build_is_refused_by_the_flow_before_it_is_built(
    home: PrefectMLSettings,
) -> None:
    """Issue 36, finding 10: the grid of 10^12 ints was built inside the validator."""
    search_space = {"hidden": {"type": "int", "low": 1, "high": 1e12}}
    tracemalloc.start()
    try:
        state = hpo_campaign(
            params={"sweep": {"sampler": "grid", "search_space": search_space}},
            return_state=True,
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "search_space.hidden: the grid has 1,000,000,000,000 values" in message
    assert peak < 200 * 2**20
    _assert_nothing_written(home)
