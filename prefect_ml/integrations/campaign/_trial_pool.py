"""The campaign's trial pool: warm trial workers on Ray, addressed by slot, and what they return.

The coordinator sees slots (0..size-1) and outcomes, never Ray: each slot runs at most one call
at a time (``begin`` a trial, ``advance`` it one epoch), :meth:`TrialPool.wait` hands back the
finished calls, and Ray's errors become our outcome types here, at the boundary —
``RayActorError`` (the process died: OOM killer, lost node) is :class:`WorkerLost`,
``RayTaskError`` (the trial's code raised) is :class:`TrialError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prefect_ml.integrations.campaign._trial_worker import EpochReport, TrialSpec, TrialWorker
from prefect_ml.integrations.compute import (
    PLACEMENT_NOTICE_S,
    PLACEMENT_REPEAT_S,
    cluster_nodes,
    describe_placement,
    free_per_node,
    placeable,
)
from prefect_ml.integrations.config.resources import Resources
from prefect_ml.integrations.errors import DETERMINISTIC_ERRORS, TrainingCodeError

if TYPE_CHECKING:
    from types import TracebackType

# How long a replacement trial worker may wait to be placed before its slot is closed (the
# cluster is busy elsewhere, e.g. a serving replica holds the CPU a lost worker had).
REPLACEMENT_WAIT_S = 60.0
# A replacement can land on the node that just failed, before Ray has declared it dead, and die
# with it: it is tried this many times, this far apart.
REPLACEMENT_ATTEMPTS = 3
REPLACEMENT_RETRY_S = 2.0
TIMEOUT_SETTING = "PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S"

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]


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


@dataclass
class _Asked:
    """Workers asked of Ray and starting: each one's readiness reference, and when asked."""

    waiting: dict[Any, Any]  # ObjectRef of ready() -> actor
    began: float


class RayTrialPool:
    """:class:`TrialPool` over warm Ray actors; closing it kills them, freeing their CPUs.

    The workers are asked of Ray when the pool is made and start (a process each, torch
    imported) while the caller goes on with its own set-up; entering the pool waits for them.
    Ray leaves an actor it cannot place pending for ever. The pool waits ``start_timeout_s``
    from the asking (Ray Train's bound for a worker group, the same setting), saying what the
    missing ones wait for, and then runs with those started: a busy cluster runs fewer trials
    at a time, as Ray Tune does, and the campaign still ends. None started is an error.
    """

    def __init__(
        self,
        size: int,
        *,
        request: Resources,
        driver_only: bool,
        start_timeout_s: float,
        logger: Logger | None = None,
    ) -> None:
        """Ask Ray for ``size`` actors placed with ``request``; ``driver_only`` actors hold
        nothing (their Ray Train workers hold the request)."""
        self._request = request
        self._placed = Resources(cpus=0) if driver_only else request
        self._logger = logger or logging.getLogger(__name__)
        self._pending: dict[Any, int] = {}  # ObjectRef -> slot
        self._size, self._start_timeout_s = size, start_timeout_s
        self._workers: list[Any] = []  # None: a closed slot
        self._asked: _Asked | None = self._ask(size)

    def __enter__(self) -> RayTrialPool:
        """Wait for the workers asked for; the pool runs with those started in time.

        Raises:
            TrainingCodeError: no worker started within ``start_timeout_s`` (not retried by
                Prefect: other work holds the cluster, which a retry seconds later meets again).
        """
        asked, self._asked = self._asked, None
        if asked is None:
            raise RuntimeError("a trial pool is entered once")
        self._workers = self._started(asked, self._start_timeout_s)
        if len(self._workers) < self._size:
            self._say_short(self._size, self._start_timeout_s)
        return self

    def _say_short(self, size: int, timeout: float) -> None:
        """Fewer workers than asked started in time: run with them, or fail if none did."""
        placement = self._placement(size)
        if not self._workers:
            raise TrainingCodeError(
                f"no trial worker of the campaign started within {timeout:g} s "
                f"({TIMEOUT_SETTING}): Ray could not place them: {placement}. To fix it: "
                "free those resources (another job holds them), run fewer or smaller "
                "trials at once (--concurrency, --trial-cpus, --trial-gpus, "
                f"--trial-memory-gb), or raise {TIMEOUT_SETTING}; then run the same "
                "command again (the campaign resumes by name)."
            )
        self._logger.warning(
            "Running %d trial(s) at a time, not %d: Ray started only %d trial worker(s) "
            "within %g s (%s): %s",
            len(self._workers),
            size,
            len(self._workers),
            timeout,
            TIMEOUT_SETTING,
            placement,
        )

    @property
    def size(self) -> int:
        return len(self._workers)

    def _placement(self, count: int) -> str:
        return describe_placement(self._placed.describe(), count, free_per_node(), "trial(s)")

    def _ask(self, count: int) -> _Asked:
        import ray

        actor_class = ray.remote(TrialWorker).options(
            **self._placed.actor_options(), max_restarts=0
        )
        threads = max(1, int(self._request.cpus))
        asked: list[Any] = [actor_class.remote() for _ in range(count)]
        return _Asked({worker.ready.remote(threads): worker for worker in asked}, time.monotonic())

    def _start(self, count: int, timeout: float) -> list[Any]:
        """``count`` more workers, those ready within ``timeout`` seconds."""
        return self._started(self._ask(count), timeout)

    def _started(self, asked: _Asked, timeout: float) -> list[Any]:
        """The workers asked for that are ready within ``timeout`` seconds of the asking; the
        others are killed (a pending actor never starts after that). A worker whose process
        died while starting raises RayActorError."""
        import ray

        waiting, began, count = dict(asked.waiting), asked.began, len(asked.waiting)
        started: list[Any] = []
        last_notice = float("-inf")
        try:
            while waiting and (left := began + timeout - time.monotonic()) > 0:
                ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=min(left, 1))
                for ref in ready:
                    ray.get(ref)
                    started.append(waiting.pop(ref))
                now = time.monotonic()
                due = now - began >= PLACEMENT_NOTICE_S and now - last_notice >= PLACEMENT_REPEAT_S
                if waiting and due:
                    last_notice = now
                    self._logger.warning(
                        "Ray has started %d of %d trial worker(s) after %.0f s: %s. The "
                        "campaign waits up to %g s (%s) for the others, then runs with those "
                        "started.",
                        len(started),
                        count,
                        now - began,
                        self._placement(count),
                        timeout,
                        TIMEOUT_SETTING,
                    )
        except BaseException:
            for worker in asked.waiting.values():
                ray.kill(worker)
            raise
        for worker in waiting.values():
            ray.kill(worker)
        return started

    def begin(self, slot: int, spec: TrialSpec) -> None:
        self._pending[self._workers[slot].begin.remote(spec)] = slot

    def advance(self, slot: int) -> None:
        self._pending[self._workers[slot].advance.remote()] = slot

    def wait(self, timeout: float) -> list[tuple[int, Outcome]]:
        import ray

        if not self._pending:
            return []
        pending = list(self._pending)
        ready, _ = ray.wait(pending, num_returns=1, timeout=timeout)
        if ready and len(pending) > 1:
            # Every call done by now, not only the first: slots whose trials end together
            # (trials of one length) each get their next trial before the loop's other work.
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
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
                started = self._start(1, REPLACEMENT_WAIT_S)
            except ray.exceptions.RayActorError:
                # Placed on the dying node before Ray declared it dead: ask again once it has.
                time.sleep(REPLACEMENT_RETRY_S)
                continue
            if started:
                self._workers[slot] = started[0]
            return bool(started)
        return False

    def finish(self) -> None:
        import ray

        ray.get([worker.finish.remote() for worker in self._workers if worker is not None])

    def close(self) -> None:
        import ray

        asked = list(self._asked.waiting.values()) if self._asked else []
        for worker in [*self._workers, *asked]:
            if worker is not None:
                ray.kill(worker)
        self._workers, self._pending, self._asked = [], {}, None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
