"""`prefect-ml run` exactly as a newcomer types it after `make run`'s install: a new project
home, its own local Ray and Prefect ephemeral API, MLflow's database created on first use. It is
the one test of that cold path; every other test's home starts from the session's migrated
MLflow database (tests/conftest.py, ``home``) and its CLI commands join the session's services
(:func:`tests.helpers.cli_env`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations import tracking
from tests.helpers import cold_env

BIN = Path(sys.executable).parent


@pytest.mark.entry_point("prefect-ml run, cold")
def test_prefect_ml_run_in_a_new_home_trains_registers_and_promotes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    run = subprocess.run(
        [str(BIN / "prefect-ml"), "run"],
        cwd=tmp_path,
        env=cold_env(home),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode == 0, output[-4000:]
    assert "digits-classifier v1" in output and "promoted:" in output, output[-4000:]

    # Everything it kept lives under the home: MLflow's database (created on first use),
    # Prefect's own database, the splits and the checkpoints.
    client = tracking.client_for(f"sqlite:///{home / 'mlflow.db'}")
    champion = tracking.champion(client, "digits-classifier", "champion")
    assert champion is not None and champion[0] == "1"
    run_id = champion[1]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    epochs = int(finished.data.params["training.epochs"])
    assert tracking.logged_epochs(client, run_id) == list(range(1, epochs + 1))
    assert finished.data.metrics["test_accuracy"] >= 0.9
    assert finished.data.tags[tracking.FLOW_RUN_TAG]  # the ephemeral API's flow run
    assert (home / "prefect").is_dir() and (home / "storage" / "checkpoints").is_dir()
