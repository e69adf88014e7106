"""The campaign's trial worker: a warm process (a Ray actor, driven through
:class:`~integrations.campaign.RayTrialPool`) that trains trial after trial.

An actor imports torch once and keeps each dataset split it has read, so a trial costs its own
epochs and almost nothing else. The coordinator drives a trial one epoch at a time
(``begin`` then ``advance``) and decides after every epoch whether it goes on, so pruning stops a
trial at the epoch boundary where the pruner says so. A trial with several workers is a Ray Train
run started from the actor; it is followed through its verified checkpoints and stopped with a
stop marker next to them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prefect_ml.integrations import storage, training
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.config.resources import Resources
from prefect_ml.integrations.datasets import Shard, open_shard
from prefect_ml.integrations.errors import (
    DETERMINISTIC_ERRORS,
    CheckpointError,
    PrefectMLError,
    TrainingCodeError,
    fix_for,
)
from prefect_ml.integrations.storage import CheckpointStore
from prefect_ml.integrations.training import (
    METRICS_FILE,
    EpochCommitter,
    EpochTrainer,
    fit,
    make_optimizer,
    retention,
)


@dataclass(frozen=True)
class TrialSpec:
    """One trial as plain data: the loop config (its checkpoints under the trial) and placement."""

    number: int
    loop: TrainLoop
    workers: int  # the sweep's trial_workers
    request: Resources  # the trial's process, or each of its workers
    ray_storage_url: str


@dataclass(frozen=True)
class EpochReport:
    """One epoch of a trial, as the coordinator sees it."""

    number: int
    epoch: int
    metrics: dict[str, float]
    final: bool  # the trial's last epoch: it is complete
    worker_pid: int = 0  # the process that trained it (warm workers are reused)
    from_checkpoint: bool = False  # trained by an earlier attempt, read back from its checkpoint
    node: str = ""  # the address of the node that trained it


def node_address() -> str:
    """The address of the Ray node this process runs on."""
    import ray

    return str(ray.util.get_node_ip_address())


class TrialWorker:
    """A warm process that trains trials; :class:`~integrations.campaign.RayTrialPool` runs
    it as a Ray actor."""

    def __init__(self) -> None:
        self._shards: dict[tuple[str, str], Shard] = {}
        self._trainer: EpochTrainer | None = None
        self._committer: EpochCommitter | None = None
        self._spec: TrialSpec | None = None
        self._epoch = 0
        self._distributed: DistributedTrial | None = None
        self.node = node_address()

    def ready(self, threads: int) -> int:
        """Pay the imports and torch's lazy initialisation once, before any trial."""
        import torch

        torch.set_num_threads(threads)
        model = torch.nn.Linear(2, 2)
        for name in ("adam", "adamw", "sgd"):
            optimizer = make_optimizer(name, model.parameters(), 1e-3, 0.0)
            model(torch.zeros(1, 2)).sum().backward()
            optimizer.step()
        training.to_files({"model": model.state_dict()})
        storage.exists(storage.join(Path.cwd().as_uri(), "warm-up"))
        return os.getpid()

    def _shard(self, loop: TrainLoop, split: str) -> Shard:
        key = (loop.data.splits_url, split)
        if key not in self._shards:
            shape = tuple(loop.data.sample_shape)
            self._shards[key] = open_shard(loop.data.splits_url, loop.data.layout, split, shape)
        return self._shards[key]

    def begin(self, spec: TrialSpec) -> list[EpochReport]:
        """Start a trial (resuming its checkpoints): the epochs already committed, then one more."""
        self.finish()
        self._spec, self._epoch = spec, 0
        if spec.workers > 1:
            self._distributed = DistributedTrial(spec)
            return self._distributed.next_reports()
        shards = {split: self._shard(spec.loop, split) for split in ("train", "val")}
        try:
            self._trainer = EpochTrainer(spec.loop, shards=shards)
        except DETERMINISTIC_ERRORS as exc:
            raise TrainingCodeError(self._setup_failure(spec, exc)) from exc
        self._committer = EpochCommitter(self._trainer.store, retention(spec.loop.training))
        history = self._trainer.committed_metrics()
        reports = [
            EpochReport(
                spec.number, epoch, metrics, epoch == spec.loop.training.epochs, os.getpid(), True
            )
            for epoch, metrics in history.items()
        ]
        self._epoch = self._trainer.first_epoch - 1
        if self._epoch >= spec.loop.training.epochs:
            return reports
        return reports + self.advance()

    def _setup_failure(self, spec: TrialSpec, error: BaseException) -> str:
        """Where the trial's model could not be built, why, and what to do: every trial of the
        campaign meets the same error on this node."""
        code = f"the model {spec.loop.model.model}"
        return (
            f"trial {spec.number} could not build {code} on node {self.node} (trial worker pid "
            f"{os.getpid()}): {type(error).__name__}: {error}. To fix it: "
            f"{fix_for(error.__cause__ or error, code)}"
        )

    def advance(self) -> list[EpochReport]:
        """Train the next epoch and commit its checkpoint in the background."""
        if self._distributed is not None:
            return self._distributed.next_reports()
        if self._trainer is None or self._committer is None or self._spec is None:
            raise PrefectMLError("advance() called with no trial started on this worker")
        self._epoch += 1
        started = time.perf_counter()
        metrics = self._trainer.train_epoch(self._epoch, self._committer)
        blocked_since = time.perf_counter()
        # Staged: a CPU copy here (0.5 ms for a small model); DCP's save (11 ms) runs in the
        # committer's thread, beside the next epoch or the round trip to the next trial.
        self._committer.submit(
            self._epoch,
            self._trainer.snapshot(self._epoch, staged=True),
            metrics,
            epoch_started=started,
            blocked_since=blocked_since,
        )
        # The commit finishes in the background; the next begin() (or finish()) waits for it.
        final = self._epoch >= self._spec.loop.training.epochs
        return [
            EpochReport(self._spec.number, self._epoch, metrics, final, os.getpid(), node=self.node)
        ]

    def finish(self) -> None:
        """End the current trial (complete or pruned): flush its checkpoint, free its state."""
        if self._committer is not None:
            self._committer.close()
        if self._distributed is not None:
            self._distributed.stop()
        self._trainer = self._committer = self._distributed = None


class DistributedTrial:
    """A trial trained by a Ray Train run in a background thread of the trial's actor."""

    def __init__(self, spec: TrialSpec) -> None:
        self._spec = spec
        self._store = CheckpointStore(spec.loop.checkpoint_url)
        self._next_epoch = 1
        self._error: BaseException | None = None
        # Finish imports here: two threads importing a module for the first time can deadlock
        # or see it half initialised (seen with fsspec.compression).
        import ray.train.torch  # noqa: F401

        self._store.epochs()
        self._thread = threading.Thread(target=self._fit, daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            fit(
                self._spec.loop,
                workers=self._spec.workers,
                request=self._spec.request,
                max_failures=0,
                ray_storage_url=self._spec.ray_storage_url,
                name=f"trial-{self._spec.number}-{int(time.time())}",
            )
        except BaseException as exc:  # re-raised in the actor's method call
            self._error = exc

    def _committed(self, epoch: int) -> dict[str, float] | None:
        try:
            metrics: dict[str, float] = json.loads(self._store.read_verified(epoch, METRICS_FILE))
        except CheckpointError:
            return None
        return metrics

    def next_reports(self) -> list[EpochReport]:
        """Wait for the next committed epoch(s); the run's error if it failed first."""
        last = self._spec.loop.training.epochs
        while True:
            reports = []
            while self._next_epoch <= last and (found := self._committed(self._next_epoch)):
                reports.append(
                    EpochReport(
                        self._spec.number, self._next_epoch, found, self._next_epoch == last
                    )
                )
                self._next_epoch += 1
            if reports:
                return reports
            if not self._thread.is_alive():
                if self._error is not None:
                    raise self._error
                raise PrefectMLError(
                    f"trial {self._spec.number}: the Ray Train run ended before epoch "
                    f"{self._next_epoch} was committed"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Ask the run to stop after its current epoch and wait for it."""
        if self._thread.is_alive():
            storage.write_bytes(self._spec.loop.stop_url, b"pruned")
            self._thread.join()
