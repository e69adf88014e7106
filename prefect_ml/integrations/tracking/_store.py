"""Reaching MLflow: a client per tracking URI (a new database's schema created by one process
at a time), the URI as it may travel to Ray workers, the probe before any compute, and the
addresses a person opens in MLflow's UI."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import quote

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.redaction import MASK, masked

if TYPE_CHECKING:
    from mlflow import MlflowClient

_INITIALISED: set[str] = set()


def shipped_uri(tracking_uri: str) -> str:
    """``tracking_uri`` as it may travel to Ray (actor and task arguments, which Ray's
    dashboard and state API show): its password masked; a worker gets it back with
    :func:`worker_uri`."""
    return masked(tracking_uri)


def worker_uri(shipped: str) -> str:
    """The tracking URI a Ray worker given ``shipped`` (:func:`shipped_uri`) uses: ``shipped``
    itself when nothing was masked, else this node's own setting (PREFECT_ML_MLFLOW_TRACKING_URI
    or MLFLOW_TRACKING_URI, as for the checkpoint key: secrets are not shipped), which must be
    the same URI."""
    if MASK not in shipped:
        return shipped
    from prefect_ml.integrations.settings import get_settings

    local = get_settings().resolved_tracking_uri
    if masked(local) != shipped:
        raise ConfigurationError(
            "PREFECT_ML_MLFLOW_TRACKING_URI",
            f"this Ray node's MLflow tracking URI is {masked(local)!r}, the driver's "
            f"{shipped!r}: the password is not shipped to Ray workers, so set the same "
            "PREFECT_ML_MLFLOW_TRACKING_URI (or MLFLOW_TRACKING_URI) on every node",
        )
    return local


def client_for(tracking_uri: str) -> MlflowClient:
    from mlflow import MlflowClient
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    if not tracking_uri.startswith(("sqlite:///", "postgresql")) or tracking_uri in _INITIALISED:
        try:
            return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        except UnsupportedModelRegistryStoreURIException:
            # A wrong scheme stays wrong: a configuration error, which is never retried.
            raise ConfigurationError(
                "PREFECT_ML_MLFLOW_TRACKING_URI",
                f"{masked(tracking_uri)!r} is not an MLflow tracking URI; use sqlite:///<file>, "
                "postgresql://... or the http(s) address of an MLflow server",
            ) from None
    # MLflow creates a new database's tables when a client first opens it; two processes doing
    # it at once collide ("table already exists", on PostgreSQL "duplicate key value violates
    # unique constraint pg_type_typname_nsp_index"). A lock makes one of them wait.
    with _initialisation_lock(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        client.search_registered_models(max_results=1)  # the registry store initialises too
    _INITIALISED.add(tracking_uri)
    return client


@contextmanager
def _initialisation_lock(tracking_uri: str) -> Iterator[None]:
    """Held by one process at a time per database: a file lock beside an SQLite file (whose
    schema is built aside, :func:`_create_sqlite_database`), an advisory lock in PostgreSQL."""
    if tracking_uri.startswith("sqlite:///"):
        import fcntl

        database = tracking_uri.removeprefix("sqlite:///")
        os.makedirs(os.path.dirname(database) or ".", exist_ok=True)
        with open(f"{database}.init-lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(database):
                _create_sqlite_database(database)
            yield
        return
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri, poolclass=sqlalchemy.NullPool)
    try:
        with engine.connect() as connection:
            # A session lock, released by the unlock or when the connection closes.
            connection.execute(sqlalchemy.text(f"SELECT pg_advisory_lock({_INIT_LOCK_KEY})"))
            try:
                yield
            finally:
                connection.execute(sqlalchemy.text(f"SELECT pg_advisory_unlock({_INIT_LOCK_KEY})"))
    finally:
        engine.dispose()


_INIT_LOCK_KEY = 0x70726566_6D6C  # "prefml": the advisory lock key of MLflow's schema creation


def _create_sqlite_database(database: str) -> None:
    """Create MLflow's schema in a temporary file, then move it into place.

    MLflow's migrations (alembic) take many statements; a process killed in between left a
    half-migrated database on which every later run failed ("table _alembic_tmp_experiments
    already exists", found by the chaos runs). Built aside and renamed, the database is either
    absent or whole. Called under the init lock, so leftovers of killed creators can go.
    """
    import glob

    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables  # what MLflow's own store runs

    for leftover in glob.glob(f"{glob.escape(database)}.creating-*"):
        os.remove(leftover)
    staging = f"{database}.creating-{os.getpid()}"
    engine = sqlalchemy.create_engine(f"sqlite:///{staging}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()
    os.replace(staging, database)


def check_writable(tracking_uri: str, artifact_root: str | None) -> str:
    """Connect to the tracking store and check that its backing files can be written."""

    from prefect_ml.integrations import storage

    client_for(tracking_uri).search_experiments(max_results=1)
    if tracking_uri.startswith("sqlite:///"):
        database = tracking_uri.removeprefix("sqlite:///")
        if not os.access(database, os.W_OK):
            raise PermissionError(f"{database} is not writable")
    if artifact_root:
        storage.check_writable(artifact_root)
    return f"{masked(tracking_uri)} reachable" + (
        f", artifacts at {artifact_root}" if artifact_root else ""
    )


def _ui_base(tracking_uri: str) -> str:
    """The MLflow UI: the tracking server itself, or a local ``mlflow ui`` on its default port."""
    base = masked(tracking_uri) if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return base.rstrip("/")


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where a person opens the run."""
    return f"{_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}"


def model_version_url(tracking_uri: str, model_name: str, version: str) -> str:
    """Where a person opens a registered model version."""
    return f"{_ui_base(tracking_uri)}/#/models/{quote(model_name)}/versions/{version}"
