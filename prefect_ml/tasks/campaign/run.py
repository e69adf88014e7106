"""A campaign from start to end: open its study, attach MLflow, run the pool, conclude.

This wires the parts — :class:`CampaignIdentity`, the :class:`Coordinator`'s decisions, a
:class:`~integrations.campaign.RayTrialPool`, the MLflow
:class:`~integrations.tracking.TrackingWriter` and the :class:`CampaignView` — and owns nothing
else. The study, not MLflow, is the source of truth: on start the MLflow runs are reconciled
with it, so a process killed between the two leaves nothing wrong.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from prefect_ml.integrations import storage, tracking
from prefect_ml.integrations.campaign import (
    INTERRUPTED_ATTR,
    NOT_STARTED_ATTR,
    PARENT_RUN_ATTR,
    TUNED_ATTR,
    RayTrialPool,
    StudyClaim,
    TrialSpec,
    best_trials,
    check_search_space,
    claims_supported,
    distributions,
    draw_once,
    grid_size,
    make_pruner,
    make_sampler,
    open_study,
    plots,
    resolve_space,
    root_trial,
    tuned_values,
)
from prefect_ml.integrations.compute import cluster_nodes, ray_session
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.config.sweep import space_text
from prefect_ml.integrations.contracts import SearchSpace
from prefect_ml.integrations.errors import CampaignFailedError, PrefectMLError
from prefect_ml.integrations.settings import PrefectMLSettings, get_settings
from prefect_ml.integrations.storage import Lease
from prefect_ml.integrations.tracking import TrackingWriter
from prefect_ml.tasks.campaign.coordinator import CampaignRules, Coordinator, TrialRefused
from prefect_ml.tasks.campaign.datasets import TrialDatasets, tunes_data
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from prefect_ml.tasks.campaign.results import (
    LEADERBOARD_SIZE,
    CampaignResult,
    leaderboard,
    trial_summary,
)
from prefect_ml.tasks.campaign.view import CampaignView, short
from prefect_ml.tasks.data import Logger, PreparedData, check_fits_training_split
from prefect_ml.tasks.params import (
    CampaignParams,
    SweepParams,
    TrainingSections,
    with_trial_values,
)
from prefect_ml.tasks.placement import require_fits
from prefect_ml.tasks.training import current_flow_run_id, flatten, train_loop

if TYPE_CHECKING:
    import optuna


@dataclass(frozen=True)
class TrialPlanner:
    """What a trial trains with: the values its search space draws, over the campaign's
    sections, and its checkpoints."""

    params: CampaignParams
    data: PreparedData
    identity: CampaignIdentity
    settings: PrefectMLSettings
    space: SearchSpace
    sections: TrainingSections  # the campaign's fixed values, without its sweep
    datasets: TrialDatasets  # the data of trials that draw dataset options
    logger: Logger

    @classmethod
    def of(
        cls,
        params: CampaignParams,
        data: PreparedData,
        identity: CampaignIdentity,
        settings: PrefectMLSettings,
        logger: Logger | None = None,
    ) -> TrialPlanner:
        space = resolve_space(params.sweep.search_space)
        sections = params.training_sections()
        datasets = TrialDatasets(data, sections.data, storage.root_url(settings))
        logger = logger or logging.getLogger(__name__)
        return cls(params, data, identity, settings, space, sections, datasets, logger)

    def draw(self, trial: optuna.trial.Trial) -> dict[str, Any]:
        """What ``trial`` sets, drawn by the space and kept on the trial (the leaderboard, the
        MLflow record and the final training read it there)."""
        source = space_text(self.params.sweep.search_space)
        values = tuned_values(self.space(trial), source=source)
        trial.set_user_attr(TUNED_ATTR, values)
        return values

    def mlflow_params(
        self,
        values: dict[str, Any],
        drawn: dict[str, Any],
        data: PreparedData | None = None,
        *,
        tuned: TrainingSections | None = None,
    ) -> dict[str, Any]:
        """A trial's MLflow params: every value it trained with (its dataset options among
        them), which ones its space set (``trial.tuned``), exactly the parameters it drew
        (``drawn.<name>``), and the fingerprint of its data when it is not the campaign's.
        ``tuned``: the sections with ``values`` in, when the caller has them already."""
        own_data = {} if data is None else {"data.fingerprint": data.fingerprint}
        return {
            **flatten(tuned or with_trial_values(self.sections, values)),
            "trial.tuned": sorted(values),
            **{f"drawn.{name}": value for name, value in drawn.items()},
            **own_data,
        }

    def trial_data(
        self, values: dict[str, Any], tuned: TrainingSections, study: optuna.Study
    ) -> PreparedData | None:
        """The data of a trial whose ``values`` set dataset options (``tuned``: the sections
        with them in; prepared for them, or shared with the trials that drew the same),
        checked against its batch size and workers; None for the others, which train on the
        campaign's data.

        Raises:
            ConfigurationError: the training split is too small for the trial's values.
        """
        if not tunes_data(values):
            return None
        data = self.datasets.for_recipe(tuned.data, study, self.logger)
        check_fits_training_split(
            tuned, data.rows["train"], workers=self.params.sweep.trial_workers
        )
        return data

    def trial_loop(
        self,
        values: dict[str, Any],
        checkpoint_url: str,
        number: int,
        data: PreparedData | None = None,
        *,
        tuned: TrainingSections | None = None,
    ) -> TrainLoop:
        """What a trial's workers receive: the campaign's sections with the trial's ``values``
        (``tuned``: those sections, when the caller has them already), and its ``data`` (the
        campaign's unless it drew dataset options).

        Trials train every epoch and report each one: the campaign's pruner is what stops a
        trial early, and the study compares trials at the same epochs."""
        tuned = tuned or with_trial_values(self.sections, values)
        every_epoch = tuned.training.model_copy(update={"early_stopping_patience": None})
        return train_loop(
            tuned.model_copy(update={"training": every_epoch}),
            data or self.data,
            checkpoint_url=checkpoint_url,
            # Per attempt: a retried trial must not see the marker of an attempt that was pruned.
            stop_url=storage.trial_stop_url(checkpoint_url, number),
        )

    def __call__(self, trial: optuna.trial.Trial) -> tuple[TrialSpec, dict[str, Any]]:
        """The trial's spec and MLflow params.

        Raises:
            TrialRefused: the space raised for this trial, set a value the sections refuse,
                or drew dataset options whose data cannot be prepared or is too small (its
                other trials may well train: the campaign goes on).
        """
        try:
            values = self.draw(trial)
            tuned = with_trial_values(self.sections, values)  # validated once per trial
            data = self.trial_data(values, tuned, trial.study)
            checkpoint_url = self.identity.trial_url(root_trial(trial))
            loop = self.trial_loop(values, checkpoint_url, trial.number, data, tuned=tuned)
            mlflow_params = self.mlflow_params(values, trial.params, data, tuned=tuned)
        except Exception as exc:  # the user's space and values: this trial fails, not the run
            reason = f"its search space: {type(exc).__name__}: {exc}"
            raise TrialRefused(reason, {f"drawn.{k}": v for k, v in trial.params.items()}) from exc
        sweep = self.params.sweep
        spec = TrialSpec(
            number=trial.number,
            loop=loop,
            workers=sweep.trial_workers,
            request=sweep.resources(),
            ray_storage_url=self.settings.ray_storage_url,
        )
        return spec, mlflow_params


def open_campaign_study(
    sweep: SweepParams, epochs: int, settings: PrefectMLSettings, study_name: str
) -> tuple[optuna.Study, int | None]:
    """The campaign's study (``study_name``: its identity's, in the tenant's namespace),
    checked against its search space, and its budget (a grid caps it at its size)."""
    space = sweep.search_space
    grid = (
        {name: d.grid() for name, d in space.items()}
        if sweep.sampler == "grid" and isinstance(space, dict)
        else None
    )
    study = open_study(
        settings.resolved_optuna_storage,
        study_name,
        dict(sweep.objectives),
        make_sampler(sweep.sampler, sweep.sampler_seed, grid, conditional=sweep.conditional),
        make_pruner(sweep.effective_pruner, epochs),
    )
    if isinstance(space, dict):  # every dimension; a define-by-run space: those of one draw
        known = distributions({name: d.model_dump() for name, d in space.items()})
    else:
        known = draw_once(resolve_space(space))[1]
    check_search_space(study, known)
    budget = sweep.n_trials
    if grid is not None:
        budget = min(budget or grid_size(grid), grid_size(grid))
    return study, budget


def slots(sweep: SweepParams, remaining: int | None, logger: Any) -> int:
    """Parallel trials: what was asked, capped by how many trials the cluster's nodes hold
    at once (a trial with several workers holds that many copies of the request)."""
    what = "trial worker(s)" if sweep.trial_workers > 1 else "trial(s)"
    copies = require_fits("sweep", sweep, sweep.trial_workers, cluster_nodes(), what=what)
    # Unenforced (PREFECT_ML_CHECK_RESOURCES=false), nothing may fit yet: run as asked.
    fits = copies // sweep.trial_workers or sweep.concurrency
    count = min([sweep.concurrency, fits, remaining or sweep.concurrency])
    if count < sweep.concurrency:
        logger.warning(
            "Running %d trials at a time, not %d: that is what the cluster fits or the budget "
            "needs",
            count,
            sweep.concurrency,
        )
    return max(1, count)


class CampaignRun:
    """One run of a campaign (a first one or a resumed one) in this process."""

    def __init__(
        self, params: CampaignParams, data: PreparedData, settings: PrefectMLSettings
    ) -> None:
        self.started = time.monotonic()
        self.params, self.data, self.settings = params, data, settings
        self.sweep = sweep = params.sweep
        self.identity = CampaignIdentity.of(
            sweep.campaign,
            settings.resolved_optuna_storage,
            storage.root_url(settings),
            tenant=settings.tenant,
        )
        self.objectives: dict[str, str] = dict(sweep.objectives)
        self.names = list(self.objectives)
        self.logger: logging.Logger | logging.LoggerAdapter[logging.Logger]
        self.logger = get_run_logger()  # type: ignore[assignment]
        self.planner = TrialPlanner.of(params, data, self.identity, settings, self.logger)
        self.timings: dict[str, float] = {}

    def run(self) -> CampaignResult:
        """Hold the campaign's lease in the storage and, when the study lives in a database,
        its claim on the study there, while its study and MLflow runs are written: two
        coordinators with different storage roots still share the study's database."""
        what, field = f"campaign '{self.sweep.campaign}'", "sweep.campaign"
        optuna_storage = self.settings.resolved_optuna_storage
        holds: list[Lease | StudyClaim] = [Lease(self.identity.lease_url, what=what, field=field)]
        if claims_supported(optuna_storage):
            holds.append(StudyClaim(optuna_storage, self.identity.name, what=what, field=field))

        def check() -> None:
            for hold in holds:
                hold.raise_if_lost()

        with contextlib.ExitStack() as stack:
            for hold in holds:
                stack.enter_context(hold)
            return self._run(check)

    def _run(self, check: Callable[[], None]) -> CampaignResult:
        sweep = self.sweep
        self.study, budget = open_campaign_study(
            sweep, self.params.training.epochs, self.settings, self.identity.name
        )
        rules = CampaignRules(
            objectives=self.objectives,
            budget=budget,
            max_consecutive_failures=sweep.max_consecutive_failures,
            stop_at=sweep.stop_at,
            timeout_seconds=sweep.timeout_seconds,
        )
        self.coordinator = Coordinator(self.study, rules, self.planner, logger=self.logger)
        self.coordinator.recover()
        if self.coordinator.remaining == 0:
            writer = self.attach()
            writer.close()
            self.logger.info(
                "Campaign %s already has %d finished trials",
                self.identity.key,
                self.coordinator.tally.finished,
            )
        else:
            with ray_session(self.settings):
                writer = self._run_on_ray(check)
        if "setup_seconds" in self.timings:
            self.timings["trials_seconds"] = time.monotonic() - self.trials_started
        return self.conclude(writer)

    def _run_on_ray(self, check: Callable[[], None]) -> TrackingWriter:
        """Ask Ray for the trial workers, open the MLflow runs while they start (a process
        and torch each), then run the trials on them; the MLflow writer, closed."""
        pool = RayTrialPool(
            slots(self.sweep, self.coordinator.remaining, self.logger),
            request=self.sweep.resources(),
            driver_only=self.sweep.trial_workers > 1,
            start_timeout_s=self.settings.worker_group_start_timeout_s,
            logger=self.logger,
        )
        try:
            writer = self.attach()
        except BaseException:
            pool.close()
            raise
        try:
            with pool:
                self.logger.info(
                    "Campaign %s: %d parallel trial workers, budget %s trials",
                    self.identity.key,
                    pool.size,
                    self.coordinator.rules.budget or "unlimited",
                )
                self._run_pool(pool, writer, check)
        finally:
            # Trials still running (an exception above) are left RUNNING: the next run retries them.
            writer.close()  # every MLflow record written: part of the trials' cost
        return writer

    def _run_pool(
        self, pool: RayTrialPool, writer: TrackingWriter, check: Callable[[], None]
    ) -> None:
        self.trials_started = time.monotonic()
        self.timings["setup_seconds"] = self.trials_started - self.started
        view = CampaignView(
            self.sweep.campaign,
            self.coordinator.rules.budget,
            self.coordinator.tally,
            rows=lambda: leaderboard(self.study, self.objectives, writer.run_ids())[
                :LEADERBOARD_SIZE
            ],
            links=lambda: self._links(writer),
        )
        with view:
            self.coordinator.run(
                pool, writer, progress=lambda force: view.show(force=force), check=check
            )

    # --- MLflow ---------------------------------------------------------------------------
    def attach(self) -> TrackingWriter:
        """The campaign's parent run (re-attached if it exists) and its writer, reconciled."""
        client = tracking.client_for(self.settings.resolved_tracking_uri)
        sweep = self.sweep
        self.experiment_id = tracking.ensure_experiment(
            client, self.params.experiment, self.settings.mlflow_artifact_root
        )
        parent_run_id, reattached = tracking.campaign_parent_run(
            client,
            self.experiment_id,
            self.identity.key,
            self.study.user_attrs.get(PARENT_RUN_ATTR),
            run_name=f"campaign-{sweep.campaign}",
            params={
                **flatten(self.params.model_copy(update={"sweep": None})),
                "sweep.search_space": space_text(sweep.search_space),
                "sweep.objectives": self.objectives,
                "sweep.sampler": sweep.sampler,
                "sweep.pruner": sweep.effective_pruner,
                "data.fingerprint": self.data.fingerprint,
            },
            tags={
                tracking.FLOW_RUN_TAG: current_flow_run_id(),
                tracking.FINGERPRINT_TAG: self.data.fingerprint,
                tracking.DATA_LAYOUT_TAG: self.data.layout,
                "prefect_ml.optuna_study": self.identity.name,
            },
        )
        self.study.set_user_attr(PARENT_RUN_ATTR, parent_run_id)
        if reattached:
            self.logger.info(
                "Continuing campaign %s (MLflow run %s)", self.identity.key, parent_run_id
            )
        writer = TrackingWriter(client, self.experiment_id, parent_run_id, self.identity.key)
        self._reconcile(writer)
        return writer

    def _reconcile(self, writer: TrackingWriter) -> None:
        """Give each finished trial a terminated nested run, whatever a dead process left."""
        runs = tracking.trial_runs(writer.client, self.experiment_id, writer.parent_run_id)
        for trial in self.study.get_trials(deepcopy=False):
            run = runs.get(trial.number)
            if run is not None:
                writer.known_run(trial.number, run.info.run_id)
            if trial.user_attrs.get(NOT_STARTED_ATTR):
                continue  # never ran: nothing to record
            if not trial.state.is_finished() or (run and run.info.status != "RUNNING"):
                continue
            if run is None:
                tuned = trial.user_attrs.get(TUNED_ATTR, trial.params)
                writer.trial_started(trial.number, self.planner.mlflow_params(tuned, trial.params))
            summary = trial_summary(trial, self.names, {})
            error = summary.error or (
                "interrupted: its coordinator process died; the trial runs again"
                if trial.user_attrs.get(INTERRUPTED_ATTR)
                else None
            )
            writer.trial_ended(trial.number, trial.state.name, summary.values, error)

    def _links(self, writer: TrackingWriter) -> dict[int, str]:
        uri = self.settings.resolved_tracking_uri
        return {
            n: tracking.run_url(uri, self.experiment_id, run_id)
            for n, run_id in writer.run_ids().items()
        }

    def conclude(self, writer: TrackingWriter) -> CampaignResult:
        """Best trial(s) and plots on the parent run; a clear error if nothing completed."""
        concluding = time.monotonic()
        client, parent, run_ids = writer.client, writer.parent_run_id, writer.run_ids()
        best = [trial_summary(t, self.names, run_ids) for t in best_trials(self.study)]
        tally = self.coordinator.tally
        if best:
            tags = {"prefect_ml.best_trials": ",".join(str(b.number) for b in best)}
            tags.update({f"best.{k}": short(v) for k, v in best[0].params.items()})
            tracking.set_tags(client, parent, tags)
            tracking.log_metrics(
                client, parent, {f"best.{k}": v for k, v in best[0].values.items()}
            )
        for name, figure in plots(self.study, self.names).items():
            tracking.log_figure(client, parent, figure, f"plots/{name}.png")
        rows = leaderboard(self.study, self.objectives, run_ids)
        tracking.log_dict(
            client, parent, {"trials": [r.model_dump() for r in rows]}, "leaderboard.json"
        )
        tracking.log_metrics(
            client,
            parent,
            {
                "trials_complete": tally.complete,
                "trials_pruned": tally.pruned,
                "trials_failed": tally.failed,
            },
        )
        if not best:
            tracking.finish_run(client, parent, "FAILED")
            raise self._nothing_completed()
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
            trials=rows,
            objectives=self.objectives,
            timings={**self.timings, "conclude_seconds": time.monotonic() - concluding},
            target_reached_at=tally.target_reached_at,
        )

    def _nothing_completed(self) -> PrefectMLError:
        """Why no trial completed, and whether a retry (Prefect's, with the trials left in the
        budget) can change that: not when the trials' own code failed them in a row."""
        tally, name = self.coordinator.tally, self.sweep.campaign
        counts = (
            f"no trial completed ({tally.failed} failed, {tally.pruned} pruned). "
            f"First failure: {tally.first_error}"
        )
        if self.coordinator.stopped_by_failures:
            limit = self.coordinator.rules.max_consecutive_failures
            stop = (
                f"campaign {name} stopped: {limit} trials in a row failed "
                f"(sweep.max_consecutive_failures); {counts}"
            )
            if not tally.transient_in_a_row:
                return CampaignFailedError(
                    f"{stop}. Every trial fails this way: fix that, then run the campaign again "
                    "(it resumes by name)."
                )
            return PrefectMLError(f"{stop}. Trials left in the budget run on a retry.")
        if self.coordinator.remaining:  # stopped early (the timeout): a rerun goes on
            return PrefectMLError(
                f"campaign {name}: {counts}. Trials left in the budget run on a retry."
            )
        return CampaignFailedError(f"campaign {name}: {counts}")


def run_campaign(params: CampaignParams, data: PreparedData) -> CampaignResult:
    """Run (or continue) the campaign ``params.sweep.campaign`` until its budget is spent."""
    return CampaignRun(params, data, get_settings()).run()
