"""The examples under examples/, run as their docstrings say: the GRU over token sequences
with its own steps and dict batches, trained by ``prefect-ml train`` on 2 Ray workers,
registered and served."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from examples import sequence
from prefect_ml.flows.serve import serve_model
from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import ServeModelParams
from tests.conftest import REPO_ROOT
from tests.helpers import cli_env, serve_applications_deleted_after

pytestmark = pytest.mark.e2e


@pytest.mark.usefixtures("ray_cluster")
def test_the_sequence_example_trains_on_two_workers_registers_and_serves(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, serve_port: int
) -> None:
    command = [sys.executable, "-m", "prefect_ml.flows.cli", "train"]
    command += ["--dataset", "examples.sequence:load", "--model", "examples.sequence:build"]
    command += ["--no-normalize", "--workers", "2", "--epochs", "8", "--batch-size", "64"]
    command += ["--model-name", "token-marker"]
    env = cli_env(home.home_dir)
    env["PREFECT_ML_ALLOWED_MODULES"] = "examples,tests.fixtures"
    run = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    client = tracking.client_for(home.resolved_tracking_uri)
    version = client.get_model_version("token-marker", "1")
    metrics = client.get_run(version.run_id).data.metrics
    assert metrics["test_accuracy"] > 0.85, metrics  # the marker's half is learnable
    history = client.get_metric_history(version.run_id, "val_confident_share")
    assert [m.step for m in history] == list(range(1, 9))  # its validation_step, every epoch
    assert client.get_run(version.run_id).data.tags["prefect_ml.worker_group_size"] == "2"

    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples,tests.fixtures")
    with serve_applications_deleted_after():
        served = serve_model(
            ServeModelParams(
                model_name="token-marker", serving={"port": serve_port, "replica_cpus": 0.25}
            )
        )
        tokens, labels = sequence.load(rows=64, seed=99)
        response = httpx.post(f"{served.url}/predict", json={"inputs": tokens.tolist()}, timeout=30)
        assert response.status_code == 200, response.text
        predicted = np.asarray(response.json()["predictions"]).astype(int)
        assert (predicted == labels).mean() > 0.85
