"""The commit: what a worker's checkpoints cost the loop and which ones it keeps.

A checkpoint is taken as a snapshot (:func:`packaged`: bytes, a CPU copy serialised later, or
every rank's own shards) and committed by the :class:`EpochCommitter`, a background writer, so
that training carries on while it is serialised, hashed and written; the
:class:`CheckpointBudget` decides whether an epoch's weights fit in the share of training time
checkpoints may take, and :func:`retention` which committed checkpoints keep their weights.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations import problems
from prefect_ml.integrations.config import TrainingParams
from prefect_ml.integrations.early_stopping import EarlyStopping, History
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.storage import CheckpointStore, RetentionPolicy
from prefect_ml.integrations.training import _distributed_checkpoint
from prefect_ml.integrations.training._distributed_checkpoint import ShardedSnapshot

if TYPE_CHECKING:
    import torch

TRAINER_STATE_FILE = "trainer.json"  # epoch, seed, LR schedule and loss scale, as JSON
# (a mid-epoch checkpoint adds its step and every rank's RNG state and running train loss)
METRICS_FILE = "metrics.json"


def best_tracker(training: TrainingParams) -> EarlyStopping | None:
    """What picks the epoch whose weights the run must keep besides the last: early
    stopping's best (evaluated and registered), else the best-checkpoint metric's (one
    patient enough never to stop the run); None when neither is on."""
    if stopping := training.early_stopping():
        return stopping
    if training.best_checkpoint_metric == "none":
        return None
    return EarlyStopping.for_metric(
        training.best_checkpoint_metric, max(1, training.epochs), mode=training.best_checkpoint_mode
    )


def retention(training: TrainingParams) -> RetentionPolicy:
    """Which checkpoints keep their weights: the newest ``keep_checkpoints``, and the best by
    the best-checkpoint metric."""
    metric = None if training.best_checkpoint_metric == "none" else training.best_checkpoint_metric
    mode = training.best_checkpoint_mode
    if mode == "auto":
        mode = "max" if problems.EPOCH_METRICS.get(metric or "") == "maximize" else "min"
    return RetentionPolicy(
        keep_last=training.keep_checkpoints,
        metric=metric,
        mode=mode,
        metrics_file=METRICS_FILE,
        kept_files=(METRICS_FILE,),
    )


@dataclass(frozen=True)
class StagedSnapshot:
    """A gathered snapshot as a CPU copy of the state, serialised (``files``) only when it is
    committed: in the committer's thread, or never (a best epoch that a better one replaced)."""

    state: dict[str, Any]
    small: dict[str, bytes]  # the trainer state, as written

    def files(self) -> dict[str, bytes]:
        return {**_distributed_checkpoint.to_files(self.state), **self.small}


Snapshot = dict[str, bytes] | StagedSnapshot | ShardedSnapshot


@dataclass(frozen=True)
class CommitCost:
    """What checkpointing took from one epoch on a rank."""

    blocking: float  # the loop blocked: snapshots, waits for the committer, mid-epoch ones
    writer_cpu: float = 0.0  # the committer thread's CPU on the commits that ended meanwhile
    weights_writer_cpu: float | None = None  # of those, the last with weights (None: none)


@dataclass
class CheckpointBudget:
    """Whether the next epoch's weights fit in ``fraction`` of the training time (rank 0's).

    ``spend`` adds what checkpoints took: the time they blocked the loop (snapshots, waits for
    the committer, mid-epoch checkpoints) and the CPU time of the committer's thread, which
    shares the worker's cores and interpreter lock with the steps (serialising, hashing,
    writing, pruning). An epoch commits its weights when what was spent plus the cost of the
    last such commit stays within ``fraction`` of the time since ``started``. So the share
    tends to ``fraction`` from below whatever an epoch lasts: every epoch when commits are
    cheap, every k-th when an epoch is shorter than a commit over ``fraction``.
    """

    fraction: float
    started: float  # time.perf_counter() when the worker group started training
    spent: float = 0.0
    commit_seconds: float | None = None  # the last commit of weights blocked; None: none yet
    commit_writer_cpu: float = 0.0  # the committer's CPU on the last commit of weights it ended

    def due(self, now: float) -> bool:
        if self.fraction <= 0 or self.commit_seconds is None:
            return True
        cost = self.commit_seconds + self.commit_writer_cpu
        return self.spent + cost <= self.fraction * (now - self.started)

    def spend(self, cost: CommitCost, *, weights: bool) -> None:
        self.spent += cost.blocking + cost.writer_cpu
        if weights:
            self.commit_seconds = cost.blocking
        if cost.weights_writer_cpu is not None:
            self.commit_writer_cpu = cost.weights_writer_cpu


class EpochCommitter:
    """The background writer: commits each epoch's checkpoint while training carries on.

    Gathered checkpoints: rank 0's committer gets the checkpoint's files as bytes, or a CPU
    copy of the state that it serialises (:class:`StagedSnapshot`). Sharded
    ones: every rank's committer gets its :class:`ShardedSnapshot`, writes its own shards, and
    rank 0's commits them all (``distributed_checkpoint.commit_sharded``, whose collectives
    run on the snapshot's checkpoint group). One commit is in flight at a time on each rank,
    so commits stay in order, every rank's collectives come in the same order, and memory
    stays bounded. An epoch submitted without files commits its metrics only (the checkpoint
    budget's, see ``train_epochs``); :meth:`submit_weights` adds its weights later. After
    each commit of weights the retention policy, if any, prunes the checkpoints it does not
    keep, except early stopping's best epoch (whose weights are the run's result). ``history``
    holds the metrics of the epochs committed before this committer started (a resumed run's).
    Workers never write metrics anywhere else: the driver turns committed checkpoints into
    MLflow history (see ``tasks.training.EpochRecorder``), which keeps MLflow's client work off
    the training process's interpreter lock.
    """

    def __init__(
        self,
        store: CheckpointStore,
        retention: RetentionPolicy | None = None,
        *,
        early_stopping: EarlyStopping | None = None,
        history: History | None = None,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._store, self._retention = store, retention
        self._early_stopping = early_stopping
        self._history = {epoch: dict(metrics) for epoch, metrics in (history or {}).items()}
        self.committed_epoch = 0  # the newest epoch this committer committed
        # This epoch's mid-epoch commits so far, and the time they blocked the loop.
        self.mid_epoch_checkpoints, self._mid_epoch_blocking = 0, 0.0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight: Future[_Committed] | None = None
        # The committer thread's CPU on the commits waited for since the last epoch's submit,
        # and on the last of them with weights.
        self._writer_cpu = 0.0
        self._weights_writer_cpu: float | None = None
        # The metrics files of epochs committed without weights, for a later commit of them.
        self._metrics_only: dict[int, dict[str, bytes]] = {}

    def submit(
        self,
        epoch: int,
        files: Snapshot | None,
        metrics: dict[str, float],
        *,
        epoch_started: float,
        blocked_since: float,
    ) -> CommitCost:
        """Queue one epoch (``files`` None: its metrics only, no resume point); the loop was
        blocked from ``blocked_since`` until this returns. Returns what checkpointing took from
        this epoch (its ``checkpoint_blocking_seconds`` and ``checkpoint_writer_cpu_seconds``)."""
        self.wait()
        now = time.perf_counter()
        # What checkpointing cost the loop: the snapshots (this epoch's mid-epoch ones too)
        # plus waiting for the previous commits; and the committer's CPU beside it.
        cost = CommitCost(
            now - blocked_since + self._mid_epoch_blocking,
            self._writer_cpu,
            self._weights_writer_cpu,
        )
        self._writer_cpu, self._weights_writer_cpu = 0.0, None
        metrics = {
            **metrics,
            "checkpoint_blocking_seconds": cost.blocking,
            "checkpoint_writer_cpu_seconds": cost.writer_cpu,  # the commits ended meanwhile
            "epoch_seconds": now - epoch_started,  # wall time of the whole epoch on rank 0
            "mid_epoch_checkpoints": self.mid_epoch_checkpoints,  # by this worker group
            "checkpoint_weights": float(files is not None),  # 0: metrics only (the budget's)
        }
        self.mid_epoch_checkpoints, self._mid_epoch_blocking = 0, 0.0
        small = {METRICS_FILE: json.dumps(metrics).encode()}
        if files is None:
            self._metrics_only[epoch] = small
            self._in_flight = self._executor.submit(
                self._commit, epoch, small, metrics, metrics_only=True
            )
        else:
            self._in_flight = self._executor.submit(
                self._commit, epoch, _with_files(files, small), metrics
            )
        return cost

    def submit_weights(self, epoch: int, files: Snapshot) -> None:
        """Queue the weights of ``epoch``, whose metrics were committed alone before (a best
        epoch kept in memory), beside those same metrics."""
        self.wait()
        small = self._metrics_only.pop(epoch, {})  # none on ranks that commit no metrics
        self._in_flight = self._executor.submit(
            self._commit, epoch, _with_files(files, small), None
        )

    def submit_step(
        self,
        epoch: int,
        step: int,
        files: Snapshot,
        *,
        blocked_since: float,
    ) -> None:
        """Queue a checkpoint taken ``step`` steps into ``epoch`` (no metrics: the epoch has
        not ended); its blocking time counts in the epoch's ``checkpoint_blocking_seconds``."""
        self.wait()
        self._in_flight = self._executor.submit(self._commit, epoch, files, None, step)
        self.mid_epoch_checkpoints += 1
        self._mid_epoch_blocking += time.perf_counter() - blocked_since

    def _commit(
        self,
        epoch: int,
        files: Snapshot,
        metrics: dict[str, float] | None,  # None: a mid-epoch checkpoint, or a best epoch's
        step: int | None = None,
        metrics_only: bool = False,
    ) -> _Committed:
        started = time.thread_time()
        if isinstance(files, StagedSnapshot):
            files = files.files()
        if isinstance(files, ShardedSnapshot):  # None on ranks other than 0
            url = _distributed_checkpoint.commit_sharded(self._store, epoch, files, step=step)
        else:
            url = self._store.save(epoch, files, step=step, metrics_only=metrics_only)
        if metrics is not None:
            self._history[epoch] = metrics
            if not metrics_only:
                self.committed_epoch = epoch
        if self._retention is not None and url is not None and not metrics_only:  # rank 0
            self._store.prune(self._retention, also_keep=self._pinned())
        return _Committed(time.thread_time() - started, weights=not metrics_only)

    def _pinned(self) -> frozenset[int]:
        """Epochs whose weights stay whatever the retention policy says: early stopping's best."""
        if self._early_stopping is None:
            return frozenset()
        best = self._early_stopping.best(self._history)
        return frozenset() if best is None else frozenset({best.epoch})

    def wait(self) -> None:
        """Block until the queued commit is done; raise a :class:`CheckpointError` if it failed
        (storage unreachable past its retries): the run then resumes from the last commit."""
        if self._in_flight is None:
            return
        in_flight, self._in_flight = self._in_flight, None
        try:
            committed = in_flight.result()
        except Exception as exc:
            last = f"epoch {self.committed_epoch}" if self.committed_epoch else "none yet"
            raise CheckpointError(
                f"could not commit a checkpoint to {self._store.root_url} "
                f"({type(exc).__name__}: {exc}); the last one committed here is {last}. "
                "Run again to resume from the last verified checkpoint."
            ) from exc
        self._writer_cpu += committed.cpu_seconds
        if committed.weights:
            self._weights_writer_cpu = committed.cpu_seconds

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()


@dataclass(frozen=True)
class _Committed:
    cpu_seconds: float  # the committer thread's CPU time on this commit
    weights: bool  # False: an epoch's metrics only


def _with_files(files: Snapshot, small: dict[str, bytes]) -> Snapshot:
    """``files`` with the small files ``small`` added (the coordinator's, when sharded)."""
    if isinstance(files, ShardedSnapshot):
        return dataclasses.replace(files, files={**files.files, **small})
    if isinstance(files, StagedSnapshot):
        return dataclasses.replace(files, small={**files.small, **small})
    return {**files, **small}


def training_state(
    state_module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> dict[str, Any]:
    """The model and optimiser state a checkpoint holds, under their plain parameter names
    (``get_state_dict`` strips the DDP and FSDP wrappers): gathered in full on the CPU in a
    process group, each rank's own part when ``sharded``. Under FSDP gathering is a
    collective: every worker calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = dist.is_available() and dist.is_initialized() and not sharded  # gathered
    model_state, optimizer_state = get_state_dict(
        state_module,
        optimizer,
        # Flattened: every optimiser value (param groups too) under its parameter's name,
        # so pipeline stages, which hold different parameters, never write the same key.
        options=StateDictOptions(
            full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=True
        ),
    )
    return {"model": model_state, "optimizer": optimizer_state}


def packaged(
    state: dict[str, Any],
    small: dict[str, bytes],
    group: Any,
    *,
    staged: bool,
) -> Snapshot:
    """``state`` and the ``small`` files as a committer takes them: this rank's CPU copy of
    its own shards when sharded (``group``, the checkpoint group, not None), a CPU copy
    serialised when it is committed (``staged``), or the files themselves."""
    if group is not None:
        return ShardedSnapshot.take(state, small, group)
    if staged:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return StagedSnapshot(BlockingAsyncStager().stage(state), small)
    return {**_distributed_checkpoint.to_files(state), **small}
