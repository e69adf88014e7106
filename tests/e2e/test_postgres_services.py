"""PostgreSQL as the one database several hosts share, end to end: campaigns from two processes
(each with its own home and storage, as two hosts) on one PostgreSQL for Optuna and MLflow, a
coordinator refused by the study's claim in the database although its storage lease is free,
and the Prefect server of `prefect-ml ui` keeping its flow runs in PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from prefect.settings import PREFECT_API_URL

from prefect_ml.flows.sweep import hpo_campaign
from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import StudyClaim
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import CampaignParams
from tests.conftest import REPO_ROOT
from tests.e2e.test_prefect_ui import BIN, _stop, _wait_for_output
from tests.helpers import cold_env, free_port, start_job
from tests.postgres import PostgresServer

pytestmark = pytest.mark.e2e

SPACE = '{"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": true}}'


def _sweep(campaign: str) -> list[str]:
    """A tiny campaign: two trials of one epoch, one at a time."""
    return [
        *(sys.executable, "-m", "prefect_ml.flows.cli", "sweep", "--campaign", campaign),
        *("--n-trials", "2", "--concurrency", "1", "--epochs", "1", "--batch-size", "64"),
        *("--sampler", "random", "--pruner", "none", "--search-space", SPACE),
    ]


def test_two_campaigns_from_two_hosts_share_one_postgresql(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """Each process has its own home and storage (two hosts); Optuna and MLflow are the same
    two new PostgreSQL databases, whose tables both processes create at once."""
    optuna_url = postgres_server.new_database("campaigns_optuna")
    mlflow_url = postgres_server.new_database("campaigns_mlflow")
    processes = {}
    for name in ("pg-a", "pg-b"):
        env = {
            **os.environ,
            "PREFECT_ML_HOME": str(tmp_path / name),
            "PREFECT_ML_OPTUNA_STORAGE": optuna_url,
            "PREFECT_ML_MLFLOW_TRACKING_URI": mlflow_url,
            "PREFECT_ML_LOCAL_RAY_CPUS": "1",
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),  # the session's server
        }
        log = (tmp_path / f"{name}.log").open("wb")
        processes[name] = subprocess.Popen(
            _sweep(name), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    for name, process in processes.items():
        assert process.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    client = tracking.client_for(mlflow_url)
    for name in processes:
        trials = optuna.load_study(study_name=name, storage=optuna_url).get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
        [parent] = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` LIKE '{name}@%'",
        )
        assert parent.info.status == "FINISHED"
        runs = tracking.trial_runs(client, parent.info.experiment_id, parent.info.run_id)
        assert sorted(runs) == [0, 1]
        # In the storage of the home that created the shared experiment, not in ./mlruns.
        location = client.get_experiment(parent.info.experiment_id).artifact_location
        homes = [(tmp_path / home / "storage" / "mlartifacts").as_uri() for home in processes]
        assert location.rsplit("/", 1)[0] in homes
        artifacts = Path(location.removeprefix("file://")) / parent.info.run_id / "artifacts"
        assert (artifacts / "leaderboard.json").is_file()
    claims = postgres_server.execute(
        "SELECT count(*) FROM prefect_ml_study_claims", "campaigns_optuna"
    )
    assert claims == [(0,)], "each coordinator released its claim"


@pytest.mark.usefixtures("ray_cluster")
def test_a_coordinator_with_its_own_storage_is_refused_by_the_studys_claim(
    home: PrefectMLSettings, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host coordinates the campaign (here: this process holds the study's claim in
    PostgreSQL, and no storage lease anywhere). This home's storage lease is free, so only the
    claim in the database can refuse it, before the study is touched."""
    monkeypatch.setenv("PREFECT_ML_OPTUNA_STORAGE", postgres_database)
    other_host = StudyClaim(
        postgres_database, "pg-held", what="campaign 'pg-held'", field="sweep.campaign"
    )
    params = CampaignParams.model_validate(
        {
            "training": {"epochs": 1, "batch_size": 64},
            "sweep": {"campaign": "pg-held", "n_trials": 2, "concurrency": 1},
        }
    )

    with other_host:
        state = hpo_campaign(params, return_state=True)

    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert f"campaign 'pg-held' is being written by process {os.getpid()} on " in message
    assert "claim on study 'pg-held' in postgresql://" in message
    with pytest.raises(KeyError):
        optuna.load_study(study_name="pg-held", storage=postgres_database)  # not even created


_REPORT_A_FLOW = """
from prefect_ml.integrations.services import prepare_process_environment

prepare_process_environment()  # finds the server `prefect-ml ui` runs for this home
from prefect import flow
from prefect.runtime import flow_run


@flow(name="postgres-probe")
def probe() -> str:
    return flow_run.id


print(probe())
"""


def test_prefect_ml_ui_keeps_its_flow_runs_in_postgresql(
    postgres_server: PostgresServer, postgres_database: str, tmp_path: Path
) -> None:
    env = cold_env(tmp_path / "home")
    env["PREFECT_ML_PREFECT_DATABASE_URL"] = postgres_database
    log = tmp_path / "ui.log"
    server = start_job([str(BIN / "prefect-ml"), "ui", "--port", str(free_port())], env, log)
    try:
        output = " ".join(
            _wait_for_output(server, log, "Next, in another terminal").split()
        )  # unwrapped
        assert "(database: postgresql+asyncpg://postgres@127.0.0.1:" in output
        reported = subprocess.run(
            [sys.executable, "-c", _REPORT_A_FLOW],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert reported.returncode == 0, reported.stdout[-2000:] + reported.stderr[-2000:]
        flow_run_id = reported.stdout.split()[-1]
    finally:
        assert _stop(server) == 0, log.read_text()[-3000:]
    rows = postgres_server.execute(
        "SELECT f.name, r.state_type FROM flow_run r JOIN flow f ON f.id = r.flow_id "
        f"WHERE r.id = '{flow_run_id}'",
        postgres_database.rsplit("/", 1)[1],
    )
    assert rows == [("postgres-probe", "COMPLETED")]
    assert not list((tmp_path / "home" / "prefect").glob("*.db")), "no SQLite database"
