"""The driver logs committed epochs to MLflow exactly once, including those a dead process left."""

from __future__ import annotations

import json

from mlflow import MlflowClient
from prefect import flow

from prefect_ml.integrations import tracking, training
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.tasks.training import EpochRecorder


def _commit(store: CheckpointStore, epoch: int) -> None:
    metrics = {
        "train_loss": 1 / epoch,
        "val_loss": 2 / epoch,
        "val_accuracy": 0.5,
        "samples_per_second": 100.0,
    }
    store.save(epoch, {training.METRICS_FILE: json.dumps(metrics).encode()})


def _run(home: PrefectMLSettings) -> tuple[MlflowClient, str, CheckpointStore]:
    """An MLflow run and its checkpoint folder."""
    client = tracking.client_for(home.resolved_tracking_uri)
    experiment = tracking.ensure_experiment(client, "exp", home.mlflow_artifact_root)
    run_id, _ = tracking.start_or_resume_run(
        client, experiment, "k", run_name="r", params={}, tags={}
    )
    return client, run_id, CheckpointStore(f"{home.resolved_storage_url}/checkpoints/{run_id}")


@flow
def record(tracking_uri: str, run_id: str, checkpoint_url: str) -> None:
    with EpochRecorder(tracking_uri, run_id, checkpoint_url, epochs=5):
        pass


def test_each_committed_epoch_is_logged_once(home: PrefectMLSettings) -> None:
    uri = home.resolved_tracking_uri
    client, run_id, store = _run(home)
    for epoch in (1, 2, 3):
        _commit(store, epoch)
    partial = store.url_for(4).removeprefix("file://")  # a commit that a crash interrupted
    (home.home_dir / partial).mkdir(parents=True, exist_ok=True)

    record(uri, run_id, store.root_url)
    record(uri, run_id, store.root_url)  # a resumed process: nothing is logged twice
    assert tracking.logged_epochs(client, run_id) == [1, 2, 3]

    _commit(store, 4)
    record(uri, run_id, store.root_url)
    assert tracking.logged_epochs(client, run_id) == [1, 2, 3, 4]
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train_loss")}
    assert history == {e: 1 / e for e in (1, 2, 3, 4)}
    assert client.get_run(run_id).data.tags["checkpoint.latest"] == store.url_for(4)


def test_the_newest_worker_group_s_record_becomes_the_run_s_tags(home: PrefectMLSettings) -> None:
    """Rank 0 of each worker group records the group in the checkpoint folder (workers never
    talk to MLflow); the driver tags the run with the newest record, and only with the worker
    group's own tags."""
    uri = home.resolved_tracking_uri
    client, run_id, store = _run(home)
    first = {training.WORLD_SIZE_TAG: "2", training.STARTED_AT_TAG: "1"}
    store.record_worker_group(first)
    store.record_worker_group(  # the group that restarted after losing a worker
        {training.WORLD_SIZE_TAG: "1", training.STARTED_AT_TAG: "3", "mlflow.user": "forged"}
    )
    _commit(store, 1)

    record(uri, run_id, store.root_url)

    tags = client.get_run(run_id).data.tags
    assert (tags[training.WORLD_SIZE_TAG], tags[training.STARTED_AT_TAG]) == ("1", "3")
    assert tags.get("mlflow.user") != "forged"
    assert len(store.worker_groups()) == 2 and store.epochs() == [1]
    assert store.read_worker_group(store.worker_groups()[0]) == first
