"""Parameters from the UI, the API or the CLI cannot run code or leave the project's folders."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from prefect_ml.flows.cli import app
from prefect_ml.flows.train import train_model
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.flows.test_invalid_parameters import _assert_nothing_written, _task_names


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
