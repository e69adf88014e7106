"""examples/lightning_classifier.py, a LightningModule written as Lightning's documentation
writes it, trained with DDP on 2 Ray workers through ``prefect-ml train`` and through the
``train`` task in a user's flow: its self.log'ged metrics reach MLflow every epoch, its StepLR
halves the learning rate every epoch, early stopping watches its own val_acc, evaluation runs its
test_step, and the registered model (its predict_step) serves (full tier: tests/e2e/ outside
tests/tiers.py's entry points)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import httpx
import numpy as np
import pytest
from prefect import flow

from prefect_ml import preprocess, train
from prefect_ml.flows.serve import serve_model
from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import ServeModelParams
from tests.conftest import REPO_ROOT
from tests.helpers import cli_env, serve_applications_deleted_after

pytestmark = pytest.mark.e2e

MODEL = "examples.lightning_classifier:build"
# val_acc is logged by the model's validation_step; no epoch after the first beats it by 0.5, so
# with patience 1 training stops after epoch 2 of 6.
STOPPING = {
    "early_stopping_patience": 1,
    "early_stopping_metric": "val_acc",
    "early_stopping_mode": "max",
    "early_stopping_min_delta": 0.5,
}


def _check_run(home: PrefectMLSettings, run_id: str, epochs: int = 6) -> int:
    """The run's per-epoch record of the module's own logging; how many epochs it trained."""
    client = tracking.client_for(home.resolved_tracking_uri)
    run = client.get_run(run_id)
    assert run.data.tags["prefect_ml.worker_group_size"] == "2"
    trained = len(client.get_metric_history(run_id, "val_acc"))
    for name in ("val_acc", "val_loss", "train_loss_epoch", "train_loss_step"):  # self.log'ged
        history = client.get_metric_history(run_id, name)
        assert [m.step for m in history] == list(range(1, trained + 1)), (name, history)
    lrs = [m.value for m in client.get_metric_history(run_id, "lr")]
    assert lrs == pytest.approx([0.1 * 0.5**epoch for epoch in range(trained)])  # StepLR
    assert run.data.metrics["val_acc"] > 0.85  # digits: a mean over both workers' rows
    if trained < epochs:
        assert (
            f"epoch {trained} of {epochs}; best epoch" in run.data.tags[tracking.EARLY_STOPPED_TAG]
        )
        assert "(val_acc" in run.data.tags[tracking.EARLY_STOPPED_TAG]
    return trained


@pytest.mark.usefixtures("ray_cluster")
def test_the_lightning_example_trains_on_two_workers_through_the_cli_and_serves(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, serve_port: int
) -> None:
    command = [sys.executable, "-m", "prefect_ml.flows.cli", "train", "--model", MODEL]
    command += ["--workers", "2", "--epochs", "6", "--model-name", "lit-digits"]
    for name, value in STOPPING.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = cli_env(home.home_dir)
    env["PREFECT_ML_ALLOWED_MODULES"] = "examples,tests.fixtures"
    run = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "val_acc" in output and "train_loss_epoch" in output  # prog_bar=True: the CLI line
    assert "self.trainer` reference is not registered" not in output  # no Lightning warnings

    client = tracking.client_for(home.resolved_tracking_uri)
    version = client.get_model_version("lit-digits", "1")
    assert _check_run(home, version.run_id) == 2
    metrics = client.get_run(version.run_id).data.metrics
    assert metrics["test_acc"] == pytest.approx(metrics["test_accuracy"])  # its test_step

    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "examples,tests.fixtures")
    with serve_applications_deleted_after():
        served = serve_model(
            ServeModelParams(
                model_name="lit-digits", serving={"port": serve_port, "replica_cpus": 0.25}
            )
        )
        from sklearn.datasets import load_digits

        digits = load_digits()
        rows = digits.images[:64].reshape(64, -1).tolist()
        response = httpx.post(f"{served.url}/predict", json={"inputs": rows}, timeout=30)
        assert response.status_code == 200, response.text
        predicted = np.asarray(response.json()["predictions"]).astype(int)
        assert (predicted == digits.target[:64]).mean() > 0.85


@pytest.mark.usefixtures("ray_cluster")
def test_the_lightning_example_trains_through_the_train_task_in_a_user_s_flow(
    home: PrefectMLSettings,
) -> None:
    """The page's flow (examples/lightning_flow.py), run as its docstring says."""
    env = cli_env(home.home_dir)
    env["PREFECT_ML_ALLOWED_MODULES"] = "examples,tests.fixtures"
    command = [sys.executable, "-m", "examples.lightning_flow"]
    run = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    *_, run_id = re.findall(r"^[0-9a-f]{32}$", run.stdout, re.MULTILINE)  # what it prints
    # early stopping (patience 2) on val_acc: 3 epochs at least
    assert _check_run(home, run_id) >= 3


@pytest.mark.usefixtures("ray_cluster")
def test_a_factory_that_raises_fails_the_train_task_once_without_retries(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, finding 5: a TypeError of the user's factory was retried twice with 20-70 s of
    back-off; it is the user's code, so the task fails at its first run, naming the error."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from prefect_ml.integrations.errors import TrainingCodeError

    monkeypatch.setenv("PREFECT_ML_TASK_RETRIES", "2")

    @flow
    def my_flow() -> None:
        data = preprocess(dataset="tests.fixtures.user_code:blobs")
        train(data, model="tests.fixtures.lightning_code:kwargs_only", model_options={"depth": 2})

    state = my_flow(return_state=True)
    with pytest.raises(TrainingCodeError, match="TypeError: kwargs_only got unexpected"):
        state.result()

    async def task_runs() -> list[Any]:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
                )
            )

    (run,) = [r for r in asyncio.run(task_runs()) if r.name.startswith("train")]
    assert run.run_count == 1 and run.state_name == "Failed"  # no retry
