"""PostgreSQL as the shared database of the product's own stores: Optuna studies and the MLflow
backend store on a real PostgreSQL (the session's, one new database per test), and the settings
that point the Prefect server at one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations import tracking
from prefect_ml.integrations.campaign import (
    OBJECTIVES_ATTR,
    distributions,
    make_pruner,
    make_sampler,
    open_study,
)
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import server_database
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.tracking import _store as tracking_store
from tests.conftest import REPO_ROOT
from tests.helpers import wait_for
from tests.postgres import PostgresServer

SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True, "step": None}}


def test_a_study_on_postgresql_is_created_asked_told_and_reopened(postgres_database: str) -> None:
    def reopen() -> object:
        return open_study(
            postgres_database,
            "pg-study",
            {"val_accuracy": "maximize"},
            make_sampler("random", 0),
            make_pruner("none", 3),
        )

    study = reopen()
    trial = study.ask(distributions(SPACE))  # type: ignore[attr-defined]
    study.tell(trial, 0.75)  # type: ignore[attr-defined]
    again = reopen()
    assert [t.value for t in again.trials] == [0.75]  # type: ignore[attr-defined]
    assert again.user_attrs[OBJECTIVES_ATTR] == {"val_accuracy": "maximize"}  # type: ignore[attr-defined]


def test_mlflow_tracks_in_postgresql_with_artifacts_in_the_storage(
    home: PrefectMLSettings, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an MLflow server the database holds runs and metrics; artifacts go to the
    storage (shared by the hosts that share the database), not to ./mlruns of the process."""
    monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", postgres_database)
    settings = PrefectMLSettings()
    artifact_root = settings.mlflow_artifact_root
    assert artifact_root == f"{settings.resolved_storage_url}/mlartifacts"
    assert "reachable" in tracking.check_writable(postgres_database, artifact_root)

    client = tracking.client_for(postgres_database)
    experiment = tracking.ensure_experiment(client, "pg-exp", artifact_root)
    run_id = client.create_run(experiment).info.run_id
    tracking.log_metrics(client, run_id, {"val_accuracy": 0.5})
    tracking.log_dict(client, run_id, {"trials": []}, "leaderboard.json")
    tracking.finish_run(client, run_id)

    reread = tracking.client_for(postgres_database).get_run(run_id)
    assert reread.data.metrics == {"val_accuracy": 0.5} and reread.info.status == "FINISHED"
    stored = Path(settings.resolved_storage_url.removeprefix("file://")) / "mlartifacts"
    assert list(stored.glob(f"pg-exp/{run_id}/artifacts/leaderboard.json"))


_OPEN_MLFLOW = """
import sys
from prefect_ml.integrations import tracking
tracking.client_for(sys.argv[1]).search_experiments()
"""


def test_two_processes_opening_a_new_mlflow_database_take_turns(
    postgres_server: PostgresServer, postgres_database: str
) -> None:
    """MLflow creates its tables when a client first opens a new database; two processes doing
    it at once collided ("duplicate key value violates unique constraint"). Both are held at
    the schema lock (taken here first) and then create it one after the other."""
    lock = f"SELECT pg_advisory_lock({tracking_store._INIT_LOCK_KEY})"
    import psycopg

    with psycopg.connect(postgres_database, autocommit=True) as holder:
        holder.execute(lock.encode())
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", _OPEN_MLFLOW, postgres_database],
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for _ in range(2)
        ]
        database = postgres_database.rsplit("/", 1)[1]
        waiting = (
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            f"WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = '{database}'"
        )
        wait_for(
            lambda: (
                postgres_server.execute(waiting)[0][0] == 2
                or any(p.poll() is not None for p in processes)
            ),
            120,
            "both processes to wait for the schema lock",
        )
        assert all(p.poll() is None for p in processes), "one went ahead without the lock"
        tables = postgres_server.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
            database,
        )
        assert tables == [(0,)], "nothing created while the lock is held"
    for process in processes:
        output = process.communicate(timeout=120)[0].decode()
        assert process.returncode == 0, output[-3000:]
    versions = postgres_server.execute("SELECT count(*) FROM alembic_version", database)
    assert versions == [(1,)]


def test_the_prefect_database_setting_takes_postgresql_urls_only(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert home.prefect_server_database is None
    assert server_database(home) == f"SQLite under {home.prefect_home}"
    # The password is a word no setting's name holds (serve_token_secret is a name, not a value).
    monkeypatch.setenv("PREFECT_ML_PREFECT_DATABASE_URL", "postgresql://u:pw-9f3@db:5432/prefect")
    settings = PrefectMLSettings()
    assert settings.prefect_server_database == "postgresql+asyncpg://u:pw-9f3@db:5432/prefect"
    assert "pw-9f3" not in repr(settings) and "pw-9f3" not in server_database(settings)
    assert server_database(settings) == "postgresql+asyncpg://u:***@db:5432/prefect"
    for refused in ("mysql://u:secret@db/prefect", "postgresql+psycopg2://db/prefect", "db"):
        monkeypatch.setenv("PREFECT_ML_PREFECT_DATABASE_URL", refused)
        with pytest.raises(ConfigurationError, match="PREFECT_ML_PREFECT_DATABASE_URL") as bad:
            _ = PrefectMLSettings().prefect_server_database
        assert "secret" not in str(bad.value)
