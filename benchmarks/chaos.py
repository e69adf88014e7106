"""Chaos runs: kill prefect-ml at random moments, many times, and check what survives.

Each scenario repeats: run -> SIGKILL at a random moment -> rerun the same command (killed
again with probability ``REKILL``, at most ``MAX_KILLS`` times) until it completes -> check the
invariants. The random kill points come from one seed, printed at the start and accepted back
with ``--seed``, so a violation can be replayed.

* ``train-kill``: ``prefect-ml train`` killed. A kill is SIGKILL to the CLI's process group, as
  a shell's ``kill -9 %job`` or a lost terminal session does: the CLI and every process it
  started die at once. The CLI starts no processes of its own here, because it connects to a
  shared Ray cluster and Prefect server (below); the Ray processes that ran its work (the Ray
  Train controller and workers, children of the cluster's raylet) are left for Ray to clean up
  when it sees the driver gone, as on a real cluster whose driver machine died.
* ``sweep-kill``: ``prefect-ml sweep`` (a campaign of ``SWEEP_TRIALS`` trials) killed the same way.
* ``upload-kill``: a process writing checkpoints through ``CheckpointStore`` to S3 (moto's
  server; a checkpoint holds a multipart-sized state file every other epoch), killed mid-write;
  the rerun aborts the incomplete uploads and resumes after the newest verified checkpoint, as a
  training run does.
* ``worker-kill``: one Ray Train worker process SIGKILLed (at most ``max_failures - 1`` times per
  run); the run must finish without a rerun.
* ``s3-faults``: ``train-kill`` with the storage on S3 behind a proxy that answers
  ``S3_FAULT_RATE`` of the requests with 503 SlowDown or a connection reset.

Invariants after the command completes: every epoch exactly once in each MLflow run's metric
history; every visible checkpoint verifies (manifest sha256 and size); no incomplete multipart
upload left behind; a campaign ends with exactly ``n_trials`` finished trials, none RUNNING or
WAITING, one FINISHED parent run and one run per trial, none RUNNING; the champion alias points
at a registered version of a FINISHED run whose model loads and predicts.

One Ray head (``ray start --head``, 2 CPUs) and one ``prefect server start`` serve the whole
chaos run, through ``PREFECT_ML_RAY_ADDRESS`` and ``PREFECT_API_URL``; moto's S3 server and the
fault proxy run in this process. Each iteration gets a fresh project home (MLflow, Optuna and
storage on SQLite and files). Everything started here is stopped by process id.

    .venv/bin/python benchmarks/chaos.py --kills 50              # every scenario, 50 kills each
    .venv/bin/python benchmarks/chaos.py --scenario train-kill --kills 3 --seed 1234

Results: ``benchmarks/results/chaos.json``; RELIABILITY.md reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.common import FOREIGN_ENV, RESULTS_DIR, save_report  # noqa: E402

SCENARIOS = ("train-kill", "sweep-kill", "upload-kill", "worker-kill", "s3-faults")
REKILL = 0.3  # chance that a rerun is killed again
MAX_KILLS = 3  # kills of one iteration's command before it is left to finish
MAX_FAILED_RERUNS = 3  # reruns that exit non-zero before the iteration is given up
RUN_TIMEOUT_S = 600
S3_FAULT_RATE = 0.10
EPOCHS = 4
SWEEP_TRIALS = 4
MAX_FAILURES = 3
UPLOAD_EPOCHS = 6
BUCKET = "prefect-ml-chaos"
EXPERIMENT = "chaos"
MODEL_NAME = "chaos-model"
USER_CODE = "tests.fixtures.user_code"
_COMMON_FLAGS = [
    "--dataset", f"{USER_CODE}:blobs",
    "--model", f"{USER_CODE}:slow_model",
    "--model-options", '{"delay": 0.02}',
    "--epochs", str(EPOCHS),
    "--batch-size", "16",
]  # fmt: skip
TRAIN_COMMAND = [
    "train", *_COMMON_FLAGS,
    "--workers", "2",
    "--max-failures", str(MAX_FAILURES),
    "--experiment", EXPERIMENT,
    "--model-name", MODEL_NAME,
]  # fmt: skip
SWEEP_COMMAND = [
    "sweep", *_COMMON_FLAGS,
    "--campaign", "chaos",
    "--n-trials", str(SWEEP_TRIALS),
    "--concurrency", "2",
    "--pruner", "none",
    "--search-space", '{"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": true}}',
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Shared services: S3 (moto + fault proxy, in this process), a Ray head and a Prefect server


def _free_port() -> int:
    from tests.helpers import free_port

    return free_port()


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    from tests.helpers import wait_for

    wait_for(condition, timeout, what)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def _stop_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process we started and its descendants, then SIGKILL what is left, by pid."""
    import psutil

    try:
        victims = [psutil.Process(process.pid)]
        victims += victims[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.terminate()
    _gone, alive = psutil.wait_procs(victims, timeout=20)
    for victim in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    psutil.wait_procs(alive, timeout=10)


def _fault_proxy(target_port: int) -> Any:
    """``tests.s3.FaultyProxy`` in front of ``target_port``, faults off until a scenario sets
    its rate."""
    from tests.s3 import FaultyProxy

    server = FaultyProxy(target_port, rate=0.0)
    # A killed command leaves requests half-sent; the proxy's server would print each reset.
    server._server.handle_error = lambda *_: None  # type: ignore[method-assign]
    return server


@dataclass
class Services:
    """What every iteration shares; ``env`` is the environment of the commands under test."""

    work: Path
    env: dict[str, str]
    proxy: Any  # tests.s3.FaultyProxy
    ray_head: subprocess.Popen[bytes] | None = None

    def ray_processes(self) -> list[Any]:
        """Processes of our Ray head (other Ray clusters on this machine are not ours)."""
        import psutil

        if self.ray_head is None:
            return []
        try:
            return list(psutil.Process(self.ray_head.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []


@contextlib.contextmanager
def _restored_environment() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def services(work: Path, *, cluster: bool = True) -> Iterator[Services]:
    """moto's S3 server and the fault proxy, and with ``cluster`` a Ray head (2 CPUs) and a
    Prefect server; all stopped (by process id) on the way out, the environment restored."""
    from tests.s3 import MotoS3

    credentials = {
        "AWS_ACCESS_KEY_ID": "chaos",
        "AWS_SECRET_ACCESS_KEY": "chaos",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    dropped = (*FOREIGN_ENV, "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")
    with _restored_environment(), contextlib.ExitStack() as stack:
        for name in dropped:
            os.environ.pop(name, None)
        moto = MotoS3(_free_port())
        moto.start()
        stack.callback(moto.stop)
        # The checks (this process) talk to S3 directly; the commands go through the proxy.
        os.environ.update(credentials, AWS_ENDPOINT_URL=moto.endpoint)
        moto.client().create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
        proxy = stack.enter_context(_fault_proxy(moto.port))
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": proxy.endpoint,
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",  # `ray start --head` turns token auth on (FIELD_NOTES)
            "PYTHONPATH": str(REPO_ROOT),  # Ray workers import the user code by path
            "PREFECT_ML_ALLOWED_MODULES": "tests.fixtures",  # ... which the allow-list admits
        }
        if not cluster:
            yield Services(work, env, proxy)
            return
        ray_port, dashboard_port, prefect_port = _free_port(), _free_port(), _free_port()
        ray_temp = Path(tempfile.mkdtemp(prefix="chaos-ray-"))  # short: Ray's socket paths
        stack.callback(shutil.rmtree, ray_temp, ignore_errors=True)
        # Ray's own helpers (Ray Train's placement-group cleaner) find the cluster by
        # RAY_ADDRESS; without it they fail when other Ray clusters run on this machine.
        env["RAY_ADDRESS"] = f"127.0.0.1:{ray_port}"
        ray_head = _start(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block"]
            + ["--num-cpus", "2", "--port", str(ray_port), "--node-ip-address", "127.0.0.1"]
            + ["--temp-dir", str(ray_temp), "--include-dashboard", "true"]
            + ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)]
            + ["--disable-usage-stats"],
            env,
            work / "ray-head.log",
        )
        stack.callback(_stop_tree, ray_head)
        prefect = _start(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
            + ["--port", str(prefect_port)],
            {**env, "PREFECT_HOME": str(work / "prefect-server")},
            work / "prefect-server.log",
        )
        stack.callback(_stop_tree, prefect)
        api_url = f"http://127.0.0.1:{prefect_port}/api"
        _wait_until(lambda: _answers(f"{api_url}/health"), 180, "the Prefect server")
        _wait_until(
            lambda: _answers(f"http://127.0.0.1:{dashboard_port}/api/version"), 180, "Ray's head"
        )
        env["PREFECT_API_URL"] = api_url
        env["PREFECT_ML_RAY_ADDRESS"] = f"127.0.0.1:{ray_port}"
        yield Services(work, env, proxy, ray_head)


# ---------------------------------------------------------------------------------------------
# Invariant checks: only the CLI's public results (MLflow, Optuna, storage) are read


def _verify_checkpoints(root_url: str) -> tuple[list[str], dict[str, list[int]]]:
    """Check every visible checkpoint under ``root_url`` against its manifest.

    Returns (violations, committed epochs by checkpoint directory).
    """
    from prefect_ml.integrations import storage

    fs, root = storage.filesystem(root_url)
    fs.invalidate_cache()
    problems: list[str] = []
    committed: dict[str, list[int]] = {}
    for manifest_path in sorted(fs.glob(f"{root}/**/MANIFEST.json")):
        url = root_url + manifest_path[len(root) :].rsplit("/MANIFEST.json", 1)[0]
        try:
            manifest = json.loads(storage.read_bytes(f"{url}/MANIFEST.json"))
        except ValueError:
            problems.append(f"{url}: MANIFEST.json is not valid JSON")
            continue
        for name, expected in manifest.get("files", {}).items():
            try:
                data, digest = storage.read_bytes_and_sha256(f"{url}/{name}")
            except FileNotFoundError:
                problems.append(f"{url}/{name}: listed in the manifest but missing")
                continue
            if len(data) != expected["size"] or digest != expected["sha256"]:
                problems.append(f"{url}/{name}: does not match its manifest")
        directory, _, epoch = url.rpartition("/epoch-")
        committed.setdefault(directory, []).append(int(epoch))
    return problems, committed


def _incomplete_uploads(url: str) -> list[str]:
    from prefect_ml.integrations import storage

    if not url.startswith("s3://"):
        return []
    fs, path = storage.filesystem(url)
    bucket, _, prefix = path.partition("/")
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    return [f"incomplete upload left: {u['Key']}" for u in uploads.get("Uploads", [])]


def _epoch_history_problems(client: Any, run: Any, expected: list[int]) -> list[str]:
    """No metric of the run logged twice at one step (an epoch; 0 for the test metrics), and
    val_loss logged for every epoch."""
    problems = []
    name = run.info.run_name
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        repeated = sorted(s for s, n in Counter(steps).items() if n > 1)
        if repeated:
            problems.append(f"run {name}: metric {key} logged more than once at steps {repeated}")
    val_steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "val_loss")})
    if val_steps != expected:
        problems.append(f"run {name}: val_loss logged for epochs {val_steps}, expected {expected}")
    return problems


def _mlflow(home: Path) -> Any:
    from prefect_ml.integrations import tracking

    return tracking.client_for(f"sqlite:///{home / 'mlflow.db'}")


def check_training(home: Path, storage_url: str) -> tuple[list[str], list[str]]:
    """(violations, notes) for a completed ``prefect-ml train`` in ``home``."""
    import mlflow
    import numpy as np

    from tests.fixtures.user_code import blobs

    client = _mlflow(home)
    problems: list[str] = []
    notes: list[str] = []
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    if not runs:
        return ["no MLflow run in the experiment"], notes
    if len(runs) > 1:
        notes.append(f"{len(runs)} MLflow runs (a kill after a run finished starts a new one)")
    for run in runs:
        if run.info.status != "FINISHED":
            problems.append(f"run {run.info.run_name} is {run.info.status}, not FINISHED")
        problems += _epoch_history_problems(client, run, list(range(1, EPOCHS + 1)))
    bad, committed = _verify_checkpoints(f"{storage_url}/checkpoints")
    problems += bad
    problems += _incomplete_uploads(storage_url)
    if not committed:
        problems.append("no committed checkpoint")
    versions = client.search_model_versions(f"name='{MODEL_NAME}'")
    if len(versions) != len(runs):
        notes.append(f"{len(versions)} registered versions for {len(runs)} runs")
    try:
        holder = client.get_model_version_by_alias(MODEL_NAME, "champion")
    except Exception as exc:  # noqa: BLE001 - any failure to resolve the alias is the finding
        return [*problems, f"no champion alias: {exc}"], notes
    if holder.run_id not in {run.info.run_id for run in runs}:
        problems.append(f"champion v{holder.version} comes from an unknown run {holder.run_id}")
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    try:
        model = mlflow.pytorch.load_model(f"models:/{MODEL_NAME}@champion")
        import torch

        features, _labels = blobs(rows=6)
        with torch.no_grad():
            output = model(torch.from_numpy(features.astype(np.float32))).numpy()
        if output.shape != (6, 3) or not np.isfinite(output).all():
            problems.append(f"champion v{holder.version} predicts {output.shape} / non-finite")
    except Exception as exc:  # noqa: BLE001 - a model that does not load is the finding
        problems.append(f"champion v{holder.version} does not load: {exc!r}")
    return problems, notes


def check_campaign(home: Path, storage_url: str) -> tuple[list[str], list[str]]:
    """(violations, notes) for a completed ``prefect-ml sweep`` in ``home``."""
    import optuna
    from optuna.trial import TrialState

    from prefect_ml.integrations import tracking

    problems: list[str] = []
    notes: list[str] = []
    storage = f"sqlite:///{home / 'optuna.db'}"
    names = optuna.get_all_study_names(storage)
    if len(names) != 1:
        return [f"expected one study, found {names}"], notes
    trials = optuna.load_study(study_name=names[0], storage=storage).get_trials()
    states = Counter(t.state.name for t in trials)
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    if len(finished) != SWEEP_TRIALS:
        problems.append(f"{len(finished)} finished trials, expected {SWEEP_TRIALS}: {states}")
    if states["RUNNING"] or states["WAITING"]:
        problems.append(f"trials left unfinished: {states}")
    if states["FAIL"]:
        notes.append(f"{states['FAIL']} FAIL trials (interrupted attempts, retried)")
    client = _mlflow(home)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(
        experiments, f"tags.`{tracking.CAMPAIGN_PARENT_TAG}` LIKE '%'", max_results=1000
    )
    if len(parents) != 1:
        return [*problems, f"{len(parents)} campaign parent runs, expected 1"], notes
    parent = parents[0]
    if parent.info.status != "FINISHED":
        problems.append(f"the parent run is {parent.info.status}")
    children = client.search_runs(
        experiments, f"tags.`{tracking.PARENT_TAG}` = '{parent.info.run_id}'", max_results=1000
    )
    by_trial = Counter(run.data.tags.get(tracking.TRIAL_TAG) for run in children)
    for trial in finished:
        if by_trial[str(trial.number)] != 1:
            problems.append(f"trial {trial.number}: {by_trial[str(trial.number)]} MLflow runs")
    for run in children:
        if run.info.status == "RUNNING":
            problems.append(f"trial run {run.info.run_name} left RUNNING")
        number = int(run.data.tags.get(tracking.TRIAL_TAG, -1))
        if any(t.number == number and t.state == TrialState.COMPLETE for t in trials):
            problems += _epoch_history_problems(client, run, list(range(1, EPOCHS + 1)))
    bad, _committed = _verify_checkpoints(f"{storage_url}/campaigns")
    return problems + bad + _incomplete_uploads(storage_url), notes


# ---------------------------------------------------------------------------------------------
# The checkpoint writer of ``upload-kill`` (run in its own process: ``--write-checkpoints URL``)


def checkpoint_files(seed: int, epoch: int) -> dict[str, bytes]:
    """The deterministic files of one epoch: state (multipart-sized every other epoch), metrics."""
    import numpy as np

    from prefect_ml.integrations import storage

    generator = np.random.default_rng([seed, epoch])
    multipart = 2 * storage.S3_PART_SIZE + 2**20  # over two parts: a multipart upload
    size = multipart if epoch % 2 == 0 else 256 * 2**10
    metrics = {"epoch": epoch, "val_loss": float(generator.random())}
    return {
        "state.bin": generator.bytes(size),
        "metrics.json": json.dumps(metrics).encode(),
    }


def write_checkpoints(url: str, seed: int) -> None:
    """What a training run does with its checkpoints, without the training: abort a dead
    writer's uploads, resume after the newest verified checkpoint, commit and prune each epoch."""
    from prefect_ml.integrations import storage
    from prefect_ml.integrations.storage import CheckpointStore, RetentionPolicy

    storage.abort_incomplete_uploads(url)
    store = CheckpointStore(url)
    latest = store.latest()
    policy = RetentionPolicy(keep_last=2, metric="val_loss")
    for epoch in range((latest.epoch if latest else 0) + 1, UPLOAD_EPOCHS + 1):
        store.save(epoch, checkpoint_files(seed, epoch))
        store.prune(policy)


def check_uploads(url: str, seed: int) -> tuple[list[str], list[str]]:
    problems, committed = _verify_checkpoints(url)
    epochs = sorted(e for found in committed.values() for e in found)
    if epochs != list(range(1, UPLOAD_EPOCHS + 1)):
        problems.append(f"committed epochs {epochs}, expected 1..{UPLOAD_EPOCHS}")
    from prefect_ml.integrations import storage

    for epoch in epochs:  # the newest two kept their state: it is this epoch's, not a stale one
        base = f"{url}/epoch-{epoch:06d}"
        listed = json.loads(storage.read_bytes(f"{base}/MANIFEST.json"))["files"]
        if "state.bin" in listed:
            expected = hashlib.sha256(checkpoint_files(seed, epoch)["state.bin"]).hexdigest()
            if listed["state.bin"]["sha256"] != expected:
                problems.append(f"{base}/state.bin is not epoch {epoch}'s state")
    return problems + _incomplete_uploads(url), []


# ---------------------------------------------------------------------------------------------
# Driving: run, kill, rerun


@dataclass
class Tally:
    """One scenario's counts."""

    scenario: str
    iterations: int = 0
    kills: int = 0
    runs: int = 0
    reruns: int = 0
    failed_runs: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)
    kill_delays_s: list[float] = field(default_factory=list)
    iteration_seconds: list[float] = field(default_factory=list)
    calibration_s: float = 0.0
    s3_requests: dict[str, int] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        seconds = sum(self.iteration_seconds)
        return {
            "scenario": self.scenario,
            "iterations": self.iterations,
            "kills": self.kills,
            "runs": self.runs,
            "reruns": self.reruns,
            "failed_runs": self.failed_runs,
            "violations": self.violations,
            "violation_count": len(self.violations),
            "notes": dict(self.notes),
            "calibration_s": round(self.calibration_s, 1),
            "s3_requests": self.s3_requests,
            "seconds": round(seconds, 1),
            "seconds_per_kill": round(seconds / self.kills, 1) if self.kills else None,
        }


def _tail(log: Path, chars: int = 2500) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group the command leads (see the module docstring)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def _started(command: list[str], env: dict[str, str], log: Path) -> Iterator[Any]:
    """The command running in its own process group, its output appended to ``log``; killed
    on the way out if it still runs (a timeout, or this harness stopping)."""
    with log.open("ab") as output:
        output.write(f"\n=== {' '.join(command)}\n".encode())
        output.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, which a kill takes down
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            _kill_group(process)


def _killed_after(process: subprocess.Popen[bytes], delay: float) -> bool:
    """SIGKILL the command ``delay`` seconds from now unless it exits first; whether it did."""
    try:
        process.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        return True
    return False


def drive(
    command: list[str],
    env: dict[str, str],
    log: Path,
    rng: random.Random,
    tally: Tally,
    horizon_s: float,
    *,
    kill: Callable[[subprocess.Popen[bytes], float], int] | None = None,
) -> bool:
    """Run ``command`` until it exits 0, killing it at random moments; True when it completed.

    The first run is killed at a uniform moment in (0, horizon_s); each rerun again with
    probability ``REKILL``. ``kill(process, delay)`` replaces the CLI kill (worker-kill): it
    kills something else and returns how many it killed; the command must finish by itself.
    """
    kills = failures = 0
    first = True
    while True:
        tally.runs += 1
        tally.reruns += not first
        should_kill = kills < MAX_KILLS and (first or rng.random() < REKILL)
        first = False
        delay = rng.uniform(0.0, horizon_s)
        with _started(command, env, log) as process:
            killed = int(should_kill) and (
                kill(process, delay) if kill else int(_killed_after(process, delay))
            )
            if killed:
                kills += killed
                tally.kills += killed
                tally.kill_delays_s.append(round(delay, 2))
            if killed and kill is None:
                continue
            try:
                returncode = process.wait(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                returncode = -1
        if returncode == 0:
            return True
        failures += 1
        tally.failed_runs += 1
        tally.violations.append(
            {
                "invariant": "the command completes"
                + (" (worker kills within --max-failures)" if kill else ""),
                "iteration": tally.iterations,
                "exit_code": returncode,
                "log_tail": _tail(log),
            }
        )
        if failures >= MAX_FAILED_RERUNS:
            return False
        kill, kills = None, MAX_KILLS  # after a failed run, the rerun is left undisturbed


def _train_workers(services: Services) -> list[Any]:
    """The Ray Train worker processes of our Ray head."""
    import psutil

    found = []
    for process in services.ray_processes():
        with contextlib.suppress(psutil.NoSuchProcess):
            if "RayTrainWorker" in " ".join(process.cmdline()):
                found.append(process)
    return found


def _worker_window(services: Services, windows: list[float]) -> Callable[..., int]:
    """For calibration: record how long the worker group lives; kills nothing."""

    def observe(process: subprocess.Popen[bytes], _delay: float) -> int:
        seen: list[float] = []
        while process.poll() is None:
            if _train_workers(services):
                seen.append(time.monotonic())
            time.sleep(0.2)
        windows.append(seen[-1] - seen[0] if seen else 0.0)
        return 0

    return observe


def _worker_killer(services: Services, rng: random.Random, horizon_s: float) -> Callable[..., int]:
    """Kill one Ray Train worker ``delay`` seconds after the group is up, then again (a new
    group, a new random delay) up to a random 1..``MAX_FAILURES - 1`` kills a run."""
    import psutil

    def kill(process: subprocess.Popen[bytes], delay: float) -> int:
        seen: set[int] = set()  # workers of the groups already hit
        kills, budget = 0, rng.randint(1, MAX_FAILURES - 1)
        while kills < budget and process.poll() is None:
            live = [w for w in _train_workers(services) if w.pid not in seen]
            if len(live) < 2:  # the group (2 workers) is not up yet, or is restarting
                time.sleep(0.2)
                continue
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and process.poll() is None:
                time.sleep(0.1)
            victim = rng.choice(live)
            try:
                victim.kill()
            except psutil.NoSuchProcess:
                break  # training ended (or the group restarted) first
            print(f"    killed Ray Train worker {victim.pid} {delay:.1f}s into its group")
            kills += 1
            seen.update(w.pid for w in live)  # the next kill waits for the restarted group
            delay = rng.uniform(0.0, horizon_s)
        return kills

    return kill


def _cli(arguments: list[str]) -> list[str]:
    return [sys.executable, "-m", "prefect_ml.flows.cli", *arguments]


def _s3_requests(proxy: Any) -> dict[str, int]:
    """Requests the proxy has forwarded, and failed on purpose, so far."""
    return {"forwarded": proxy.forwarded, "503": proxy.slow_downs, "reset": proxy.resets}


def run_scenario(
    name: str, services: Services, rng: random.Random, kills_wanted: int, seed: int
) -> Tally:
    """Iterate ``name`` until it has ``kills_wanted`` kills; the first iteration calibrates the
    kill horizon (one undisturbed run) and is checked like the others."""
    tally = Tally(name)
    horizon = 0.0
    proxy = services.proxy
    before = _s3_requests(proxy)
    while tally.kills < kills_wanted:
        tally.iterations += 1
        iteration = f"{name}-{tally.iterations:03d}"
        home = services.work / iteration
        home.mkdir()
        log = home / "commands.log"
        on_s3 = name in ("s3-faults", "upload-kill")
        storage_url = f"s3://{BUCKET}/{iteration}" if on_s3 else (home / "storage").as_uri()
        env = {**services.env, "PREFECT_ML_HOME": str(home)}
        if on_s3:
            env["PREFECT_ML_STORAGE_URL"] = storage_url
        services.proxy.rate = S3_FAULT_RATE if name == "s3-faults" else 0.0
        check: Callable[[], tuple[list[str], list[str]]]
        if name == "upload-kill":
            command = [sys.executable, str(Path(__file__)), "--write-checkpoints", storage_url]
            command += ["--seed", str(seed)]
            check = functools.partial(check_uploads, storage_url, seed)
        elif name == "sweep-kill":
            command = _cli(SWEEP_COMMAND)
            check = functools.partial(check_campaign, home, storage_url)
        else:
            command = _cli(TRAIN_COMMAND)
            check = functools.partial(check_training, home, storage_url)
        started = time.monotonic()
        if not horizon:  # calibration: one undisturbed run, how long it (its workers) lasted
            windows: list[float] = []
            completed = drive(
                command, env, log, rng, tally, 0.0, kill=_worker_window(services, windows)
            )
            horizon = tally.calibration_s = time.monotonic() - started
            if name == "worker-kill":  # kill inside the group's life, which includes its exit
                horizon = max(0.6 * windows[0], 1.0)
            print(f"  calibration: {tally.calibration_s:.0f}s a run, kills within {horizon:.1f}s")
        elif name == "worker-kill":
            killer = _worker_killer(services, rng, horizon)
            completed = drive(command, env, log, rng, tally, horizon, kill=killer)
        else:
            completed = drive(command, env, log, rng, tally, horizon)
        problems, notes = check() if completed else ([], [])
        tally.notes.update(notes)
        for problem in problems:
            tally.violations.append(
                {"invariant": problem, "iteration": tally.iterations, "home": str(home)}
            )
        seconds = time.monotonic() - started
        tally.iteration_seconds.append(seconds)
        print(
            f"  {iteration}: kills {tally.kills}/{kills_wanted}, runs {tally.runs}, "
            f"violations {len(tally.violations)}, {seconds:.0f}s"
            + (f"  NEW: {problems}" if problems else ""),
            flush=True,
        )
        if not problems and completed:
            shutil.rmtree(home, ignore_errors=True)
            _remove_prefix(storage_url)
    after = _s3_requests(proxy)
    tally.s3_requests = {kind: after[kind] - before[kind] for kind in after}
    return tally


def _remove_prefix(url: str) -> None:
    """Drop an iteration's S3 objects: moto keeps them in this process's memory."""
    if url.startswith("s3://"):
        from prefect_ml.integrations import storage

        fs, path = storage.filesystem(url)
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="kills per scenario")
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="repeatable")
    parser.add_argument(
        "--kills-of",
        action="append",
        default=[],
        metavar="SCENARIO=N",
        help="kills for one scenario instead of --kills (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=None, help="replay a run's kill points")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "chaos.json")
    parser.add_argument("--write-checkpoints", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    if args.write_checkpoints:
        write_checkpoints(args.write_checkpoints, seed)
        return {}
    print(f"chaos seed {seed} (replay with --seed {seed})", flush=True)
    # A SIGTERM (a background job cannot get SIGINT) stops the run and what it started, cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scenarios = args.scenario or list(SCENARIOS)
    kills = {name: args.kills for name in scenarios}
    for override in args.kills_of:
        name, _, count = override.partition("=")
        if name not in kills or not count.isdigit():
            parser.error(f"--kills-of {override}: expected SCENARIO=N with one of {scenarios}")
        kills[name] = int(count)
    started = time.monotonic()
    tallies = []
    # Iterations that pass delete their home; those with a violation keep it here to inspect.
    work = Path(tempfile.mkdtemp(prefix=f"prefect-ml-chaos-{seed}-"))
    with services(work, cluster=scenarios != ["upload-kill"]) as shared:
        for name in scenarios:
            print(f"{name}: {kills[name]} kills", flush=True)
            rng = random.Random(f"{seed}:{name}")
            tallies.append(run_scenario(name, shared, rng, kills[name], seed))
    if any(t.violations for t in tallies):
        print(f"homes of the iterations with violations: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "seed": seed,
        "kills_per_scenario": kills,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "s3_fault_rate": S3_FAULT_RATE,
        "scenarios": [t.report() for t in tallies],
    }
    table = [
        "| scenario | iterations | kills | reruns | violations | s/kill |",
        "|---|---|---|---|---|---|",
    ]
    for t in report["scenarios"]:
        table.append(
            f"| {t['scenario']} | {t['iterations']} | {t['kills']} | {t['reruns']} "
            f"| {t['violation_count']} | {t['seconds_per_kill']} |"
        )
    save_report(report, args.output, "\n".join(table))
    return report


if __name__ == "__main__":
    main()
