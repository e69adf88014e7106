"""The campaign's decisions: ask, dispatch, report, prune, tell, retry, and when to stop.

The coordinator is the study's only writer, so the storage has one writer however many workers
run trials. It sees a :class:`~integrations.campaign.TrialPool` (slots and outcomes, not Ray)
and an MLflow :class:`~integrations.tracking.TrackingWriter`, so it runs as well on a fake pool
and an in-memory study. Asking for the next trial and telling a finished one take tens of
milliseconds; one background thread (the *study writer*) does them in order, and asks for one
trial per slot ahead of time, so a free worker gets its next trial at once, even when every
slot finishes at the same moment. What that thread tells is a :class:`TrialEnd` fixed when the
trial ended: nothing it reads is changed afterwards by the loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.campaign import (
    ERROR_ATTR,
    NOT_STARTED_ATTR,
    EpochReport,
    Epochs,
    Outcome,
    TrialError,
    TrialPool,
    TrialSpec,
    WorkerLost,
    counts_toward_budget,
    recover_interrupted,
    requeue,
)
from prefect_ml.integrations.errors import PrefectMLError
from prefect_ml.integrations.storage import CheckpointStore, LeaseLostError
from prefect_ml.integrations.tracking import NODE_TAG, RESUMED_TAG, WORKER_TAG
from prefect_ml.tasks.campaign.results import trial_values

if TYPE_CHECKING:
    import optuna

    from prefect_ml.integrations.tracking import TrackingWriter

WAIT_S = 1.0  # how long the loop waits for a result before it looks at the clock again
VERDICT_STATES = {"complete": "COMPLETE", "prune": "PRUNED", "fail": "FAIL", "retry": "FAIL"}
# What a trial trains with, drawn from its search space: its spec and its MLflow params.
Plan = Callable[["optuna.trial.Trial"], tuple[TrialSpec, dict[str, Any]]]


class TrialRefused(PrefectMLError):
    """A plan that cannot train: the space raised for this trial, or set a value the sections
    refuse. The trial fails at once with ``reason``; the campaign goes on."""

    def __init__(self, reason: str, mlflow_params: dict[str, Any]) -> None:
        super().__init__(reason)
        self.reason, self.mlflow_params = reason, mlflow_params


def new_study_writer() -> Executor:
    """One thread, so the study still has one writer in this process, and in order."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="optuna")


@dataclass(frozen=True)
class CampaignRules:
    """When trials start and when the campaign stops."""

    objectives: Mapping[str, str]  # name -> "maximize" | "minimize"; the first one ranks
    budget: int | None  # finished trials to reach; None: until the timeout
    max_consecutive_failures: int
    stop_at: float | None = None  # no new trial once an epoch's first objective reaches it
    timeout_seconds: float | None = None  # no new trial after this long

    @property
    def names(self) -> list[str]:
        return list(self.objectives)

    def reached(self, value: float) -> bool:
        if self.stop_at is None:
            return False
        maximize = self.objectives[self.names[0]] == "maximize"
        return value >= self.stop_at if maximize else value <= self.stop_at


@dataclass
class Tally:
    """Counts the view and the budget read; changed only by the coordinator's loop."""

    complete: int = 0
    pruned: int = 0
    failed: int = 0
    failures_in_a_row: int = 0
    transient_in_a_row: bool = False  # a failure of the streak may heal (storage, a lost worker)
    first_error: str | None = None
    best: float | None = None
    target_reached_at: float | None = None  # Unix time

    @property
    def finished(self) -> int:
        return self.complete + self.pruned + self.failed


@dataclass(frozen=True)
class TrialEnd:
    """What the study is told when a trial ends, fixed at that moment (the study writer reads
    it later): values only for a COMPLETE trial, the epochs not yet reported, the error."""

    trial: optuna.trial.Trial
    state: str
    values: tuple[float, ...] | None
    reports: tuple[EpochReport, ...]
    error: str | None


@dataclass
class RunningTrial:
    """A trial on a slot; only the loop's thread touches it."""

    trial: optuna.trial.Trial
    checkpoint_url: str
    tagged: bool = False  # its worker (and resume point) are on its MLflow run
    unreported: list[EpochReport] = field(default_factory=list)  # not yet reported to Optuna
    last_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Asked:
    trial: optuna.trial.Trial
    spec: TrialSpec | None  # None: refused, for ``error``
    mlflow_params: dict[str, Any]
    error: str | None = None


class Coordinator:
    """Asks for trials, dispatches them to a pool, reports epochs, prunes and tells results."""

    def __init__(
        self,
        study: optuna.Study,
        rules: CampaignRules,
        plan: Plan,
        *,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        study_writer: Executor | None = None,
    ) -> None:
        self.study, self.rules, self.plan = study, rules, plan
        self.names = rules.names
        self.deadline: float | None = None  # no new trial after it (monotonic clock)
        self.logger = logger
        self.tally = Tally()
        self.running: dict[int, RunningTrial] = {}  # slot -> its trial
        self.closed: set[int] = set()  # slots whose lost worker could not be replaced
        self.study_writer = study_writer or new_study_writer()
        self.study_writes: list[Future[TrialEnd]] = []
        # The next trials, asked while the workers are busy: one per open slot at most.
        self.spares: deque[Future[Asked]] = deque()

    # --- before the loop ------------------------------------------------------------------
    def recover(self) -> list[int]:
        """Requeue the trials a dead coordinator left RUNNING, then count the finished ones."""
        interrupted = recover_interrupted(self.study)
        for trial in interrupted:
            self.logger.warning(
                "Trial %d was left running by a dead process; it runs again", trial.number
            )
        self.tally = Tally()
        for trial in self.study.get_trials(deepcopy=False):
            if counts_toward_budget(trial):
                values, error = (
                    trial_values(trial, self.names),
                    trial.user_attrs.get(ERROR_ATTR),
                )
                self._count(trial.number, trial.state.name, values, error)
        # A streak counts within one run: the code may be fixed.
        self.tally.failures_in_a_row, self.tally.transient_in_a_row = 0, False
        return [trial.number for trial in interrupted]

    @property
    def stopped_by_failures(self) -> bool:
        """Whether the last trials failed ``max_consecutive_failures`` times in a row."""
        return self.tally.failures_in_a_row >= self.rules.max_consecutive_failures

    @property
    def remaining(self) -> int | None:
        """Trials still to finish; None without a budget."""
        budget = self.rules.budget
        return None if budget is None else max(0, budget - self.tally.finished)

    # --- the loop -------------------------------------------------------------------------
    def run(
        self,
        pool: TrialPool,
        writer: TrackingWriter,
        *,
        progress: Callable[[bool], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Keep every slot busy until the budget is spent, then let the workers finish.

        ``progress(force)`` is called after every wait, and ``check()``, which raises to stop
        the campaign (its lease was lost). Trials running when this raises are left RUNNING:
        the next coordinator retries them.
        """
        try:
            self._drive(pool, writer, progress or (lambda force: None), check or (lambda: None))
        except LeaseLostError:
            # Another coordinator owns the study now: tell it nothing more (it retries the
            # trials this one leaves RUNNING), and let the lease error be what is raised.
            self.study_writer.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            self.study_writer.shutdown(wait=True)
        for write in self.study_writes:
            write.result()  # a failed write to the study surfaces here

    def _drive(
        self,
        pool: TrialPool,
        writer: TrackingWriter,
        progress: Callable[[bool], None],
        check: Callable[[], None],
    ) -> None:
        timeout = self.rules.timeout_seconds
        self.deadline = deadline = time.monotonic() + timeout if timeout else None
        for slot in range(pool.size):
            if self._can_start(deadline):
                self._dispatch(pool, slot, writer)
        while self.running:
            self._ask_ahead(pool.size - len(self.closed), deadline)
            for slot, outcome in pool.wait(WAIT_S):
                self._on_outcome(pool, slot, outcome, deadline, writer)
            progress(False)
            check()
        self._discard_spares()
        pool.finish()
        progress(True)

    def _can_start(self, deadline: float | None, pending: int = 0) -> bool:
        """Whether another trial may start; ``pending`` trials count too: ones about to be
        recorded, or asked ahead."""
        tally, budget = self.tally, self.rules.budget
        if budget is not None and tally.finished + pending + len(self.running) >= budget:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if tally.target_reached_at is not None:
            return False
        return tally.failures_in_a_row < self.rules.max_consecutive_failures

    def _ask(self) -> Asked:
        """A new trial (or a retry queued in the study), planned: the plan draws its values."""
        trial = self.study.ask()
        try:
            spec, mlflow_params = self.plan(trial)
        except TrialRefused as refused:
            return Asked(trial, None, refused.mlflow_params, refused.reason)
        return Asked(trial, spec, mlflow_params)

    def _ask_ahead(self, open_slots: int, deadline: float | None) -> None:
        """Queue asks on the study writer until each open slot has a next trial waiting (as
        far as the budget goes): slots whose trials end together (trials of one length) then
        find theirs ready, rather than one waiting for the other's tell and ask."""
        while len(self.spares) < open_slots and self._can_start(deadline, len(self.spares)):
            self.spares.append(self.study_writer.submit(self._ask))

    def _dispatch(self, pool: TrialPool, slot: int, writer: TrackingWriter) -> None:
        """Start the next trial on ``slot``: the oldest one asked ahead of time, if any. A
        refused plan fails its trial at once (counted, recorded) and the next one is taken."""
        while True:
            asked = self.spares.popleft().result() if self.spares else self._ask()
            if asked.spec is not None:
                break
            writer.trial_started(asked.trial.number, asked.mlflow_params)
            self._finish(RunningTrial(asked.trial, ""), "FAIL", {}, writer, asked.error)
            if not self._can_start(self.deadline, max(0, len(self.spares) - 1)):
                return
        pool.begin(slot, asked.spec)
        self.running[slot] = RunningTrial(asked.trial, asked.spec.loop.checkpoint_url)
        writer.trial_started(asked.trial.number, asked.mlflow_params)

    def _discard_spares(self) -> None:
        """Trials asked ahead but never started (timeout, target, failures): not counted."""
        from optuna.trial import TrialState

        while self.spares:
            trial = self.spares.popleft().result().trial
            trial.set_user_attr(NOT_STARTED_ATTR, True)
            self.study.tell(trial, state=TrialState.FAIL)

    def _on_outcome(
        self,
        pool: TrialPool,
        slot: int,
        outcome: Outcome,
        deadline: float | None,
        writer: TrackingWriter,
    ) -> None:
        """One call of a running trial came back: go on, or record it and start the next."""
        running = self.running.pop(slot)
        values: dict[str, float] = {}
        error: str | None = None
        transient = False  # a failure that may heal: a worker lost too often, a storage error
        if isinstance(outcome, Epochs):
            verdict, values, error = self._decide(running, outcome.reports, writer)
        elif isinstance(outcome, WorkerLost):
            # Not the trial's fault as far as we know (OOM killer, lost node): run it again.
            verdict, error, transient = "retry", outcome.reason, True
            if not pool.replace(slot):
                self.closed.add(slot)
        else:
            assert isinstance(outcome, TrialError)
            verdict, error = "fail", outcome.error
            transient = not outcome.deterministic
        if verdict == "continue":
            pool.advance(slot)
            self.running[slot] = running
            return
        # The slot is free: it gets the next trial before this one is recorded, unless a
        # failure has to be counted first (failures in a row can stop the campaign).
        early = verdict in ("complete", "prune") and self._can_start(deadline, pending=1)
        if early:
            self._dispatch(pool, slot, writer)
        if verdict == "retry" and requeue(self.study, running.trial):
            self.logger.warning("Trial %d: %s; it runs again", running.trial.number, error)
            writer.trial_ended(running.trial.number, "FAIL", {}, f"interrupted: {error}")
        else:
            self._finish(running, VERDICT_STATES[verdict], values, writer, error, transient)
        if slot in self.closed:
            self._closed(pool, slot)
        elif not early and self._can_start(deadline):
            self._dispatch(pool, slot, writer)

    def _closed(self, pool: TrialPool, slot: int) -> None:
        """A slot whose worker could not be replaced (the cluster lost its room) runs no more;
        with none left the campaign stops (its trials wait in the study for the next run)."""
        open_slots = pool.size - len(self.closed)
        self.logger.warning(
            "Trial slot %d closed: the cluster has no room for its worker any more (a lost "
            "node?); %d slot(s) go on",
            slot,
            open_slots,
        )
        if open_slots == 0:
            raise PrefectMLError(
                "every trial worker was lost and the cluster has room for none; the trials "
                "they ran wait in the study: run the campaign again once the cluster has its "
                "nodes back"
            )

    def _decide(
        self, running: RunningTrial, reports: tuple[EpochReport, ...], writer: TrackingWriter
    ) -> tuple[str, dict[str, float], str | None]:
        """Record the epochs; (verdict, values, error), the verdict one of 'continue',
        'complete', 'prune' or 'fail'."""
        trial = running.trial
        for report in reports:
            checkpoint = CheckpointStore(running.checkpoint_url).url_for(report.epoch)
            # The worker that ran the trial is tagged in the same write as its first epoch.
            tags = None if running.tagged else worker_tags(reports)
            running.tagged = True
            writer.epoch(trial.number, report.epoch, report.metrics, checkpoint, tags)
            self._check_target(report.metrics[self.names[0]])
        running.unreported.extend(reports)
        if reports:
            running.last_metrics = reports[-1].metrics
        if reports and reports[-1].final:  # told in _finish, after the next trial started
            values = {n: float(reports[-1].metrics[n]) for n in self.names}
            if not all(math.isfinite(v) for v in values.values()):
                return "fail", {}, f"objective is not finite: {values}"
            return "complete", values, None
        # The pruner is about to read them: intermediate values to Optuna now.
        self._report(trial, running.unreported)
        running.unreported.clear()
        if len(self.names) == 1 and trial.should_prune():
            return "prune", {}, None
        return "continue", {}, None

    def _check_target(self, value: float) -> None:
        if self.tally.target_reached_at is None and self.rules.reached(value):
            self.tally.target_reached_at = time.time()
            self.logger.info("A trial reached %s = %g: no new trials", self.names[0], value)

    def _finish(
        self,
        running: RunningTrial,
        state: str,
        values: dict[str, float],
        writer: TrackingWriter,
        error: str | None = None,
        transient: bool = False,
    ) -> None:
        """Record a trial's end: counted here at once, told to the study in the background."""
        trial = running.trial
        told = tuple(values[n] for n in self.names) if state == "COMPLETE" else None
        end = TrialEnd(trial, state, told, tuple(running.unreported), error)
        running.unreported.clear()
        told_future = self.study_writer.submit(self._tell, end)
        self.study_writes.append(told_future)
        shown = dict(values)
        if state == "PRUNED" and running.last_metrics:  # its value: the last one it reported
            shown = {self.names[0]: float(running.last_metrics[self.names[0]])}

        def record(told: Future[TrialEnd]) -> None:
            # MLflow ends the trial's run only once the study has it: a process killed in
            # between leaves the run RUNNING, which the next run marks interrupted, never a
            # FINISHED run for an attempt the study retries.
            if not told.cancelled() and told.exception() is None:
                writer.trial_ended(trial.number, state, shown, error)

        told_future.add_done_callback(record)
        self._count(trial.number, state, shown, error, transient)
        if state == "FAIL":
            self.logger.warning("Trial %d failed: %s", trial.number, error)

    def _tell(self, end: TrialEnd) -> TrialEnd:
        """On the study writer: what was fixed when the trial ended, nothing read later;
        returns it once the study has it."""
        from optuna.trial import TrialState

        self._report(end.trial, end.reports)
        if end.error:
            end.trial.set_user_attr(ERROR_ATTR, end.error[:2000])
        told = list(end.values) if end.values is not None else None
        self.study.tell(end.trial, told, state=TrialState[end.state])
        return end

    def _report(self, trial: optuna.trial.Trial, reports: Sequence[EpochReport]) -> None:
        if len(self.names) == 1:
            for report in reports:
                trial.report(report.metrics[self.names[0]], report.epoch)

    def _count(
        self,
        number: int,
        state: str,
        values: dict[str, float],
        error: str | None,
        transient: bool = False,
    ) -> None:
        tally = self.tally
        if state == "COMPLETE":
            tally.complete += 1
            tally.failures_in_a_row, tally.transient_in_a_row = 0, False
        elif state == "PRUNED":
            tally.pruned += 1
            tally.failures_in_a_row, tally.transient_in_a_row = 0, False
        else:
            tally.failed += 1
            tally.failures_in_a_row += 1
            tally.transient_in_a_row = tally.transient_in_a_row or transient
            tally.first_error = tally.first_error or f"trial {number}: {error}"
        value = values.get(self.names[0])
        if state == "COMPLETE" and value is not None and math.isfinite(value):
            better = max if self.rules.objectives[self.names[0]] == "maximize" else min
            tally.best = value if tally.best is None else better(tally.best, value)


def worker_tags(reports: tuple[EpochReport, ...]) -> dict[str, str]:
    """The process that trains a trial, and the epoch it resumed from (if it did)."""
    tags = {WORKER_TAG: str(reports[0].worker_pid)}
    node = next((report.node for report in reports if report.node), None)
    if node:
        tags[NODE_TAG] = node
    resumed = [r.epoch for r in reports if r.from_checkpoint]
    if resumed:
        tags[RESUMED_TAG] = str(max(resumed))
    return tags
