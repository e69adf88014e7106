"""Training on a real local Ray: an elastic worker group, checkpoints, a worker killed mid-epoch."""

from __future__ import annotations

import os
import signal
import threading

import psutil
import pytest
from prefect import flow

from integrations import ray_training, tracking
from integrations.settings import PrefectMLSettings
from tasks.data import inspect_dataset, preprocess_dataset
from tasks.params import TrainModelParams
from tasks.train import TrainResult, train_distributed
from tests.helpers import committed_epochs, wait_for

EPOCHS = 4


@flow
def train_flow(params: TrainModelParams) -> TrainResult:
    summary = inspect_dataset(params)
    data = preprocess_dataset(
        params.data, summary.fingerprint, PrefectMLSettings().resolved_storage_url
    )
    return train_distributed(params, data)


def _train_workers() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any("RayTrainWorker" in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


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
    outcome: dict[str, TrainResult | BaseException] = {}

    def run() -> None:
        try:
            outcome["result"] = train_flow(params)
        except BaseException as exc:  # surfaced by the assertion below
            outcome["result"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    storage_dir = home.home_dir / "storage"
    wait_for(lambda: 2 in committed_epochs(storage_dir), 240, "the epoch-2 checkpoint")
    victims = _train_workers()
    assert len(victims) == 2, "the group started with the 2 workers the cluster has room for"
    os.kill(victims[-1].pid, signal.SIGKILL)
    thread.join(timeout=400)

    result = outcome["result"]
    assert isinstance(result, TrainResult), result
    assert result.final_epoch == EPOCHS
    client = tracking.client_for(home.resolved_tracking_uri)
    assert tracking.logged_epochs(client, result.run_id) == list(range(1, EPOCHS + 1))
    tags = client.get_run(result.run_id).data.tags
    restarted_at = int(tags[ray_training.STARTED_AT_TAG])
    assert 3 <= restarted_at <= EPOCHS, "the new worker group resumed from a checkpoint"
    assert tags[ray_training.WORLD_SIZE_TAG] == "2"
    workers = {m.step: m.value for m in client.get_metric_history(result.run_id, "workers")}
    assert workers == {e: 2 for e in range(1, EPOCHS + 1)}
    assert all(f"checkpoint.epoch_{e:04d}" in tags for e in range(1, EPOCHS + 1))
    assert committed_epochs(storage_dir) == list(range(1, EPOCHS + 1))
    assert result.epoch_metrics["val_accuracy"] > 0.5
