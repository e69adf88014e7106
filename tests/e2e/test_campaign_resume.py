"""Campaign processes killed and run side by side: the study stays exact, MLflow stays whole."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState
from sqlalchemy.exc import SQLAlchemyError

from prefect_ml.flows.cli import app
from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import INTERRUPTED_ATTR, counts_toward_budget, root_trial
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.tracking import RESUMED_TAG
from prefect_ml.tasks.campaign import coordinator
from prefect_ml.tasks.campaign import run as campaign_run
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from tests.conftest import REPO_ROOT
from tests.e2e.test_resume_after_kill import _kill_tree
from tests.helpers import cli_env, wait_while_running
from tests.tasks.test_campaign_coordinator import LateExecutor

N_TRIALS = 8
SPACE = '{"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": true}}'


def _command(campaign: str, n_trials: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "prefect_ml.flows.cli",
        "sweep",
        "--campaign",
        campaign,
        "--n-trials",
        str(n_trials),
        "--concurrency",
        "2",
        "--epochs",
        "5",
        "--batch-size",
        "64",
        "--model",
        "tests.fixtures.user_code:slow_model",
        "--model-options",
        '{"delay": 0.02}',
        "--pruner",
        "none",
        *extra,
    ]


def _env(home: PrefectMLSettings) -> dict[str, str]:
    return cli_env(home.home_dir, own_ray=True, PREFECT_ML_LOCAL_RAY_CPUS="2")


def _trials(home: PrefectMLSettings, campaign: str) -> list[optuna.trial.FrozenTrial]:
    if not (home.home_dir / "optuna.db").exists():
        return []
    try:
        study = optuna.load_study(study_name=campaign, storage=home.resolved_optuna_storage)
    except KeyError:  # not created yet
        return []
    except SQLAlchemyError:  # the campaign is creating the database's tables right now
        return []
    return study.get_trials()


def _killable(home: PrefectMLSettings, campaign: str, mid_way_epochs: int = 2) -> bool:
    """Some trials finished and one is mid-way with committed checkpoints behind it."""
    trials = _trials(home, campaign)
    finished = [t for t in trials if counts_toward_budget(t)]
    mid_way = [
        t
        for t in trials
        if t.state == TrialState.RUNNING and len(t.intermediate_values) >= mid_way_epochs
    ]
    return len(finished) >= 2 and bool(mid_way)


def _keeps_parameters(retry: optuna.trial.FrozenTrial, orphan: optuna.trial.FrozenTrial) -> bool:
    """The retry has every value the killed trial had drawn. A trial killed between its creation
    and its sampling (the kill is random) has drawn none or some: it never trained, and its retry
    draws the rest."""
    return retry.params.items() >= orphan.params.items()


def _trial_runs(home: PrefectMLSettings, campaign: str) -> tuple[list[Any], dict[int, Any]]:
    client = tracking.client_for(home.resolved_tracking_uri)
    parents = client.search_runs(
        ["1"], f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` LIKE '{campaign}@%'"
    )
    runs = tracking.trial_runs(client, "1", parents[0].info.run_id) if parents else {}
    return parents, runs


def kill_mid_way_and_resume(
    home: PrefectMLSettings, tmp_path: Path, campaign: str, command: list[str]
) -> list[int]:
    """Run ``command`` until some trials finished and one is mid-way, SIGKILL its process
    tree, then run it again to its end; the numbers of the trials the kill left running."""
    env = _env(home)
    log = (tmp_path / "first.log").open("wb")
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_while_running(
            first,
            tmp_path / "first.log",
            lambda: _killable(home, campaign),
            400,
            "finished trials and one mid-way",
        )
    finally:
        _kill_tree(first)
    left_running = [t.number for t in _trials(home, campaign) if t.state == TrialState.RUNNING]
    assert left_running, "the process must die with trials running"

    second = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return left_running


@pytest.mark.entry_point("sweep killed and resumed")
def test_killed_campaign_resumes_to_exactly_n_trials(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    left_running = kill_mid_way_and_resume(home, tmp_path, "killed", _command("killed", N_TRIALS))

    trials = _trials(home, "killed")
    counted = [t for t in trials if counts_toward_budget(t)]
    assert len(counted) == N_TRIALS
    assert all(t.state.is_finished() for t in trials), "nothing left RUNNING or WAITING"
    roots = Counter(root_trial(t) for t in counted)
    assert max(roots.values()) == 1, "no trial finished twice"
    by_number = {t.number: t for t in trials}
    for number in left_running:
        interrupted = by_number[number]
        assert interrupted.state == TrialState.FAIL
        assert interrupted.user_attrs[INTERRUPTED_ATTR]
        retry = next(t for t in counted if root_trial(t) == number)
        assert _keeps_parameters(retry, interrupted), "re-run with the same parameters"

    parents, runs = _trial_runs(home, "killed")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(runs) == sorted(by_number), "one MLflow run per trial"
    assert all(run.info.status != "RUNNING" for run in runs.values())
    resumed = [runs[t.number] for t in counted if root_trial(t) in left_running]
    assert any(int(run.data.tags.get(RESUMED_TAG, 0)) >= 1 for run in resumed), (
        "a re-run trial continued from its checkpoints"
    )


def test_two_campaigns_share_a_storage_without_cross_talk(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    space_file = tmp_path / "space.yaml"
    space_file.write_text("lr: {type: float, low: 0.001, high: 0.1, log: true}\n")
    env = _env(home)
    processes = {
        name: subprocess.Popen(
            _command(name, 3, "--search-space", space, "--epochs", "2"),  # the last --epochs wins
            cwd=REPO_ROOT,
            env=env,
            stdout=(tmp_path / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name, space in (("twin-a", SPACE), ("twin-b", str(space_file)))
    }
    for name, process in processes.items():
        assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    for name in processes:
        trials = _trials(home, name)
        assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
        parents, runs = _trial_runs(home, name)
        assert len(parents) == 1
        assert sorted(runs) == [0, 1, 2]
        assert {run.data.tags[tracking.CAMPAIGN_TAG] for run in runs.values()} == {
            parents[0].data.tags[tracking.CAMPAIGN_PARENT_TAG]
        }
        root = CampaignIdentity.of(name, home.resolved_optuna_storage, home.resolved_storage_url)
        trial_dirs = sorted(p.name for p in Path(urlparse(root.checkpoint_root).path).iterdir())
        assert trial_dirs == ["lease", "trial-00000", "trial-00001", "trial-00002"]


REPRODUCTION = ["sweep", "--campaign", "bar-resume", "--n-trials", "8", "--concurrency", "2"]


@pytest.mark.usefixtures("ray_cluster")
def test_issue_15_reproduction_resumes_with_pruned_trials_told_late(
    home: PrefectMLSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 15: killed after 2 finished trials, run again with the same command (default
    search space): the rerun crashed telling a PRUNED trial with values. The rerun here runs
    in this process with the ordering that crashed forced: the study writer runs each job only
    when a later result needs it (every tell after the loop moved on), and every new trial is
    pruned at its second epoch."""
    command = [sys.executable, "-m", "prefect_ml.flows.cli", *REPRODUCTION, "--epochs", "3"]
    log = (tmp_path / "first.log").open("wb")
    first = subprocess.Popen(
        command, cwd=REPO_ROOT, env=_env(home), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_while_running(
            first,
            tmp_path / "first.log",
            lambda: _killable(home, "bar-resume", 1),
            400,
            "2 finished trials",
        )
    finally:
        _kill_tree(first)
    left_running = [t.number for t in _trials(home, "bar-resume") if t.state == TrialState.RUNNING]
    assert left_running, "the process must die with trials running"
    finished_first = [t for t in _trials(home, "bar-resume") if t.state.is_finished()]
    assert all(t.state == TrialState.COMPLETE for t in finished_first)
    monkeypatch.setattr(coordinator, "new_study_writer", LateExecutor)
    monkeypatch.setattr(
        campaign_run,
        "make_pruner",
        lambda name, epochs: optuna.pruners.ThresholdPruner(lower=2.0, n_warmup_steps=1),
    )

    second = CliRunner().invoke(app, [*REPRODUCTION, "--epochs", "3"])

    assert second.exit_code == 0, second.output[-3000:]
    trials = _trials(home, "bar-resume")
    counted = [t for t in trials if counts_toward_budget(t)]
    assert len(counted) == 8
    assert any(t.state == TrialState.PRUNED for t in counted), "the crash's ordering happened"
    assert all(t.state.is_finished() for t in trials), "nothing left RUNNING or WAITING"
    assert max(Counter(root_trial(t) for t in counted).values()) == 1
    for number in left_running:
        retry = next(t for t in counted if root_trial(t) == number)
        assert _keeps_parameters(retry, trials[number])
    parents, runs = _trial_runs(home, "bar-resume")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert sorted(runs) == [t.number for t in trials], "one MLflow run per trial"
    assert all(run.info.status != "RUNNING" for run in runs.values())
