"""Cluster: the same training and campaign on 1 node vs 3 nodes of a local Ray cluster (the same
2 CPUs), the per-node and per-trial costs around them, and Optuna on PostgreSQL vs SQLite.

The cluster is ``tests/cluster.py``'s: real ``ray start`` nodes, each in its own mount namespace
with the checkout hidden, so prefect-ml reaches them only by being shipped with the job.

* ``1-node``: a head with 2 CPUs alone (the driver's Ray Train workers and trials all run there);
* ``3-nodes``: a head with 0 CPUs and two worker nodes of 1 CPU each (127.0.0.2, 127.0.0.3).

Per topology, in order: the nodes start (each ``ray start`` until ``ray status`` counts it);
an untimed bare connect (this process's first-``ray.init`` costs); the driver connects twice
through ``ray_session`` (the first connect zips and uploads prefect-ml, the second finds it in
the cluster by its content hash), and after each connect a task runs on every node twice (the
first one on a node sets up the job's runtime env there, downloading and unpacking the code on
a fresh cluster, and starts a worker); then ``prefect_ml.train`` (digits MLP, 2 workers, E
epochs, DDP over gloo) runs once (reported apart: the first fit on the fresh cluster) and then
``trainings`` times (medians), and ``prefect_ml.campaign`` (N trials of the digits MLP, 2 at a
time, random sampler with seed 0, no pruning, study on PostgreSQL) once after an untimed
2-trial warm-up campaign. The trainings and campaigns run inside the second connection, so
their numbers leave the connect out. For each training, ``training.fit`` is timed from its
call; the first epoch's checkpoint manifest (``created_unix``, written by the worker on its
node) gives the time to the first committed epoch, and minus that epoch's ``epoch_seconds``
the worker-group start.

Shared by both topologies, started once: moto's S3 server (a child process) holds the
checkpoints, datasets and MLflow artifacts; a real ``mlflow server`` (SQLite backend) tracks;
PostgreSQL (``tests/postgres.py``, durable defaults) holds the campaigns' studies.

Also measured here, once: Optuna ask+tell on PostgreSQL vs SQLite at 1, 2 and 8 concurrent
writers (``benchmarks.study_storage.ask_tell_latency``); a coordinator's study work per trial
on each (one writer: TPE ask, per-epoch report and ``should_prune``, tell); MLflow writes per
second (an epoch's ``log_batch``, one thread and 8 threads, and a campaign trial's whole record)
against the server and against SQLite directly; and the checkpoint commit
(``CheckpointStore.save`` to moto) per size.

Run ``.venv/bin/python benchmarks/cluster.py`` (``--quick``: fewer epochs and trials, a smoke
run written to ``results/cluster.quick.json``). All state lives in a temporary project home.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

if TYPE_CHECKING:
    from prefect_ml.tasks.campaign.results import CampaignResult
    from prefect_ml.tasks.data import PreparedData
    from prefect_ml.tasks.train import TrainResult

# name -> (head CPUs, worker nodes as (name, CPUs)); both have 2 CPUs for training and trials.
TOPOLOGIES: dict[str, tuple[int, tuple[tuple[str, int], ...]]] = {
    "1-node": (2, ()),
    "3-nodes": (0, (("node-a", 1), ("node-b", 1))),
}
WORKERS = 2  # Ray Train workers per training
CONCURRENCY = 2  # trials at a time
MB = 10**6
SEARCH_SPACE = {
    "lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
    "hidden": {"type": "int", "low": 32, "high": 128},
}


@dataclass(frozen=True)
class Sizes:
    epochs: int  # per training
    trainings: int  # per topology, after a first one (reported apart)
    trials: int  # per campaign
    trial_epochs: int
    writers: tuple[int, ...]  # concurrent Optuna writers
    study_trials: int  # ask+tell rounds per storage and writer count, split between the writers
    commit_mb: tuple[int, ...]  # checkpoint sizes
    commit_repeats: int
    mlflow_seconds: float  # per MLflow arm
    coordinator_trials: int  # trials of the one-writer study loop, per storage


FULL = Sizes(6, 3, 16, 3, (1, 2, 8), 256, (1, 10, 100), 3, 3.0, 128)
QUICK = Sizes(3, 1, 4, 2, (1, 2), 64, (1, 10), 1, 1.0, 16)


# --- Optuna storage, MLflow, checkpoints: once -----------------------------------------------


def study_storage_runs(pg_url: str, sqlite_url: str, sizes: Sizes) -> list[dict[str, Any]]:
    """Ask+tell on both storages at each writer count (``study_storage``'s measurement)."""
    from benchmarks.study_storage import ask_tell_latency

    runs = []
    for storage, url in (("postgresql", pg_url), ("sqlite", sqlite_url)):
        for writers in sizes.writers:
            run = ask_tell_latency(url, writers, max(4, sizes.study_trials // writers))
            runs.append({"storage": storage, **run})
            print(f"  optuna {storage}, {writers} writers: p50 {run['p50_ms']:.1f} ms", flush=True)
    return runs


def coordinator_costs(url: str, trials: int, epochs: int) -> dict[str, Any]:
    """What a campaign's coordinator asks of its study per trial, one writer, as it runs them:
    ``ask`` (TPE, seed 0, over the default search space), ``report`` + ``should_prune``
    (median pruner) after every epoch but the last, the last ``report`` and ``tell``. Medians
    (ms) over the first and the last quarter of ``trials``, since TPE and the pruner read the
    trials so far."""
    import random

    from prefect_ml.integrations.campaign import (
        distributions,
        make_pruner,
        make_sampler,
        open_study,
    )
    from prefect_ml.tasks.params import default_search_space

    space = {n: d.model_dump(exclude_none=True) for n, d in default_search_space().items()}
    dimensions = distributions(space)
    study = open_study(
        url,
        f"coordinator-{time.time_ns()}",
        {"val_accuracy": "maximize"},
        make_sampler("tpe", 0),
        make_pruner("median", epochs),
    )
    values = random.Random(0)
    rows: list[tuple[float, float, float]] = []
    for _ in range(trials):
        began = time.perf_counter()
        trial = study.ask(dimensions)
        asked = time.perf_counter()
        for epoch in range(1, epochs):
            trial.report(values.random(), epoch)
            trial.should_prune()
        reported = time.perf_counter()
        value = values.random()
        trial.report(value, epochs)
        study.tell(trial, value)
        rows.append((asked - began, reported - asked, time.perf_counter() - reported))
    quarter = max(1, trials // 4)

    def medians(part: list[tuple[float, float, float]]) -> dict[str, float]:
        ask, report, tell = (1000 * statistics.median(column) for column in zip(*part, strict=True))
        return {
            "ask_ms": ask,
            "epochs_ms": report,
            "tell_ms": tell,
            "total_ms": ask + report + tell,
        }

    last = medians(rows[-quarter:])
    return {
        "trials": trials,
        "epochs": epochs,
        "first_quarter": medians(rows[:quarter]),
        "last_quarter": last,
        "trials_per_s_at_end": 1000 / last["total_ms"],
    }


def _epoch_metrics(epoch: int) -> dict[str, float]:
    """What one epoch logs (the metrics our training and trials log per epoch)."""
    names = (
        "train_loss",
        "val_loss",
        "val_accuracy",
        "samples_per_second",
        "epoch_seconds",
        "checkpoint_blocking_seconds",
        "workers",
        "peak_memory_mib",
        "lr",
    )
    return {name: 1.0 / (epoch + index + 1) for index, name in enumerate(names)}


def _rate(call: Callable[[int], None], seconds: float, threads: int = 1) -> dict[str, float]:
    """Calls per second of ``call(i)`` repeated for ``seconds`` on ``threads`` threads, and the
    median latency of one call."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def loop(offset: int) -> None:
        done: list[float] = []
        index = offset
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            call(index)
            done.append(time.perf_counter() - began)
            index += threads
        with lock:
            latencies.extend(done)

    began = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(offset,)) for offset in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - began
    return {
        "calls": len(latencies),
        "per_second": len(latencies) / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "threads": threads,
    }


def mlflow_rates(tracking_uri: str, artifact_root: str | None, seconds: float) -> dict[str, Any]:
    """MLflow writes per second against ``tracking_uri``: an epoch's batch (9 metrics, 2 tags;
    ``tracking.log_epoch``) from 1 and 8 threads, and a trial's whole record (create the run
    with its params, 3 epochs, end it), as a campaign's writer thread makes them."""
    from prefect_ml.integrations import tracking
    from prefect_ml.tasks.params import CampaignParams
    from prefect_ml.tasks.training import flatten

    client = tracking.client_for(tracking_uri)
    experiment = tracking.ensure_experiment(
        client, f"bench-logging-{time.time_ns()}", artifact_root
    )
    parent = client.create_run(experiment, run_name="parent").info.run_id
    params = flatten(CampaignParams.model_validate({"sweep": {"search_space": SEARCH_SPACE}}))
    runs = [client.create_run(experiment, run_name=f"epochs-{i}").info.run_id for i in range(8)]

    def epoch_on(run_id: str) -> Callable[[int], None]:
        def log(index: int) -> None:
            tracking.log_epoch(client, run_id, index, _epoch_metrics(index), "s3://b/k")

        return log

    def trial(index: int) -> None:
        run_id = tracking.start_trial_run(client, experiment, parent, "bench", index, params)
        for epoch in range(1, 4):
            tracking.log_epoch(client, run_id, epoch, _epoch_metrics(epoch), "s3://b/k")
        tracking.end_trial_run(client, run_id, "COMPLETE", {"val_accuracy": 0.9})

    epoch_threads = {offset: epoch_on(runs[offset % 8]) for offset in range(8)}
    return {
        "params_per_trial": len(params),
        "log_epoch": _rate(epoch_on(runs[0]), seconds),
        # each thread logs to its own run, as separate trials or trainings do
        "log_epoch_8_threads": _rate(lambda i: epoch_threads[i % 8](i), seconds, threads=8),
        "trial_record": _rate(trial, seconds),
    }


def commit_times(storage_url: str, sizes: Sizes) -> list[dict[str, Any]]:
    """``CheckpointStore.save`` of a ``state.pt`` (random bytes) plus ``metrics.json`` per size:
    the median of the repeats after one untimed save."""
    from prefect_ml.integrations import storage
    from prefect_ml.integrations.storage import CheckpointStore

    rows = []
    for megabytes in sizes.commit_mb:
        payload = os.urandom(megabytes * MB)
        files = {"state.pt": payload, "metrics.json": json.dumps(_epoch_metrics(1)).encode()}
        store = CheckpointStore(storage.join(storage_url, f"commit-{megabytes}mb"))
        store.save(1, files)
        seconds = []
        for epoch in range(2, 2 + sizes.commit_repeats):
            began = time.perf_counter()
            store.save(epoch, files)
            seconds.append(time.perf_counter() - began)
        median = statistics.median(seconds)
        rows.append(
            {
                "mb": megabytes,
                "seconds": seconds,
                "median_s": median,
                "mb_per_s": megabytes / median,
            }
        )
        print(f"  commit {megabytes} MB: {median:.3f} s", flush=True)
    return rows


def shipped_package() -> dict[str, Any]:
    """What a job ships (prefect-ml and allowed user packages): files, zip size, hash time."""
    import tempfile

    from ray._private.runtime_env import packaging

    from prefect_ml.integrations import compute
    from prefect_ml.integrations.settings import get_settings

    plan = compute.plan_code(get_settings())
    packages = []
    for package in (plan.project, *plan.user):
        excludes = list(compute.EXCLUDES)
        began = time.perf_counter()
        packaging.get_uri_for_directory(str(package.path), True, excludes)
        hashed = time.perf_counter() - began
        with tempfile.TemporaryDirectory() as folder:
            target = Path(folder) / "package.zip"
            began = time.perf_counter()
            packaging.create_package(
                str(package.path), target, True, include_parent_dir=True, excludes=excludes
            )
            zipped = time.perf_counter() - began
            zip_bytes = target.stat().st_size
        packages.append(
            {
                "name": package.name,
                "file_bytes": package.size_bytes,
                "zip_bytes": zip_bytes,
                "hash_s": hashed,
                "zip_s": zipped,
            }
        )
    return {"describe": plan.describe(ship_project=True), "packages": packages}


# --- per topology ----------------------------------------------------------------------------


@contextlib.contextmanager
def timed_fits(fits: list[dict[str, float]]) -> Iterator[None]:
    """Record the wall-clock start and end of every ``training.fit`` call in ``fits``."""
    from prefect_ml.integrations import training

    original = training.fit

    def fit(*args: Any, **kwargs: Any) -> None:
        fits.append({"started_unix": time.time()})
        try:
            original(*args, **kwargs)
        finally:
            fits[-1]["ended_unix"] = time.time()

    training.fit = fit  # type: ignore[assignment]
    try:
        yield
    finally:
        training.fit = original  # type: ignore[assignment]


def probe_nodes() -> dict[str, Any]:
    """One task on every node (``on_each_node``), timed; the nodes' addresses."""
    from prefect_ml.integrations import compute
    from prefect_ml.integrations.compute import on_each_node

    began = time.perf_counter()
    answers = on_each_node(compute.code_on_node)
    seconds = time.perf_counter() - began
    failed = [str(result) for _, result in answers if isinstance(result, BaseException)]
    if failed:
        raise RuntimeError(f"the node probe failed: {failed}")
    return {"seconds": seconds, "nodes": sorted(r["ip"] for _, r in answers)}  # type: ignore[index]


@contextlib.contextmanager
def recorded_uploads(uploads: list[dict[str, Any]]) -> Iterator[None]:
    """Record every package Ray's ``py_modules`` hands to the cluster while connecting: its
    URI, whether it was uploaded (False: the cluster had that content already) and the seconds
    (zip and upload, or the existence check)."""
    from ray._private.runtime_env import py_modules

    original = py_modules.upload_package_if_needed

    def upload(uri: str, *args: Any, **kwargs: Any) -> bool:
        began = time.perf_counter()
        uploaded = original(uri, *args, **kwargs)
        uploads.append({"uri": uri, "uploaded": uploaded, "s": time.perf_counter() - began})
        return uploaded

    py_modules.upload_package_if_needed = upload  # type: ignore[assignment]
    try:
        yield
    finally:
        py_modules.upload_package_if_needed = original


def bare_connect(address: str) -> None:
    """Join the cluster with no runtime env and leave again (what the first ``ray.init`` of a
    process costs is then not counted in the connects measured after it)."""
    import logging

    import ray
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # as ray_session does
    ray.init(address=address, logging_level=logging.WARNING)
    ray.shutdown()


def connect_and_probe(settings: Any, stack: contextlib.ExitStack | None) -> dict[str, Any]:
    """Connect (``ray_session``), then probe every node twice. With ``stack`` the connection
    stays open (on the stack); without, it is closed again."""
    from prefect_ml.integrations.compute import ray_session, shipped_code

    session = ray_session(settings)
    uploads: list[dict[str, Any]] = []
    began = time.perf_counter()
    with recorded_uploads(uploads):
        session.__enter__()
    connect = time.perf_counter() - began
    try:
        first, second = probe_nodes(), probe_nodes()
        out = {
            "connect_s": connect,
            "uploads": uploads,
            "first_task_s": first["seconds"],
            "second_task_s": second["seconds"],
            "nodes": first["nodes"],
            "shipped": shipped_code(),
        }
    except BaseException:
        session.__exit__(*sys.exc_info())
        raise
    if stack is None:
        session.__exit__(None, None, None)
    else:
        stack.push(session.__exit__)
    return out


def training_run(data: PreparedData, experiment: str, epochs: int) -> dict[str, Any]:
    """``prefect_ml.train`` in a flow; its fit, epochs and tags."""
    from prefect import flow

    import prefect_ml
    from prefect_ml.integrations import storage, tracking, training
    from prefect_ml.integrations.settings import get_settings
    from prefect_ml.integrations.storage import MANIFEST, CheckpointStore

    def body() -> TrainResult:
        return prefect_ml.train(data, experiment=experiment, epochs=epochs, workers=WORKERS)

    fits: list[dict[str, float]] = []
    began = time.perf_counter()
    with timed_fits(fits):
        result = flow(name="benchmark-cluster-train", validate_parameters=False)(body)()
    call_s = time.perf_counter() - began
    (fit,) = fits
    store = CheckpointStore(result.checkpoint_url)
    manifests = {
        epoch: json.loads(storage.read_bytes(storage.join(store.url_for(epoch), MANIFEST)))
        for epoch in store.epochs()
    }
    committed = [manifests[e]["created_unix"] for e in sorted(manifests)]
    client = tracking.client_for(get_settings().resolved_tracking_uri)

    def history(key: str) -> list[float]:
        return [
            m.value
            for m in sorted(client.get_metric_history(result.run_id, key), key=lambda m: m.step)
        ]

    epoch_s = history("epoch_seconds")
    tags = client.get_run(result.run_id).data.tags
    latest = manifests[max(manifests)]["files"]
    first_commit = committed[0] - fit["started_unix"]
    return {
        "call_s": call_s,
        "fit_s": fit["ended_unix"] - fit["started_unix"],
        "to_first_commit_s": first_commit,
        "group_start_s": first_commit - epoch_s[0],
        "after_last_commit_s": fit["ended_unix"] - committed[-1],
        "epoch_seconds": epoch_s,
        "steady_epoch_s": statistics.mean(epoch_s[1:]),
        "commit_intervals_s": [b - a for a, b in zip(committed, committed[1:], strict=False)],
        "checkpoint_blocking_seconds": history("checkpoint_blocking_seconds"),
        "samples_per_second": history("samples_per_second"),
        "workers": history("workers"),
        "worker_nodes": tags.get(training.WORKER_NODES_TAG),
        "code": tags.get(tracking.CODE_TAG),
        "checkpoint_bytes": sum(int(f["size"]) for f in latest.values()),
        "val_accuracy": result.epoch_metrics.get("val_accuracy"),
    }


def campaign_run(data: PreparedData, name: str, sizes: Sizes) -> dict[str, Any]:
    """``prefect_ml.campaign`` in a flow: its phases and the nodes its trials ran on."""
    from prefect import flow

    import prefect_ml
    from prefect_ml.integrations import tracking
    from prefect_ml.integrations.settings import get_settings

    def body() -> CampaignResult:
        return prefect_ml.campaign(
            data,
            experiment=f"bench-cluster-{name}",
            campaign=name,
            n_trials=sizes.trials,
            concurrency=CONCURRENCY,
            epochs=sizes.trial_epochs,
            sampler="random",
            pruner="none",
            search_space=SEARCH_SPACE,
        )

    began = time.perf_counter()
    result = flow(name="benchmark-cluster-campaign", validate_parameters=False)(body)()
    call_s = time.perf_counter() - began
    if result.finished != sizes.trials or result.failed:
        raise RuntimeError(f"campaign {name}: {result.finished} finished, {result.failed} failed")
    client = tracking.client_for(get_settings().resolved_tracking_uri)
    runs = client.search_runs([result.experiment_id])
    nodes = sorted(
        {r.data.tags[tracking.NODE_TAG] for r in runs if tracking.NODE_TAG in r.data.tags}
    )
    trials_s = result.timings["trials_seconds"]
    return {
        "call_s": call_s,
        **result.timings,
        # slot-seconds per trial: each of the CONCURRENCY slots is busy for this long per trial
        "per_trial_s": trials_s * CONCURRENCY / sizes.trials,
        "trials_per_s": sizes.trials / trials_s,
        "trial_nodes": nodes,
        "best_val_accuracy": max(row.values.get("val_accuracy", 0.0) for row in result.best),
    }


def start_nodes(root: Path, head_cpus: int, workers: tuple[tuple[str, int], ...]) -> Any:
    """``tests.cluster``'s cluster, node by node (``start_cluster``'s steps), each timed."""
    from tests.cluster import REPO_ROOT, SOURCE_FOLDERS, LocalCluster, node_environment

    aws = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    hidden = tuple(REPO_ROOT / name for name in SOURCE_FOLDERS)
    cluster = LocalCluster(root, hidden, node_environment(aws))
    seconds = {}
    try:
        began = time.perf_counter()
        cluster.start_head(head_cpus)
        seconds["head"] = time.perf_counter() - began
        for index, (name, cpus) in enumerate(workers, start=2):
            began = time.perf_counter()
            cluster.add_node(name, f"127.0.0.{index}", cpus)
            seconds[name] = time.perf_counter() - began
    except BaseException:
        cluster.stop()
        raise
    return cluster, seconds


def topology_run(name: str, root: Path, data: PreparedData, sizes: Sizes) -> dict[str, Any]:
    from prefect_ml.integrations.settings import get_settings

    head_cpus, workers = TOPOLOGIES[name]
    load_before = os.getloadavg()[0]
    cluster, node_start = start_nodes(root / name, head_cpus, workers)
    print(f"{name}: nodes up {node_start}", flush=True)
    os.environ["PREFECT_ML_RAY_ADDRESS"] = cluster.address
    out: dict[str, Any] = {"node_start_s": node_start, "loadavg_1m_before": load_before}
    try:
        settings = get_settings()
        bare_connect(cluster.address)  # untimed: this process's first-connect costs
        out["connect_cold"] = connect_and_probe(settings, None)
        print(f"{name}: cold connect {out['connect_cold']}", flush=True)
        with contextlib.ExitStack() as stack:
            out["connect_warm"] = connect_and_probe(settings, stack)
            print(f"{name}: warm connect {out['connect_warm']}", flush=True)
            out["trainings"] = []
            for repeat in range(1 + sizes.trainings):  # the first one is reported apart
                experiment = f"bench-cluster-{name}-{repeat}-{time.time_ns()}"
                run = training_run(data, experiment, sizes.epochs)
                out["trainings"].append(run)
                print(
                    f"{name}: training {repeat}: fit {run['fit_s']:.1f} s, group start "
                    f"{run['group_start_s']:.1f} s, steady epoch {run['steady_epoch_s']:.3f} s, "
                    f"nodes {run['worker_nodes']}",
                    flush=True,
                )
            out["first_training"] = out["trainings"].pop(0)
            warm_up = Sizes(**{**asdict(sizes), "trials": CONCURRENCY, "trial_epochs": 1})
            out["campaign_warm_up"] = campaign_run(data, f"warm-{name}-{time.time_ns()}", warm_up)
            campaign = f"bench-{name}-{time.time_ns()}"
            out["campaign"] = campaign_run(data, campaign, sizes)
            print(f"{name}: campaign {out['campaign']}", flush=True)
    finally:
        os.environ.pop("PREFECT_ML_RAY_ADDRESS", None)
        cluster.stop()
    out["loadavg_1m_after"] = os.getloadavg()[0]
    return out


# --- the report ------------------------------------------------------------------------------


def ratios(topologies: dict[str, Any]) -> dict[str, float]:
    """3 nodes over 1 node (lower is better for every one of them)."""
    one, three = topologies["1-node"], topologies["3-nodes"]

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    pairs = {
        "node_start_total": (
            sum(three["node_start_s"].values()),
            sum(one["node_start_s"].values()),
        ),
        "connect_cold": (three["connect_cold"]["connect_s"], one["connect_cold"]["connect_s"]),
        "connect_warm": (three["connect_warm"]["connect_s"], one["connect_warm"]["connect_s"]),
        "first_task_cold": (
            three["connect_cold"]["first_task_s"],
            one["connect_cold"]["first_task_s"],
        ),
        "first_task_warm": (
            three["connect_warm"]["first_task_s"],
            one["connect_warm"]["first_task_s"],
        ),
    }
    for key in (
        "call_s",
        "fit_s",
        "group_start_s",
        "to_first_commit_s",
        "steady_epoch_s",
        "after_last_commit_s",
    ):
        pairs[f"training_{key}"] = (median(three["trainings"], key), median(one["trainings"], key))
        pairs[f"first_training_{key}"] = (three["first_training"][key], one["first_training"][key])
    for key in ("call_s", "setup_seconds", "trials_seconds", "per_trial_s", "conclude_seconds"):
        pairs[f"campaign_{key}"] = (three["campaign"][key], one["campaign"][key])
    return {key: ours / peer for key, (ours, peer) in pairs.items()}


def _uploads(connect: dict[str, Any]) -> str:
    return ", ".join(
        f"{'uploaded' if u['uploaded'] else 'found'} in {u['s']:.3f} s" for u in connect["uploads"]
    )


def _training_median(topology: dict[str, Any], key: str) -> float:
    return statistics.median(row[key] for row in topology["trainings"])


def markdown(report: dict[str, Any]) -> str:
    tops, r = report["topologies"], report["ratios"]
    one, three = tops["1-node"], tops["3-nodes"]
    rows = [
        (
            "nodes start (each `ray start` until `ray status` counts it)",
            " + ".join(f"{s:.1f}" for s in one["node_start_s"].values()),
            " + ".join(f"{s:.1f}" for s in three["node_start_s"].values()),
            r["node_start_total"],
        ),
        (
            "connect, first (zip + upload prefect-ml: "
            f"{_uploads(one['connect_cold'])}; {_uploads(three['connect_cold'])})",
            f"{one['connect_cold']['connect_s']:.2f}",
            f"{three['connect_cold']['connect_s']:.2f}",
            r["connect_cold"],
        ),
        (
            "connect, again (upload cached: "
            f"{_uploads(one['connect_warm'])}; {_uploads(three['connect_warm'])})",
            f"{one['connect_warm']['connect_s']:.2f}",
            f"{three['connect_warm']['connect_s']:.2f}",
            r["connect_warm"],
        ),
        (
            "first task on every node, fresh cluster (runtime env: download, unpack; worker)",
            f"{one['connect_cold']['first_task_s']:.2f}",
            f"{three['connect_cold']['first_task_s']:.2f}",
            r["first_task_cold"],
        ),
        (
            "first task on every node, code already there (worker start)",
            f"{one['connect_warm']['first_task_s']:.2f}",
            f"{three['connect_warm']['first_task_s']:.2f}",
            r["first_task_warm"],
        ),
    ]
    labels = {
        "call_s": "training: `train` call",
        "fit_s": "training: `fit`",
        "to_first_commit_s": "training: fit to first committed epoch",
        "group_start_s": "training: worker-group start (that minus epoch 1)",
        "steady_epoch_s": "training: steady epoch (epochs 2..E, `epoch_seconds`)",
        "after_last_commit_s": "training: last commit to the end of `fit` (final report, teardown)",
    }
    for key, label in labels.items():
        digits = 3 if key == "steady_epoch_s" else 1
        rows.append(
            (
                label,
                f"{_training_median(one, key):.{digits}f}",
                f"{_training_median(three, key):.{digits}f}",
                r[f"training_{key}"],
            )
        )
    for key in ("fit_s", "group_start_s"):
        rows.append(
            (
                f"first training on the fresh cluster: {labels[key].split(': ', 1)[1]}",
                f"{one['first_training'][key]:.1f}",
                f"{three['first_training'][key]:.1f}",
                r[f"first_training_{key}"],
            )
        )
    labels = {
        "call_s": "campaign: `campaign` call",
        "setup_seconds": "campaign: setup (study claim, MLflow parent, warm workers)",
        "trials_seconds": "campaign: trials phase",
        "per_trial_s": "campaign: slot-seconds per trial",
        "conclude_seconds": "campaign: conclusion (plots)",
    }
    for key, label in labels.items():
        digits = 2 if key == "per_trial_s" else 1
        rows.append(
            (
                label,
                f"{one['campaign'][key]:.{digits}f}",
                f"{three['campaign'][key]:.{digits}f}",
                r[f"campaign_{key}"],
            )
        )
    sizes = report["sizes"]
    lines = [
        f"Training: digits MLP, {WORKERS} workers, {sizes['epochs']} epochs, median of "
        f"{sizes['trainings']} after a first one; campaign: {sizes['trials']} trials x "
        f"{sizes['trial_epochs']} epochs, {CONCURRENCY} at a time, after a 2-trial warm-up",
        "",
        "| seconds | 1 node | 3 nodes | 3 nodes / 1 node |",
        "|---|---|---|---|",
        *(f"| {label} | {a} | {b} | {ratio:.2f}x |" for label, a, b, ratio in rows),
        "",
        "| shipped | files MB | zip MB | hash s | zip s |",
        "|---|---|---|---|---|",
    ]
    for package in report["shipped"]["packages"]:
        lines.append(
            f"| {package['name']} | {package['file_bytes'] / MB:.2f} | "
            f"{package['zip_bytes'] / MB:.2f} | {package['hash_s']:.3f} | {package['zip_s']:.3f} |"
        )
    lines += [
        "",
        "| Optuna storage | writers | p50 ask+tell ms | p95 ms | trials/s | failed |",
        "|---|---|---|---|---|---|",
    ]
    for run in report["study_storage"]:
        lines.append(
            f"| {run['storage']} | {run['workers']} | {run['p50_ms']:.1f} | {run['p95_ms']:.1f} "
            f"| {run['trials_per_s']:.0f} | {run['failed']} |"
        )
    lines += [
        "",
        "| coordinator's study, 1 writer, TPE + median pruner | trials | ask ms | epoch reports "
        "ms | tell ms | total ms (first quarter) | trials/s at the end |",
        "|---|---|---|---|---|---|---|",
    ]
    for storage, cost in report["coordinator"].items():
        last = cost["last_quarter"]
        lines.append(
            f"| {storage} | {cost['trials']} | {last['ask_ms']:.1f} | {last['epochs_ms']:.1f} "
            f"| {last['tell_ms']:.1f} | {last['total_ms']:.1f} "
            f"({cost['first_quarter']['total_ms']:.1f}) | {cost['trials_per_s_at_end']:.1f} |"
        )
    lines += [
        "",
        "| MLflow | log_epoch/s (1 thread) | p50 ms | log_epoch/s (8 threads) | trial records/s |",
        "|---|---|---|---|---|",
    ]
    for backend, rates in report["mlflow"].items():
        lines.append(
            f"| {backend} | {rates['log_epoch']['per_second']:.0f} "
            f"| {rates['log_epoch']['p50_ms']:.1f} "
            f"| {rates['log_epoch_8_threads']['per_second']:.0f} "
            f"| {rates['trial_record']['per_second']:.1f} |"
        )
    lines += ["", "| checkpoint commit MB | median s | MB/s |", "|---|---|---|"]
    for row in report["commits"]:
        lines.append(f"| {row['mb']} | {row['median_s']:.3f} | {row['mb_per_s']:.0f} |")
    return "\n".join(lines)


def run_benchmark(sizes: Sizes, quick: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"benchmark": "cluster", "quick": quick, "sizes": asdict(sizes)}
    load_before = os.getloadavg()
    started = time.perf_counter()
    with embedded_home() as (work, settings):
        # Only prefect-ml is shipped: the digits and the MLP are built in.
        os.environ["PREFECT_ML_ALLOWED_MODULES"] = ""
        from benchmarks.checkpoints import BUCKET, s3_endpoint
        from tests.postgres import PostgresServer

        postgres = PostgresServer(durable=True, max_connections=100).start()
        try:
            pg_url = postgres.new_database("studies")
            report["study_storage"] = study_storage_runs(
                postgres.new_database("asktell"), f"sqlite:///{work}/asktell.db", sizes
            )
            report["coordinator"] = {
                storage: coordinator_costs(url, sizes.coordinator_trials, sizes.trial_epochs)
                for storage, url in (
                    ("postgresql", postgres.new_database("coordinator")),
                    ("sqlite", f"sqlite:///{work}/coordinator.db"),
                )
            }
            print(f"  coordinator {report['coordinator']}", flush=True)
            with s3_endpoint(in_process=False) as endpoint:
                report.update(services(work, endpoint, BUCKET, pg_url, sizes))
        finally:
            postgres.stop()
    report["ratios"] = ratios(report["topologies"])
    report["wall_s"] = time.perf_counter() - started
    import mlflow
    import optuna
    import ray
    import torch

    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m.__name__: m.__version__ for m in (ray, torch, mlflow, optuna)},
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    return report


def services(work: Path, endpoint: str, bucket: str, pg_url: str, sizes: Sizes) -> dict[str, Any]:
    """Everything that needs S3 and MLflow: the MLflow and commit measurements, then the
    topologies, with storage, tracking and studies pointed at the shared services."""
    from tests.s3 import MlflowServer

    out: dict[str, Any] = {"s3_endpoint": endpoint}
    server = MlflowServer(work / "mlflow", f"s3://{bucket}/mlartifacts")
    try:
        tracking_uri = server.ready()
        print(f"mlflow server at {tracking_uri}", flush=True)
        out["mlflow"] = {
            "server": mlflow_rates(tracking_uri, None, sizes.mlflow_seconds),
            "sqlite": mlflow_rates(
                f"sqlite:///{work}/mlflow-direct.db",
                (work / "mlartifacts").as_uri(),
                sizes.mlflow_seconds,
            ),
        }
        print(f"  mlflow rates {out['mlflow']}", flush=True)
        storage_url = f"s3://{bucket}/prefect-ml"
        out["commits"] = commit_times(f"{storage_url}/commit-bench", sizes)
        os.environ.update(
            PREFECT_ML_STORAGE_URL=storage_url,
            PREFECT_ML_MLFLOW_TRACKING_URI=tracking_uri,
            PREFECT_ML_OPTUNA_STORAGE=pg_url,
        )
        out["shipped"] = shipped_package()
        data = prepare_digits()
        out["topologies"] = {
            name: topology_run(name, work / "cluster", data, sizes) for name in TOPOLOGIES
        }
    finally:
        server.stop()
    return out


def prepare_digits() -> PreparedData:
    """The digits' splits in the storage, from a flow (which also starts Prefect's API)."""
    from prefect import flow

    import prefect_ml

    def body() -> PreparedData:
        return prefect_ml.preprocess("digits")

    return flow(name="benchmark-cluster-data")(body)()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer epochs and trials")
    parser.add_argument("--output", type=Path, help="JSON results [results/cluster.json]")
    args = parser.parse_args(argv)
    report = run_benchmark(QUICK if args.quick else FULL, args.quick)
    save_report(report, args.output or results_path("cluster", args.quick), markdown(report))
    return report


if __name__ == "__main__":
    main()
