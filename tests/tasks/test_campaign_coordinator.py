"""The campaign's decisions on a fake trial pool and an in-memory Optuna study.

The pool is the only stand-in: it plays each trial's epochs from a script (an accuracy per
learning rate, a worker that dies, a trial that raises), so every decision — pruning, budget,
failure streak, retries of dead workers, stop_at, resume — is tested without Ray. The study is
real Optuna and the writer is the real MLflow writer on SQLite.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import (
    ATTEMPT_ATTR,
    ERROR_ATTR,
    INTERRUPTED_ATTR,
    MAX_ATTEMPTS,
    NOT_STARTED_ATTR,
    EpochReport,
    Epochs,
    Outcome,
    TrialError,
    TrialSpec,
    WorkerLost,
    counts_toward_budget,
    root_trial,
)
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.config.resources import Resources
from prefect_ml.integrations.errors import PrefectMLError
from prefect_ml.integrations.storage import LeaseLostError
from prefect_ml.integrations.tracking import TrackingWriter
from prefect_ml.tasks.campaign.coordinator import CampaignRules, Coordinator, TrialRefused

EPOCHS = 3
GOOD, BAD = 0.05, 0.0005  # learning rates: accuracy 0.9 and 0.1 at every epoch
DIES, RAISES = 0.02, 0.03  # learning rates: the worker dies, the trial's code raises
Script = Callable[[TrialSpec, int, int], Outcome]  # (spec, epoch, attempt) -> what comes back


def accuracy(spec: TrialSpec, epoch: int, attempt: int) -> Outcome:
    """0.9 for good learning rates, 0.1 for bad ones; a worker lost or an error as scripted."""
    if spec.loop.training.lr == DIES and epoch == 2 and attempt == 1:
        return WorkerLost("its worker process died: killed by the test")
    if spec.loop.training.lr == RAISES:
        return TrialError("ValueError: the trial's code refuses this lr")
    value = 0.9 if spec.loop.training.lr >= 0.01 else 0.1
    report = EpochReport(
        spec.number, epoch, {"val_accuracy": value}, epoch == spec.loop.training.epochs
    )
    return Epochs((report,))


class Killed(BaseException):
    """The coordinator's process dies (SIGKILL) at this point."""


class FakePool:
    """Slots whose calls come back in the order they were made, played from a script."""

    def __init__(
        self, size: int, script: Script = accuracy, *, kill_after: int = 0, room: int = 99
    ) -> None:
        """``room``: how many lost workers the cluster still has room to replace."""
        self.size, self.script, self.kill_after, self.room = size, script, kill_after, room
        self.trials: dict[int, tuple[TrialSpec, int]] = {}  # slot -> (spec, last epoch)
        self.ready: deque[tuple[int, Outcome]] = deque()
        self.replaced: list[int] = []
        self.attempts: Counter[float] = Counter()  # per learning rate: trials begun
        self.finals = 0
        self.finished = False

    def begin(self, slot: int, spec: TrialSpec) -> None:
        self.attempts[spec.loop.training.lr] += 1
        self.trials[slot] = (spec, 0)
        self.advance(slot)

    def advance(self, slot: int) -> None:
        spec, epoch = self.trials[slot]
        self.trials[slot] = (spec, epoch + 1)
        self.ready.append(
            (slot, self.script(spec, epoch + 1, self.attempts[spec.loop.training.lr]))
        )

    def wait(self, timeout: float) -> list[tuple[int, Outcome]]:
        if self.kill_after and self.finals >= self.kill_after:
            raise Killed
        slot, outcome = self.ready.popleft()
        if isinstance(outcome, Epochs) and outcome.reports[-1].final:
            self.finals += 1
        return [(slot, outcome)]

    def replace(self, slot: int) -> bool:
        if len(self.replaced) >= self.room:
            return False
        self.replaced.append(slot)
        return True

    def finish(self) -> None:
        self.finished = True


class LateExecutor(Executor):
    """The study writer as late as it can be: a job runs only when a result is needed (the
    next asked trial) or at shutdown, in the order submitted — so every tell runs after the
    loop has moved on from the trial it tells. ``lose_held`` drops what is held at shutdown,
    as a killed process does."""

    def __init__(self, *, lose_held: bool = False) -> None:
        self.held: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self.lose_held = lose_held

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        executor = self

        class Late(Future[Any]):
            def result(self, timeout: float | None = None) -> Any:
                executor.run_until(self)
                return super().result(timeout)

        future = Late()
        self.held.append((future, lambda: fn(*args, **kwargs)))
        return future

    def run_until(self, target: Future[Any] | None) -> None:
        while self.held and not (target is not None and target.done()):
            future, job = self.held.popleft()
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if cancel_futures or self.lose_held:
            for future, _job in self.held:
                future.cancel()
            self.held.clear()
        self.run_until(None)


@pytest.fixture(scope="module")
def mlflow_client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    return tracking.client_for(uri)


@pytest.fixture
def writer(mlflow_client: Any, request: pytest.FixtureRequest) -> Iterator[TrackingWriter]:
    experiment_id = tracking.ensure_experiment(mlflow_client, "decisions", None)
    parent = mlflow_client.create_run(experiment_id, run_name=request.node.name).info.run_id
    writer = TrackingWriter(mlflow_client, experiment_id, parent, request.node.name)
    yield writer
    writer.close()


def plan(tmp_path: Path) -> Callable[[optuna.trial.Trial], tuple[TrialSpec, dict[str, Any]]]:
    def spec_of(trial: optuna.trial.Trial) -> tuple[TrialSpec, dict[str, Any]]:
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)  # the plan draws (define by run)
        loop = TrainLoop.from_options(
            splits_url="",
            sample_shape=[64],
            num_classes=10,
            model="mlp",
            model_options={},
            epochs=EPOCHS,
            batch_size=32,
            lr=lr,
            optimizer="adam",
            weight_decay=0.0,
            scheduler="none",
            seed=0,
            checkpoint_url=(tmp_path / f"trial-{root_trial(trial):05d}").as_uri(),
        )
        spec = TrialSpec(trial.number, loop, 1, Resources(cpus=1), ray_storage_url="")
        return spec, {"lr": lr}

    return spec_of


def coordinator(
    study: optuna.Study,
    tmp_path: Path,
    *,
    budget: int | None,
    study_writer: Executor | None = None,
    **rules: Any,
) -> Coordinator:
    made = Coordinator(
        study,
        CampaignRules(
            objectives={"val_accuracy": "maximize"},
            budget=budget,
            max_consecutive_failures=rules.pop("max_consecutive_failures", 5),
            **rules,
        ),
        plan(tmp_path),
        logger=logging.getLogger("campaign-test"),
        study_writer=study_writer,
    )
    made.recover()
    return made


def study_of(*learning_rates: float, pruner: optuna.pruners.BasePruner | None = None) -> Any:
    """An in-memory study whose next trials take these learning rates, then random ones."""
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.RandomSampler(seed=0),
        pruner=pruner or optuna.pruners.NopPruner(),
    )
    for lr in learning_rates:
        study.enqueue_trial({"lr": lr})
    return study


def started(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials that ran (not one asked ahead and never started)."""
    return [t for t in study.trials if not t.user_attrs.get(NOT_STARTED_ATTR)]


def counted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if counts_toward_budget(t)]


def test_the_budget_is_exactly_n_trials_and_each_has_a_finished_mlflow_run(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    study = study_of()
    campaign = coordinator(study, tmp_path, budget=5)

    campaign.run(FakePool(2), writer)

    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    assert all(sorted(t.intermediate_values) == [1, 2, 3] for t in study.trials)
    assert campaign.tally.finished == campaign.tally.complete == 5
    writer.close()
    runs = tracking.trial_runs(writer.client, writer.experiment_id, writer.parent_run_id)
    assert sorted(runs) == [0, 1, 2, 3, 4]
    assert {run.info.status for run in runs.values()} == {"FINISHED"}


class TogetherPool(FakePool):
    """Every slot's call comes back in the same wait: trials of one length end together."""

    def wait(self, timeout: float) -> list[tuple[int, Outcome]]:
        together = list(self.ready)
        self.ready.clear()
        return together


def test_slots_that_finish_together_each_find_their_next_trial_asked_ahead(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    """Only the first trial of each slot is asked by the loop itself; every later one was
    asked by the study writer while the workers trained, so no slot waits for another's tell
    and ask."""
    study = study_of()
    campaign = coordinator(study, tmp_path, budget=7)
    spec_of = campaign.plan
    asked_on: dict[int, str] = {}  # trial number -> the thread that asked for it

    def recording_plan(trial: optuna.trial.Trial) -> tuple[TrialSpec, dict[str, Any]]:
        asked_on[trial.number] = threading.current_thread().name
        return spec_of(trial)

    campaign.plan = recording_plan
    campaign.run(TogetherPool(2), writer)

    assert [t.state for t in started(study)] == [TrialState.COMPLETE] * 7
    assert all(t.state.is_finished() for t in study.trials)
    loop = threading.current_thread().name
    assert [n for n, thread in asked_on.items() if thread == loop] == [0, 1]


def test_a_pruned_trial_is_told_pruned_without_values_however_late_the_study_writer(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    """The crash of issue 15: a pruned trial's end was told with values when the study thread
    ran after the loop had rebound them."""
    study = study_of(GOOD, GOOD, BAD, GOOD, pruner=optuna.pruners.MedianPruner(1, 0))
    campaign = coordinator(study, tmp_path, budget=4, study_writer=LateExecutor())

    campaign.run(FakePool(1), writer)

    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE] * 2 + [TrialState.PRUNED, TrialState.COMPLETE]
    pruned = study.trials[2]
    assert pruned.intermediate_values == {1: 0.1}
    assert (campaign.tally.complete, campaign.tally.pruned) == (3, 1)
    writer.close()
    run = tracking.trial_runs(writer.client, writer.experiment_id, writer.parent_run_id)[2]
    assert run.info.status == "KILLED"
    assert run.data.metrics["objective.val_accuracy"] == pytest.approx(0.1)


def test_a_coordinator_whose_lease_was_lost_tells_the_study_nothing_more(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    """Once another coordinator took the campaign over, ends waiting for the study writer are
    dropped (the new owner retries those trials) and the lease error is what is raised."""
    study = study_of(GOOD, GOOD, GOOD, GOOD)
    campaign = coordinator(study, tmp_path, budget=4, study_writer=LateExecutor())

    told_when_lost: list[int] = []

    def lost() -> None:
        if campaign.tally.finished >= 2:
            told_when_lost.append(sum(t.state.is_finished() for t in study.trials))
            raise LeaseLostError("campaign c: another process took over its lease")

    with pytest.raises(LeaseLostError):
        campaign.run(FakePool(2), writer, check=lost)
    told_after = sum(t.state.is_finished() for t in study.trials)
    assert told_after == told_when_lost[0] < campaign.tally.finished, "nothing told late"


def test_failures_in_a_row_stop_the_campaign_with_the_first_error(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    study = study_of(GOOD, RAISES, RAISES, RAISES)
    campaign = coordinator(study, tmp_path, budget=10, max_consecutive_failures=3)

    campaign.run(FakePool(1), writer)

    states = [t.state for t in started(study)]
    assert states == [TrialState.COMPLETE] + [TrialState.FAIL] * 3, "no trial after the streak"
    assert all(t.state.is_finished() for t in study.trials)
    assert campaign.tally.failed == 3 and campaign.tally.failures_in_a_row == 3
    assert "trial 1: ValueError: the trial's code refuses" in (campaign.tally.first_error or "")
    assert "refuses this lr" in study.trials[1].user_attrs[ERROR_ATTR]


def test_a_trial_whose_drawn_values_are_refused_fails_alone_and_the_campaign_goes_on(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    refused_lr = 0.04
    study = study_of(GOOD, refused_lr, GOOD, GOOD)
    campaign = coordinator(study, tmp_path, budget=4)
    planned = campaign.plan

    def refusing(trial: optuna.trial.Trial) -> tuple[TrialSpec, dict[str, Any]]:
        spec, params = planned(trial)
        if spec.loop.training.lr == refused_lr:  # as a space's other branch would
            raise TrialRefused("its search space: ValueError: widths must be positive", params)
        return spec, params

    campaign.plan = refusing
    pool = FakePool(2)

    campaign.run(pool, writer)

    states = [t.state for t in counted(study)]
    assert states.count(TrialState.COMPLETE) == 3 and states.count(TrialState.FAIL) == 1
    assert pool.attempts[refused_lr] == 0, "a refused trial never reaches a worker"
    failed = next(t for t in study.trials if t.state == TrialState.FAIL)
    assert "widths must be positive" in failed.user_attrs[ERROR_ATTR]
    writer.close()
    runs = tracking.trial_runs(writer.client, writer.experiment_id, writer.parent_run_id)
    assert runs[failed.number].info.status == "FAILED"
    assert "widths must be positive" in runs[failed.number].data.tags[tracking.ERROR_TAG]


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_streak_may_heal_only_when_one_of_its_failures_may(
    tmp_path: Path, writer: TrackingWriter, deterministic: bool
) -> None:
    """A streak of the trials' own code errors ends the campaign for good; one with an error
    that may heal (storage, network) leaves the trials left in the budget to a retry."""

    def raises(spec: TrialSpec, epoch: int, attempt: int) -> Outcome:
        if spec.number == 2:
            return TrialError("OSError: the storage did not answer", deterministic)
        return TrialError("ModuleNotFoundError: No module named 'x'", deterministic=True)

    study = study_of(RAISES, RAISES, RAISES)
    campaign = coordinator(study, tmp_path, budget=10, max_consecutive_failures=3)

    campaign.run(FakePool(1, raises), writer)

    assert campaign.stopped_by_failures
    assert campaign.tally.transient_in_a_row is not deterministic


def test_a_trial_whose_worker_dies_runs_again_with_its_parameters_and_counts_once(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    study = study_of(DIES, GOOD)
    pool = FakePool(1)
    campaign = coordinator(study, tmp_path, budget=2)

    campaign.run(pool, writer)

    first, _good, retry = study.trials
    assert first.state == TrialState.FAIL and first.user_attrs[INTERRUPTED_ATTR]
    assert retry.state == TrialState.COMPLETE and retry.params == first.params
    assert root_trial(retry) == 0 and retry.user_attrs[ATTEMPT_ATTR] == 2
    assert pool.replaced == [0], "the dead worker's slot got a new worker"
    assert len(counted(study)) == 2 and campaign.tally.finished == 2


def test_a_trial_whose_worker_always_dies_fails_after_max_attempts(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    def always_dies(spec: TrialSpec, epoch: int, attempt: int) -> Outcome:
        return WorkerLost("its worker process died") if epoch == 2 else accuracy(spec, epoch, 1)

    study = study_of(DIES)
    pool = FakePool(1, always_dies)
    campaign = coordinator(study, tmp_path, budget=1)

    campaign.run(pool, writer)

    assert len(study.trials) == MAX_ATTEMPTS
    assert {root_trial(t) for t in study.trials} == {0}
    assert all(t.state == TrialState.FAIL for t in study.trials)
    *interrupted, last = study.trials
    assert all(t.user_attrs[INTERRUPTED_ATTR] for t in interrupted)
    assert INTERRUPTED_ATTR not in last.user_attrs, "the last attempt counts as failed"
    assert counted(study) == [last] and campaign.tally.failed == 1
    assert len(pool.replaced) == MAX_ATTEMPTS


def test_a_slot_whose_lost_worker_cannot_be_replaced_closes_and_the_others_finish(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    """A lost node took a worker and its room: the slot closes, its trial runs again on the
    other slot, and the budget completes there."""
    study = study_of(DIES, GOOD, GOOD)
    pool = FakePool(2, room=0)
    campaign = coordinator(study, tmp_path, budget=3)

    campaign.run(pool, writer)

    assert campaign.closed == {0} and pool.replaced == []
    retry = next(t for t in study.trials if t.user_attrs.get(ATTEMPT_ATTR) == 2)
    assert retry.state == TrialState.COMPLETE and retry.params == study.trials[0].params
    assert campaign.tally.finished == 3


def test_a_campaign_whose_every_slot_closed_stops_leaving_its_trials_in_the_study(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    study = study_of(DIES, GOOD)
    campaign = coordinator(study, tmp_path, budget=2)

    with pytest.raises(PrefectMLError, match="room for none"):
        campaign.run(FakePool(1, room=0), writer)

    waiting = [t for t in study.get_trials() if t.state == TrialState.WAITING]
    assert len(waiting) == 1
    assert waiting[0].system_attrs["fixed_params"] == study.trials[0].params, "its retry"


def test_stop_at_starts_no_trial_after_the_target_is_reached(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    study = study_of(BAD, BAD, GOOD)
    campaign = coordinator(study, tmp_path, budget=6, stop_at=0.85)

    campaign.run(FakePool(1), writer)

    assert [t.params["lr"] for t in started(study)] == [BAD, BAD, GOOD]
    assert all(t.state.is_finished() for t in study.trials)
    assert campaign.tally.target_reached_at is not None


def test_a_campaign_resumed_after_its_coordinator_died_finishes_exactly_n_trials(
    tmp_path: Path, writer: TrackingWriter
) -> None:
    """Killed after 2 finished trials (their tells lost with the process), rerun: trials left
    RUNNING run again, none is counted twice, and pruned trials are told late."""
    study = study_of(
        GOOD, GOOD, BAD, GOOD, BAD, GOOD, BAD, GOOD, pruner=optuna.pruners.MedianPruner(1, 0)
    )
    dying = coordinator(study, tmp_path, budget=8, study_writer=LateExecutor(lose_held=True))
    dying_writer = TrackingWriter(
        writer.client, writer.experiment_id, writer.parent_run_id, writer.campaign_key
    )
    with pytest.raises(Killed):
        dying.run(FakePool(2, kill_after=2), dying_writer)
    dying_writer.close()  # what the dead process had handed to MLflow
    left_running = [t.number for t in study.trials if t.state == TrialState.RUNNING]
    assert left_running
    # Their ends never reached the study, so MLflow must not show them finished either (the
    # next campaign run marks those runs interrupted).
    runs = dying_writer.run_ids()
    for number in left_running:
        if number in runs:
            assert writer.client.get_run(runs[number]).info.status == "RUNNING"
    for number, run_id in dying_writer.run_ids().items():
        writer.known_run(number, run_id)

    resumed = coordinator(study, tmp_path, budget=8, study_writer=LateExecutor())
    resumed.run(FakePool(2), writer)

    trials = study.trials
    assert len(counted(study)) == 8 == resumed.tally.finished
    assert all(t.state.is_finished() for t in trials), "nothing left RUNNING or WAITING"
    assert max(Counter(root_trial(t) for t in counted(study)).values()) == 1
    for number in left_running:
        assert trials[number].user_attrs[INTERRUPTED_ATTR]
        retry = next(t for t in counted(study) if root_trial(t) == number)
        assert retry.params == trials[number].params
    assert resumed.tally.pruned >= 1, "the late tells included a pruned trial"
