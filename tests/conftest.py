"""Real services for the tests: Prefect's test harness, one local Ray, MLflow on SQLite in tmp.

Prefect reads its settings when it is imported, so its home and telemetry switches are set
here, before any test module imports it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="prefect-ml-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_ML_HOME"] = str(_SESSION_DIR / "home")
os.environ.pop("MLFLOW_TRACKING_URI", None)
# The tests' user code (``tests.fixtures.user_code:blobs``) is allowed the way a user allows
# theirs; every subprocess and the session's Ray inherit it.
os.environ["PREFECT_ML_ALLOWED_MODULES"] = "tests.fixtures"

from prefect_ml.integrations.compute import setup_hook  # noqa: E402
from prefect_ml.integrations.services import prepare_process_environment  # noqa: E402
from prefect_ml.integrations.settings import PrefectMLSettings  # noqa: E402
from tests.cluster import LocalCluster, start_cluster  # noqa: E402
from tests.helpers import free_port  # noqa: E402

prepare_process_environment()

# `make test-all` runs test files side by side (pytest-xdist, two workers; TEST_WORKERS=0 and
# `make test` run one process, see the Makefile): each worker is a session of its own, with its
# own Prefect API, Ray, MLflow and folders. The ports Ray Serve's ingress takes whatever the
# application's port (HAProxy's stats and Prometheus, the fallback proxy) are the worker's own,
# so two workers can serve at once.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _variable in (
        "RAY_SERVE_HAPROXY_STATS_PORT",
        "RAY_SERVE_HAPROXY_METRICS_PORT",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
    ):
        os.environ[_variable] = str(free_port())

# Ray Serve says why a replica is not ready yet (not placed, a slow constructor) once it has
# waited 5 s, not Ray's 30: test_serving's replica that is never placed fails at a bound of 20 s,
# not 45, with that reason. Read by each Serve controller, which the session's Ray (and a
# command's own) starts from this environment.
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "5")
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "5")

# S3 is moto's server on loopback, with throw-away credentials; set before Ray starts, so local
# Ray workers (and every subprocess) reach the same endpoint. Real AWS settings are dropped.
_S3_PORT = free_port()
for _variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_variable, None)
os.environ.update(
    AWS_ENDPOINT_URL=f"http://127.0.0.1:{_S3_PORT}",
    AWS_ACCESS_KEY_ID="prefect-ml-test",
    AWS_SECRET_ACCESS_KEY="prefect-ml-test",
    AWS_DEFAULT_REGION="us-east-1",
)

import pytest  # noqa: E402
from hypothesis import settings as hypothesis_settings  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from tests import durations, tiers, worker_groups  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tests.s3 import TEST_BUCKET, MlflowServer, MotoS3  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

# Property-based tests draw the same examples on every run (from each test's source), so a run
# of `make test` passes or fails by the code, not by the draw; HYPOTHESIS_PROFILE=explore draws
# new ones to look for more.
hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis_settings.register_profile("explore")
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True, scope="session")
def prefect_harness() -> Iterator[None]:
    """One real (temporary) Prefect API for the whole session."""
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray with 2 CPUs, started once and shared by every test that trains."""
    import ray

    ray.init(
        address="local",  # not the session's `ray start` cluster (tests.cluster)
        num_cpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}, **setup_hook()},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster: None) -> Iterator[int]:
    """The port of the session's one Ray Serve instance, on the session's Ray: every test that
    serves there uses it and deletes its applications when done
    (``tests.helpers.serve_applications_deleted_after``) instead of shutting Serve down, whose
    controller and HAProxy proxy would start again for the next one. Shut down at the end."""
    from ray import serve

    yield free_port()
    serve.shutdown()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real 3-node Ray cluster (:mod:`tests.cluster`) whose nodes cannot import the checkout:
    a head with no CPUs, node-a (127.0.0.2, 1 CPU) and node-b (127.0.0.3, 1 CPU and 1
    ``fast_disk``). Nodes get the S3 endpoint and credentials, as a host's image would."""
    aws = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    started = start_cluster(
        tmp_path_factory.mktemp("cluster"),
        head_cpus=0,
        workers=[("node-a", 1, {}), ("node-b", 1, {"fast_disk": 1})],
        environment=aws,
    )
    _running_clusters.append(started)
    yield started
    started.stop()


# The session's cluster stops as soon as the last test that uses it has run, rather than idling
# (its raylets hold memory and some CPU) through the rest of the session.
_running_clusters: list[LocalCluster] = []
_last_cluster_test: list[str] = []


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _last_cluster_test and item.nodeid == _last_cluster_test[0]:
        for running in _running_clusters:
            running.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    """moto's S3 server at the session's AWS_ENDPOINT_URL."""
    server = MotoS3(_S3_PORT)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL for the session, on a free loopback port; tests take their own database
    on it (``postgres_database``)."""
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def postgres_database(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> str:
    """A new, empty database on the session's PostgreSQL; its ``postgresql://`` URL."""
    name = "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:40]
    return postgres_server.new_database(f"{name}_{next(_DATABASE_NUMBERS)}")


_DATABASE_NUMBERS = itertools.count()
_early_mlflow: list[MlflowServer] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tiers (tests/tiers.py), marked before ``-m`` selects; the cluster's tests in its
    files (tests/worker_groups.py)."""
    tiers.apply(items)
    worker_groups.check_cluster_files(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadgroup``: a worker runs a test file, or all the cluster's files, at a time
    (tests/worker_groups.py says why xdist's own marks cannot)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return worker_groups.make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start the MLflow server early when a selected test needs it: it takes 15-25 s to come
    up, time the tests before it use. Here rather than at collection: ``--collect-only``
    starts nothing. A test worker starts it on first use: it does not know yet which of the
    items it will run (the one that runs the cluster's group runs its last test, though)."""
    items = session.items
    users = [item.nodeid for item in items if "cluster" in getattr(item, "fixturenames", ())]
    _last_cluster_test[:] = users[-1:]
    needed = any("mlflow_s3_server" in getattr(item, "fixturenames", ()) for item in items)
    if needed and not XDIST_WORKER:
        _early_mlflow.append(MlflowServer(_SESSION_DIR / "mlflow-s3", _MLFLOW_ARTIFACTS))


def pytest_sessionfinish() -> None:
    for server in _early_mlflow:
        server.stop()


_MLFLOW_ARTIFACTS = f"s3://{TEST_BUCKET}/mlartifacts"


@pytest.fixture(scope="session")
def mlflow_s3_server() -> str:
    """A real MLflow tracking server (SQLite) whose artifacts live in the S3 test bucket; its
    tracking URI. Tests that use it also take ``s3_bucket``, which creates the bucket."""
    if not _early_mlflow:
        _early_mlflow.append(MlflowServer(_SESSION_DIR / "mlflow-s3", _MLFLOW_ARTIFACTS))
    return _early_mlflow[0].ready()


@pytest.fixture
def s3_bucket(moto_s3: MotoS3) -> Iterator[str]:
    """An empty bucket on a freshly reset S3 server; yields its ``s3://`` URL."""
    from s3fs import S3FileSystem

    moto_s3.reset()
    moto_s3.client().create_bucket(Bucket=TEST_BUCKET)  # type: ignore[attr-defined]
    S3FileSystem.clear_instance_cache()
    yield f"s3://{TEST_BUCKET}"
    S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def mlflow_database_template() -> Path:
    """An MLflow SQLite database with MLflow's schema, migrated once for the session: a new
    database takes MLflow's migrations, 2-4 s a home. The product's own creation of a database
    on first use is covered by tests/e2e/test_cold_start.py."""
    from prefect_ml.integrations.tracking._store import _create_sqlite_database

    template = _SESSION_DIR / "mlflow-template.db"
    _create_sqlite_database(str(template))
    return template


@pytest.fixture
def home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> PrefectMLSettings:
    """A fresh project home per test: its own MLflow SQLite DB (a copy of the session's migrated
    template) and storage directory. Marked ``empty_home``, it starts empty: for tests that
    assert MLflow was never touched."""
    if request.node.get_closest_marker("empty_home") is None:
        template = request.getfixturevalue("mlflow_database_template")
        (tmp_path / "home").mkdir()
        shutil.copyfile(template, tmp_path / "home" / "mlflow.db")
    monkeypatch.setenv("PREFECT_ML_HOME", str(tmp_path / "home"))
    for variable in (
        "MLFLOW_TRACKING_URI",
        "PREFECT_ML_STORAGE_URL",
        "PREFECT_ML_MLFLOW_TRACKING_URI",
    ):
        monkeypatch.delenv(variable, raising=False)
    return PrefectMLSettings()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not XDIST_WORKER:  # the controller reports every worker's tests
        durations.report(terminalreporter, REPO_ROOT / "test-reports")
