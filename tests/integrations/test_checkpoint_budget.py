"""The checkpoint budget (``--checkpoint-budget``): epochs whose weights do not fit commit their
metrics only, the first and last epoch always commit their weights, the best epoch keeps its
weights, a resumed run replays the skipped epochs exactly, and every rank takes rank 0's answer.

No clock is asserted on: a budget of 0 commits every epoch, and a vanishing one (``TINY``) none
but the first and the last, whatever the machine's speed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from prefect_ml.integrations.storage import CheckpointStore, MetricsOnlyCheckpoint, RetentionPolicy
from prefect_ml.integrations.training import (
    METRICS_FILE,
    CheckpointBudget,
    CommitCost,
    EpochCommitter,
    EpochTrainer,
    committed_history,
    load_trained_model,
    train_epochs,
)
from tests.helpers import blob_trainer, free_port, in_gloo_group
from tests.integrations.test_parallel_training import _config, _full_state, _shards

TINY = 1e-12  # no epoch's weights fit but those that must commit


def _with_weights(url: str) -> list[int]:
    """The epochs whose end-of-epoch checkpoint has its weights."""
    store, found = CheckpointStore(url), []
    for epoch in store.epochs():
        try:
            store.load(epoch)
        except MetricsOnlyCheckpoint:
            continue
        found.append(epoch)
    return found


def _model_state(url: str, epoch: int) -> dict[str, torch.Tensor]:
    model, _ = load_trained_model(
        url, "tests.fixtures.user_code:linear_model", [4], 3, {}, epoch=epoch
    )
    return model.state_dict()


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


TRAINED = ("train_loss", "val_loss", "val_accuracy")


def test_the_budget_commits_weights_while_their_cost_fits_its_share_of_the_time() -> None:
    budget = CheckpointBudget(0.05, started=100.0)
    assert budget.due(100.0), "nothing measured yet: the first epoch commits"
    budget.spend(CommitCost(0.01), weights=True)
    assert not budget.due(100.1), "0.01 spent + 0.01 more > 5% of 0.1 s"
    assert budget.due(100.4), "0.02 <= 5% of 0.4 s"
    budget.spend(CommitCost(0.001), weights=False)  # an epoch of metrics only costs its wait
    assert not budget.due(100.4)
    assert budget.due(100.42)
    budget.spend(CommitCost(0.03), weights=True)  # commits got slower: the next one waits longer
    assert not budget.due(100.8) and budget.due(101.42)
    off = CheckpointBudget(0.0, started=0.0, spent=10.0, commit_seconds=10.0)
    assert off.due(0.0), "a budget of 0 commits every epoch"


def test_the_committers_cpu_counts_in_the_budget_as_the_loops_blocking_does() -> None:
    """The committer's thread serialises, hashes and writes beside the steps, on the same cores
    and interpreter lock: its CPU time counts, and a commit's cost is its blocking plus it."""
    blocking_only = CheckpointBudget(0.05, started=0.0)
    with_writer = CheckpointBudget(0.05, started=0.0)
    for budget, writer_cpu in ((blocking_only, 0.0), (with_writer, 0.02)):
        budget.spend(CommitCost(0.01), weights=True)
        # The next epoch (metrics only) waited for that commit, which took this much CPU.
        budget.spend(CommitCost(0.001, writer_cpu, writer_cpu), weights=False)
    assert blocking_only.due(0.5), "0.011 + 0.01 <= 5% of 0.5 s"
    assert not with_writer.due(0.5), "0.031 + 0.03 > 5% of 0.5 s"
    assert with_writer.due(1.22), "0.031 + 0.03 <= 5% of 1.22 s"
    assert with_writer.commit_writer_cpu == 0.02


def test_a_committed_epoch_reports_what_its_committer_spent(tmp_path: Path) -> None:
    """Each epoch's metrics carry the committer's CPU on the commits that ended meanwhile, and
    ``submit`` returns it with the blocking time, for the budget."""
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    committer = EpochCommitter(store)
    weights = {"model.pt": torch.randn(256, 256).numpy().tobytes()}
    first = committer.submit(1, weights, {"train_loss": 1.0}, epoch_started=0.0, blocked_since=0.0)
    second = committer.submit(2, None, {"train_loss": 0.5}, epoch_started=0.0, blocked_since=0.0)
    third = committer.submit(3, None, {"train_loss": 0.4}, epoch_started=0.0, blocked_since=0.0)
    committer.close()

    assert first.writer_cpu == 0.0 and first.weights_writer_cpu is None, "nothing ended yet"
    assert second.writer_cpu > 0 and second.weights_writer_cpu == second.writer_cpu
    assert third.writer_cpu > 0 and third.weights_writer_cpu is None, "epoch 2: metrics only"
    history = committed_history(store, 3)
    assert history[2]["checkpoint_writer_cpu_seconds"] == second.writer_cpu
    assert history[3]["checkpoint_writer_cpu_seconds"] == third.writer_cpu


def test_skipped_epochs_commit_their_metrics_and_a_resumed_run_replays_them_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole_url, budgeted_url = (tmp_path / "whole").as_uri(), (tmp_path / "budgeted").as_uri()
    train_epochs(whole := blob_trainer(whole_url, checkpoint_budget=0.0))
    assert _with_weights(whole_url) == [1, 2, 3, 4, 5]

    train_epochs(blob_trainer(budgeted_url, checkpoint_budget=TINY))
    store = CheckpointStore(budgeted_url)
    assert store.epochs() == [1, 2, 3, 4, 5], "every epoch's metrics are committed"
    assert _with_weights(budgeted_url) == [1, 5], "the first and the last always have weights"
    whole_history = committed_history(CheckpointStore(whole_url), 5)
    history = committed_history(store, 5)
    assert [history[epoch]["checkpoint_weights"] for epoch in range(1, 6)] == [1, 0, 0, 0, 1]
    for epoch in range(1, 6):
        for metric in TRAINED:
            assert history[epoch][metric] == whole_history[epoch][metric], (epoch, metric)
    _assert_identical(_model_state(budgeted_url, 5), _model_state(whole_url, 5))

    # Killed before epoch 5 committed: epochs 2-4 hold metrics only, so the run resumes after
    # epoch 1 and replays them.
    shutil.rmtree(tmp_path / "budgeted" / "epoch-000005")
    with caplog.at_level(logging.WARNING):
        resumed = blob_trainer(budgeted_url, checkpoint_budget=TINY)
    assert resumed.first_epoch == 2
    assert "Skipping checkpoint" not in caplog.text, "metrics-only epochs are not broken ones"
    train_epochs(resumed)
    _assert_identical(_full_state(resumed), _full_state(whole))
    resumed_history = committed_history(CheckpointStore(budgeted_url), 5)
    for epoch in range(2, 6):
        for metric in TRAINED:
            assert resumed_history[epoch][metric] == whole_history[epoch][metric], (epoch, metric)
    assert _with_weights(budgeted_url) == [1, 2, 5], "a resumed group's first epoch commits too"


def test_the_best_epoch_keeps_its_weights_though_its_epoch_committed_metrics_only(
    tmp_path: Path,
) -> None:
    """val_loss improves by more than 0.02 up to epoch 4, then by less: early stopping (patience
    2) stops after epoch 6 and evaluates epoch 4, whose weights the budget did not commit then."""
    stopping = {"early_stopping_patience": 2, "early_stopping_min_delta": 0.02, "epochs": 8}
    whole_url, budgeted_url = (tmp_path / "whole").as_uri(), (tmp_path / "budgeted").as_uri()
    train_epochs(blob_trainer(whole_url, checkpoint_budget=0.0, **stopping))
    trainer = blob_trainer(budgeted_url, checkpoint_budget=TINY, **stopping)
    train_epochs(trainer)

    store = CheckpointStore(budgeted_url)
    early_stopping = trainer.config.training.early_stopping()
    assert early_stopping is not None
    best = early_stopping.best(committed_history(store, 8))
    assert best is not None and best.epoch == 4 and store.epochs() == [1, 2, 3, 4, 5, 6]
    assert _with_weights(budgeted_url) == [1, 4, 6], "epochs 2 and 3 were best only for a while"
    _assert_identical(_model_state(budgeted_url, 4), _model_state(whole_url, 4))
    assert json.loads(store.read_verified(4, METRICS_FILE))["val_loss"] == best.value


def test_retention_counts_only_checkpoints_with_weights(tmp_path: Path) -> None:
    """keep_last 1 with metrics-only epochs after the newest weights: those weights stay, the
    resume point; ``latest`` passes over the metrics-only epochs without a warning."""
    store = CheckpointStore(tmp_path.as_uri())
    metrics = {METRICS_FILE: json.dumps({"val_loss": 1.0}).encode()}
    store.save(1, {**metrics, "weights.bin": b"1"})
    store.save(2, {**metrics, "weights.bin": b"2"})
    store.save(3, metrics, metrics_only=True)
    store.save(4, metrics, metrics_only=True)
    assert store.prune(RetentionPolicy(keep_last=1)) == [1]
    latest = store.latest()
    assert latest is not None and latest.epoch == 2 and latest.files["weights.bin"] == b"2"
    with pytest.raises(MetricsOnlyCheckpoint, match="metrics only"):
        store.load(3)
    assert json.loads(store.read_verified(4, METRICS_FILE)) == {"val_loss": 1.0}
    store.save(3, {**metrics, "weights.bin": b"3"})  # a best epoch's weights, committed later
    assert store.load(3).files["weights.bin"] == b"3"


def _agreeing_worker(rank: int, world_size: int, url: str, out: str) -> None:
    """One rank of two: rank 0's budget has no room, rank 1's (which no one asks) has; only
    rank 1 finds the stop file. Each writes what it was told."""
    from torch.nn.parallel import DistributedDataParallel

    stop_url = f"{url}/stop" if rank == 1 else ""
    trainer = EpochTrainer(
        _config(url, stop_url=stop_url),
        rank=rank,
        world_size=world_size,
        prepare_model=DistributedDataParallel,
        shards=_shards(rank, world_size),
    )
    budget = (
        CheckpointBudget(TINY, started=0.0, commit_seconds=1.0)
        if rank == 0
        else CheckpointBudget(0.0, started=0.0)
    )
    outcome = trainer.run_epoch(1, None, budget)
    told = {"due": outcome.commit_due, "stop": outcome.stop_requested, **outcome.metrics}
    Path(f"{out}-{rank}.json").write_text(json.dumps(told))


def _budgeted_group_worker(rank: int, world_size: int, url: str, layout: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    config: dict[str, Any] = {
        "epochs": 4,
        "checkpoint_budget": TINY,
        "checkpoint_layout": layout,
        "keep_checkpoints": 1,  # the best epoch by val_loss keeps its weights too
    }
    train_epochs(
        EpochTrainer(
            _config(url, **config),
            rank=rank,
            world_size=world_size,
            prepare_model=DistributedDataParallel,
            shards=_shards(rank, world_size),
        )
    )


def test_two_ranks_take_rank_zeros_budget_and_any_ranks_stop_in_the_epochs_one_collective(
    tmp_path: Path,
) -> None:
    (tmp_path / "stop").write_bytes(b"pruned")
    out = tmp_path / "told"
    mp.start_processes(
        in_gloo_group,
        args=(2, free_port(), _agreeing_worker, tmp_path.as_uri(), str(out)),
        nprocs=2,
        start_method="spawn",
    )
    told = [json.loads(Path(f"{out}-{rank}.json").read_text()) for rank in (0, 1)]
    assert told[0] == told[1], "every rank gets the same metrics and the same answers"
    assert told[0]["due"] is False and told[0]["stop"] is True
    assert told[0]["workers"] == 2 and {"step_seconds_rank0", "step_seconds_rank1"} <= set(told[0])


@pytest.mark.parametrize("layout", ["gathered", "sharded"])
def test_a_ddp_group_under_the_budget_commits_every_epochs_metrics_and_the_last_weights(
    tmp_path: Path, layout: str
) -> None:
    """Sharded, every rank writes its shards of the commits with weights, and only rank 0
    the metrics-only ones: the same commits, in the same order, on every rank."""
    url = tmp_path.as_uri()
    mp.start_processes(
        in_gloo_group,
        args=(2, free_port(), _budgeted_group_worker, url, layout),
        nprocs=2,
        start_method="spawn",
    )
    store = CheckpointStore(url)
    assert store.epochs() == [1, 2, 3, 4]
    history = committed_history(store, 4)
    assert all(history[epoch]["workers"] == 2 for epoch in range(1, 5))
    best = min(history, key=lambda epoch: history[epoch]["val_loss"])
    assert _with_weights(url) == sorted({best, 4}), "retention keeps the newest and the best"
