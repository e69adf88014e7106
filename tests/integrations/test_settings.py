from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from prefect_ml.integrations.settings import (
    PrefectMLSettings,
    prepare_process_environment,
    running_local_server,
    worker_environment,
)


def test_defaults_live_under_the_home(home: PrefectMLSettings) -> None:
    root = home.home_dir
    assert home.resolved_storage_url == (root / "storage").as_uri()
    assert home.resolved_tracking_uri == f"sqlite:///{root / 'mlflow.db'}"
    assert home.mlflow_artifact_root == (root / "mlartifacts").as_uri()
    assert home.prefect_home == root / "prefect"
    assert home.ray_address is None


def test_environment_overrides(home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", "s3://bucket/prefix/")
    monkeypatch.setenv("PREFECT_ML_RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5001")
    settings = PrefectMLSettings()
    assert settings.resolved_storage_url == "s3://bucket/prefix"
    assert settings.ray_address == "ray://head:10001"
    assert settings.resolved_tracking_uri == "http://127.0.0.1:5001"
    assert settings.mlflow_artifact_root is None, "a tracking server decides where artifacts go"


def test_own_tracking_setting_wins_over_mlflow_variable(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")
    monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", "http://here:5000")
    assert PrefectMLSettings().resolved_tracking_uri == "http://here:5000"


def test_home_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_ML_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert PrefectMLSettings().home_dir == tmp_path / ".prefect-ml"


def test_commands_find_the_server_that_prefect_ml_ui_runs_for_their_home(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # restored after the test
    home.prefect_home.mkdir(parents=True)
    record = {"api_url": "http://127.0.0.1:4311/api", "pid": os.getpid()}  # a live process
    home.local_server_file.write_text(json.dumps(record))
    assert running_local_server(home) == "http://127.0.0.1:4311/api"
    prepare_process_environment(home)
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4311/api"


def test_a_stale_server_record_is_ignored(home: PrefectMLSettings) -> None:
    home.prefect_home.mkdir(parents=True)
    dead = subprocess.Popen(["true"])  # a process that no longer exists
    dead.wait()
    home.local_server_file.write_text(json.dumps({"api_url": "http://x/api", "pid": dead.pid}))
    assert running_local_server(home) is None
    home.local_server_file.write_text("not json")
    assert running_local_server(home) is None


def test_every_process_we_start_refuses_pickled_models(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # a user's own setting
    prepare_process_environment(home)
    assert os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] == "false"
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "my_project")
    monkeypatch.setenv("PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S", "12.5")
    assert worker_environment(PrefectMLSettings()) == {
        "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false",
        "PREFECT_ML_ALLOWED_MODULES": "my_project",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "12.5",
    }


_WORKER = """
import json, os, ray
from prefect_ml.integrations.ray_cluster import ray_session
from prefect_ml.integrations.settings import PrefectMLSettings

@ray.remote
def worker():
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray.util.state import list_nodes

    seen = {"pickle": os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")}
    try:  # where Ray's state API (Ray Train's placement-group cleaner) looks from a worker
        seen["state_api_cluster"] = canonicalize_bootstrap_address_or_die(None)
        seen["nodes"] = len(list_nodes(timeout=20))
    except Exception as exc:
        seen["state_api_error"] = repr(exc)
    return seen

with ray_session(PrefectMLSettings()):
    seen = ray.get(worker.remote())
    print("worker:", json.dumps({**seen, "own": ray.get_runtime_context().gcs_address}))
"""


@pytest.fixture(scope="module")
def worker_view(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a worker of the product's own local Ray (``ray_session``) sees, on a machine whose
    record of its newest Ray (``/tmp/ray/ray_current_cluster``, written by ``ray start``)
    names a cluster that is gone, as a stopped cluster leaves it; with a driver that allows
    pickled models."""
    from ray._common.utils import get_ray_address_file

    record = Path(get_ray_address_file(None))
    before = record.read_text() if record.exists() else None
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("127.0.0.1:1")
    env = {**os.environ, "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "true"}
    env["PREFECT_ML_HOME"] = str(tmp_path_factory.mktemp("worker-view") / "home")
    env["PREFECT_ML_LOCAL_RAY_CPUS"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WORKER],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        if before is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(before)
    line = next((x for x in done.stdout.splitlines() if x.startswith("worker: ")), None)
    assert line, done.stdout + done.stderr[-4000:]
    return cast(dict[str, Any], json.loads(line.removeprefix("worker: ")))


def test_ray_workers_we_start_refuse_pickled_models(worker_view: dict[str, Any]) -> None:
    """Shipped in the job's runtime environment, whatever the driver's environment says."""
    assert worker_view["pickle"] == "false"


def test_ray_workers_we_start_query_their_own_cluster_whatever_the_machine_recorded(
    worker_view: dict[str, Any],
) -> None:
    """Ray's state API in a worker looked up the cluster named in ray_current_cluster: a gone
    one, where every query waited for a GCS that never answered (each training's end took
    about 12 s longer: Ray Train's placement-group cleaner stopped only after its query timed
    out), or another live one, whose placement groups and actors it would then have watched."""
    assert "state_api_error" not in worker_view, worker_view
    assert worker_view["state_api_cluster"] == worker_view["own"]
    assert worker_view["nodes"] == 1


BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
_INGRESS = """
import json, os
from prefect_ml.integrations.settings import prepare_process_environment
prepare_process_environment()
print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}))
"""


def _ingress_environment(home: PrefectMLSettings, **variables: str) -> dict[str, str]:
    """What a fresh process of ours sets for Ray Serve, from a clean environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_", "PREFECT_ML_"))}
    env.update(PREFECT_ML_HOME=str(home.home_dir), **variables)
    done = subprocess.run(
        [sys.executable, "-c", _INGRESS], env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_haproxy_s_admin_socket_lives_where_only_this_user_can_reach_it(
    home: PrefectMLSettings,
) -> None:
    """Issue 36, finding 7: Ray's template makes the admin socket mode 666 in /tmp/haproxy-serve,
    where any local user could reconfigure the ingress."""
    haproxy = _ingress_environment(home)
    assert haproxy["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    for variable in ("SOCKET_PATH", "METRICS_SOCKET_PATH", "CONFIG_FILE_LOC", "SERVER_STATE_FILE"):
        folder = Path(haproxy[f"RAY_SERVE_HAPROXY_{variable}"]).parent
        assert not str(folder).startswith("/tmp/haproxy-serve")
        info = folder.lstat()
        assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700, folder


def test_the_proxy_ingress_opens_only_the_serving_port_and_says_which(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect_ml.integrations.serving import listening

    assert "RAY_SERVE_ENABLE_HA_PROXY" not in _ingress_environment(
        home, PREFECT_ML_SERVE_INGRESS="proxy"
    )
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    assert listening("127.0.0.1", 8000) == "Serve's proxy on 127.0.0.1:8000 only"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", _ingress_environment(home)[BINARY])
    assert listening("127.0.0.1", 8000) == (
        "HAProxy on 127.0.0.1:8000, its stats on 127.0.0.1:8404 and Prometheus metrics on "
        "127.0.0.1:9101"
    )
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/sbin/haproxy")  # the user's own
    assert "(*:8404) and Prometheus metrics (*:9101) on every interface" in listening(
        "127.0.0.1", 8000
    )


# Ray's template's shape: the serving frontend on every interface (Ray writes `*` for 0.0.0.0).
RAY_CONFIG = """global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend prometheus
    bind :9101
    mode http
    http-request use-service prometheus-exporter if { path /metrics }
    no log
frontend http_frontend
    bind *:8000
    default_backend replicas
backend replicas
    server replica 127.0.0.1:30000
listen stats
  bind *:8404
  stats enable
  stats uri /stats
"""


def test_haproxy_starts_through_a_script_that_binds_stats_and_prometheus_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, finding 7: Ray's template binds them on every interface, whatever the serving
    host; the serving frontend keeps the host it was given. The real HAProxy checks the result."""
    import tempfile

    from prefect_ml.integrations.settings import haproxy_private_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = haproxy_private_paths()[BINARY]
    assert Path(script).stat().st_mode & 0o777 == 0o700
    config = tmp_path / "haproxy.cfg"
    config.write_text(RAY_CONFIG)
    checked = subprocess.run([script, "-c", "-f", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert config.read_text() == RAY_CONFIG.replace("bind :9101", "bind 127.0.0.1:9101").replace(
        "bind *:8404", "bind 127.0.0.1:8404"
    )


def test_haproxy_started_through_the_script_dies_with_the_process_that_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: a SIGKILLed serve left its HAProxy running (parent 1) on the stats and metrics
    ports, and every later serve on the machine crash-looped on them. Here the real HAProxy's
    parent (a Ray worker, for Ray) is SIGKILLed: HAProxy goes with it."""
    import tempfile

    import psutil

    from prefect_ml.integrations.settings import haproxy_private_paths
    from tests.helpers import free_port, wait_for

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = haproxy_private_paths()[BINARY]
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
        f"  timeout server 1s\nfrontend serving\n  bind 127.0.0.1:{free_port()}\n"
    )
    parent = subprocess.Popen(["sh", "-c", '"$0" -db -f "$1" & wait', script, str(config)])
    wait_for(lambda: bool(psutil.Process(parent.pid).children()), 30, "HAProxy to start")
    (haproxy,) = psutil.Process(parent.pid).children()
    try:
        wait_for(lambda: "haproxy" in haproxy.name(), 30, "the script to exec HAProxy")
        parent.kill()
        parent.wait()
        gone, _alive = psutil.wait_procs([haproxy], timeout=30)
        assert gone, f"HAProxy {haproxy.pid} outlived the process that started it"
    finally:
        if haproxy.is_running():
            haproxy.kill()


def test_each_haproxy_binary_keeps_its_own_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefect-ml of another virtualenv started later does not turn this one's Ray to its
    HAProxy (nor, once that virtualenv is deleted, to none): one script per HAProxy binary."""
    import tempfile

    from prefect_ml.integrations import settings

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ours = Path(settings.haproxy_private_paths()[BINARY])
    monkeypatch.setattr(settings, "_bundled_haproxy", lambda: "/elsewhere/venv/bin/haproxy")
    theirs = Path(settings.haproxy_private_paths()[BINARY])
    assert ours != theirs and ours.exists()
    assert "/elsewhere/" not in ours.read_text()
    assert theirs.read_text().rstrip().endswith('exec /elsewhere/venv/bin/haproxy "$@"')


def test_a_planted_haproxy_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from prefect_ml.integrations.errors import EnvironmentCheckError
    from prefect_ml.integrations.settings import haproxy_private_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"prefect-ml-haproxy-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EnvironmentCheckError, match="is not a folder"):
        haproxy_private_paths()
