"""Which Ray Train failures end a training run at once, and which Ray Train may retry.

Ray Train v2 retries any worker's error up to ``max_failures`` times and a worker group that
cannot start for ever (``FailureConfig.controller_failure_limit`` defaults to -1). A failure that
a retry meets again the same way then costs a restart each time, or hangs the run: a worker's
code raising a Python error (a module missing on the node, a model that raises when it is built,
a loss that is not a scalar) or a group that never starts. Those end the run at once with the
node, the worker, the code and the fix; only what can heal (a worker process or node that died,
a collective broken by a lost peer, a storage or network error) goes to ``max_failures``.

:class:`FailFast` decides inside Ray Train's controller, where each failure is seen before the
restart: it ends the run by raising from a controller hook, which Ray Train does not retry.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import (
    UserExceptionWithTraceback,
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
)
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller.state import (
    ReschedulingState,
    RestartingState,
    RunningState,
)
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from prefect_ml.integrations.compute import describe_placement, free_per_node
from prefect_ml.integrations.errors import DETERMINISTIC_ERRORS, TrainingCodeError, fix_for

if TYPE_CHECKING:
    from ray.train.v2._internal.execution.controller.state import TrainControllerState
    from ray.train.v2._internal.execution.worker_group import WorkerGroup, WorkerGroupPollStatus

# Worker failures that are a process or node going away: retried, and the other ranks' errors
# in the same poll may be its collateral (a collective that lost its peer).
DEATHS = (RayActorError, WorkerHealthCheckFailedError)

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


@dataclass(frozen=True)
class WorkerFailure:
    """One worker's error, where it ran and where in its code it was raised."""

    rank: int
    node: str  # the node's IP address, or "an unknown node"
    error: BaseException
    raised_in: str = ""  # "<function> (<file>:<line>)": the innermost frame of its traceback

    def describe(self) -> str:
        where = f" in {self.raised_in}" if self.raised_in else ""
        return f"worker rank {self.rank} on node {self.node}: {_error_text(self.error)}{where}"


def _error_text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")


def innermost_frame(traceback_text: str) -> str:
    """``"build (/path/models.py:12)"``: the innermost frame of a formatted traceback that is
    not Python's or an installed package's (where the user's code raised), or ""."""
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [
        frame
        for frame in _FRAME.finditer(traceback_text)
        if not frame["file"].startswith((stdlib, "<")) and "/site-packages/" not in frame["file"]
    ]
    if not frames:
        return ""
    last = frames[-1]
    return f"{last['function']} ({last['file']}:{last['line']})"


def deterministic(failures: Mapping[int, BaseException]) -> list[int]:
    """The ranks whose error a retry meets again, in rank order; none when any worker died
    (the others' errors may be its collateral, and a restart heals them all)."""
    if any(isinstance(error, DEATHS) for error in failures.values()):
        return []
    return sorted(
        rank for rank, error in failures.items() if isinstance(error, DETERMINISTIC_ERRORS)
    )


def code_failure_message(failures: list[WorkerFailure], code: str, attempt_note: str) -> str:
    """The run's end for deterministic worker errors: each distinct error once, with its
    ranks' places, then the fix."""
    first = failures[0]
    others = [f for f in failures[1:] if _error_text(f.error) != _error_text(first.error)]
    same = len(failures) - 1 - len(others)
    also = f" (and {same} other worker(s) the same way)" if same else ""
    lines = [f"{first.describe()}{also}", *(f.describe() for f in others)]
    return (
        f"the training workers' code failed, and would fail the same way on every retry "
        f"({attempt_note}): {'; '.join(lines)}. To fix it: {fix_for(first.error, code)}; "
        "then run the same command again (the run resumes from its last verified checkpoint)."
    )


def start_failure_message(error: BaseException, starts: int, placement: str) -> str:
    """The run's end when its worker group failed to start ``starts`` times in a row."""
    if isinstance(error, WorkerGroupStartupTimeoutError):
        reason = f"Ray could not place it: {placement}"
        fix = (
            "free those resources (another job may hold them) or ask for fewer workers or "
            "less per worker (--workers, --cpus-per-worker, --gpus-per-worker); raise "
            "PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S on a cluster that adds nodes slowly"
        )
    else:
        cause = error.__cause__ or error
        reason = f"a worker died while starting ({_error_text(cause)})"
        fix = "see the worker's log on its node (ray logs) for why its process ended"
    return (
        f"the training worker group failed to start {starts} time(s) in a row: {reason}. "
        f"To fix it: {fix}; PREFECT_ML_CONTROLLER_FAILURE_LIMIT allows more tries."
    )


class FailFast(ControllerCallback, WorkerGroupCallback):  # type: ignore[misc]
    """Lives in Ray Train's controller: ends the run instead of restarting it when a worker's
    code raised a deterministic error, or when the group failed to start more than
    ``start_failure_limit`` times in a row (a group that starts resets the count).

    Args:
        code: what the workers run, for messages (``"the model tests.models:build"``).
        request: one worker's request, for messages (``"1 CPU"``).
        start_failure_limit: failed starts in a row that are tried again.
        max_failures: the run's ``max_failures``, for messages.
    """

    def __init__(
        self, *, code: str, request: str, start_failure_limit: int, max_failures: int
    ) -> None:
        self.code, self.request = code, request
        self.start_failure_limit, self.max_failures = start_failure_limit, max_failures
        self._failed_starts = 0
        self._nodes: dict[int, str] = {}  # rank -> node IP of the latest group
        self._frames: dict[int, str] = {}  # rank -> where its latest error was raised
        self._asked = 0

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._nodes = {
            w.distributed_context.world_rank: w.metadata.node_ip
            for w in worker_group.get_workers()
            if w.distributed_context is not None
        }

    def after_worker_group_poll_status(self, worker_group_status: WorkerGroupPollStatus) -> None:
        for rank, status in worker_group_status.worker_statuses.items():
            if isinstance(status.error, UserExceptionWithTraceback):
                self._frames[rank] = innermost_frame(status.error._traceback_str)

    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> None:
        self._asked = num_workers

    def after_controller_state_update(
        self, previous_state: TrainControllerState, current_state: TrainControllerState
    ) -> None:
        if isinstance(current_state, RunningState):
            self._failed_starts = 0
        elif isinstance(current_state, RestartingState):
            self._check_worker_errors(current_state.training_failed_error)
        elif isinstance(current_state, ReschedulingState):
            self._check_start(current_state.training_failed_error)

    def _check_worker_errors(self, error: Exception) -> None:
        if not isinstance(error, WorkerGroupError):
            return
        ranks = deterministic(error.worker_failures)
        if not ranks:
            return
        failures = [
            WorkerFailure(
                rank,
                self._nodes.get(rank, "an unknown node"),
                error.worker_failures[rank],
                self._frames.get(rank, ""),
            )
            for rank in ranks
        ]
        note = f"not retried through --max-failures {self.max_failures}"
        raise TrainingCodeError(code_failure_message(failures, self.code, note))

    def _check_start(self, error: Exception) -> None:
        cause = error.controller_failure if isinstance(error, ControllerError) else error
        if not isinstance(cause, (WorkerGroupStartupTimeoutError, WorkerGroupStartupFailedError)):
            return
        self._failed_starts += 1
        if self._failed_starts > self.start_failure_limit:
            placement = describe_placement(self.request, self._asked, free_per_node())
            raise TrainingCodeError(start_failure_message(cause, self._failed_starts, placement))
