"""The campaign's trial pool: warm trial workers on Ray, addressed by slot, and what they return.

The coordinator sees slots (0..size-1) and outcomes, never Ray: each slot runs at most one call
at a time (``begin`` a trial, ``advance`` it one epoch), :meth:`TrialPool.wait` hands back the
finished calls, and Ray's errors become our outcome types here, at the boundary —
``RayActorError`` (the process died: OOM killer, lost node) is :class:`WorkerLost`,
``RayTaskError`` (the trial's code raised) is :class:`TrialError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prefect_ml.integrations.errors import TrainingCodeError
from prefect_ml.integrations.resources import ResourceRequest, cluster_nodes, placeable
from prefect_ml.integrations.train_failures import DETERMINISTIC_ERRORS
from prefect_ml.integrations.trial_worker import EpochReport, TrialSpec, TrialWorker

if TYPE_CHECKING:
    from types import TracebackType

# How long a replacement trial worker may wait to be placed before its slot is closed (the
# cluster is busy elsewhere, e.g. a serving replica holds the CPU a lost worker had).
REPLACEMENT_WAIT_S = 60.0
# A replacement can land on the node that just failed, before Ray has declared it dead, and die
# with it: it is tried this many times, this far apart.
REPLACEMENT_ATTEMPTS = 3
REPLACEMENT_RETRY_S = 2.0


@dataclass(frozen=True)
class Epochs:
    """The epochs a call trained (or read back from the trial's checkpoints)."""

    reports: tuple[EpochReport, ...]


@dataclass(frozen=True)
class WorkerLost:
    """The slot's process died; the trial is not to blame. :meth:`TrialPool.replace` the slot."""

    reason: str


@dataclass(frozen=True)
class TrialError:
    """The trial's own code raised: the trial failed, its worker is fine. ``deterministic``:
    an error of the code itself (a missing module, a model that raises), which the same code
    raises again; otherwise maybe the machine's (storage, network), which may heal."""

    error: str
    deterministic: bool = False


Outcome = Epochs | WorkerLost | TrialError


class TrialPool(Protocol):
    """Warm workers that run one trial each, driven one call at a time per slot."""

    @property
    def size(self) -> int:
        """How many slots (trials at once)."""
        ...

    def begin(self, slot: int, spec: TrialSpec) -> None:
        """Start ``spec`` on ``slot`` (resuming its checkpoints); its first epochs come back."""
        ...

    def advance(self, slot: int) -> None:
        """Train the next epoch of the trial running on ``slot``."""
        ...

    def wait(self, timeout: float) -> list[tuple[int, Outcome]]:
        """The calls that finished within ``timeout`` seconds (maybe none), by slot."""
        ...

    def replace(self, slot: int) -> bool:
        """A fresh worker in the slot of one that died; False when the cluster has no room for
        it any more (its node was lost): the slot is closed and runs nothing more."""
        ...

    def finish(self) -> None:
        """Let every worker end its trial (flush its last checkpoint); no call is pending."""
        ...


class RayTrialPool:
    """:class:`TrialPool` over warm Ray actors; closing it kills them, freeing their CPUs."""

    def __init__(self, size: int, *, request: ResourceRequest, driver_only: bool) -> None:
        """``size`` actors placed with ``request``; ``driver_only`` actors hold nothing (their
        Ray Train workers hold the request)."""
        self._request = request
        self._placed = ResourceRequest(cpus=0) if driver_only else request
        self._pending: dict[Any, int] = {}  # ObjectRef -> slot
        self._workers: list[Any] = self._start(size)  # None: a closed slot

    @property
    def size(self) -> int:
        return len(self._workers)

    def _start(self, count: int, timeout: float | None = None) -> list[Any]:
        import ray

        actor_class = ray.remote(TrialWorker).options(
            **self._placed.actor_options(), max_restarts=0
        )
        workers: list[Any] = [actor_class.remote() for _ in range(count)]
        threads = max(1, int(self._request.cpus))
        try:
            ray.get([worker.ready.remote(threads) for worker in workers], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            for worker in workers:
                ray.kill(worker)
            raise
        return workers

    def begin(self, slot: int, spec: TrialSpec) -> None:
        self._pending[self._workers[slot].begin.remote(spec)] = slot

    def advance(self, slot: int) -> None:
        self._pending[self._workers[slot].advance.remote()] = slot

    def wait(self, timeout: float) -> list[tuple[int, Outcome]]:
        import ray

        if not self._pending:
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        return [(self._pending.pop(ref), self._outcome(ref)) for ref in ready]

    @staticmethod
    def _outcome(ref: Any) -> Outcome:
        import ray

        try:
            return Epochs(tuple(ray.get(ref)))
        except ray.exceptions.RayActorError as exc:
            return WorkerLost(f"its worker process died: {exc}")
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            deterministic = isinstance(cause, (*DETERMINISTIC_ERRORS, TrainingCodeError))
            return TrialError(f"{type(cause).__name__}: {cause}", deterministic)

    def replace(self, slot: int) -> bool:
        """Start a worker in place of the dead one when the cluster still holds one more copy
        of the request next to the live ones and it is placed within
        :data:`REPLACEMENT_WAIT_S`; otherwise close the slot."""
        import ray

        ray.kill(self._workers[slot])
        self._workers[slot] = None
        live = sum(worker is not None for worker in self._workers)
        for _ in range(REPLACEMENT_ATTEMPTS):
            if placeable(self._placed, cluster_nodes()) <= live:
                return False
            try:
                self._workers[slot] = self._start(1, timeout=REPLACEMENT_WAIT_S)[0]
                return True
            except ray.exceptions.GetTimeoutError:
                return False
            except ray.exceptions.RayActorError:
                # Placed on the dying node before Ray declared it dead: ask again once it has.
                time.sleep(REPLACEMENT_RETRY_S)
        return False

    def finish(self) -> None:
        import ray

        ray.get([worker.finish.remote() for worker in self._workers if worker is not None])

    def close(self) -> None:
        import ray

        for worker in self._workers:
            if worker is not None:
                ray.kill(worker)
        self._workers, self._pending = [], {}

    def __enter__(self) -> RayTrialPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
