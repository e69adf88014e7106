"""The campaign step: one coordinator owns the Optuna study and drives trials on warm Ray actors.

The coordinator is the study's only writer (ask, report, prune, tell), so the storage has one
writer however many workers and nodes run trials. Workers train one epoch per call and the
coordinator decides after each epoch. MLflow writes go through a background thread so that
tracking never holds a worker idle; the study, not MLflow, is the source of truth, and on start
the MLflow runs are reconciled with it (a process killed between the two leaves nothing wrong).
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from integrations import ray_trials, storage, studies, tracking
from integrations.checkpoints import CheckpointStore
from integrations.errors import CampaignFailedError
from integrations.prefect_server import RAY_TAG
from integrations.ray_cluster import ray_session
from integrations.resources import cluster_nodes
from integrations.settings import PrefectMLSettings, get_settings
from tasks.data import PreparedData
from tasks.params import TRIAL_FIELDS, CampaignParams, with_trial_values
from tasks.placement import require_fits
from tasks.retries import transient_retries
from tasks.train import current_flow_run_id, flatten, loop_config

if TYPE_CHECKING:
    from uuid import UUID

    import optuna
    from mlflow import MlflowClient

LEADERBOARD_SIZE = 10
LEADERBOARD_INTERVAL_S = 3.0
HEARTBEAT_INTERVAL_S = 10.0
VERDICT_STATES = {"complete": "COMPLETE", "prune": "PRUNED", "fail": "FAIL", "retry": "FAIL"}
WORKER_TAG = "prefect_ml.worker_pid"
RESUMED_TAG = "prefect_ml.resumed_from_epoch"


class TrialSummary(BaseModel):
    """One finished trial as the leaderboard and the pipeline see it."""

    number: int
    state: str
    values: dict[str, float]
    params: dict[str, Any]
    run_id: str | None = None
    error: str | None = None


class CampaignResult(BaseModel):
    """A campaign's outcome: counts, the best trial(s) and where the record lives."""

    campaign: str
    experiment_id: str
    parent_run_id: str
    finished: int
    complete: int
    pruned: int
    failed: int
    best: list[TrialSummary]  # one trial, or the Pareto front for several objectives
    leaderboard: list[TrialSummary]
    objectives: dict[str, str]
    # Seconds spent: setup (study, MLflow, workers), trials, conclusion (plots, records).
    timings: dict[str, float]
    target_reached_at: float | None = None  # Unix time an epoch first reached stop_at


def campaign_key(campaign: str, storage_url: str) -> str:
    """Names a campaign uniquely: the same name in two storages is two campaigns."""
    return f"{campaign}@{hashlib.sha256(storage_url.encode()).hexdigest()[:8]}"


class TrackingWriter:
    """MLflow's only writer during a campaign: a FIFO thread, so tracking never blocks trials."""

    def __init__(
        self, client: MlflowClient, experiment_id: str, parent_run_id: str, key: str
    ) -> None:
        self.client, self.experiment_id = client, experiment_id
        self.parent_run_id, self.key = parent_run_id, key
        self.run_ids: dict[int, str] = {}
        self.errors: list[str] = []
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception as exc:  # recorded; the study stays the source of truth
                self.errors.append(repr(exc))

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        def start() -> None:
            self.run_ids[number] = tracking.start_trial_run(
                self.client, self.experiment_id, self.parent_run_id, self.key, number, params
            )

        self.submit(start)

    def submit_tags(self, number: int, tags: dict[str, str]) -> None:
        self.submit(lambda: tracking.set_tags(self.client, self.run_ids[number], tags))

    def epoch(self, number: int, epoch: int, metrics: dict[str, float], checkpoint: str) -> None:
        self.submit(
            lambda: tracking.log_epoch(
                self.client, self.run_ids[number], epoch, metrics, checkpoint
            )
        )

    def trial_ended(
        self, number: int, state: str, values: dict[str, float], error: str | None
    ) -> None:
        self.submit(
            lambda: tracking.end_trial_run(self.client, self.run_ids[number], state, values, error)
        )

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def trial_summary(
    trial: optuna.trial.FrozenTrial, objectives: list[str], run_ids: dict[int, str]
) -> TrialSummary:
    values = dict(zip(objectives, trial.values or [], strict=False))
    if not values and trial.intermediate_values:  # a pruned trial: its last reported value
        last = max(trial.intermediate_values)
        values = {objectives[0]: trial.intermediate_values[last]}
    return TrialSummary(
        number=trial.number,
        state=trial.state.name,
        values=values,
        params=trial.params,
        run_id=run_ids.get(trial.number),
        error=trial.user_attrs.get(studies.ERROR_ATTR),
    )


def leaderboard(
    study: optuna.Study, objectives: dict[str, str], run_ids: dict[int, str]
) -> list[TrialSummary]:
    """Finished trials, best first by the first objective; failed ones last."""
    names, direction = list(objectives), next(iter(objectives.values()))
    finished = [t for t in study.get_trials(deepcopy=False) if studies.counts_toward_budget(t)]
    summaries = [trial_summary(t, names, run_ids) for t in finished]
    sign = -1.0 if direction == "maximize" else 1.0

    def rank(summary: TrialSummary) -> tuple[int, int, float]:
        value = summary.values.get(names[0], math.nan)
        order = {"COMPLETE": 0, "PRUNED": 1}.get(summary.state, 2)
        return (
            order,
            0 if math.isfinite(value) else 1,
            sign * value if math.isfinite(value) else 0,
        )

    return sorted(summaries, key=rank)


@dataclass
class Tally:
    """What the progress bar and the budget need to know, kept up to date by the coordinator."""

    complete: int = 0
    pruned: int = 0
    failed: int = 0
    failures_in_a_row: int = 0
    first_error: str | None = None
    best: float | None = None
    started: float = field(default_factory=time.monotonic)
    target_reached_at: float | None = None  # Unix time

    @property
    def finished(self) -> int:
        return self.complete + self.pruned + self.failed


class CampaignView:
    """The live view: a rich progress bar here, progress and leaderboard artifacts in Prefect."""

    def __init__(self, campaign: str, total: int | None, tally: Tally) -> None:
        self.campaign, self.total, self.tally = campaign, total, tally
        self._progress = Progress(
            TextColumn(f"[bold]campaign {campaign}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
        )
        self._bar = self._progress.add_task("trials", total=total, status="")
        self._artifact_id: UUID = create_progress_artifact(  # type: ignore[assignment]
            0.0, key=f"campaign-{slug(campaign)}-progress", description=f"campaign {campaign}"
        )
        self._last_leaderboard = 0.0

    def __enter__(self) -> CampaignView:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def update(self) -> None:
        tally = self.tally
        best = "-" if tally.best is None else f"{tally.best:.4f}"
        status = (
            f"best {best}  complete {tally.complete}  pruned {tally.pruned}  failed {tally.failed}"
        )
        self._progress.update(self._bar, completed=tally.finished, status=status)

    def publish(
        self,
        rows_of: Callable[[], list[TrialSummary]],
        links_of: Callable[[], dict[int, str]],
        *,
        force: bool,
    ) -> None:
        """Leaderboard and progress artifacts, at most every few seconds unless forced."""
        now = time.monotonic()
        if not force and now - self._last_leaderboard < LEADERBOARD_INTERVAL_S:
            return
        self._last_leaderboard = now
        if self.total:
            update_progress_artifact(
                self._artifact_id, min(100.0, 100.0 * self.tally.finished / self.total)
            )
        rows, links = rows_of(), links_of()
        if rows:
            create_table_artifact(
                [leaderboard_row(row, links.get(row.number, "")) for row in rows],
                key=f"campaign-{slug(self.campaign)}-leaderboard",
                description=f"Top {len(rows)} trials of campaign {self.campaign}",
            )


def slug(name: str) -> str:
    """A Prefect artifact key from a campaign name (lowercase letters, digits, dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "campaign"


def leaderboard_row(row: TrialSummary, link: str) -> dict[str, Any]:
    return {
        "trial": row.number,
        "state": row.state,
        **{name: round(value, 6) for name, value in row.values.items()},
        "params": ", ".join(f"{k}={_short(v)}" for k, v in sorted(row.params.items())),
        "mlflow_run": link,
    }


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class TrialEnd:
    """What the study is told when a trial ends, fixed at that moment (the study thread reads it
    later): values only for a COMPLETE trial, the epochs not yet reported, the error."""

    trial: optuna.trial.Trial
    state: str
    values: tuple[float, ...] | None
    reports: tuple[Any, ...]
    error: str | None


@dataclass
class RunningTrial:
    trial: optuna.trial.Trial
    worker: Any
    checkpoint_url: str
    tagged: bool = False  # its worker (and resume point) are on its MLflow run
    unreported: list[Any] = field(default_factory=list)  # epochs not yet reported to Optuna
    last_metrics: dict[str, float] = field(default_factory=dict)


class Coordinator:
    """Asks for trials, dispatches them to workers, reports epochs, prunes and tells results."""

    def __init__(
        self, params: CampaignParams, data: PreparedData, settings: PrefectMLSettings
    ) -> None:
        self.params, self.data, self.settings = params, data, settings
        self.sweep = params.sweep
        self.objectives: dict[str, str] = dict(self.sweep.objectives)
        self.names = list(self.objectives)
        space = {name: d.model_dump() for name, d in self.sweep.search_space.items()}
        self.distributions = studies.distributions(space)
        grid = (
            {name: d.grid() for name, d in self.sweep.search_space.items()}
            if self.sweep.sampler == "grid"
            else None
        )
        self.study = studies.open_study(
            settings.resolved_optuna_storage,
            self.sweep.campaign,
            self.objectives,
            studies.make_sampler(self.sweep.sampler, self.sweep.sampler_seed, grid),
            studies.make_pruner(self.sweep.effective_pruner, params.training.epochs),
        )
        studies.check_search_space(self.study, self.distributions)
        budget = self.sweep.n_trials
        if grid is not None:
            budget = min(budget or studies.grid_size(grid), studies.grid_size(grid))
        self.budget = budget
        self.key = campaign_key(self.sweep.campaign, settings.resolved_optuna_storage)
        self.campaign_url = storage.join(
            settings.resolved_storage_url, "campaigns", self.sweep.campaign
        )
        self.logger = get_run_logger()
        self.tally = Tally()
        self.running: dict[Any, RunningTrial] = {}  # pending ObjectRef -> trial
        # Asking for the next trial and telling finished ones take tens of milliseconds each;
        # one background thread does them in order (still this process's only study writer),
        # so the loop hands a finished worker its next trial at once.
        self.study_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optuna")
        self.study_writes: list[Future[None]] = []
        self.spare: Future[tuple[optuna.trial.Trial, ray_trials.TrialSpec, dict[str, Any]]] | None
        self.spare = None  # the next trial, asked while the workers are busy
        self.workers: list[Any] = []  # the trial actors, released at the end

    # --- study and MLflow state -----------------------------------------------------------
    def attach(self) -> TrackingWriter:
        """Claim the study, recover interrupted trials, re-attach MLflow runs to the study."""
        self.owner = studies.claim(self.study)
        for trial in studies.recover_interrupted(self.study):
            self.logger.warning(
                "Trial %d was left running by a dead process; it runs again", trial.number
            )
        client = tracking.client_for(self.settings.resolved_tracking_uri)
        self.experiment_id = tracking.ensure_experiment(
            client, self.params.experiment, self.settings.mlflow_artifact_root
        )
        parent_run_id, reattached = tracking.campaign_parent_run(
            client,
            self.experiment_id,
            self.key,
            self.study.user_attrs.get(studies.PARENT_RUN_ATTR),
            run_name=f"campaign-{self.sweep.campaign}",
            params={
                **flatten(self.params.model_copy(update={"sweep": None})),
                "sweep.search_space": {
                    k: v.model_dump(exclude_none=True) for k, v in self.sweep.search_space.items()
                },
                "sweep.objectives": self.objectives,
                "sweep.sampler": self.sweep.sampler,
                "sweep.pruner": self.sweep.effective_pruner,
                "data.fingerprint": self.data.fingerprint,
            },
            tags={
                tracking.FLOW_RUN_TAG: current_flow_run_id(),
                tracking.FINGERPRINT_TAG: self.data.fingerprint,
                "prefect_ml.optuna_study": self.sweep.campaign,
            },
        )
        self.study.set_user_attr(studies.PARENT_RUN_ATTR, parent_run_id)
        if reattached:
            self.logger.info("Continuing campaign %s (MLflow run %s)", self.key, parent_run_id)
        writer = TrackingWriter(client, self.experiment_id, parent_run_id, self.key)
        self._reconcile(writer)
        return writer

    def _reconcile(self, writer: TrackingWriter) -> None:
        """Count the finished trials and give each a terminated nested run, whatever a dead
        process left."""
        runs = tracking.trial_runs(writer.client, self.experiment_id, writer.parent_run_id)
        for trial in self.study.get_trials(deepcopy=False):
            summary = trial_summary(trial, self.names, {})
            if studies.counts_toward_budget(trial):
                self._count(trial.state.name, summary)
            run = runs.get(trial.number)
            if run is not None:
                writer.run_ids[trial.number] = run.info.run_id
            if trial.user_attrs.get(studies.NOT_STARTED_ATTR):
                continue  # never ran: nothing to record
            if not trial.state.is_finished() or (run and run.info.status != "RUNNING"):
                continue
            if run is None:
                tuned = with_trial_values(self.params, trial.params)
                writer.trial_started(trial.number, self.trial_params(tuned, trial.params))
            error = summary.error or (
                "interrupted: its coordinator process died; the trial runs again"
                if trial.user_attrs.get(studies.INTERRUPTED_ATTR)
                else None
            )
            writer.trial_ended(trial.number, trial.state.name, summary.values, error)
        self.tally.failures_in_a_row = 0  # a streak counts within one run: the code may be fixed

    @staticmethod
    def trial_params(tuned: CampaignParams, values: dict[str, Any]) -> dict[str, Any]:
        """A trial's MLflow params: every value it trained with, and which ones were tuned."""
        return {**flatten(tuned), "trial.tuned": sorted(values)}

    # --- the loop -------------------------------------------------------------------------
    def _can_start(self, deadline: float | None, finishing: int = 0) -> bool:
        """Whether another trial may start; ``finishing`` trials are about to be recorded."""
        tally = self.tally
        started = tally.finished + finishing + len(self.running)
        if self.budget is not None and started >= self.budget:
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if tally.target_reached_at is not None:
            return False
        return tally.failures_in_a_row < self.sweep.max_consecutive_failures

    def _check_target(self, value: float) -> None:
        target, tally = self.sweep.stop_at, self.tally
        if target is None or tally.target_reached_at is not None:
            return
        maximize = self.objectives[self.names[0]] == "maximize"
        if (value >= target) if maximize else (value <= target):
            tally.target_reached_at = time.time()
            self.logger.info("A trial reached %s = %g: no new trials", self.names[0], value)

    def _spec(self, trial: optuna.trial.Trial, tuned: CampaignParams) -> ray_trials.TrialSpec:
        root = studies.root_trial(trial)
        checkpoint_url = storage.join(self.campaign_url, f"trial-{root:05d}")
        config = loop_config(
            tuned,
            self.data,
            checkpoint_url=checkpoint_url,
            tracking_uri=self.settings.resolved_tracking_uri,
            run_id="",
        )
        # Per attempt: a retried trial must not see the marker of an attempt that was pruned.
        config = replace(config, stop_url=storage.join(checkpoint_url, f"STOP-{trial.number}"))
        return ray_trials.TrialSpec(
            number=trial.number,
            loop=config,
            workers=self.sweep.trial_workers,
            request=self.sweep.trial_request(),
            ray_storage_url=self.settings.ray_storage_url,
        )

    def _ask(self) -> tuple[optuna.trial.Trial, ray_trials.TrialSpec, dict[str, Any]]:
        trial = self.study.ask(self.distributions)
        tuned = with_trial_values(self.params, trial.params)
        return trial, self._spec(trial, tuned), self.trial_params(tuned, trial.params)

    def _dispatch(self, worker: Any, writer: TrackingWriter) -> None:
        """Start the next trial on ``worker``: the one asked ahead of time, if any."""
        trial, spec, mlflow_params = self.spare.result() if self.spare else self._ask()
        self.spare = None
        self.running[worker.begin.remote(spec)] = RunningTrial(
            trial, worker, spec.loop.checkpoint_url
        )
        writer.trial_started(trial.number, mlflow_params)

    def _discard_spare(self) -> None:
        """A trial asked ahead but never started (timeout, target, failures): not counted."""
        from optuna.trial import TrialState

        if self.spare is not None:
            trial, _spec, _params = self.spare.result()
            trial.set_user_attr(studies.NOT_STARTED_ATTR, True)
            self.study.tell(trial, state=TrialState.FAIL)
            self.spare = None

    def _count(self, state: str, summary: TrialSummary) -> None:
        tally = self.tally
        if state == "COMPLETE":
            tally.complete += 1
            tally.failures_in_a_row = 0
        elif state == "PRUNED":
            tally.pruned += 1
            tally.failures_in_a_row = 0
        else:
            tally.failed += 1
            tally.failures_in_a_row += 1
            tally.first_error = tally.first_error or f"trial {summary.number}: {summary.error}"
        value = summary.values.get(self.names[0])
        if state == "COMPLETE" and value is not None and math.isfinite(value):
            better = max if self.objectives[self.names[0]] == "maximize" else min
            tally.best = value if tally.best is None else better(tally.best, value)

    def _finish(
        self,
        running: RunningTrial,
        state: str,
        values: dict[str, float],
        writer: TrackingWriter,
        error: str | None = None,
    ) -> None:
        """Record a trial's end: counted here at once, told to the study in the background."""
        trial = running.trial
        told = (
            tuple(values[n] for n in self.names) if state == "COMPLETE" and values else None
        )
        end = TrialEnd(trial, state, told, tuple(running.unreported), error)
        running.unreported.clear()
        self.study_writes.append(self.study_thread.submit(self._tell, end))
        if state == "PRUNED" and running.last_metrics:  # its value: the last one it reported
            values = {self.names[0]: float(running.last_metrics[self.names[0]])}
        summary = TrialSummary(
            number=trial.number, state=state, values=values, params=trial.params, error=error
        )
        writer.trial_ended(trial.number, state, summary.values, error)
        self._count(state, summary)
        if state == "FAIL":
            self.logger.warning("Trial %d failed: %s", trial.number, error)

    def _tell(self, end: TrialEnd) -> None:
        """On the study thread: what was fixed when the trial ended, nothing read later."""
        from optuna.trial import TrialState

        self._report_values(end.trial, list(end.reports))
        if end.error:
            end.trial.set_user_attr(studies.ERROR_ATTR, end.error[:2000])
        told = list(end.values) if end.values is not None else None
        self.study.tell(end.trial, told, state=TrialState[end.state])

    def _report_values(self, trial: optuna.trial.Trial, reports: list[Any]) -> None:
        if len(self.names) == 1:
            for report in reports:
                trial.report(report.metrics[self.names[0]], report.epoch)

    def _report(self, running: RunningTrial) -> None:
        """Intermediate values to Optuna now (the pruner is about to read them)."""
        self._report_values(running.trial, running.unreported)
        running.unreported.clear()

    def _decide(
        self, running: RunningTrial, reports: list[Any], writer: TrackingWriter
    ) -> tuple[str, dict[str, float], str | None]:
        """Report epochs to Optuna and MLflow; (verdict, values, error), where the verdict is
        'continue', 'complete', 'prune', 'fail' or (decided by the caller) 'retry'."""
        trial = running.trial
        if reports and not running.tagged:
            running.tagged = True
            tags = {WORKER_TAG: str(reports[0].worker_pid)}
            resumed = [r.epoch for r in reports if r.from_checkpoint]
            if resumed:
                tags[RESUMED_TAG] = str(max(resumed))
            writer.submit_tags(trial.number, tags)
        for report in reports:
            checkpoint = CheckpointStore(running.checkpoint_url).url_for(report.epoch)
            writer.epoch(trial.number, report.epoch, report.metrics, checkpoint)
            self._check_target(report.metrics[self.names[0]])
        running.unreported.extend(reports)
        if reports:
            running.last_metrics = reports[-1].metrics
        if reports and reports[-1].final:  # recorded in _finish, after the next trial started
            values = {n: float(reports[-1].metrics[n]) for n in self.names}
            if not all(math.isfinite(v) for v in values.values()):
                return "fail", {}, f"objective is not finite: {values}"
            return "complete", values, None
        self._report(running)
        if len(self.names) == 1 and trial.should_prune():
            return "prune", {}, None
        return "continue", {}, None

    def run(self) -> CampaignResult:
        self.timings: dict[str, float] = {}
        writer = self.attach()
        try:
            if self.budget is not None and self.tally.finished >= self.budget:
                self.logger.info(
                    "Campaign %s already has %d finished trials", self.key, self.tally.finished
                )
            else:
                self._run_trials(writer)
        finally:
            # Trials still running (an exception above) are left RUNNING: the next run retries them.
            writer.close()  # every MLflow record written: part of the trials' cost
        if "setup_seconds" in self.timings:
            self.timings["trials_seconds"] = time.monotonic() - self.trials_started
        return self._conclude(writer)

    def _run_trials(self, writer: TrackingWriter) -> None:
        import ray

        remaining = None if self.budget is None else self.budget - self.tally.finished
        with ray_session(self.settings):
            slots = self._slots(cluster_nodes(), remaining)
            try:
                self._drive(self._start_workers(slots), writer)
            finally:
                self.study_thread.shutdown(wait=True)
                for write in self.study_writes:
                    write.result()  # a failed write to the study surfaces here
                for worker in self.workers:  # their CPUs are free for whatever runs next
                    ray.kill(worker)

    def _drive(self, workers: list[Any], writer: TrackingWriter) -> None:
        """The loop: keep every worker busy until the budget is spent, then flush them."""
        import ray

        deadline = (
            time.monotonic() + self.sweep.timeout_seconds if self.sweep.timeout_seconds else None
        )
        self.logger.info(
            "Campaign %s: %d parallel trial workers, budget %s trials",
            self.key,
            len(workers),
            self.budget or "unlimited",
        )
        view = CampaignView(self.sweep.campaign, self.budget, self.tally)
        self.trials_started = last_heartbeat = time.monotonic()
        self.timings["setup_seconds"] = self.trials_started - self.tally.started
        with view:
            for worker in workers:
                if self._can_start(deadline):
                    self._dispatch(worker, writer)
            while self.running:
                ready, _ = ray.wait(list(self.running), num_returns=1, timeout=1.0)
                for ref in ready:
                    self._on_result(ref, deadline, writer)
                if self.spare is None and self._can_start(deadline):
                    self.spare = self.study_thread.submit(self._ask)
                view.update()
                view.publish(
                    lambda: self._leaderboard(writer), lambda: self._links(writer), force=False
                )
                if time.monotonic() - last_heartbeat > HEARTBEAT_INTERVAL_S:
                    studies.heartbeat(self.study, self.owner)
                    last_heartbeat = time.monotonic()
            self._discard_spare()
            ray.get([worker.finish.remote() for worker in self.workers])
            view.publish(lambda: self._leaderboard(writer), lambda: self._links(writer), force=True)

    def _start_workers(self, count: int) -> list[Any]:
        workers = ray_trials.start_workers(
            count, request=self.sweep.trial_request(), driver_only=self.sweep.trial_workers > 1
        )
        self.workers.extend(workers)
        return workers

    def _on_result(self, ref: Any, deadline: float | None, writer: TrackingWriter) -> None:
        """One epoch (or error) of a running trial: go on, or record it and start the next."""
        import ray

        running = self.running.pop(ref)
        try:
            verdict, values, error = self._decide(running, ray.get(ref), writer)
        except ray.exceptions.RayActorError as exc:
            # Not the trial's fault as far as we know (OOM killer, lost node): run it again.
            verdict, values, error = "retry", {}, f"its worker process died: {exc}"
            self.workers.remove(running.worker)
            running.worker = self._start_workers(1)[0]
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            verdict, values, error = "fail", {}, f"{type(cause).__name__}: {cause}"
        if verdict == "continue":
            self.running[running.worker.advance.remote()] = running
            return
        # The worker is free: it gets the next trial before this one is recorded, unless a
        # failure has to be counted first (failures in a row can stop the campaign).
        early = verdict in ("complete", "prune") and self._can_start(deadline, finishing=1)
        if early:
            self._dispatch(running.worker, writer)
        if verdict == "retry" and studies.requeue(self.study, running.trial):
            self.logger.warning("Trial %d: %s; it runs again", running.trial.number, error)
            writer.trial_ended(running.trial.number, "FAIL", {}, f"interrupted: {error}")
        else:
            self._finish(running, VERDICT_STATES[verdict], values, writer, error)
        if not early and self._can_start(deadline):
            self._dispatch(running.worker, writer)

    def _slots(self, nodes: list[dict[str, float]], remaining: int | None) -> int:
        """Parallel trials: what was asked, capped by how many trials the cluster's nodes hold
        at once (a trial with several workers holds that many copies of the request)."""
        sweep = self.sweep
        what = "trial worker(s)" if sweep.trial_workers > 1 else "trial(s)"
        copies = require_fits(
            sweep.trial_request(), sweep.trial_workers, nodes, what=what, fields=TRIAL_FIELDS
        )
        # Unenforced (PREFECT_ML_CHECK_RESOURCES=false), nothing may fit yet: run as asked.
        fits = copies // sweep.trial_workers or sweep.concurrency
        slots = min([sweep.concurrency, fits, remaining or sweep.concurrency])
        if slots < sweep.concurrency:
            self.logger.warning(
                "Running %d trials at a time, not %d: that is what the cluster fits or the budget "
                "needs",
                slots,
                sweep.concurrency,
            )
        return max(1, slots)

    def _leaderboard(self, writer: TrackingWriter) -> list[TrialSummary]:
        return leaderboard(self.study, self.objectives, writer.run_ids)[:LEADERBOARD_SIZE]

    def _links(self, writer: TrackingWriter) -> dict[int, str]:
        uri = self.settings.resolved_tracking_uri
        return {
            n: tracking.run_url(uri, self.experiment_id, run_id)
            for n, run_id in writer.run_ids.items()
        }

    def _conclude(self, writer: TrackingWriter) -> CampaignResult:
        """Best trial(s) and plots on the parent run; a clear error if nothing completed."""
        concluding = time.monotonic()
        client, parent = writer.client, writer.parent_run_id
        best = [
            trial_summary(t, self.names, writer.run_ids) for t in studies.best_trials(self.study)
        ]
        tally = self.tally
        if best:
            tags = {"prefect_ml.best_trials": ",".join(str(b.number) for b in best)}
            tags.update({f"best.{k}": _short(v) for k, v in best[0].params.items()})
            tracking.set_tags(client, parent, tags)
            tracking.log_metrics(
                client, parent, {f"best.{k}": v for k, v in best[0].values.items()}
            )
        for name, figure in studies.plots(self.study, self.names).items():
            tracking.log_figure(client, parent, figure, f"plots/{name}.png")
        rows = leaderboard(self.study, self.objectives, writer.run_ids)
        client.log_dict(parent, {"trials": [r.model_dump() for r in rows]}, "leaderboard.json")
        tracking.log_metrics(
            client,
            parent,
            {
                "trials_complete": tally.complete,
                "trials_pruned": tally.pruned,
                "trials_failed": tally.failed,
            },
        )
        studies.release(self.study)
        if not best:
            tracking.finish_run(client, parent, "FAILED")
            raise CampaignFailedError(
                f"campaign {self.sweep.campaign}: no trial completed "
                f"({tally.failed} failed, {tally.pruned} pruned). "
                f"First failure: {tally.first_error}"
            )
        tracking.finish_run(client, parent)
        if writer.errors:
            self.logger.warning("Some MLflow writes failed: %s", "; ".join(writer.errors[:3]))
        return CampaignResult(
            campaign=self.sweep.campaign,
            experiment_id=self.experiment_id,
            parent_run_id=parent,
            finished=tally.finished,
            complete=tally.complete,
            pruned=tally.pruned,
            failed=tally.failed,
            best=best,
            leaderboard=rows[:LEADERBOARD_SIZE],
            objectives=self.objectives,
            timings={**self.timings, "conclude_seconds": time.monotonic() - concluding},
            target_reached_at=tally.target_reached_at,
        )


def run_campaign(params: CampaignParams, data: PreparedData) -> CampaignResult:
    """Run (or continue) the campaign ``params.sweep.campaign`` until its budget is spent."""
    return Coordinator(params, data, get_settings()).run()


def campaign_markdown(result: CampaignResult, links: dict[int, str]) -> str:
    best_lines = "\n".join(
        f"- trial {b.number}: "
        + ", ".join(f"{k} = {v:.4f}" for k, v in b.values.items())
        + f" — params `{b.params}`"
        + (f" — [MLflow run]({links[b.number]})" if b.number in links else "")
        for b in result.best
    )
    title = "Pareto front" if len(result.objectives) > 1 else "Best trial"
    return f"""# Campaign `{result.campaign}`

| finished | complete | pruned | failed |
|---|---|---|---|
| {result.finished} | {result.complete} | {result.pruned} | {result.failed} |

## {title}
{best_lines}

Objectives: {", ".join(f"{k} ({v})" for k, v in result.objectives.items())}.
Plots (optimisation history, importances, parallel coordinates, intermediate values) are
artifacts of the campaign's MLflow run `{result.parent_run_id}`.
"""


@task(
    name="hpo-campaign",
    cache_policy=NO_CACHE,
    tags=[RAY_TAG, "campaign"],
    **transient_retries(),
)
def campaign(params: CampaignParams, data: PreparedData) -> CampaignResult:
    result = run_campaign(params, data)
    uri = get_settings().resolved_tracking_uri
    links = {
        row.number: tracking.run_url(uri, result.experiment_id, row.run_id)
        for row in [*result.best, *result.leaderboard]
        if row.run_id
    }
    create_markdown_artifact(
        campaign_markdown(result, links),
        key=f"campaign-{slug(result.campaign)}-summary",
        description=f"campaign {result.campaign}",
    )
    create_link_artifact(
        tracking.run_url(uri, result.experiment_id, result.parent_run_id),
        link_text=f"MLflow parent run of campaign {result.campaign} (plots, every trial)",
        key=f"campaign-{slug(result.campaign)}-mlflow",
    )
    return result
