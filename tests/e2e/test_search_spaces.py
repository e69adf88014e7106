"""Campaigns over a user's own model, dataset loader and define-by-run search space, end to end
(full tier): ``prefect-ml sweep`` with the space's import path (over the model's options, and
over the loader's), ``hpo_campaign`` given the parameters a UI form posts, the ``hpo_campaign``
deployment of prefect.yaml run by a real ``prefect worker``, and a killed campaign resumed.
The user's code lives outside the package (``tests.fixtures.search_spaces``, allowed by
``PREFECT_ML_ALLOWED_MODULES``)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from examples import best_trial
from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import TUNED_ATTR, counts_toward_budget, root_trial
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.tracking import WORKER_TAG
from prefect_ml.tasks.params import CampaignParams
from tests.conftest import REPO_ROOT
from tests.e2e.test_campaign_resume import (
    _command,
    _keeps_parameters,
    _trial_runs,
    _trials,
    kill_mid_way_and_resume,
)
from tests.e2e.test_resume_after_kill import _kill_tree
from tests.helpers import cli_env, start_job

MODEL = "tests.fixtures.search_spaces:blocks_model"
SPACE = "tests.fixtures.search_spaces:branch_and_loop"
LOADER = "tests.fixtures.search_spaces:feature_subset"
BIN = Path(sys.executable).parent


def branch_params(trial: optuna.trial.FrozenTrial) -> set[str]:
    """The parameters ``branch_and_loop`` draws in the branch this trial took."""
    blocks = trial.params["blocks"]
    residual = trial.params["block"] == "residual"
    return {"blocks", "lr", "block", *(f"width_{i}" for i in range(blocks))} | (
        {"skip_scale"} if residual else set()
    )


def assert_carries_its_branch(trial: optuna.trial.FrozenTrial) -> None:
    assert set(trial.params) == branch_params(trial), trial.params
    tuned = trial.user_attrs[TUNED_ATTR]
    widths = [trial.params[f"width_{i}"] for i in range(trial.params["blocks"])]
    assert tuned["model_options.widths"] == widths
    assert tuned["lr"] == trial.params["lr"]
    assert tuned.get("model_options.skip_scale") == trial.params.get("skip_scale")


def sweep(
    home: PrefectMLSettings, campaign: str, *flags: str, **settings: str
) -> subprocess.CompletedProcess[str]:
    """``prefect-ml sweep`` of 6 trials of 2 epochs, 2 at a time, with ``flags``; it succeeds."""
    command = [sys.executable, "-m", "prefect_ml.flows.cli", "sweep", "--campaign", campaign]
    command += ["--n-trials", "6", "--concurrency", "2", "--epochs", "2", *flags]
    run = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=cli_env(home.home_dir, **settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.usefixtures("ray_cluster")
def test_prefect_ml_sweep_tunes_a_user_model_with_a_define_by_run_space(
    home: PrefectMLSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    received = tmp_path / "received"
    run = sweep(
        home,
        "by-run",
        "--batch-size",
        "64",
        "--model",
        MODEL,
        "--model-options",
        json.dumps({"record": str(received)}),
        "--search-space",
        SPACE,
        COLUMNS="300",  # the leaderboard's params unwrapped
    )

    # A plain Optuna study in the configured storage: optuna-dashboard reads the same.
    study = optuna.load_study(study_name="by-run", storage=home.resolved_optuna_storage)
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len([t for t in finished if counts_toward_budget(t)]) == 6
    for trial in finished:
        assert_carries_its_branch(trial)
    assert {t.params["block"] for t in finished} == {"plain", "residual"}, "both branches ran"
    assert len({t.params["blocks"] for t in finished}) > 1, "the loop ran different lengths"
    # read as docs/how-to/search-spaces.md reads it (examples/best_trial.py)
    best = best_trial.best_trial("by-run", storage=home.resolved_optuna_storage)
    assert best.number == study.best_trial.number and best.state == TrialState.COMPLETE
    assert_carries_its_branch(best)
    assert repr(best.user_attrs[TUNED_ATTR]) in capsys.readouterr().out

    # The user's model received exactly what each trial set (its options, not the others').
    got = [json.loads(p.read_text()) for p in received.iterdir()]
    for trial in finished:
        tuned = trial.user_attrs[TUNED_ATTR]
        expected = {
            "widths": tuned["model_options.widths"],
            "skip_scale": tuned.get("model_options.skip_scale", 0.0),
            "broken": False,
        }
        assert expected in got, (trial.number, expected)

    # One MLflow run per trial with exactly the parameters it drew; absent ones are absent.
    parents, runs = _trial_runs(home, "by-run")
    assert len(parents) == 1 and sorted(runs) == sorted(t.number for t in study.trials)
    for trial in finished:
        params = runs[trial.number].data.params
        drawn = {k.removeprefix("drawn."): v for k, v in params.items() if k.startswith("drawn.")}
        assert set(drawn) == set(trial.params)
        assert ("skip_scale" in params["model.model_options"]) == ("skip_scale" in trial.params)
    workers = {run.data.tags[WORKER_TAG] for run in runs.values() if WORKER_TAG in run.data.tags}
    assert 1 <= len(workers) <= 2, "warm workers: two processes trained every trial"
    client = tracking.client_for(home.resolved_tracking_uri)
    plots = {a.path for a in client.list_artifacts(parents[0].info.run_id, "plots")}
    assert {"plots/optimization_history.png", "plots/parallel_coordinate.png"} <= plots
    leaderboard = " ".join(run.stdout.split() + run.stderr.split())
    assert "width_0=" in leaderboard, "the leaderboard shows what each trial drew"


@pytest.mark.usefixtures("ray_cluster")
def test_hpo_campaign_takes_the_space_as_a_flow_parameter_and_failing_trials_fail_alone(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    # What the Prefect UI form (or `prefect deployment run --param`) posts: plain JSON.
    posted: dict[str, Any] = {
        "training": {"epochs": 2, "batch_size": 64},
        "model": {"model": MODEL, "model_options": {"record": str(tmp_path / "received")}},
        "sweep": {
            "campaign": "by-run-form",
            "search_space": "tests.fixtures.search_spaces:sometimes_broken",
            "objectives": {"val_accuracy": "maximize", "val_loss": "minimize"},
            "pruner": "none",
            "sampler": "random",
            "n_trials": 6,
            "concurrency": 2,
            "max_consecutive_failures": 6,
        },
    }
    schema = CampaignParams.model_json_schema()
    space_forms = schema["$defs"]["SweepParams"]["properties"]["search_space"]["anyOf"]
    assert {"type": "string"} in space_forms, "the UI form takes an import path"

    result = hpo_campaign(params=posted)

    study = optuna.load_study(study_name="by-run-form", storage=home.resolved_optuna_storage)
    counted = [t for t in study.trials if counts_toward_budget(t)]
    assert len(counted) == result.finished == 6
    broken = [t for t in counted if t.params["broken"]]
    whole = [t for t in counted if not t.params["broken"]]
    assert broken and whole, "random draws with seed 0 give both"
    assert all(t.state == TrialState.FAIL for t in broken)
    assert all(t.state == TrialState.COMPLETE for t in whole)
    _, runs = _trial_runs(home, "by-run-form")
    for trial in broken:
        error = runs[trial.number].data.tags[tracking.ERROR_TAG]
        assert "shapes cannot be multiplied" in error, error
    assert 1 <= len(result.best) <= len(whole), "a Pareto front of the complete trials"
    for best in result.best:
        assert best.tuned["model_options.widths"] and best.tuned["model_options.broken"] is False


def test_a_killed_campaign_with_a_define_by_run_space_resumes_to_exactly_n_trials(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    n_trials = 6
    command = _command("by-run-killed", n_trials) + [
        "--model",
        MODEL,
        "--model-options",
        '{"delay": 0.02}',
        "--search-space",
        SPACE,
    ]
    left_running = kill_mid_way_and_resume(home, tmp_path, "by-run-killed", command)

    trials = _trials(home, "by-run-killed")
    counted = [t for t in trials if counts_toward_budget(t)]
    assert len(counted) == n_trials
    assert all(t.state.is_finished() for t in trials), "nothing left RUNNING or WAITING"
    assert max(Counter(root_trial(t) for t in counted).values()) == 1
    for trial in counted:
        assert_carries_its_branch(trial)
    by_number = {t.number: t for t in trials}
    for number in left_running:
        retry = next(t for t in counted if root_trial(t) == number)
        interrupted = by_number[number]
        assert _keeps_parameters(retry, interrupted), "re-run with the same parameters"
        first_values = interrupted.user_attrs.get(TUNED_ATTR)
        if first_values is not None:  # it had drawn them all before the kill
            assert retry.user_attrs[TUNED_ATTR] == first_values


@pytest.mark.usefixtures("ray_cluster")
def test_prefect_ml_sweep_tunes_a_user_loader_s_option_preparing_each_value_once(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    received = tmp_path / "received"
    sweep(
        home,
        "by-data",
        "--batch-size",
        "32",
        "--dataset",
        LOADER,
        "--dataset-options",
        json.dumps({"record": str(received)}),
        "--model",
        MODEL,
        "--search-space",
        "tests.fixtures.search_spaces:features_and_widths",
    )

    study = optuna.load_study(study_name="by-data", storage=home.resolved_optuna_storage)
    counted = [t for t in study.trials if counts_toward_budget(t)]
    assert len(counted) == 6 and all(t.state != TrialState.FAIL for t in counted)
    drawn = Counter(t.params["features"] for t in counted)
    assert len(drawn) > 1, drawn

    # The loader received each drawn value, once however many trials drew it (the campaign's
    # own data, without the option, was loaded by the flow before the trials).
    loads = Counter(json.loads(p.read_text())["features"] for p in received.iterdir())
    every = {t.params["features"] for t in study.trials if "features" in t.params}
    assert {k: n for k, n in loads.items() if k is not None} == dict.fromkeys(every, 1), loads

    # Each trial's MLflow run: the dataset options it trained with, and its data's fingerprint,
    # one per distinct value.
    _, runs = _trial_runs(home, "by-data")
    fingerprints: dict[int, set[str]] = {}
    for trial in counted:
        params = runs[trial.number].data.params
        options = ast.literal_eval(params["data.dataset_options"])
        assert options == {"record": str(received), "features": trial.params["features"]}
        assert params["drawn.features"] == str(trial.params["features"])
        fingerprints.setdefault(trial.params["features"], set()).add(params["data.fingerprint"])
    assert all(len(found) == 1 for found in fingerprints.values()), fingerprints
    assert len(set().union(*fingerprints.values())) == len(drawn)
    workers = {run.data.tags[WORKER_TAG] for run in runs.values() if WORKER_TAG in run.data.tags}
    assert 1 <= len(workers) <= 2, "warm workers: two processes trained every trial"


def _prefect(*arguments: str, env: dict[str, str]) -> None:
    finished = subprocess.run(
        [str(BIN / "prefect"), *arguments],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]


@pytest.mark.usefixtures("ray_cluster")
def test_the_hpo_campaign_deployment_runs_a_define_by_run_space_given_as_its_parameters(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    """prefect.yaml's ``hpo-campaign/campaign`` deployment, registered by ``prefect deploy`` on
    the session's Prefect server and run by a real ``prefect worker`` with the parameters the
    UI form posts: the space by its import path."""
    pool = "campaign-spaces"
    env = cli_env(home.home_dir)
    posted: dict[str, Any] = {
        "training": {"epochs": 2, "batch_size": 64},
        "model": {"model": MODEL, "model_options": {"record": str(tmp_path / "received")}},
        "sweep": {"campaign": "by-deployment", "search_space": SPACE, "n_trials": 4},
    }
    _prefect("work-pool", "create", pool, "--type", "process", env=env)
    worker = None
    try:
        _prefect(
            "--no-prompt",
            "deploy",
            "--prefect-file",
            "deployments/prefect.yaml",
            "--name",
            "hpo-campaign/campaign",
            "--pool",
            pool,
            env=env,
        )
        worker_log = tmp_path / "worker.log"
        worker_command = [str(BIN / "prefect"), "worker", "start", "--pool", pool]
        worker = start_job(worker_command, env, worker_log)
        flow_run = run_deployment(
            "hpo-campaign/campaign", parameters={"params": posted}, timeout=900
        )
        assert flow_run.state is not None and flow_run.state.is_completed(), (
            flow_run.state,
            worker_log.read_text()[-3000:],
        )
        assert flow_run.work_pool_name == pool
    finally:
        if worker is not None:
            _kill_tree(worker)
        with get_client(sync_client=True) as client, suppress(ObjectNotFound):
            deployment = client.read_deployment_by_name("hpo-campaign/campaign")
            client.delete_deployment(deployment.id)
        with get_client(sync_client=True) as client:
            client.delete_work_pool(pool)

    study = optuna.load_study(study_name="by-deployment", storage=home.resolved_optuna_storage)
    counted = [t for t in study.trials if counts_toward_budget(t)]
    assert len(counted) == 4
    for trial in counted:
        assert_carries_its_branch(trial)
    got = [json.loads(p.read_text()) for p in (tmp_path / "received").iterdir()]
    for trial in counted:
        widths = trial.user_attrs[TUNED_ATTR]["model_options.widths"]
        assert any(g["widths"] == widths for g in got), (trial.number, widths)
    parents, _ = _trial_runs(home, "by-deployment")
    assert parents[0].data.tags[tracking.FLOW_RUN_TAG] == str(flow_run.id)
