"""Streaming data: the driver's memory and the training speed as the dataset grows, in one run:
ours (streamed Parquet shards), today's in-memory path, and a bare Ray Data loop.

One S3 server for every arm: moto's, on loopback, in a child process (from
``benchmarks/checkpoints.py``). For each size (``--sizes``, MB of float32 features; default
100, 1000 and 4000) the script writes a generated dataset to it as Parquet files of 128 MB (256
feature columns and a 10-class label, the largest of the first 10 columns), then runs each arm
in a fresh child process, one at a time, with storage on the same S3 server:

* ``ours``: ``train_model`` (the flow of ``prefect-ml train``) with the streamed layout at
  every size (``PREFECT_ML_DATA_LAYOUT=parquet``; left to itself it streams from 256 MB): Ray
  Data prepares the splits, one Ray Train worker streams its shard, Ray Data actors score the
  test split, the model is registered;
* ``in-memory``: the same flow with ``PREFECT_ML_DATA_LAYOUT=arrays`` (today's path: the driver
  loads the files, splits with scikit-learn, writes ``.npy`` splits that the worker reads
  whole); run up to ``--in-memory-max-mb`` (1000);
* ``ray-data``: the bare Ray Data loop a user would write: a ``TorchTrainer`` with
  ``datasets={"train": ray.data.read_parquet(<our train shards>)}``, each worker iterating
  ``get_dataset_shard("train").iter_torch_batches(prefetch_batches=4)`` into the same MLP,
  optimiser and batch size; no checkpoints, no validation.

Measured per arm: the driver process's peak RSS (``VmHWM`` of the child), the workers' peak
RSS (our ``peak_memory_mib`` metric, ``VmHWM`` per epoch; ``VmHWM`` of the bare loop's
worker), and training samples/s: rows trained over the training loop's seconds (validation and
checkpoints excluded in every arm), the median over epochs 2..N. One worker with one CPU in
every arm: the second core is left to Ray Data's read tasks (a bare loop with two 1-CPU workers
on two cores leaves Ray Data no CPU and hangs).

Run ``.venv/bin/python benchmarks/data.py`` (about 30 minutes; ``--quick``: 20 and 60 MB).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

FEATURES = 256
CLASSES = 10
FILE_MB = 128
EPOCHS = 3
BATCH = 512
MODEL = {"hidden": 128, "depth": 2, "dropout": 0.0}
ARMS = ("ours", "in-memory", "ray-data")
FEATURES_COLUMN, LABEL_COLUMN = "features", "label"  # integrations.datasets' Parquet columns


def generate(url: str, megabytes: int, seed: int = 0) -> None:
    """``megabytes`` of float32 features as Parquet files of ``FILE_MB`` under ``url``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prefect_ml.integrations import storage

    rows_per_file = FILE_MB * 10**6 // (4 * FEATURES)
    total_rows = megabytes * 10**6 // (4 * FEATURES)
    rng = np.random.default_rng(seed)
    for index, start in enumerate(range(0, total_rows, rows_per_file)):
        rows = min(rows_per_file, total_rows - start)
        x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
        columns = {f"x{j:03d}": x[:, j] for j in range(FEATURES)}
        columns["y"] = x[:, :CLASSES].argmax(axis=1).astype(np.int64)
        buffer = io.BytesIO()
        pq.write_table(pa.table(columns), buffer, compression="none")
        storage.write_bytes(storage.join(url, f"part-{index:04d}.parquet"), buffer.getvalue())


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``). Not ``ru_maxrss``: Linux carries that over from the
    forked copy of the parent across ``exec``, so a child would report at least its parent's
    size."""
    status = Path("/proc/self/status").read_text()
    return (
        next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        / 1024
    )


def run_ours(url: str, layout: str, storage_url: str) -> dict[str, Any]:
    """The child process of the ``ours`` and ``in-memory`` arms."""
    with embedded_home():
        os.environ["PREFECT_ML_DATA_LAYOUT"] = layout
        os.environ["PREFECT_ML_STORAGE_URL"] = storage_url
        from prefect_ml.flows.train import train_model
        from prefect_ml.integrations import tracking
        from prefect_ml.integrations.settings import get_settings
        from prefect_ml.tasks.params import TrainModelParams

        started = time.perf_counter()
        outcome = train_model(
            TrainModelParams(
                data={"dataset": "tabular", "url": url, "label_column": "y"},
                model={"model": "mlp", **MODEL},
                training={"epochs": EPOCHS, "workers": 1, "batch_size": BATCH, "lr": 1e-3},
                registry={"model_name": f"bench-data-{layout}"},
            )
        )
        wall = time.perf_counter() - started
        client = tracking.client_for(get_settings().resolved_tracking_uri)

        def history(name: str) -> list[float]:
            metrics = client.get_metric_history(outcome.trained.run_id, name)
            return [m.value for m in sorted(metrics, key=lambda m: m.step)]

        speeds = history("samples_per_second")
        return {
            "layout": outcome.data.layout,
            "splits_url": outcome.data.splits_url,
            "rows": outcome.data.rows,
            "driver_peak_rss_mb": peak_rss_mb(),
            "worker_peak_rss_mb": max(history("peak_memory_mib")),
            "samples_per_second": statistics.median(speeds[1:] or speeds),
            "samples_per_second_by_epoch": speeds,
            "test_accuracy": outcome.evaluation.metrics["accuracy"],
            "wall_s": wall,
        }


def bare_loop(config: dict[str, Any]) -> None:
    """The bare Ray Data arm's worker: iterate the dataset shard into the model."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    from prefect_ml.integrations.datasets import build_mlp

    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(build_mlp([FEATURES], CLASSES, **MODEL))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    shard = ray.train.get_dataset_shard("train")
    speeds = []
    for _epoch in range(EPOCHS):
        started, rows = time.perf_counter(), 0
        for batch in shard.iter_torch_batches(batch_size=BATCH, prefetch_batches=4):
            features, labels = batch[FEATURES_COLUMN], batch[LABEL_COLUMN]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(features), labels)
            loss.backward()
            optimizer.step()
            rows += len(labels)
        speeds.append(rows / (time.perf_counter() - started))
    # Ray Train v2 keeps no metrics reported without a checkpoint: the result goes in a file.
    Path(config["result_file"]).write_text(json.dumps({"speeds": speeds, "rss": peak_rss_mb()}))
    ray.train.report({})


def run_ray_data(splits_url: str) -> dict[str, Any]:
    """The child process of the bare Ray Data arm, over the shards ``ours`` prepared."""
    with embedded_home():
        import ray
        import ray.data
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from prefect_ml.integrations import datasets, storage

        files = datasets.read_manifest(splits_url)["train"]
        located = [storage.ray_storage(storage.join(splits_url, f.name)) for f in files]
        ray.init(address="local", num_cpus=2, include_dashboard=True, logging_level="WARNING")
        dataset = ray.data.read_parquet(
            [path for path, _ in located], filesystem=located[0][1], partitioning=None
        )
        storage_path = os.environ["PREFECT_ML_HOME"]
        result_file = Path(os.environ["PREFECT_ML_HOME"]) / "bare-loop.json"
        trainer = TorchTrainer(
            bare_loop,
            train_loop_config={"result_file": str(result_file)},
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
            datasets={"train": dataset},
            run_config=RunConfig(storage_path=storage_path, name="bare-ray-data"),
        )
        trainer.fit()
        result = json.loads(result_file.read_text())
        speeds = result["speeds"]
        return {
            "driver_peak_rss_mb": peak_rss_mb(),
            "worker_peak_rss_mb": result["rss"],
            "samples_per_second": statistics.median(speeds[1:] or speeds),
            "samples_per_second_by_epoch": speeds,
        }


def child(arm: str, url: str, storage_url: str, splits_url: str, endpoint: str) -> dict[str, Any]:
    """Run one arm in a fresh process; its JSON result."""
    command = [sys.executable, __file__, "--child", arm, url, storage_url, splits_url]
    environment = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.checkpoints import BUCKET, s3_endpoint

    results: dict[str, dict[str, Any]] = {}
    with embedded_home(), s3_endpoint(in_process=False) as endpoint:
        import ray

        from prefect_ml.integrations import storage

        for megabytes in args.sizes:
            url = f"s3://{BUCKET}/data-{megabytes}mb"
            started = time.perf_counter()
            generate(url, megabytes)
            print(f"{megabytes} MB generated in {time.perf_counter() - started:.0f} s", flush=True)
            storage_url = f"s3://{BUCKET}/store-{megabytes}mb"
            row: dict[str, Any] = {}
            row["ours"] = child("ours", url, storage_url, "", endpoint)
            print(f"  ours: {row['ours']}", flush=True)
            row["ray-data"] = child(
                "ray-data", url, storage_url, row["ours"]["splits_url"], endpoint
            )
            print(f"  ray-data: {row['ray-data']}", flush=True)
            if megabytes <= args.in_memory_max_mb:
                row["in-memory"] = child("in-memory", url, storage_url, "", endpoint)
                print(f"  in-memory: {row['in-memory']}", flush=True)
            results[str(megabytes)] = row
            fs, path = storage.filesystem(f"s3://{BUCKET}")
            for prefix in (url, storage_url):  # the next size needs the server's disk
                fs.rm(storage.filesystem(prefix)[1], recursive=True)
    return {
        "benchmark": "data",
        "sizes_mb": args.sizes,
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "features": FEATURES,
        "results": results,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "ray": ray.__version__,
        },
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| size (MB) | arm | layout | driver peak RSS (MB) | worker peak RSS (MB) | "
        "samples/s | vs bare Ray Data |",
        "|---|---|---|---|---|---|---|",
    ]
    smallest = None
    for size, row in report["results"].items():
        bare = row["ray-data"]["samples_per_second"]
        for arm in ARMS:
            if arm not in row:
                continue
            result = row[arm]
            ratio = result["samples_per_second"] / bare
            if arm == "ours" and smallest is None:
                smallest = result["driver_peak_rss_mb"]
            lines.append(
                f"| {size} | {arm} | {result.get('layout', '-')} | "
                f"{result['driver_peak_rss_mb']:.0f} | {result['worker_peak_rss_mb']:.0f} | "
                f"{result['samples_per_second']:,.0f} | {ratio:.2f}× |"
            )
    largest = list(report["results"].values())[-1]["ours"]["driver_peak_rss_mb"]
    growth = largest - (smallest or 0)
    lines.append(f"\nDriver peak RSS of ours, largest minus smallest size: {growth:+.0f} MB")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 and 60 MB")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--in-memory-max-mb", type=int, default=1000)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [20, 60]
    args.output = args.output or results_path("data", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        arm, url, storage_url, splits_url = args.child
        if arm == "ray-data":
            result = run_ray_data(splits_url)
        else:
            result = run_ours(url, "arrays" if arm == "in-memory" else "parquet", storage_url)
        print(json.dumps(result))
        return
    report = run_benchmark(args)
    save_report(report, args.output, markdown(report))


if __name__ == "__main__":
    main()
