"""Small waits, probes and fixtures-in-code shared by the tests."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.datasets import ArrayShard
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.training import EpochTrainer
from tests.fixtures.user_code import blobs

REPO_ROOT = Path(__file__).resolve().parents[1]

if TYPE_CHECKING:
    import psutil


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_while_running(
    process: subprocess.Popen[bytes],
    log: Path,
    condition: Callable[[], bool],
    timeout: float,
    what: str,
) -> None:
    """:func:`wait_for` ``condition`` while ``process`` runs; a process that exits first, or a
    timeout, fails at once with the end of the process's ``log`` (what it was doing)."""
    held = False

    def held_or_exited() -> bool:
        # What held is remembered, not asked again: a moment the test waits for (a trial
        # mid-way) may have passed by the time a second look comes.
        nonlocal held
        held = condition()
        return held or process.poll() is not None

    try:
        wait_for(held_or_exited, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the command's log ends:\n{_tail(log)}") from None
    if not held:
        raise AssertionError(
            f"the command exited ({process.returncode}) before {what}; its log ends:\n{_tail(log)}"
        )


def _tail(log: Path, characters: int = 4000) -> str:
    return log.read_text(errors="replace")[-characters:] if log.exists() else "(no log)"


def start_job(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``command`` from the checkout in its own process group, as a shell starts a job (a
    signal to the group reaches everything it started); its output in ``log``."""
    with log.open("wb") as output:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def cli_env(home: Path, *, own_ray: bool = False, **settings: str) -> dict[str, str]:
    """This process's environment for a ``prefect-ml`` command on the project home ``home``,
    reporting to the session's Prefect server (``PREFECT_API_URL``) instead of starting an
    ephemeral API of its own (13-24 s a command), and joining the session's Ray
    (``ray_cluster``) through ``PREFECT_ML_RAY_ADDRESS`` as a command joins a cluster, instead
    of starting a local Ray (10-11 s to start, 1.5 s to stop). ``own_ray``: a local Ray of the
    command's own, for a test of what the command starts and stops (a SIGKILL takes it along).
    ``settings`` are added last."""
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    assert api_url, "cli_env needs the session's Prefect server (tests/conftest.py)"
    env = {**os.environ, "PREFECT_ML_HOME": str(home), "PREFECT_API_URL": api_url}
    if not own_ray:
        import ray

        assert ray.is_initialized(), "cli_env joins the session's Ray: use the ray_cluster fixture"
        env["PREFECT_ML_RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    return {**env, **settings}


def cold_env(home: Path) -> dict[str, str]:
    """This process's environment for a ``prefect-ml`` command on the project home ``home`` as a
    newcomer runs it: none of the session's Prefect, MLflow or prefect-ml settings, no
    credentials, so it starts its own local Ray and Prefect API."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")
        and not k.startswith(("PREFECT_ML_", "PREFECT_API_AUTH", "PREFECT_SERVER_API_AUTH"))
    }
    env["PREFECT_ML_HOME"] = str(home)
    return env


def flow_run_artifacts(flow_run_id: str) -> dict[str, str]:
    """The artifacts a flow run published on the session's Prefect API, by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {artifact.key: str(artifact.data) for artifact in found if artifact.key}


def committed_epochs(storage_dir: Path) -> list[int]:
    """Epochs with a committed end-of-epoch checkpoint (manifest written) anywhere under
    ``storage_dir``; mid-epoch checkpoints (``epoch-000003-step-000040``) are not counted."""
    manifests = storage_dir.glob("checkpoints/*/*/epoch-*/MANIFEST.json")
    epochs = (manifest.parent.name.removeprefix("epoch-") for manifest in manifests)
    return sorted(int(epoch) for epoch in epochs if epoch.isdigit())


def resume_point(storage_dir: Path) -> int:
    """The epochs fully trained at the newest checkpoint with weights anywhere under
    ``storage_dir`` (what a resume starts after): an epoch end counts its epoch, a mid-epoch
    checkpoint the epoch before; epochs that committed their metrics only (the checkpoint
    budget's) or were pruned are no resume point. 0 when there is none."""
    points = [0]
    for manifest in storage_dir.glob("checkpoints/*/*/epoch-*/MANIFEST.json"):
        if json.loads(manifest.read_text()).get("pruned"):
            continue
        epoch, _, step = manifest.parent.name.removeprefix("epoch-").partition("-step-")
        points.append(int(epoch) - 1 if step else int(epoch))
    return max(points)


def linked_venv(folder: Path, packages: Path) -> Path:
    """A new virtual environment (no pip) at ``folder`` whose site-packages adds ``packages``,
    a folder of links to installed distributions, as a site directory; returns its python."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "linked_packages.pth").write_text(
        f"import site; site.addsitedir({str(packages)!r})\n"
    )
    return python


# Ports a test hands to a server it starts later: below the kernel's ephemeral range (32768-60999
# here), so that no process asking the kernel for any port (Ray's agents and metrics, an outgoing
# connection) is given it between the pick and the server's bind; above Ray's worker ports
# (10002-19999).
_LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port free now that only a deliberate bind can take before the test uses it."""
    for port in random.sample(_LISTEN_PORTS, 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {_LISTEN_PORTS}")


def register_classifier(
    settings: PrefectMLSettings,
    model_name: str,
    features: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int,
    feature_names: list[str] | None = None,
    alias: str | None = "champion",
    wrap: Callable[[Any], Any] | None = None,
) -> str:
    """Fit a small MLP in-process (a second of full-batch Adam) and register it as our registry
    step does: standardiser inside, schema tags on the version (``wrap``, if given, wraps the
    network that is registered). Returns the version number."""
    import torch

    from prefect_ml.integrations import datasets, tracking

    torch.manual_seed(seed)
    mean, std = features.mean(axis=0), features.std(axis=0) + 1e-6
    model = datasets.build_model("mlp", [features.shape[1]], int(labels.max()) + 1, {"hidden": 32})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    inputs = torch.from_numpy(((features - mean) / std).astype(np.float32))
    targets = torch.from_numpy(labels.astype(np.int64))
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    client = tracking.client_for(settings.resolved_tracking_uri)
    experiment = tracking.ensure_experiment(client, "serving-tests", settings.mlflow_artifact_root)
    run_id = client.create_run(experiment).info.run_id
    classes = [str(c) for c in range(int(labels.max()) + 1)]
    registered = datasets.with_standardizer(model, mean, std, [features.shape[1]])
    version = tracking.log_and_register_model(
        client,
        settings.resolved_tracking_uri,
        run_id,
        wrap(registered) if wrap else registered,
        features[:3].astype(np.float32),
        model_name=model_name,
        tags={
            tracking.FINGERPRINT_TAG: f"fingerprint-{seed}",
            tracking.SAMPLE_SHAPE_TAG: json.dumps([features.shape[1]]),
            tracking.CLASS_NAMES_TAG: json.dumps(classes),
            **({tracking.FEATURE_NAMES_TAG: json.dumps(feature_names)} if feature_names else {}),
        },
    )
    client.set_terminated(run_id)
    if alias:
        tracking.set_alias(client, model_name, alias, version)
    return version


def blob_trainer(checkpoint_url: str, device: Any = None, **config: Any) -> EpochTrainer:
    """A one-process trainer of a small linear model on blobs (on ``device``, the CPU by
    default), checkpointing to the URL."""
    features, labels = blobs(rows=90, features=4)
    shard = ArrayShard(features.astype(np.float32), labels.astype(np.int64))
    defaults: dict[str, Any] = {
        "splits_url": "",
        "sample_shape": [4],
        "num_classes": 3,
        "model": "tests.fixtures.user_code:linear_model",
        "model_options": {},
        "epochs": 5,
        "batch_size": 16,
        "lr": 0.05,
        "optimizer": "adam",
        "weight_decay": 0.0,
        "scheduler": "none",
        "seed": 0,
        "keep_checkpoints": 100,  # every epoch keeps its weights
        "checkpoint_url": checkpoint_url,
        "tracking_uri": "",
        "run_id": "",
    }
    return EpochTrainer(
        TrainLoop.from_options(**{**defaults, **config}),
        device=device,
        shards={"train": shard, "val": shard},
    )


def latest_failed_flow_run_message() -> str:
    """The state message of the flow run that started last on the session's Prefect API,
    which must have failed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (latest,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
    assert latest.state is not None
    assert latest.state.is_failed(), latest.state
    return str(latest.state.message)


class _CpuHolder:
    def ready(self) -> None:
        return None


@contextlib.contextmanager
def holding_cpus(cpus: float) -> Iterator[None]:
    """Other work on the session Ray: a started actor holding ``cpus`` CPUs, killed when the
    block ends."""
    import ray

    holder = ray.remote(num_cpus=cpus)(_CpuHolder).remote()
    try:
        ray.get(holder.ready.remote(), timeout=120)
        yield
    finally:
        ray.kill(holder)


def ray_train_workers() -> list[psutil.Process]:
    """The live Ray Train worker processes of this session's Ray (not of other Rays here)."""
    import psutil
    import ray
    from ray.util.state import list_actors

    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
    )
    return [psutil.Process(actor.pid) for actor in actors]


def in_gloo_group(
    rank: int, world_size: int, port: int, work: Callable[..., None], *args: Any
) -> None:
    """``work(rank, world_size, *args)`` as one member of a gloo group, which it then leaves.

    Destroying the group does not always free it: DDP keeps it alive (torch holds it from C++),
    FSDP's device meshes too, and with it gloo's worker threads. One that releases a finished
    collective's tensor while the interpreter shuts down takes the GIL then, and aborts the
    process ("terminate called without an active exception"). So a worker that succeeded ends
    without the interpreter's shutdown, as a forked multiprocessing child does; one that failed
    ends the usual way, its traceback reported.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        work(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def docs_hook(name: str) -> ModuleType:
    """A docs hook module (docs/hooks/<name>.py), loaded by path as mkdocs loads it."""
    path = REPO_ROOT / "docs" / "hooks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def serve_applications_deleted_after() -> Iterator[None]:
    """Every Ray Serve application is deleted when the block ends, however it ends (the
    replicas' CPUs freed for the tests that train); Serve itself, its controller and proxy,
    keeps listening on the session's ``serve_port`` for the next test that serves."""
    from ray import serve

    try:
        yield
    finally:
        for name in serve.status().applications:
            serve.delete(name)
