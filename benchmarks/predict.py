"""Batch scoring: rows/s of ``batch_predict`` (the flow of ``prefect-ml predict``) against a
plain single-process loop and a hand-written Ray Data pipeline, in one run, on the same files
and the same registered model.

The data is generated tabular Parquet (``--rows``, default 1,000,000; ``FEATURES`` float32
columns and a string ``id``, in ``FILES`` files) on local disk; the model an MLP
(``MODEL``, random weights: throughput does not depend on them) registered in the embedded
MLflow with its feature names, as ``prefect-ml train`` registers one. Every arm reads the
files, scores batches of ``BATCH`` rows and writes Parquet with ``id``, ``prediction`` and
``probabilities``; each is timed end to end, model loading included:

* ``ours``: ``batch_predict(PredictParams(..., force=True))``: resolving the version, describing
  the files, Ray Data actors (2, the default), the manifest and the Prefect artifacts;
* ``single-process``: the loop a user would write: ``mlflow.pytorch.load_model``, then per file
  ``pyarrow.parquet.ParquetFile.iter_batches``, the model, softmax, argmax, a ``ParquetWriter``;
  with one torch thread (one core, the target's peer), and again with torch's default threads
  (``single-process-all-threads``: every core inside each matrix multiply);
* ``ray-data``: the Ray Data pipeline a user would write: ``read_parquet`` ->
  ``map_batches`` (a class that loads the model in ``__init__``, same actors, CPUs and batch
  size as ours) -> ``write_parquet``.

The ephemeral Prefect API is started before the clock runs (a deployment's flow run finds
it up). Ratios are rows/s of ours over rows/s of the peer.

Run ``.venv/bin/python benchmarks/predict.py`` (about 3 minutes on 2 cores; ``--quick``:
100,000 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS_DIR, embedded_home, save_report  # noqa: E402

FEATURES = 32
CLASSES = 10
FILES = 8
BATCH = 8192
MODEL = {"hidden": 1024, "depth": 2, "dropout": 0.0}  # compute-bound: ~1.1M multiply-adds a row
MODEL_NAME = "bench-scorer"
ACTORS, ACTOR_CPUS, READ_CPUS = 2, 0.5, 0.25  # ours' defaults, given to the hand-written arm too
NAMES = [f"x{j:02d}" for j in range(FEATURES)]


def generate(folder: Path, rows: int, seed: int = 0) -> list[str]:
    """``rows`` generated rows as ``FILES`` Parquet files under ``folder``; their paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    paths = []
    per_file = -(-rows // FILES)
    for index, start in enumerate(range(0, rows, per_file)):
        count = min(per_file, rows - start)
        x = rng.standard_normal((count, FEATURES), dtype=np.float32)
        columns: dict[str, Any] = {"id": pa.array([f"row-{start + i}" for i in range(count)])}
        columns.update({name: x[:, j] for j, name in enumerate(NAMES)})
        path = folder / f"part-{index:03d}.parquet"
        pq.write_table(pa.table(columns), path)
        paths.append(str(path))
    return paths


def register(settings: Any) -> str:
    """An MLP over ``NAMES`` registered as the registry step does (schema tags); its version."""
    import numpy as np
    import torch

    from prefect_ml.integrations import catalog, tracking

    torch.manual_seed(0)
    model = catalog.build_model("mlp", [FEATURES], CLASSES, MODEL)
    client = tracking.client_for(settings.resolved_tracking_uri)
    experiment = tracking.ensure_experiment(client, "bench-predict", settings.mlflow_artifact_root)
    run_id = client.create_run(experiment).info.run_id
    version = tracking.log_and_register_model(
        client,
        settings.resolved_tracking_uri,
        run_id,
        model,
        np.zeros((2, FEATURES), np.float32),
        model_name=MODEL_NAME,
        tags={
            tracking.SAMPLE_SHAPE_TAG: json.dumps([FEATURES]),
            tracking.CLASS_NAMES_TAG: json.dumps([str(c) for c in range(CLASSES)]),
            tracking.FEATURE_NAMES_TAG: json.dumps(NAMES),
        },
    )
    client.set_terminated(run_id)
    tracking.set_alias(client, MODEL_NAME, "champion", version)
    return version


def load_module(tracking_uri: str, version: str) -> Any:
    import mlflow.pytorch
    import torch

    mlflow.set_tracking_uri(tracking_uri)
    loaded = mlflow.pytorch.load_model(f"models:/{MODEL_NAME}/{version}")
    return loaded.module() if isinstance(loaded, torch.export.ExportedProgram) else loaded


def score_table(module: Any, table: Any) -> Any:
    """``id``, ``prediction`` and ``probabilities`` of a batch, written by hand."""
    import numpy as np
    import pyarrow as pa
    import torch

    x = np.column_stack([table.column(n).to_numpy() for n in NAMES]).astype(np.float32)
    with torch.inference_mode():
        probabilities = torch.softmax(module(torch.from_numpy(x)), dim=1).numpy()
    classes = np.array([str(c) for c in range(CLASSES)])
    flat = pa.array(probabilities.reshape(-1))
    return pa.table(
        {
            "id": table.column("id"),
            "prediction": pa.array(classes[probabilities.argmax(axis=1)]),
            "probabilities": pa.FixedSizeListArray.from_arrays(flat, CLASSES).cast(
                pa.list_(pa.float32())
            ),
        }
    )


def single_process(
    paths: list[str], output: Path, tracking_uri: str, version: str, threads: int
) -> int:
    import torch

    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _single_process_loop(paths, output, load_module(tracking_uri, version))
    finally:
        torch.set_num_threads(default_threads)


def _single_process_loop(paths: list[str], output: Path, module: Any) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    output.mkdir(parents=True)
    rows = 0
    for index, path in enumerate(paths):
        writer = None
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            scored = score_table(module, pa.Table.from_batches([batch]))
            if writer is None:
                writer = pq.ParquetWriter(output / f"part-{index:03d}.parquet", scored.schema)
            writer.write_table(scored)
            rows += scored.num_rows
        if writer is not None:
            writer.close()
    return rows


class HandScorer:
    """The hand-written arm's actor: the model, loaded once."""

    def __init__(self, tracking_uri: str, version: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.module = load_module(tracking_uri, version)

    def __call__(self, table: Any) -> Any:
        return score_table(self.module, table)


def ray_data(paths: list[str], output: Path, tracking_uri: str, version: str) -> int:
    import ray.data

    ray.data.read_parquet(paths, num_cpus=READ_CPUS, override_num_blocks=FILES).map_batches(
        HandScorer,
        fn_constructor_kwargs={"tracking_uri": tracking_uri, "version": version},
        batch_format="pyarrow",
        batch_size=BATCH,
        compute=ray.data.ActorPoolStrategy(size=ACTORS),
        num_cpus=ACTOR_CPUS,
    ).write_parquet(str(output))
    return int(ray.data.read_parquet(str(output)).count())


def ours(folder: Path, output: Path) -> tuple[int, dict[str, float]]:
    """The flow's rows, and the seconds of its Ray Data pipeline alone (from the manifest)."""
    from prefect_ml.flows.predict import batch_predict
    from prefect_ml.tasks.params import PredictParams

    params = PredictParams(
        model_name=MODEL_NAME, url=str(folder), output=str(output), batch_size=BATCH, force=True
    )
    manifest = batch_predict(params).manifest
    return manifest.rows, {"pipeline_seconds": round(manifest.seconds, 3)}


def warm_prefect() -> None:
    from prefect import flow

    flow(name="warm-up")(lambda: None)()


def timed(arm: Any, *args: Any) -> dict[str, float]:
    """The arm's rows, seconds end to end and rows/s; an arm may return details with its rows."""
    started = time.perf_counter()
    returned = arm(*args)
    seconds = time.perf_counter() - started
    rows, details = returned if isinstance(returned, tuple) else (returned, {})
    return {
        "rows": rows,
        "seconds": round(seconds, 3),
        "rows_per_s": round(rows / seconds, 1),
        **details,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 rows")
    args = parser.parse_args()
    rows = 100_000 if args.quick else args.rows
    with embedded_home() as (tmp, settings):
        import ray

        folder = tmp / "rows"
        paths = generate(folder, rows)
        version = register(settings)
        uri = settings.resolved_tracking_uri
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            warm_prefect()  # a flow run's API is up in a deployment; a fresh home starts one
            cores = os.cpu_count() or 1
            results = {
                "single-process": timed(single_process, paths, tmp / "out-1", uri, version, 1),
                "single-process-all-threads": timed(
                    single_process, paths, tmp / "out-all", uri, version, cores
                ),
                # Either order gives the same numbers (measured: 0.72x and 0.73x of ray-data).
                "ours": timed(ours, folder, tmp / "out-ours"),
                "ray-data": timed(ray_data, paths, tmp / "out-ray-data", uri, version),
            }
        finally:
            ray.shutdown()
    for name, result in results.items():
        assert result["rows"] == rows, f"{name} wrote {result['rows']} rows of {rows}"
    ratios = {
        peer: round(results["ours"]["rows_per_s"] / results[peer]["rows_per_s"], 2)
        for peer in ("single-process", "single-process-all-threads", "ray-data")
    }
    report = {
        "rows": rows,
        "features": FEATURES,
        "files": FILES,
        "batch_size": BATCH,
        "model": MODEL,
        "actors": ACTORS,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "results": results,
        "ratios": ratios,
        "targets": {"single-process": 1.8, "ray-data": 0.9},
    }
    table = "\n".join(
        [
            "| arm | rows/s | seconds | ours / arm |",
            "|---|---|---|---|",
            *(
                f"| {name} | {r['rows_per_s']:,.0f} | {r['seconds']:.1f} | "
                f"{ratios.get(name, 1.0):.2f} |"
                for name, r in results.items()
            ),
        ]
    )
    name = "predict.quick.json" if args.quick else "predict.json"
    save_report(report, RESULTS_DIR / name, table)


if __name__ == "__main__":
    main()
