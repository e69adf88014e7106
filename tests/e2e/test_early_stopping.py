"""Early stopping and skipping what is already done, on real Prefect, Ray and MLflow (SQLite).

One early-stopped ``train_model`` on digits is shared by the module: its worker dies mid-way
and the new worker group carries on with the same patience count; it stops before its last
epoch and registers its best epoch's weights. The same training again reuses that run and
version; ``--force`` trains a new run; a resumed run that had stopped trains no further.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pytest
import torch

from prefect_ml.flows.cli import print_outcome
from prefect_ml.flows.train import TrainingOutcome, train_model
from prefect_ml.integrations import storage, tracking, training
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import load_trained_model
from prefect_ml.tasks.params import TrainModelParams
from tests.e2e.test_fault_promises import prepare
from tests.fixtures.faulty_code import BUDGET_FILE
from tests.helpers import flow_run_artifacts
from tests.tasks.test_train import train_flow

EPOCHS, PATIENCE, BATCH = 6, 2, 64
MODEL_NAME = "early-digits"
# No later epoch can beat the first's val_loss by 10: early stopping's best epoch is 1 and
# training stops after epoch 1 + PATIENCE, whatever the numbers. Retention keeps 1 checkpoint
# and no best-checkpoint metric, so epoch 1 keeps its weights only because early stopping
# needs them.
TRAINING = {
    "epochs": EPOCHS,
    "workers": 1,
    "batch_size": BATCH,
    "early_stopping_patience": PATIENCE,
    "early_stopping_min_delta": 10.0,
    "early_stopping_metric": "val_loss",
    "keep_checkpoints": 1,
    "best_checkpoint_metric": "none",
}
STOPPED_AT = 1 + PATIENCE


@dataclass(frozen=True)
class Stopped:
    settings: PrefectMLSettings
    params: TrainModelParams
    outcome: TrainingOutcome
    flow_run_id: str
    crash_dir: Path


@pytest.fixture(scope="module")
def stopped(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stopped]:
    """The early-stopped training, registered, in a home of the module's own. Its worker
    process dies (``os._exit``) once, in the middle of epoch 3, the stopping epoch."""
    folder = tmp_path_factory.mktemp("early-stopping")
    crash_dir = folder / "crashes"
    crash_dir.mkdir()
    (crash_dir / BUDGET_FILE).write_text("1")  # the force-trained run does not crash
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_ML_HOME", str(folder / "home"))
        for variable in (
            "MLFLOW_TRACKING_URI",
            "PREFECT_ML_MLFLOW_TRACKING_URI",
            "PREFECT_ML_STORAGE_URL",
        ):
            patch.delenv(variable, raising=False)
        training = {**TRAINING, "max_failures": 1}
        data = prepare(TrainModelParams.model_validate({"training": training}))
        batches = -(-data.rows["train"] // BATCH)
        options = {"crash_dir": str(crash_dir), "after_batches": 2 * batches + batches // 2}
        params = TrainModelParams.model_validate(
            {
                "model": {
                    "model": "tests.fixtures.faulty_code:crashing_model",
                    "model_options": options,
                },
                "training": training,
                "registry": {"model_name": MODEL_NAME},
            }
        )
        state = train_model(params=params, return_state=True)
        assert state.is_completed(), state
        flow_run_id = str(state.state_details.flow_run_id)
        yield Stopped(PrefectMLSettings(), params, state.result(), flow_run_id, crash_dir)


def _checkpoint_logits(outcome: TrainingOutcome, epoch: int, rows: np.ndarray) -> np.ndarray:
    trained, data = outcome.trained, outcome.data
    model, _ = load_trained_model(
        trained.checkpoint_url,
        trained.model.model,
        data.sample_shape,
        data.num_classes,
        trained.model.factory_options(),
        epoch=epoch,
    )
    with torch.no_grad():
        return model(torch.from_numpy(rows)).numpy()  # type: ignore[no-any-return]


def test_early_stopping_ends_training_and_registers_the_best_epochs_weights(
    stopped: Stopped,
) -> None:
    outcome = stopped.outcome
    trained = outcome.trained
    assert (trained.final_epoch, trained.best_epoch) == (STOPPED_AT, 1)
    assert trained.early_stopped is not None
    assert trained.early_stopped.startswith(f"epoch {STOPPED_AT} of {EPOCHS}; best epoch 1 (")
    client = tracking.client_for(stopped.settings.resolved_tracking_uri)
    run = client.get_run(trained.run_id)
    assert run.data.tags[tracking.EARLY_STOPPED_TAG] == trained.early_stopped
    assert run.data.tags[tracking.BEST_EPOCH_TAG] == "1"
    assert tracking.logged_epochs(client, trained.run_id) == list(range(1, STOPPED_AT + 1))
    store = CheckpointStore(trained.checkpoint_url)
    assert store.epochs() == list(range(1, STOPPED_AT + 1))
    with pytest.raises(CheckpointError, match="pruned"):
        store.load(2)  # neither the newest nor early stopping's best

    # The registered model (standardisation inside, raw features in) is epoch 1's network.
    data = outcome.data
    rows, _ = data.shard("test").head(64)
    mean = storage.read_array(storage.statistic_url(data.splits_url, "mean"))
    std = storage.read_array(storage.statistic_url(data.splits_url, "std"))
    mlflow.set_tracking_uri(stopped.settings.resolved_tracking_uri)
    served = mlflow.pyfunc.load_model(outcome.registration.model_uri)
    registered = np.asarray(served.predict((rows * std + mean).astype(np.float32)))
    np.testing.assert_allclose(registered, _checkpoint_logits(outcome, 1, rows), atol=1e-4)
    assert not np.allclose(registered, _checkpoint_logits(outcome, STOPPED_AT, rows), atol=1e-3)

    summary = flow_run_artifacts(stopped.flow_run_id)["training-summary"]
    assert f"early stopping ended it at {trained.early_stopped}" in summary


def test_the_same_training_again_reuses_its_run_and_version_and_force_trains_anew(
    stopped: Stopped, capsys: pytest.CaptureFixture[str]
) -> None:
    first = stopped.outcome
    client = tracking.client_for(stopped.settings.resolved_tracking_uri)
    state = train_model(params=stopped.params, return_state=True)
    assert state.is_completed(), state
    again: TrainingOutcome = state.result()

    assert again.trained.reused and again.trained.run_id == first.trained.run_id
    for field in ("final_epoch", "best_epoch", "early_stopped", "checkpoint_url"):
        assert getattr(again.trained, field) == getattr(first.trained, field), field
    assert again.evaluation.metrics == pytest.approx(first.evaluation.metrics)
    registration = again.registration
    assert (registration.version, registration.promoted) == ("1", False)
    assert f"reused MLflow run {first.trained.run_id}" in registration.reason
    assert "v1 holds @champion" in registration.reason
    experiment = first.trained.experiment_id
    assert len(client.search_runs([experiment])) == 1, "no new MLflow run"
    assert len(client.search_model_versions(f"name='{MODEL_NAME}'")) == 1, "no new version"
    # Lineage keeps every flow run that touched the run, not only the latest.
    touched = tracking.flow_runs(client.get_run(first.trained.run_id).data.tags)
    reused_by = str(state.state_details.flow_run_id)
    assert {(f, step) for _when, f, step in touched} >= {
        (stopped.flow_run_id, "train"),
        (stopped.flow_run_id, "register"),
        (reused_by, "reuse"),
    }
    summary = flow_run_artifacts(str(state.state_details.flow_run_id))["training-summary"]
    assert "**Reused**" in summary and first.trained.run_id in summary
    assert f"{MODEL_NAME} v1 were already trained" in summary
    capsys.readouterr()
    print_outcome(again)
    printed = " ".join(capsys.readouterr().err.split())
    assert "reused: reused MLflow run" in printed and "early stopped" in printed

    forced = stopped.params.model_copy(
        update={"training": stopped.params.training.model_copy(update={"force": True})}
    )
    retrained = train_model(params=forced)
    assert not retrained.trained.reused
    assert retrained.trained.run_id != first.trained.run_id
    assert retrained.registration.version == "2"
    assert len(client.search_runs([experiment])) == 2


def test_a_resumed_run_that_had_stopped_early_trains_no_further(stopped: Stopped) -> None:
    """The driver died after training, before registration (the run left unfinished): running
    the training again decides from the checkpoints that it is done, and starts no workers."""
    first = stopped.outcome.trained
    client = tracking.client_for(stopped.settings.resolved_tracking_uri)
    started_at = client.get_run(first.run_id).data.tags[training.STARTED_AT_TAG]
    client.set_terminated(first.run_id, status="FAILED")
    try:
        resumed = train_flow(stopped.params)
    finally:
        client.set_terminated(first.run_id, status="FINISHED")
    assert resumed.run_id == first.run_id
    assert (resumed.final_epoch, resumed.best_epoch) == (STOPPED_AT, 1)
    assert resumed.early_stopped == first.early_stopped
    tags = client.get_run(first.run_id).data.tags
    assert tags["prefect_ml.resumed_from_epoch"] == str(STOPPED_AT)
    assert tags[training.STARTED_AT_TAG] == started_at, "no worker group started again"
    assert CheckpointStore(first.checkpoint_url).epochs() == list(range(1, STOPPED_AT + 1))


def test_a_worker_killed_mid_way_resumed_with_the_same_patience_count(stopped: Stopped) -> None:
    """The worker died in the middle of epoch 3: the new worker group resumed from a
    checkpoint with the count its history gives, trained epoch 3 and stopped there. A count
    started over would have trained on to epoch 5."""
    assert len(list(stopped.crash_dir.glob("crash-*"))) == 1, "the worker died once"
    trained = stopped.outcome.trained
    client = tracking.client_for(stopped.settings.resolved_tracking_uri)
    tags = client.get_run(trained.run_id).data.tags
    assert tags[training.STARTED_AT_TAG] in ("2", "3"), "a new group resumed mid-way"
    assert (trained.final_epoch, trained.best_epoch) == (STOPPED_AT, 1)
