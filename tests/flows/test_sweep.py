"""``hpo_campaign`` on a real local Ray, Optuna on SQLite and MLflow on SQLite.

The campaign's decisions (budget, pruning, failure streaks, retries, stop_at, resume) are
tested on a fake pool in ``tests/tasks/test_campaign_coordinator.py``; these tests cover what
only the real systems show: MLflow records and artifacts, Ray's errors translated, a killed
worker process, a distributed trial stopped at an epoch boundary, the campaign's lease.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import optuna
import pytest
import ray
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import (
    ERROR_ATTR,
    INTERRUPTED_ATTR,
    PARENT_RUN_ATTR,
    root_trial,
    storage_for,
)
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import Lease
from prefect_ml.integrations.tracking import RESUMED_TAG, WORKER_TAG
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from prefect_ml.tasks.params import CampaignParams
from prefect_ml.tasks.sweep import CampaignResult
from tests.helpers import holding_cpus, wait_for

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _params(campaign: str, epochs: int = 3, **sweep: Any) -> CampaignParams:
    return CampaignParams.model_validate(
        {
            "training": {"epochs": epochs, "batch_size": 64},
            "sweep": {"campaign": campaign, "sampler": "random", "concurrency": 2, **sweep},
        }
    )


def _study(home: PrefectMLSettings, campaign: str) -> optuna.Study:
    return optuna.load_study(study_name=campaign, storage=home.resolved_optuna_storage)


def _identity(home: PrefectMLSettings, campaign: str) -> CampaignIdentity:
    return CampaignIdentity.of(campaign, home.resolved_optuna_storage, home.resolved_storage_url)


def _trial_dir(home: PrefectMLSettings, campaign: str, root_trial: int) -> Path:
    return Path(urlparse(_identity(home, campaign).trial_url(root_trial)).path)


def _runs(home: PrefectMLSettings, result: CampaignResult) -> tuple[Any, dict[int, Any]]:
    client = tracking.client_for(home.resolved_tracking_uri)
    parent = client.get_run(result.parent_run_id)
    return parent, tracking.trial_runs(client, result.experiment_id, result.parent_run_id)


def _published(keys: set[str]) -> set[str]:
    """Which of ``keys`` the session's Prefect API holds artifacts under (asked by key: the
    session's other tests publish more artifacts than one unfiltered page holds)."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys)))
        )
    return {artifact.key for artifact in found if artifact.key}


def test_campaign_records_every_trial_and_continues_by_name(home: PrefectMLSettings) -> None:
    result = hpo_campaign(_params("digits-a", n_trials=4))

    assert (result.finished, result.complete, result.failed) == (4, 4, 0)
    study = _study(home, "digits-a")
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 4 and all(sorted(t.intermediate_values) == [1, 2, 3] for t in trials)
    assert result.best[0].number == study.best_trial.number
    assert study.user_attrs[PARENT_RUN_ATTR] == result.parent_run_id

    client = tracking.client_for(home.resolved_tracking_uri)
    parent, runs = _runs(home, result)
    assert sorted(runs) == [t.number for t in trials]
    for trial in trials:
        run = runs[trial.number]
        assert run.info.status == "FINISHED"
        assert float(run.data.params["training.lr"]) == pytest.approx(trial.params["lr"])
        assert run.data.metrics["objective.val_accuracy"] == pytest.approx(trial.value)
        history = client.get_metric_history(run.info.run_id, "val_accuracy")
        assert [m.step for m in history] == [1, 2, 3]
    # Warm workers: two processes trained all four trials.
    assert len({run.data.tags[WORKER_TAG] for run in runs.values()}) <= 2
    assert parent.data.metrics["best.val_accuracy"] == pytest.approx(study.best_value)
    assert parent.data.tags["best.optimizer"] == study.best_params["optimizer"]
    plots = {a.path for a in client.list_artifacts(result.parent_run_id, "plots")}
    assert {
        "plots/optimization_history.png",
        "plots/param_importances.png",
        "plots/parallel_coordinate.png",
        "plots/intermediate_values.png",
    } <= plots
    for trial in trials:
        checkpoint = _trial_dir(home, "digits-a", trial.number) / "epoch-000003/MANIFEST.json"
        assert checkpoint.exists()
    keys = {f"campaign-digits-a-{kind}" for kind in ("leaderboard", "summary", "mlflow")}
    assert _published(keys) == keys

    more = hpo_campaign(_params("digits-a", n_trials=6))

    assert more.finished == 6 and more.parent_run_id == result.parent_run_id
    assert len(_study(home, "digits-a").trials) == 6, "the first four trials were kept"
    parents = client.search_runs(
        [result.experiment_id], f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` != ''"
    )
    assert len(parents) == 1
    assert sorted(_runs(home, more)[1]) == list(range(6))


def _prefill(home: PrefectMLSettings, campaign: str, good: int) -> None:
    """Finished trials that reached 0.95 accuracy at every epoch: a high bar for the pruner."""
    study = optuna.create_study(
        study_name=campaign,
        storage=storage_for(home.resolved_optuna_storage),
        direction="maximize",
    )
    for _ in range(good):
        study.add_trial(
            create_trial(
                params={"lr": 0.01},
                distributions={"lr": FloatDistribution(1e-7, 0.1, log=True)},
                value=0.95,
                intermediate_values={epoch: 0.95 for epoch in range(1, 5)},
            )
        )


@pytest.mark.full  # distributed trials pruned mid-way, about 30 s (tests/tiers.py)
def test_a_hopeless_distributed_trial_is_pruned_and_stops_training(
    home: PrefectMLSettings,
) -> None:
    campaign, trial_workers = "prune-distributed", 2
    _prefill(home, campaign, good=4)
    params = _params(
        campaign,
        epochs=4,
        n_trials=5,
        concurrency=1,
        trial_workers=trial_workers,
        pruner="median",
        search_space={
            "lr": {"type": "float", "low": 1e-7, "high": 1e-6, "log": True},
            "optimizer": {"type": "categorical", "choices": ["sgd"]},
        },
    )
    # Epochs long enough to see: a distributed trial stops at the first epoch boundary after
    # the pruner's decision, which comes a moment after the epoch's checkpoint is committed.
    slow = {"model": "tests.fixtures.user_code:slow_model", "model_options": {"delay": 0.05}}
    params = params.model_copy(update={"model": params.model.model_copy(update=slow)})

    result = hpo_campaign(params)

    assert (result.finished, result.pruned) == (5, 1)
    pruned = _study(home, campaign).trials[-1]
    assert pruned.state == TrialState.PRUNED
    # It stopped at the epoch where the pruner said so, not after all four epochs.
    trial_dir = _trial_dir(home, campaign, pruned.number)
    committed = sorted(p.parent.name for p in trial_dir.glob("epoch-*/MANIFEST.json"))
    assert committed and "epoch-000004" not in committed
    _parent, runs = _runs(home, result)
    assert runs[pruned.number].info.status == "KILLED"
    assert runs[pruned.number].data.tags[tracking.TRIAL_STATE_TAG] == "PRUNED"
    assert len(runs) == 5, "the pre-filled trials got their MLflow runs too"


PICKY = "tests.fixtures.user_code:picky_model"


def test_a_campaign_where_every_trial_fails_shows_the_first_failure(
    home: PrefectMLSettings,
) -> None:
    params = _params(
        "all-fail",
        epochs=2,
        n_trials=3,
        search_space={"hidden": {"type": "int", "low": 40, "high": 100}},
    ).model_copy(update={"model": CampaignParams().model.model_copy(update={"model": PICKY})})

    state = hpo_campaign(params, return_state=True)

    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "no trial completed (3 failed" in message
    assert "First failure: trial" in message and "picky_model refuses hidden=" in message
    failed = _study(home, "all-fail").trials[0]
    assert "picky_model refuses hidden=" in failed.user_attrs[ERROR_ATTR]
    client = tracking.client_for(home.resolved_tracking_uri)
    [parent] = client.search_runs(["1"], f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` != ''")
    assert parent.info.status == "FAILED"
    run = tracking.trial_runs(client, "1", parent.info.run_id)[failed.number]
    assert run.info.status == "FAILED"
    assert "picky_model refuses hidden=" in run.data.tags[tracking.ERROR_TAG]


LACKING = "tests.fixtures.faulty_code:model_needing_a_module_the_nodes_lack"


@pytest.mark.full  # a campaign on Ray whose trials all fail, about 20 s (tests/tiers.py)
def test_trials_that_cannot_import_the_user_s_model_fail_at_once_and_stop_the_campaign(
    home: PrefectMLSettings,
) -> None:
    params = _params("cannot-import", epochs=2, n_trials=20, max_consecutive_failures=3)
    params = params.model_copy(
        update={"model": CampaignParams().model.model_copy(update={"model": LACKING})}
    )
    started = time.monotonic()

    state = hpo_campaign(params, return_state=True)

    assert time.monotonic() - started < 60
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "3 trials in a row failed" in message and "sweep.max_consecutive_failures" in message
    for reason in (
        "No module named 'a_module_the_nodes_lack'",
        LACKING,  # the user function
        f"on node {ray.util.get_node_ip_address()} (trial worker pid",  # where it ran
        "pip install",  # the fixes
        "PREFECT_ML_ALLOWED_MODULES",
    ):
        assert reason in message, reason
    trials = _study(home, "cannot-import").trials
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) >= 3 and all(t.state != TrialState.COMPLETE for t in trials)
    assert LACKING in failed[0].user_attrs[ERROR_ATTR]
    client = tracking.client_for(home.resolved_tracking_uri)
    [parent] = client.search_runs(["1"], f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` != ''")
    run = tracking.trial_runs(client, "1", parent.info.run_id)[failed[0].number]
    assert "a_module_the_nodes_lack" in run.data.tags[tracking.ERROR_TAG]


def test_several_objectives_give_a_pareto_front(home: PrefectMLSettings) -> None:
    result = hpo_campaign(
        _params(
            "pareto",
            epochs=1,
            n_trials=2,
            pruner="none",
            objectives={"val_accuracy": "maximize", "val_loss": "minimize"},
        )
    )

    study = _study(home, "pareto")
    assert {b.number for b in result.best} == {t.number for t in study.best_trials}
    assert all(set(b.values) == {"val_accuracy", "val_loss"} for b in result.best)
    client = tracking.client_for(home.resolved_tracking_uri)
    plots = {a.path for a in client.list_artifacts(result.parent_run_id, "plots")}
    assert "plots/pareto_front.png" in plots


def test_a_changed_categorical_dimension_is_refused_before_any_trial(
    home: PrefectMLSettings,
) -> None:
    _prefill(home, "changed", good=1)
    space = {"lr": {"type": "categorical", "choices": [0.01, 0.001]}}

    state = hpo_campaign(_params("changed", n_trials=3, search_space=space), return_state=True)

    assert state.is_failed()
    assert "sweep.search_space.lr" in str(state.result(raise_on_failure=False))
    assert len(_study(home, "changed").trials) == 1


@pytest.mark.full  # a fault scenario of tens of seconds (tests/tiers.py)
def test_a_trial_whose_worker_dies_runs_again_from_its_checkpoint(
    home: PrefectMLSettings,
) -> None:
    params = _params(
        "worker-dies",
        epochs=4,
        n_trials=2,
        concurrency=1,
        pruner="none",
        search_space={"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
    )
    slow = {"model": "tests.fixtures.user_code:slow_model", "model_options": {"delay": 0.05}}
    params = params.model_copy(update={"model": params.model.model_copy(update=slow)})
    outcome: list[CampaignResult] = []
    campaign = threading.Thread(target=lambda: outcome.append(hpo_campaign(params)))
    campaign.start()
    client = tracking.client_for(home.resolved_tracking_uri)
    first_epoch = _trial_dir(home, "worker-dies", 0) / "epoch-000001"

    def worker_of_trial_0() -> str | None:
        runs = client.search_runs(["1"], f"tags.`{tracking.TRIAL_TAG}` = '0'")
        return runs[0].data.tags.get(WORKER_TAG) if runs else None

    wait_for(
        lambda: (first_epoch / "MANIFEST.json").exists() and worker_of_trial_0() is not None,
        300,
        "trial 0's first committed epoch",
    )
    killed = int(worker_of_trial_0() or 0)
    os.kill(killed, signal.SIGKILL)
    campaign.join(timeout=300)

    result = outcome[0]
    assert (result.finished, result.complete, result.failed) == (2, 2, 0)
    trials = _study(home, "worker-dies").trials
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs[INTERRUPTED_ATTR]
    retry = next(t for t in trials if root_trial(t) == 0 and t.number != 0)
    assert retry.state == TrialState.COMPLETE and retry.params == trials[0].params
    runs = _runs(home, result)[1]
    assert int(runs[retry.number].data.tags[WORKER_TAG]) != killed
    assert int(runs[retry.number].data.tags[RESUMED_TAG]) >= 1, "resumed from its checkpoint"
    assert runs[0].info.status == "FAILED"


def test_a_second_coordinator_on_a_running_campaign_is_refused(home: PrefectMLSettings) -> None:
    """One writer per campaign: while another process holds its lease (here: this one, as
    another coordinator), a run is refused before it touches the study, naming the holder."""
    lease = Lease(_identity(home, "held").lease_url, what="campaign 'held'", field="x")

    with lease:
        state = hpo_campaign(_params("held", n_trials=2), return_state=True)

    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert f"campaign 'held' is being written by process {os.getpid()} on " in message
    assert "last heartbeat" in message and "s ago" in message
    with pytest.raises(KeyError):
        _study(home, "held")  # not even created


@pytest.mark.full  # a campaign that first waits out its placement timeout, about 40 s (tiers.py)
def test_a_campaign_runs_with_the_trial_workers_ray_could_place_and_says_so(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Other work holds one of the session Ray's 2 CPUs: of 2 trial workers one is placed; the
    campaign says what the other waits for, then runs its trials one at a time."""
    # The placed worker must start (import torch) within the timeout: 15 s was too short at
    # load 25-36 (none started; the full-tier run of 2026-12-07 10:47).
    monkeypatch.setenv("PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S", "30")
    logger = logging.getLogger("prefect.task_runs")  # the campaign task's run logger
    logger.addHandler(caplog.handler)
    try:
        with holding_cpus(1):
            result = hpo_campaign(_params("half-placed", epochs=2, n_trials=3, concurrency=2))
    finally:
        logger.removeHandler(caplog.handler)

    assert (result.finished, result.complete) == (3, 3)
    node = ray.util.get_node_ip_address()
    assert "of 2 trial worker(s) after" in caplog.text  # while it waited
    assert f"2 trial(s) x (1 CPU) asked; free now: node {node}: 0 of 2 CPU" in caplog.text
    # Said once (each record reaches caplog twice: through the handler and by propagation).
    said = {id(r) for r in caplog.records if "Running 1 trial(s) at a time, not 2" in r.message}
    assert len(said) == 1


@pytest.mark.full  # a campaign that waits out its placement timeout, about 20 s (tiers.py)
def test_a_campaign_whose_trial_workers_ray_cannot_place_ends_at_the_timeout(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other work holds both CPUs: no trial worker is placed; the campaign ends when the
    timeout runs out, with the request, each node's free resources and the fixes, and Prefect
    does not retry it (a retry would wait the same way)."""
    monkeypatch.setenv("PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S", "10")
    started = time.monotonic()
    with holding_cpus(2):
        state = hpo_campaign(_params("unplaced", epochs=2, n_trials=2), return_state=True)

    assert time.monotonic() - started < 60
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    node = ray.util.get_node_ip_address()
    for reason in (
        "no trial worker of the campaign started within 10 s",
        f"2 trial(s) x (1 CPU) asked; free now: node {node}: 0 of 2 CPU",
        "--concurrency",
        "PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S",
    ):
        assert reason in message, reason
    assert not _study(home, "unplaced").trials, "no trial was started"
