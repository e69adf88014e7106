"""``EpochTrainer`` in one process: resuming a trial reads back its committed history."""

from __future__ import annotations

import json
from pathlib import Path

from prefect_ml.integrations.checkpoints import CheckpointStore
from prefect_ml.integrations.epoch_trainer import METRICS_FILE
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
