"""Training on a real local Ray: an elastic worker group, checkpoints, a worker killed mid-epoch,
a driver whose lease another driver took over, a run evaluated twice."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

import pytest
from prefect import flow

from prefect_ml.integrations import storage, tracking, training
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import LeaseLostError, LeaseRecord
from prefect_ml.tasks.data import inspect_dataset, preprocess_dataset
from prefect_ml.tasks.evaluate import Evaluation, evaluate_model
from prefect_ml.tasks.params import TrainModelParams
from prefect_ml.tasks.train import TrainResult, train_distributed
from tests.helpers import committed_epochs, ray_train_workers, resume_point, wait_for

EPOCHS = 4


@flow
def train_flow(params: TrainModelParams) -> TrainResult:
    summary = inspect_dataset(params)
    data = preprocess_dataset(
        params.data, summary.fingerprint, PrefectMLSettings().resolved_storage_url
    )
    return train_distributed(params, data)


@flow
def evaluate_flow(trained: TrainResult) -> Evaluation:
    return evaluate_model(trained)


def _train_in_thread(
    params: TrainModelParams,
) -> tuple[threading.Thread, dict[str, TrainResult | BaseException]]:
    """``train_flow(params)`` started in a thread; its result or error lands in ``["result"]``."""
    outcome: dict[str, TrainResult | BaseException] = {}

    def run() -> None:
        try:
            outcome["result"] = train_flow(params)
        except BaseException as exc:  # surfaced by the test's assertions
            outcome["result"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.full  # a fault scenario of tens of seconds (tests/tiers.py)
@pytest.mark.usefixtures("ray_cluster")
def test_elastic_group_trains_on_what_the_cluster_has_and_carries_on_after_losing_a_worker(
    home: PrefectMLSettings,
) -> None:
    """Workers 1-3 on a 2-CPU Ray: training starts on the 2 workers the cluster has instead of
    waiting for a third (a fixed 3 is refused before any compute). A worker killed after epoch 2
    makes the group restart from the last checkpoint and finish; each epoch is logged once."""
    params = TrainModelParams.model_validate(
        {
            "model": {
                "model": "tests.fixtures.user_code:slow_model",
                "model_options": {"delay": 0.04},
            },
            "training": {"epochs": EPOCHS, "workers": "1-3", "max_failures": 2},
        }
    )
    thread, outcome = _train_in_thread(params)
    storage_dir = home.home_dir / "storage"
    wait_for(lambda: 2 in committed_epochs(storage_dir), 240, "the epoch-2 checkpoint")
    victims = ray_train_workers()
    assert len(victims) == 2, "the group started with the 2 workers the cluster has room for"
    os.kill(victims[-1].pid, signal.SIGKILL)
    killed_at = resume_point(storage_dir)  # epoch 1 always has its weights, epoch 2 may not
    thread.join(timeout=400)

    result = outcome["result"]
    assert isinstance(result, TrainResult), result
    assert result.final_epoch == EPOCHS
    client = tracking.client_for(home.resolved_tracking_uri)
    assert tracking.logged_epochs(client, result.run_id) == list(range(1, EPOCHS + 1))
    tags = client.get_run(result.run_id).data.tags
    restarted_at = int(tags[training.STARTED_AT_TAG])
    assert 1 <= killed_at < restarted_at <= EPOCHS, "the new group resumed from a checkpoint"
    assert tags[training.WORLD_SIZE_TAG] == "2"
    workers = {m.step: m.value for m in client.get_metric_history(result.run_id, "workers")}
    assert workers == {e: 2 for e in range(1, EPOCHS + 1)}
    assert all(f"checkpoint.epoch_{e:04d}" in tags for e in range(1, EPOCHS + 1))
    assert committed_epochs(storage_dir) == list(range(1, EPOCHS + 1))
    assert result.epoch_metrics["val_accuracy"] > 0.5

    # A rerun killed between evaluation and registration evaluates the same run again: its test
    # metrics stay logged once.
    evaluations = [evaluate_flow(result) for _ in range(2)]
    assert evaluations[0].metrics == evaluations[1].metrics
    history = client.get_metric_history(result.run_id, "test_accuracy")
    assert [m.value for m in history] == [evaluations[0].metrics["accuracy"]]


@pytest.mark.full  # a fault scenario of tens of seconds (tests/tiers.py)
@pytest.mark.usefixtures("ray_cluster")
def test_driver_whose_lease_is_taken_over_stops_at_the_next_epoch_boundary(
    home: PrefectMLSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host takes the lease over while epoch 1 trains (the model waits for a gate file
    until then): the workers stop before epoch 2, and the driver raises instead of going on or
    marking the run FAILED (the new driver carries it on)."""
    monkeypatch.setenv("PREFECT_ML_LEASE_EXPIRY_S", "3")
    gate = tmp_path / "gate"
    params = TrainModelParams.model_validate(
        {
            "model": {
                "model": "tests.fixtures.user_code:slow_model",
                "model_options": {"gate": str(gate)},
            },
            "training": {"epochs": EPOCHS, "workers": 1},
        }
    )
    thread, outcome = _train_in_thread(params)
    try:
        leases = home.home_dir / "storage" / "leases" / "training"
        wait_for((tmp_path / "gate.waiting").exists, 240, "epoch 1 to start")
        taken_over = next(leases.glob("*/gen-000001.json")).with_name("gen-000002.json")
        record = LeaseRecord.mine("new-driver", "training run")
        elsewhere = dataclasses.replace(record, host="elsewhere", pid=1)
        assert storage.create_exclusive(taken_over.as_uri(), elsewhere.to_bytes())
    finally:
        gate.touch()
        thread.join(timeout=400)

    error = outcome["result"]
    assert isinstance(error, LeaseLostError), error
    assert "another process took over its lease" in str(error)
    assert committed_epochs(home.home_dir / "storage") == [1], "stopped after epoch 1"
    client = tracking.client_for(home.resolved_tracking_uri)
    (run,) = client.search_runs(["1"])
    assert run.info.status == "RUNNING", "left for the driver that took it over"


@pytest.mark.usefixtures("ray_cluster")
def test_a_model_with_its_own_steps_trains_on_two_ddp_workers_and_is_evaluated(
    home: PrefectMLSettings,
) -> None:
    """A LightningModule-shaped model (training_step, validation_step, configure_optimizers)
    on 2 Ray Train workers: its steps run inside DDP, its validation metric reaches MLflow
    every epoch, and evaluation scores its forward."""
    params = TrainModelParams.model_validate(
        {
            "data": {"dataset": "tests.fixtures.user_code:blobs"},
            "model": {"model": "tests.fixtures.user_code:steps_model"},
            "training": {"epochs": 3, "workers": 2, "batch_size": 16},
        }
    )
    result = train_flow(params)
    client = tracking.client_for(home.resolved_tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags[training.WORLD_SIZE_TAG] == "2"
    history = client.get_metric_history(result.run_id, "val_top2_accuracy")
    assert [m.step for m in history] == [1, 2, 3]
    assert run.data.params["training.optimizer"] == "adam"  # the flag, overridden by the hook
    assert result.epoch_metrics["val_accuracy"] > 0.9  # blobs are well separated
    evaluation = evaluate_flow(result)
    assert evaluation.metrics["accuracy"] > 0.9


def test_the_loop_config_that_ray_s_workers_receive_holds_no_mlflow_address(
    home: PrefectMLSettings,
) -> None:
    """Issue 36, finding 9: the training and trial workers' config (Ray Train's loop config, a
    campaign trial's spec) carried the MLflow database password; Ray records it pickled. Since
    the driver alone writes the run (workers record their group in the checkpoint folder), the
    config carries no MLflow address at all."""
    import cloudpickle

    from prefect_ml.integrations.config.loop import TrainLoop
    from prefect_ml.tasks.data import PreparedData
    from prefect_ml.tasks.training import train_loop

    data = PreparedData(
        fingerprint="f" * 16,
        splits_url=(home.home_dir / "splits").as_uri(),
        rows={"train": 100},
        sample_shape=[4],
        num_classes=2,
        class_names=["a", "b"],
        feature_names=None,
    )
    config = train_loop(
        TrainModelParams(), data, checkpoint_url=(home.home_dir / "checkpoints").as_uri()
    )
    pickled = cloudpickle.dumps(config)
    assert home.resolved_tracking_uri.encode() not in pickled
    assert not {"tracking_uri", "run_id"} & set(TrainLoop.model_fields)
