"""Checkpoints inside an epoch (``--checkpoint-every-steps``/``--checkpoint-every-seconds``):
a run stopped after one resumes at the next step and ends as if it had never stopped.

A stop is a committer that raises right after a chosen mid-epoch commit is on storage, as a
process killed there would leave it; in a group, that rank's process dies and takes the group
down. The resumed run is a new trainer (a new process group) reading the store back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessRaisedException

from prefect_ml.integrations import datasets
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.storage import CheckpointPosition, CheckpointStore
from prefect_ml.integrations.training import (
    METRICS_FILE,
    EpochCommitter,
    EpochTrainer,
    retention,
)
from tests.helpers import blob_trainer, free_port, in_gloo_group
from tests.integrations.test_parallel_training import _config, _full_state, _shards

EPOCHS = 3


class Stopped(Exception):
    """The run was stopped right after the mid-epoch checkpoint it was told to stop at."""


class StoppingCommitter(EpochCommitter):
    """A real committer that stops the run once the checkpoint at ``stop_at`` is committed."""

    def __init__(self, store: CheckpointStore, stop_at: tuple[int, int]) -> None:
        super().__init__(store)
        self.stop_at = stop_at

    def submit_step(self, epoch: int, step: int, files: Any, *, blocked_since: float) -> None:
        super().submit_step(epoch, step, files, blocked_since=blocked_since)
        if (epoch, step) == self.stop_at:
            self.close()  # committed: on storage, verified
            raise Stopped(f"stopped after epoch {epoch} step {step}")


def _step_config(url: str, **overrides: Any) -> TrainLoop:
    """12 steps an epoch on one worker (6 on each of two), a checkpoint every 3 steps, and
    dropout, so that a resume that lost the RNG state would train differently."""
    options = {"hidden": 16, "depth": 2, "dropout": 0.3}
    return _config(url, epochs=EPOCHS, checkpoint_every_steps=3, model_options=options, **overrides)


def _train(trainer: EpochTrainer, committer: EpochCommitter | None) -> dict[int, dict[str, float]]:
    """Train ``trainer`` to the last epoch the loop's way: mid-epoch commits, then the end's."""
    history = {}
    for epoch in range(trainer.first_epoch, EPOCHS + 1):
        metrics = trainer.train_epoch(epoch, committer)
        files = trainer.snapshot(epoch)
        if committer is not None:
            committer.submit(epoch, files, metrics, epoch_started=0.0, blocked_since=0.0)
        history[epoch] = metrics
    if committer is not None:
        committer.close()
    return history


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def test_a_run_stopped_mid_epoch_resumes_at_the_next_step_with_the_same_result(
    tmp_path: Path,
) -> None:
    whole_url, stopped_url = (tmp_path / "whole").as_uri(), (tmp_path / "stopped").as_uri()
    whole = EpochTrainer(_step_config(whole_url), shards=_shards(0, 1))
    whole_history = _train(whole, EpochCommitter(whole.store))

    store = CheckpointStore(whole_url)
    assert store.epochs() == [1, 2, 3], "epoch ends only: they hold the metrics"
    assert store.positions()[:4] == [
        CheckpointPosition(1, 3),
        CheckpointPosition(1, 6),
        CheckpointPosition(1, 9),
        CheckpointPosition(1),
    ]
    assert whole_history[1]["train_loss"] > whole_history[3]["train_loss"]
    saved = json.loads(store.read_verified(2, METRICS_FILE))
    assert saved["mid_epoch_checkpoints"] == 3  # steps 3, 6 and 9; the end commits step 12

    stopping = EpochTrainer(_step_config(stopped_url), shards=_shards(0, 1))
    with pytest.raises(Stopped):
        _train(stopping, StoppingCommitter(stopping.store, stop_at=(2, 6)))
    latest = CheckpointStore(stopped_url).latest()
    assert latest is not None and latest.position == CheckpointPosition(2, 6)
    assert latest.completed_epochs == 1

    resumed = EpochTrainer(_step_config(stopped_url), shards=_shards(0, 1))
    assert resumed.first_epoch == 2 and resumed.resume is not None
    assert resumed.resume.step == 6
    resumed_history = _train(resumed, EpochCommitter(resumed.store))

    _assert_identical(_full_state(resumed), _full_state(whole))
    for epoch in (2, 3):
        for metric in ("train_loss", "val_loss", "val_accuracy"):
            assert resumed_history[epoch][metric] == whole_history[epoch][metric], metric
    assert CheckpointStore(stopped_url).epochs() == [1, 2, 3]


def _group_worker(
    rank: int, world_size: int, url: str, stop_at: tuple[int, int] | None, out: str
) -> None:
    from torch.nn.parallel import DistributedDataParallel

    trainer = EpochTrainer(
        _step_config(url),
        rank=rank,
        world_size=world_size,
        prepare_model=DistributedDataParallel,
        shards=_shards(rank, world_size),
    )
    first_epoch = trainer.first_epoch
    first_step = trainer.resume.step if trainer.resume else 0
    committer: EpochCommitter | None = None
    if rank == 0:
        committer = (
            StoppingCommitter(trainer.store, stop_at) if stop_at else EpochCommitter(trainer.store)
        )
    history = _train(trainer, committer)
    final = _full_state(trainer)
    if rank == 0:
        torch.save(final, f"{out}.pt")
        report = {"first_epoch": first_epoch, "first_step": first_step, "history": history}
        Path(f"{out}.json").write_text(json.dumps(report))


def _run_group(url: str, out: Path, stop_at: tuple[int, int] | None = None) -> Any:
    mp.start_processes(
        in_gloo_group,
        args=(2, free_port(), _group_worker, url, stop_at, str(out)),
        nprocs=2,
        start_method="spawn",
    )
    report = json.loads(out.with_suffix(".json").read_text())
    return report, torch.load(out.with_suffix(".pt"), weights_only=True)


@pytest.mark.full  # a fault scenario of tens of seconds (tests/tiers.py)
def test_a_ddp_group_stopped_mid_epoch_resumes_exactly_and_another_size_resumes_too(
    tmp_path: Path,
) -> None:
    """Two DDP ranks; each trains 6 steps an epoch, so epoch 2's step-3 checkpoint is mid-way.
    Every rank's RNG state and loss sum travel in rank 0's checkpoint."""
    whole_url, stopped_url = (tmp_path / "whole").as_uri(), (tmp_path / "stopped").as_uri()
    whole, whole_state = _run_group(whole_url, tmp_path / "whole")
    with pytest.raises(ProcessRaisedException, match="Stopped"):
        _run_group(stopped_url, tmp_path / "stopped", stop_at=(2, 3))
    latest = CheckpointStore(stopped_url).latest()
    assert latest is not None and latest.position == CheckpointPosition(2, 3)
    trainer_state = json.loads(latest.files["trainer.json"])
    assert trainer_state["world_size"] == 2 and len(trainer_state["ranks"]) == 2
    assert trainer_state["ranks"][0]["rng"] != trainer_state["ranks"][1]["rng"]

    # One process resumes the two ranks' checkpoint: the same share of epoch 2 (6 of its 12
    # steps) is left to train, with its own seed; the epoch's loss sums are carried over.
    other_size = EpochTrainer(_step_config(stopped_url), shards=_shards(0, 1))
    assert other_size.first_epoch == 2
    single = _train(other_size, None)
    assert single[2]["train_loss"] == pytest.approx(whole["history"]["2"]["train_loss"], rel=0.2)

    resumed, resumed_state = _run_group(stopped_url, tmp_path / "resumed")
    assert (resumed["first_epoch"], resumed["first_step"]) == (2, 3)
    _assert_identical(resumed_state, whole_state)
    for epoch in ("2", "3"):
        assert resumed["history"][epoch]["train_loss"] == whole["history"][epoch]["train_loss"]


def test_the_seconds_cadence_commits_inside_a_slow_epoch(tmp_path: Path) -> None:
    url = (tmp_path / "slow").as_uri()
    trainer = blob_trainer(
        url,
        model="tests.fixtures.user_code:slow_model",
        model_options={"delay": 0.03},
        batch_size=8,  # 12 steps of at least 30 ms
        checkpoint_every_seconds=0.1,
    )
    committer = EpochCommitter(trainer.store)
    metrics = trainer.train_epoch(1, committer)
    committer.submit(1, trainer.snapshot(1), metrics, epoch_started=0.0, blocked_since=0.0)
    committer.close()

    store = CheckpointStore(url)
    inside = [p for p in store.positions() if p.step is not None]
    assert inside and all(p.epoch == 1 and 0 < p.step < 12 for p in inside)
    committed = json.loads(store.read_verified(1, METRICS_FILE))
    assert committed["mid_epoch_checkpoints"] == len(inside)
    assert committed["checkpoint_blocking_seconds"] > 0
    assert store.epochs() == [1]


def test_retention_counts_mid_epoch_checkpoints_and_leaves_no_folders_of_them(
    tmp_path: Path,
) -> None:
    url = (tmp_path / "kept").as_uri()
    trainer = EpochTrainer(
        _step_config(url, keep_checkpoints=2, best_checkpoint_metric="none"),
        shards=_shards(0, 1),
    )
    _train(trainer, EpochCommitter(trainer.store, retention(trainer.config.training)))

    store = CheckpointStore(url)
    assert store.positions() == [
        CheckpointPosition(1),
        CheckpointPosition(2),
        CheckpointPosition(3, 9),
        CheckpointPosition(3),
    ], "the last two checkpoints, one of them mid-epoch, and every epoch's end (its metrics)"
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [
        "epoch-000001",
        "epoch-000002",
        "epoch-000003",
        "epoch-000003-step-000009",
    ]
    assert store.load(3, step=9).step == 9
    latest = store.latest()
    assert latest is not None and latest.position == CheckpointPosition(3)


def _streamed_shard(folder: Path) -> datasets.StreamedShard:
    """Two Parquet files of row groups of 7 rows whose labels are the row ids; shuffle windows
    of about 16 rows, so windows carry rows over to the next at a batch size of 8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    listed = []
    for index, (start, stop) in enumerate(((0, 35), (35, 63))):
        ids = np.arange(start, stop)
        values = pa.array(np.repeat(ids, 4).astype(np.float32))
        table = pa.table(
            {
                datasets.FEATURES: pa.FixedSizeListArray.from_arrays(values, 4),
                datasets.LABEL: pa.array(ids, pa.int64()),
            }
        )
        pq.write_table(table, folder / f"part-{index}.parquet", row_group_size=7)
        groups = tuple(min(7, stop - start - g) for g in range(0, stop - start, 7))
        listed.append(datasets.ShardFile(f"part-{index}.parquet", groups))
    shard = datasets.StreamedShard(folder.as_uri(), listed, (4,))
    shard.window_rows = 16
    return shard


def test_a_shard_leaves_out_the_batches_a_resumed_epoch_already_trained(tmp_path: Path) -> None:
    def place(features: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(features), torch.from_numpy(labels)

    ids = np.arange(61)
    arrays = datasets.ArrayShard(np.repeat(ids, 4).reshape(61, 4).astype(np.float32), ids)
    order = datasets.EpochOrder(seed=1, epoch=2, rank=0)
    for shard in (arrays, _streamed_shard(tmp_path / "streamed")):
        whole = [labels for _, labels in shard.batches(8, order, place)]
        resumed = [labels for _, labels in shard.batches(8, order, place, skip=3)]
        assert len(whole) == 8 and len(resumed) == 5
        assert all(torch.equal(a, b) for a, b in zip(whole[3:], resumed, strict=True))
        assert torch.cat(whole).tolist() != sorted(torch.cat(whole).tolist()), "shuffled"
