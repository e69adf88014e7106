"""``EpochTrainer`` in one process: resuming a trial reads back its committed history."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import METRICS_FILE, EpochCommitter, StagedSnapshot
from tests.helpers import blob_trainer


def test_a_resumed_trainer_reports_each_verified_epoch_under_its_own_number(
    tmp_path: Path,
) -> None:
    url = (tmp_path / "trial").as_uri()
    first = blob_trainer(url)
    for epoch in (1, 2, 3):
        metrics = first.train_epoch(epoch)
        files = {**first.snapshot(epoch), METRICS_FILE: json.dumps(metrics).encode()}
        CheckpointStore(url).save(epoch, files)
    broken = tmp_path / "trial" / "epoch-000002" / METRICS_FILE
    broken.write_bytes(broken.read_bytes()[:-3])  # a torn write

    resumed = blob_trainer(url)

    assert resumed.first_epoch == 4
    history = resumed.committed_metrics()
    assert sorted(history) == [1, 3], "epoch 2 is missing, not shifted onto another number"
    saved = json.loads((tmp_path / "trial" / "epoch-000003" / METRICS_FILE).read_text())
    assert history[3] == saved


def test_a_staged_snapshot_commits_its_epochs_weights_while_the_next_epoch_trains(
    tmp_path: Path,
) -> None:
    """A trial worker's snapshot is a CPU copy serialised in the committer's thread; training
    the next epoch in place meanwhile must not reach the checkpoint of the one before."""
    url = (tmp_path / "trial").as_uri()
    trainer = blob_trainer(url)
    committer = EpochCommitter(trainer.store, None)
    metrics = trainer.train_epoch(1, committer)
    after_first = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    snapshot = trainer.snapshot(1, staged=True)
    assert isinstance(snapshot, StagedSnapshot)
    trainer.train_epoch(2, committer)  # in place, before the commit serialises the copy
    now = time.perf_counter()
    committer.submit(1, snapshot, metrics, epoch_started=now, blocked_since=now)
    committer.close()

    resumed = blob_trainer(url)

    assert resumed.first_epoch == 2
    restored = resumed.model.state_dict()
    assert set(restored) == set(after_first)
    for name, value in after_first.items():
        assert torch.equal(restored[name], value), f"{name}: not epoch 1's weights"
    trained_on = trainer.model.state_dict()
    assert any(not torch.equal(trained_on[n], v) for n, v in after_first.items())
