"""Serving: a bare FastAPI app vs ``mlflow models serve`` vs ours (Ray Serve) without and with
dynamic batching, on the same registered model, in one run.

The model is trained and registered by our own ``train_model`` flow (digits MLP, 3 epochs). Every
arm runs one server process or replica and answers one digit per request; the load comes from
``wrk`` (one thread, C connections, a fixed duration after a warm-up) in another process:

* ``bare-fastapi``: uvicorn (1 worker) running a FastAPI app whose ``POST /predict`` validates
  ``{"inputs": [[...]]}`` with pydantic and calls the model MLflow loads (``--bare-server``);
* ``mlflow-serve``: ``mlflow models serve -m models:/<name>/<version> --env-manager local`` with
  its defaults (1 worker), ``POST /invocations`` with the same row shaped as the signature wants;
* ``ours``: ``serve_model`` with one replica (1 CPU), batching off;
* ``ours+batching``: the same with adaptive batching (``integrations/serving/_batching.py``, the
  defaults: up to 32 requests per model call, no wait);
* ``ours+batching, threaded``: the same, every model call in the batcher's thread (no inline
  calls: ``batch_inline_below_s=0``), as before the inline calls;
* ``ours+batching, no access log``: the same, with Ray Serve's per-request access log off;
* ``ours+batching, replica port``: the defaults' replica asked on its own HTTP port (Ray's direct
  ingress), past HAProxy: what the HAProxy hop costs;
* ``ours /invocations`` and ``ours OIP infer``: the defaults' deployment asked the same row in
  MLflow's scoring protocol (the body ``mlflow-serve`` gets) and in the Open Inference Protocol
  v2 (``POST /v2/models/<name>/infer``), taking turns with ``ours+batching``'s ``/predict`` at
  each concurrency (three turns each): what each protocol's translation costs, and
  ``/invocations`` against ``mlflow models serve`` itself;
* ``ours, 2 versions``: the same ``/predict`` rows on the defaults' deployment, every other
  request selecting a second registered version by the ``serve_multiplexed_model_id`` header
  (the same network registered again: two models in the replica, each with its own batcher),
  in the same turns: what serving several versions on one endpoint costs.

``--protocols`` runs only the arms the protocols are compared with (``mlflow-serve``,
``ours+batching``, the two protocol arms and the two versions), all of them in the same rotating
turns, ``mlflow-serve`` included (its server stays up beside our replica).

Every server runs at the OS's default priority: Ray starts its worker processes (our replica) at
nice 15 unless ``RAY_worker_niceness`` says otherwise, where ``mlflow models serve`` and the bare
app run at 0, so on a machine where anything else runs our replica would get a fraction of a core
that its peers do not share; the benchmark sets ``RAY_worker_niceness=0``.

Throughput (requests/s), p50 and p99 latency (wrk's own percentiles), and errors (non-2xx and
socket errors) per arm and concurrency 1, 8, 32. Needs ``wrk`` (``apt-get install -y wrk``).
Smoke run: ``.venv/bin/python benchmarks/serving.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

CONCURRENCY = (1, 8, 32)
# Our arms, in the order they run: serving options on top of the defaults (the last one deployed
# is the defaults', which the replica-port arm asks again).
OUR_ARMS: dict[str, dict[str, Any]] = {
    "ours": {"batching": False},
    "ours+batching, threaded": {"batching": True, "batch_inline_below_s": 0.0},
    "ours+batching, no access log": {"batching": True, "access_log": False},
    "ours+batching": {"batching": True},
}
MODEL_NAME = "digits-classifier"
PROTOCOL_ARMS = ("ours /invocations", "ours OIP infer")
VERSIONS_ARM = "ours, 2 versions"
WRK_TIMEOUT = "10s"


class BareRequest(BaseModel):
    inputs: list[list[float]]


def bare_server(port: int, model_uri: str) -> None:
    """Arm (a): the smallest honest FastAPI server around the same MLflow model."""
    import mlflow.pytorch
    import torch
    import uvicorn
    from fastapi import FastAPI

    torch.set_num_threads(1)
    loaded = mlflow.pytorch.load_model(model_uri)
    model = loaded.module() if isinstance(loaded, torch.export.ExportedProgram) else loaded
    shape = json.loads(os.environ["BENCH_SAMPLE_SHAPE"])

    app = FastAPI()

    @app.post("/predict")
    def predict(request: BareRequest) -> dict[str, Any]:
        samples = torch.tensor(request.inputs, dtype=torch.float32).reshape(-1, *shape)
        with torch.inference_mode():
            probabilities = torch.softmax(model(samples), dim=1).numpy()
        return {
            "predictions": [str(i) for i in probabilities.argmax(axis=1)],
            "probabilities": probabilities.astype(np.float64).round(6).tolist(),
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(
    url: str, body: dict[str, Any], check_alive: Callable[[], None], timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive()
        try:
            if httpx.post(url, json=body, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s")


# Each connection's requests take turns selecting the model ids of ``model_ids``.
ALTERNATING = """
local ids, n = {%s}, 0
request = function()
  n = n + 1
  wrk.headers["serve_multiplexed_model_id"] = ids[n %% #ids + 1]
  return wrk.format()
end
"""


def _wrk(
    url: str,
    body: dict[str, Any],
    connections: int,
    seconds: float,
    model_ids: tuple[str, ...] = (),
) -> dict[str, float]:
    """One wrk run: requests/s, p50/p99 latency in ms, errors; with ``model_ids``, each
    connection's requests select them in turn."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = {json.dumps(json.dumps(body))}\n"
        )
        if model_ids:
            script.write(ALTERNATING % ", ".join(json.dumps(i) for i in model_ids))
    command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency"]
    output = subprocess.run(
        [*command, "--timeout", WRK_TIMEOUT, "-s", script.name, url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    os.unlink(script.name)

    def latency_ms(percentile: str) -> float:
        match = re.search(rf"^\s+{percentile}%\s+([\d.]+)(us|ms|s)\s*$", output, re.M)
        assert match, output
        value, unit = float(match.group(1)), match.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    errors = int(non_2xx.group(1)) if non_2xx else 0
    errors += sum(int(n) for n in socket_errors.groups()) if socket_errors else 0
    throughput = re.search(r"Requests/sec:\s+([\d.]+)", output)
    assert throughput, output
    return {
        "rps": float(throughput.group(1)),
        "p50_ms": latency_ms("50"),
        "p99_ms": latency_ms("99"),
        "errors": errors,
    }


def load_curve(
    url: str,
    body: dict[str, Any],
    seconds: float,
    check_alive: Callable[[], None] = lambda: None,
    batch_counts: Callable[[], dict[str, int]] | None = None,
) -> dict[int, dict[str, float]]:
    """Each concurrency after a warm-up at that concurrency, once ``url`` answers (a peer
    server's ``check_alive`` raises if it exited meanwhile); with ``batch_counts`` (the
    replica's model calls and requests so far), the mean batch size of each point too."""
    _wait_ready(url, body, check_alive)
    curve = {}
    for connections in CONCURRENCY:
        curve[connections] = _point(url, body, connections, seconds, batch_counts)
        print(f"  c={connections}: {curve[connections]}", flush=True)
    return curve


def _point(
    url: str,
    body: dict[str, Any],
    connections: int,
    seconds: float,
    batch_counts: Callable[[], dict[str, int]] | None,
    model_ids: tuple[str, ...] = (),
) -> dict[str, float]:
    """One wrk run after a 2 s warm-up; with ``batch_counts``, its mean batch size too."""
    _wrk(url, body, connections, 2, model_ids)
    before = batch_counts() if batch_counts else None
    point = _wrk(url, body, connections, seconds, model_ids)
    if batch_counts and before:
        after = batch_counts()
        calls = max(after["batches"] - before["batches"], 1)
        point["mean_batch"] = (after["requests"] - before["requests"]) / calls
    return point


def interleaved_curves(
    requests: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]],
    seconds: float,
    batch_counts: Callable[[], dict[str, int]],
    peers: Container[str] = (),
    rounds: int = 3,
) -> dict[str, dict[int, dict[str, float]]]:
    """The arms side by side: at each concurrency they take turns, ``rounds`` times
    ``seconds // rounds`` each, each round starting with the next arm, so that a change of the
    machine's load meets all of them; a point is the mean of an arm's turns (errors: their
    sum). ``batch_counts`` counts our replica's model calls, not those of the ``peers``."""
    for url, body, _ in requests.values():
        _wait_ready(url, body, lambda: None)
    curves: dict[str, dict[int, dict[str, float]]] = {arm: {} for arm in requests}
    turn_s = max(1, int(seconds // rounds))  # wrk takes whole seconds
    for connections in CONCURRENCY:
        turns: dict[str, list[dict[str, float]]] = {arm: [] for arm in requests}
        order = list(requests.items())
        for turn in range(rounds):  # each round starts with another arm
            for arm, (url, body, ids) in order[turn % len(order) :] + order[: turn % len(order)]:
                counts = None if arm in peers else batch_counts
                turns[arm].append(_point(url, body, connections, turn_s, counts, ids))
        for arm, points in turns.items():
            mean = {key: float(np.mean([p[key] for p in points])) for key in points[0]}
            curves[arm][connections] = {**mean, "errors": sum(p["errors"] for p in points)}
            print(f"  {arm}, c={connections}: {curves[arm][connections]}", flush=True)
    return curves


@contextmanager
def running(command: list[str], env: dict[str, str]) -> Iterator[Callable[[], None]]:
    """A peer server, with this interpreter's ``bin`` first on ``PATH`` as in an activated
    venv (``mlflow models serve`` starts ``uvicorn`` by name); yields a check that raises at
    once, with the server's stderr, if it has exited."""
    path = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
    stderr = tempfile.TemporaryFile()
    process = subprocess.Popen(
        command, env={**env, "PATH": path}, stdout=subprocess.DEVNULL, stderr=stderr
    )

    def check_alive() -> None:
        if process.poll() is not None:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{command[:4]} exited ({process.returncode}):\n{tail}")

    try:
        yield check_alive
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        stderr.close()


def _replica_port(timeout: float = 60) -> int:
    """The HTTP port of the one replica up (Ray's direct ingress listens on 30000-31000), once
    a rolled-out replica has stopped listening."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ports = {
            c.laddr.port
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and 30000 <= c.laddr.port <= 31000
        }
        if len(ports) == 1:
            return ports.pop()
        time.sleep(0.5)
    raise RuntimeError(f"not exactly one replica port after {timeout:.0f}s: {sorted(ports)}")


def measure(seconds: float, protocols_only: bool = False) -> dict[str, Any]:
    from prefect_ml.flows.train import train_model
    from prefect_ml.integrations.settings import get_settings
    from prefect_ml.tasks.params import TrainModelParams

    outcome = train_model(TrainModelParams(training={"epochs": 3, "workers": 1}))
    version = outcome.registration.version
    shape = outcome.data.sample_shape
    settings = get_settings()
    model_uri = f"models:/{MODEL_NAME}/{version}"
    from sklearn.datasets import load_digits

    row = load_digits().data[0].astype(float).tolist()
    flat_body = {"inputs": [row]}
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": settings.resolved_tracking_uri,
        "BENCH_SAMPLE_SHAPE": json.dumps(shape),
    }
    arms: dict[str, dict[int, dict[str, float]]] = {}

    port = _free_port()
    if not protocols_only:
        print("bare-fastapi", flush=True)
        bare = [sys.executable, __file__, "--bare-server", str(port), model_uri]
        with running(bare, env) as alive:
            arms["bare-fastapi"] = load_curve(
                f"http://127.0.0.1:{port}/predict", flat_body, seconds, alive
            )

    port = _free_port()
    print("mlflow-serve", flush=True)
    mlflow_body = {"inputs": np.asarray(row).reshape(1, *shape).tolist()}
    mlflow_command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri]
    local_only = ["--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)]
    mlflow_url = f"http://127.0.0.1:{port}/invocations"
    # MLflow's server stays up while ours run: with --protocols it takes its turns beside them.
    with running([*mlflow_command, *local_only], env) as alive:
        if protocols_only:
            _wait_ready(mlflow_url, mlflow_body, alive)
        else:
            arms["mlflow-serve"] = load_curve(mlflow_url, mlflow_body, seconds, alive)
        peers: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {}
        if protocols_only:
            peers["mlflow-serve"] = (mlflow_url, mlflow_body, ())
        bodies = (flat_body, mlflow_body)
        arms.update(ours_curves(version, row, bodies, seconds, protocols_only, peers))
    return {"model_uri": model_uri, "arms": arms}


def ours_curves(
    version: str,
    row: list[float],
    bodies: tuple[dict[str, Any], dict[str, Any]],
    seconds: float,
    protocols_only: bool,
    peers: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]],
) -> dict[str, dict[int, dict[str, float]]]:
    """Our arms on one local Ray; the defaults' replica is deployed last, and ``/predict``, the
    other protocols, the two versions and ``peers`` (servers already up) take turns on it.
    ``bodies``: the row as ``/predict``'s body and as MLflow's."""
    from prefect_ml.flows.serve import serve_model
    from prefect_ml.integrations.compute import ray_session
    from prefect_ml.integrations.settings import get_settings
    from prefect_ml.tasks.params import ServeModelParams

    settings = get_settings()
    port = _free_port()

    def batch_counts() -> dict[str, int]:
        """Model calls and requests so far, of every version the replica holds."""
        metadata = httpx.get(f"http://127.0.0.1:{port}/metadata").json()
        versions = [metadata["batching"], *metadata["versions"]["loaded"].values()]
        return {key: sum(v[key] for v in versions) for key in ("batches", "requests")}

    base = f"http://127.0.0.1:{port}"
    flat_body, mlflow_body = bodies
    oip_body = {
        "inputs": [{"name": "input", "shape": [1, len(row)], "datatype": "FP32", "data": row}]
    }
    protocol_requests = {
        "ours /invocations": (f"{base}/invocations", mlflow_body, ()),
        "ours OIP infer": (f"{base}/v2/models/{MODEL_NAME}/infer", oip_body, ()),
        VERSIONS_ARM: (f"{base}/predict", flat_body, _two_versions(settings, version)),
    }
    arms: dict[str, dict[int, dict[str, float]]] = {}
    ours = {"ours+batching": OUR_ARMS["ours+batching"]} if protocols_only else OUR_ARMS
    with ray_session(settings):
        for arm, options in ours.items():
            print(arm, flush=True)
            serving = {"port": port, "replica_cpus": 1.0, **options}
            serve_model(ServeModelParams(model_version=version, serving=serving))
            counts = batch_counts if options["batching"] else None
            if arm != "ours+batching":
                arms[arm] = load_curve(f"{base}/predict", flat_body, seconds, batch_counts=counts)
        # The defaults, deployed last: /predict and the protocols take turns on that replica.
        side_by_side = {"ours+batching": (f"{base}/predict", flat_body, ()), **protocol_requests}
        arms.update(interleaved_curves({**side_by_side, **peers}, seconds, batch_counts, peers))
        if not protocols_only:
            arm = "ours+batching, replica port"
            print(arm, flush=True)
            replica = f"http://127.0.0.1:{_replica_port()}/predict"
            arms[arm] = load_curve(replica, flat_body, seconds, batch_counts=batch_counts)
    return arms


def _two_versions(settings: Any, version: str) -> tuple[str, ...]:
    """The model ids of ``version`` and of a second version registered from its artifacts."""
    from prefect_ml.integrations import tracking

    client = tracking.client_for(settings.resolved_tracking_uri)
    first = client.get_model_version(MODEL_NAME, version)
    second = client.create_model_version(
        MODEL_NAME, str(first.source), str(first.run_id), tags=first.tags
    )
    return f"{MODEL_NAME}/{version}", f"{MODEL_NAME}/{second.version}"


def markdown(report: dict[str, Any]) -> str:
    arms = report["arms"]
    lines = [
        "| arm | concurrency | requests/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for arm, curve in arms.items():
        for connections, row in curve.items():
            lines.append(
                f"| {arm} | {connections} | {row['rps']:.0f} | {row['p50_ms']:.2f} | "
                f"{row['p99_ms']:.2f} | {row['errors']} |"
            )
    lines += ["", "| ratio | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    ratios = {
        "ours+batching / mlflow-serve, throughput": ("ours+batching", "mlflow-serve", "rps"),
        "ours / mlflow-serve, throughput": ("ours", "mlflow-serve", "rps"),
        "ours+batching / bare-fastapi, p99": ("ours+batching", "bare-fastapi", "p99_ms"),
        "ours / bare-fastapi, p99": ("ours", "bare-fastapi", "p99_ms"),
        "ours+batching, threaded / bare-fastapi, p99": (
            "ours+batching, threaded",
            "bare-fastapi",
            "p99_ms",
        ),
        "ours+batching, replica port / bare-fastapi, p99": (
            "ours+batching, replica port",
            "bare-fastapi",
            "p99_ms",
        ),
    }
    for protocol in PROTOCOL_ARMS:
        ratios[f"{protocol} / ours+batching /predict, throughput"] = (
            protocol,
            "ours+batching",
            "rps",
        )
    ratios[f"{VERSIONS_ARM} / ours+batching /predict, throughput"] = (
        VERSIONS_ARM,
        "ours+batching",
        "rps",
    )
    ratios[f"{VERSIONS_ARM} / ours+batching /predict, p99"] = (
        VERSIONS_ARM,
        "ours+batching",
        "p99_ms",
    )
    ratios["ours /invocations / mlflow-serve, throughput"] = (
        PROTOCOL_ARMS[0],
        "mlflow-serve",
        "rps",
    )
    ratios["ours /invocations / mlflow-serve, p99"] = (PROTOCOL_ARMS[0], "mlflow-serve", "p99_ms")
    for label, (mine, peer, key) in ratios.items():
        if mine not in arms or peer not in arms:  # a --protocols run
            continue
        cells = [f"{arms[mine][c][key] / arms[peer][c][key]:.2f}x" for c in arms[mine]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| requests per model call | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    for arm, curve in arms.items():
        if all("mean_batch" in row for row in curve.values()):
            cells = [f"{row['mean_batch']:.1f}" for row in curve.values()]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s per point instead of 10 s")
    parser.add_argument(
        "--seconds", type=float, help="s per point (split into 3 turns with --protocols) [10]"
    )
    parser.add_argument(
        "--protocols", action="store_true", help="only mlflow-serve, ours+batching and protocols"
    )
    parser.add_argument("--bare-server", nargs=2, metavar=("PORT", "MODEL_URI"), help="internal")
    parser.add_argument("--output", type=Path, help="JSON results [results/serving.json]")
    args = parser.parse_args()
    if args.bare_server:
        bare_server(int(args.bare_server[0]), args.bare_server[1])
        return
    os.environ.setdefault("RAY_worker_niceness", "0")  # our replica at its peers' priority
    with embedded_home():
        report = measure(args.seconds or (3 if args.quick else 10), args.protocols)
    report["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    save_report(
        report,
        args.output
        or results_path("serving.protocols" if args.protocols else "serving", args.quick),
        markdown(report),
    )


if __name__ == "__main__":
    main()
