"""A worker group's training loop: epochs until the last one, a stop request or early
stopping, each committing a checkpoint within the checkpoint budget."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prefect_ml.integrations import storage
from prefect_ml.integrations.config import TrainingParams
from prefect_ml.integrations.early_stopping import EarlyStopping, History
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.training import _collectives
from prefect_ml.integrations.training._commit import (
    CheckpointBudget,
    EpochCommitter,
    Snapshot,
    best_tracker,
    retention,
)
from prefect_ml.integrations.training._trainer import EpochOutcome, EpochTrainer

if TYPE_CHECKING:
    import torch


def stop_requested(stop_url: str, device: torch.device) -> bool:
    """Whether someone asked this run to stop (a pruned trial); every worker agrees."""
    return _collectives.any_worker(bool(stop_url) and storage.exists(stop_url), device)


def stopped_early(
    early_stopping: EarlyStopping | None, history: History, device: torch.device
) -> bool:
    """Whether the monitored metric stopped improving (early stopping); every worker agrees."""
    if early_stopping is None:
        return False
    return _collectives.any_worker(early_stopping.decide(history) is not None, device)


def check_monitored(training: TrainingParams, metrics: Mapping[str, float]) -> None:
    """Refuse, after an epoch, an early-stopping or best-checkpoint metric that the epoch did
    not produce (a name the model never logged), as Lightning's callbacks do."""
    watched = []
    if training.early_stopping() is not None:
        watched.append(("training.early_stopping_metric", training.early_stopping_monitor))
    if training.best_checkpoint_metric != "none":
        watched.append(("training.best_checkpoint_metric", training.best_checkpoint_metric))
    for field, metric in watched:
        if metric not in metrics:
            names = sorted(name for name in metrics if name.startswith(("train", "val")))
            raise ConfigurationError(
                field,
                f"{metric!r} is not among the epoch's metrics {names}; name one of them, or "
                "log it from the model's steps with self.log",
            )


def train_epochs(trainer: EpochTrainer) -> None:
    """A worker group's training: epochs from ``trainer.first_epoch`` until the last one, a stop
    request or early stopping, each committing a checkpoint.

    An epoch commits its weights when rank 0's :class:`CheckpointBudget` has room for them
    (``checkpoint_budget``), and the last epoch trained always does; any other commits its
    metrics only, so every epoch's metrics reach MLflow, and a run resumed after it replays it
    from the last epoch with weights, in the same data order. The best epoch (of
    ``best_tracker``) keeps its weights as a CPU copy until the next commit of
    weights, which commits it first: a run that fails before that replays it too. Every rank
    takes the same branch: the budget's answer, the stop request and the metrics all come from
    the epoch's one collective (:meth:`EpochTrainer.run_epoch`).
    """
    training = trainer.config.training
    early_stopping, tracker = training.early_stopping(), best_tracker(training)
    # A resumed group decides from the committed epochs' metrics, as the first group would have.
    history = trainer.committed_metrics() if tracker else {}
    committer = (
        EpochCommitter(
            trainer.store, retention(training), early_stopping=early_stopping, history=history
        )
        if trainer.writes_checkpoints  # rank 0; every rank when checkpoints are sharded
        else None
    )
    stopped = stop_requested(trainer.config.stop_url, trainer.device) or stopped_early(
        early_stopping, history, trainer.device
    )
    commits = _EpochCommits(
        trainer,
        committer,
        CheckpointBudget(training.checkpoint_budget, started=time.perf_counter()),
    )
    for epoch in range(
        training.epochs + 1 if stopped else trainer.first_epoch, training.epochs + 1
    ):
        started = time.perf_counter()
        outcome = trainer.run_epoch(epoch, committer, commits.budget)
        history[epoch] = outcome.metrics  # from the collective: the same on every worker
        check_monitored(training, outcome.metrics)
        last = (
            epoch == training.epochs
            or outcome.stop_requested
            or (early_stopping is not None and early_stopping.decide(history) is not None)
        )
        best_epoch = tracker.best(history) if tracker else None
        new_best = best_epoch is not None and best_epoch.epoch == epoch
        commits.commit(
            epoch, outcome, started, weights=outcome.commit_due or last, new_best=new_best
        )
        if last:
            break
    if committer is not None:
        committer.close()


class _EpochCommits:
    """What each epoch commits: its weights when they are due, else its metrics only, and a
    best epoch's weights kept as a CPU copy until the next commit of weights."""

    def __init__(
        self, trainer: EpochTrainer, committer: EpochCommitter | None, budget: CheckpointBudget
    ) -> None:
        self.trainer, self.committer, self.budget = trainer, committer, budget
        self.best: tuple[int, Snapshot] | None = None  # a best epoch committed without weights

    def commit(
        self, epoch: int, outcome: EpochOutcome, started: float, *, weights: bool, new_best: bool
    ) -> None:
        trainer, committer = self.trainer, self.committer
        if new_best:
            self.best = None  # a better epoch came: its weights are kept instead
        blocked_since = time.perf_counter()
        if weights and self.best is not None:
            if committer is not None:
                committer.submit_weights(*self.best)
            self.best = None
        # The snapshot (rank 0's CPU copy of the state, or each rank's of its shards; every
        # worker takes it) is the only part that blocks: serialising, hashing and writing
        # happen in the background.
        files = None
        if weights or new_best:
            snapshot = trainer.snapshot(epoch, staged=True)
            if weights:
                files = snapshot
            else:
                self.best = (epoch, snapshot)
        if committer is not None and (weights or trainer.rank == 0):
            cost = committer.submit(
                epoch,
                files,
                outcome.metrics,
                epoch_started=started,
                blocked_since=blocked_since,
            )
            self.budget.spend(cost, weights=weights)
