"""Two identical ``prefect-ml train`` commands: the second is refused while the first runs,
naming the first's process, and the first finishes untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import LeaseHeldError
from prefect_ml.tasks.params import TrainModelParams
from tests.conftest import REPO_ROOT
from tests.helpers import cli_env, wait_while_running
from tests.tasks.test_train import train_flow

EPOCHS = 2
MODEL = "tests.fixtures.user_code:slow_model"


@pytest.mark.usefixtures("ray_cluster")
def test_second_driver_of_a_running_training_is_refused(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    """The first command's model waits for a gate file, so it is certainly training when the
    second (the same parameters and steps, in this process) asks for the run's lease."""
    options = {"delay": 0.0, "gate": str(tmp_path / "gate")}
    command = [sys.executable, "-m", "prefect_ml.flows.cli", "train", "--model", MODEL]
    command += ["--model-options", json.dumps(options), "--epochs", str(EPOCHS)]
    command += ["--workers", "1"]
    env = cli_env(home.home_dir)
    log_path = tmp_path / "first.log"
    with log_path.open("wb") as log:
        first = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_while_running(
            first, log_path, (tmp_path / "gate.waiting").exists, 300, "the first command to train"
        )
        params = TrainModelParams.model_validate(
            {
                "model": {"model": MODEL, "model_options": options},
                "training": {"epochs": EPOCHS, "workers": 1},
            }
        )
        with pytest.raises(LeaseHeldError) as refused:
            train_flow(params)  # the same steps as the command, in this process
    finally:
        (tmp_path / "gate").touch()
        returncode = first.wait(timeout=600)
    assert f"is being written by process {first.pid} on " in str(refused.value)
    assert returncode == 0, log_path.read_text()[-3000:]

    client = tracking.client_for(home.resolved_tracking_uri)
    runs = client.search_runs(["1"])
    assert len(runs) == 1, "the refused driver created no run"
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert "prefect_ml.resumed_from_epoch" not in run.data.tags, "nobody reopened the run"
    assert tracking.logged_epochs(client, run.info.run_id) == list(range(1, EPOCHS + 1))
