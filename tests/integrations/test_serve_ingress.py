"""Ray Serve's HAProxy ingress as prefect-ml starts it (integrations/services/_serve_ingress.py):
a private folder, stats and Prometheus on loopback, no HAProxy outliving what started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations.settings import PrefectMLSettings

BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
_INGRESS = """
import json, os
from prefect_ml.integrations.services import prepare_process_environment
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
    for port in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        monkeypatch.delenv(port, raising=False)  # Ray's defaults, not a test worker's own
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

    from prefect_ml.integrations.services import haproxy_private_paths

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

    from prefect_ml.integrations.services import haproxy_private_paths
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
        # HAProxy itself, not our script (named haproxy-<hash>) still rewriting the config:
        # killed before it execs setpriv, the parent leaves an HAProxy with no death signal.
        wait_for(lambda: haproxy.name() == "haproxy", 30, "the script to exec HAProxy")
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

    from prefect_ml.integrations.services import _serve_ingress

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ours = Path(_serve_ingress.haproxy_private_paths()[BINARY])
    monkeypatch.setattr(_serve_ingress, "_bundled_haproxy", lambda: "/elsewhere/venv/bin/haproxy")
    theirs = Path(_serve_ingress.haproxy_private_paths()[BINARY])
    assert ours != theirs and ours.exists()
    assert "/elsewhere/" not in ours.read_text()
    assert theirs.read_text().rstrip().endswith('exec /elsewhere/venv/bin/haproxy "$@"')


def test_a_planted_haproxy_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from prefect_ml.integrations.errors import EnvironmentCheckError
    from prefect_ml.integrations.services import haproxy_private_paths

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"prefect-ml-haproxy-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(EnvironmentCheckError, match="is not a folder"):
        haproxy_private_paths()
