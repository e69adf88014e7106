"""Optuna study storage under concurrent writers: PostgreSQL vs SQLite, 1, 8 and 64 writers.

Each writer is a process of its own (SQLite locks the whole file, so threads of one process
would understate its contention), forked once the study exists and connected through the
product's :func:`integrations.campaign.storage_for` (SQLite waits up to 60 s for its lock). All
writers wait at a barrier, then each runs ``trials_per_worker`` rounds of ``study.ask`` with a
fixed two-parameter space (random sampler, so the storage is what is measured, not a sampler's
model) and ``study.tell``. Reported: the latency of one ask+tell (p50, p95), trials per second
over the wall time from the barrier to the last writer's end, and failed rounds (an ask or
tell that raised, e.g. "database is locked").

The coordinator of a campaign is one writer; many writers are several campaigns on one
database, or users who run Optuna's own distributed optimisation on it. PostgreSQL is a
cluster this script creates in a temporary folder (Debian's ``postgresql``, started on a free
loopback port by ``tests/postgres.py``), with its durable defaults (fsync on); SQLite is a file
in a temporary folder, as Optuna opens it (rollback journal, ``synchronous=FULL``).

Run ``.venv/bin/python benchmarks/study_storage.py`` (``--quick``: 1 and 4 writers, a smoke run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import results_path, save_report  # noqa: E402

WORKERS = (1, 8, 64)
QUICK_WORKERS = (1, 4)
TOTAL_TRIALS = 256  # per run, split between the writers (at least 4 each)


def _space() -> dict[str, Any]:
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    return {
        "lr": FloatDistribution(1e-4, 1e-1, log=True),
        "optimizer": CategoricalDistribution(["adam", "sgd"]),
    }


def _writer(url: str, study_name: str, rounds: int, start: Any, results: Any) -> None:
    """One writer process: connect, wait for the others, then time ``rounds`` ask+tell."""
    import optuna

    from prefect_ml.integrations.campaign import storage_for

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(
        study_name=study_name,
        storage=storage_for(url),
        sampler=optuna.samplers.RandomSampler(seed=os.getpid()),
    )
    space = _space()
    latencies, errors = [], 0
    start.wait()
    for _ in range(rounds):
        began = time.perf_counter()
        try:
            trial = study.ask(space)
            study.tell(trial, trial.params["lr"])
        except Exception:
            errors += 1
            continue
        latencies.append(time.perf_counter() - began)
    results.put((latencies, errors, time.perf_counter()))


def ask_tell_latency(url: str, workers: int, trials_per_worker: int) -> dict[str, Any]:
    """Ask+tell latency of ``workers`` concurrent writer processes on the storage ``url``, each
    telling ``trials_per_worker`` trials of one new study: p50/p95 (ms), trials/s, failures."""
    import optuna

    from prefect_ml.integrations.campaign import storage_for

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study_name = f"bench-{uuid.uuid4().hex[:8]}"
    optuna.create_study(storage=storage_for(url), study_name=study_name)
    context = multiprocessing.get_context("fork")  # optuna imported once, in this process
    start, results = context.Barrier(workers + 1), context.Queue()
    processes = [
        context.Process(target=_writer, args=(url, study_name, trials_per_worker, start, results))
        for _ in range(workers)
    ]
    for process in processes:
        process.start()
    start.wait()  # every writer connected and loaded the study
    began = time.perf_counter()
    outcomes = [results.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join()
    wall = max(ended for _, _, ended in outcomes) - began
    latencies = sorted(latency for times, _, _ in outcomes for latency in times)
    stored = len(optuna.load_study(study_name=study_name, storage=url).trials)
    return {
        "workers": workers,
        "trials": len(latencies),
        "failed": sum(errors for _, errors, _ in outcomes),
        "stored_trials": stored,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "trials_per_s": len(latencies) / wall if wall > 0 else None,
        "wall_s": wall,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| storage | writers | trials | failed | p50 ask+tell (ms) | p95 (ms) | trials/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        lines.append(
            f"| {row['storage']} | {row['workers']} | {row['trials']} | {row['failed']} | "
            f"{row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {row['trials_per_s']:.1f} |"
        )
    return "\n".join(lines)


def run_benchmark(workers: tuple[int, ...]) -> dict[str, Any]:
    import optuna
    import sqlalchemy

    from tests.postgres import PostgresServer

    load_before = os.getloadavg()
    server = PostgresServer(durable=True, max_connections=max(workers) * 2 + 20).start()
    runs = []
    try:
        version = server.execute("SHOW server_version")[0][0]
        with tempfile.TemporaryDirectory(prefix="prefect-ml-bench-") as folder:
            storages = {
                "postgresql": server.new_database("bench"),
                "sqlite": f"sqlite:///{folder}/optuna.db",
            }
            for name, url in storages.items():
                for count in workers:
                    per_worker = max(4, TOTAL_TRIALS // count)
                    run = ask_tell_latency(url, count, per_worker)
                    runs.append({"storage": name, **run})
                    print(f"{name}: {count} writers: {run}", flush=True)
    finally:
        server.stop()
    return {
        "benchmark": "study_storage",
        "total_trials": TOTAL_TRIALS,
        "runs": runs,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "postgresql": version,
            "versions": {m.__name__: m.__version__ for m in (optuna, sqlalchemy)},
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 4 writers: a smoke run")
    parser.add_argument("--output", type=Path, help="JSON results [results/study_storage.json]")
    args = parser.parse_args(argv)
    report = run_benchmark(QUICK_WORKERS if args.quick else WORKERS)
    report["quick"] = args.quick
    save_report(report, args.output or results_path("study_storage", args.quick), markdown(report))
    return report


if __name__ == "__main__":
    main()
