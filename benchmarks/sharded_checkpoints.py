"""Checkpoint time of gathered vs sharded writes on S3, as the state grows, with 2 and 4 ranks.

The ranks are a real gloo group of spawned processes (one torch thread each), holding the
FSDP2-sharded state of a model of ``LAYERS`` bias-free linear layers (float32, 100 MB to
2 GB in all; the parameters are created on the meta device, sharded by ``fully_shard``, then
materialised, so no rank ever holds the whole model). The S3 server is moto's, in a child
process (``benchmarks.checkpoints.s3_endpoint``).

Each arm writes one committed, verified-on-read checkpoint of the model's state, the code the
training loop runs:

* ``gathered``: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (the gather
  to rank 0), ``training.to_files`` and ``CheckpointStore.save`` on rank 0;
* ``sharded``: every rank's ``get_model_state_dict`` (its DTensor shards),
  ``ShardedSnapshot.take`` (the CPU copy the loop blocks for) and
  ``training.commit_sharded`` (DCP save over the checkpoint group, each rank's
  upload through the store, the gather of the listings, rank 0's commit).

Checkpoint time runs from a barrier before the snapshot to a barrier after the commit, on rank
0; the part the training loop would block for (gathered: gather and serialise; sharded: the
CPU copy) is reported apart. Arms alternate, the order rotated per repeat; one untimed warm-up
of both arms at the smallest size runs first; the median of the repeats is reported. After
each timing the checkpoint's manifest is checked (every rank's files listed; the smallest size
is read back whole and verified) and its objects are deleted, untimed.

Run ``.venv/bin/python -m benchmarks.sharded_checkpoints`` (``--quick``: 20 and 50 MB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.checkpoints import BUCKET, MB, s3_endpoint  # noqa: E402
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

if TYPE_CHECKING:
    import torch

LAYERS = 8  # linear layers of equal size; each is one FSDP unit
COLUMNS = 1000
ARMS = ("gathered", "sharded")
TARGET = 0.6  # sharded seconds over gathered, 4 ranks, largest size
# (sizes in MB, ranks, repeats)
FULL, QUICK = ((100, 500, 2000), (2, 4), 2), ((20, 50), (2, 4), 1)


def sharded_model(megabytes: int) -> torch.nn.Module:
    """``LAYERS`` linear layers of ``megabytes`` MB in all, sharded by FSDP2 over every rank,
    each rank's shard filled with its own random values."""
    import torch
    from torch.distributed.fsdp import fully_shard

    rows = megabytes * MB // 4 // LAYERS // COLUMNS
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *(torch.nn.Linear(COLUMNS, rows, bias=False) for _ in range(LAYERS))
        )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.to_local().normal_(generator=generator)
    return model


def gathered_checkpoint(model: torch.nn.Module, url: str, rank: int) -> dict[str, float]:
    """Rank 0 gathers, serialises and saves; the seconds of each part (rank 0's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from prefect_ml.integrations.storage import CheckpointStore
    from prefect_ml.integrations.training import to_files

    started = time.perf_counter()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    gathered = time.perf_counter()
    if rank != 0:
        return {}
    files = to_files({"model": state})
    del state
    serialised = time.perf_counter()
    CheckpointStore(url).save(1, files)
    return {
        "gather_s": gathered - started,
        "serialise_s": serialised - gathered,
        "blocking_s": serialised - started,
        "commit_s": time.perf_counter() - serialised,
    }


def sharded_checkpoint(model: torch.nn.Module, url: str, group: Any) -> dict[str, float]:
    """Every rank copies its shards, then writes and commits them; rank 0's seconds."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from prefect_ml.integrations.storage import CheckpointStore
    from prefect_ml.integrations.training import ShardedSnapshot, commit_sharded

    started = time.perf_counter()
    snapshot = ShardedSnapshot.take({"model": get_model_state_dict(model)}, {}, group)
    staged = time.perf_counter()
    commit_sharded(CheckpointStore(url), 1, snapshot)
    return {"blocking_s": staged - started, "commit_s": time.perf_counter() - staged}


def check_and_clean(url: str, world: int, layout: str, verify: bool) -> None:
    """Untimed, on rank 0: the manifest lists what it should (``verify``: every file read back
    and checked), then the checkpoint's objects go."""
    from prefect_ml.integrations import storage
    from prefect_ml.integrations.storage import MANIFEST, CheckpointStore

    store = CheckpointStore(url)
    manifest = json.loads(storage.read_bytes(storage.join(store.url_for(1), MANIFEST)))
    shards = {name for name in manifest["files"] if name.endswith(".distcp")}
    expected = (
        {f"__{r}_0.distcp" for r in range(world)} if layout == "sharded" else {"__0_0.distcp"}
    )
    if shards != expected or ".metadata" not in manifest["files"]:
        raise AssertionError(f"{layout}: the manifest lists {sorted(manifest['files'])}")
    if verify and store.load(1).epoch != 1:
        raise AssertionError(f"{layout}: the checkpoint did not verify")
    fs, path = storage.filesystem(url)
    fs.rm(path, recursive=True)


def worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out: str) -> None:
    """One rank: every size, every arm, ``repeats`` times; rank 0 writes the seconds."""
    import torch
    import torch.distributed as dist

    from prefect_ml.integrations.training import checkpoint_group

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    group = checkpoint_group()
    results: dict[str, Any] = {}
    plan = [(sizes[0], -1)] + [(size, repeat) for size in sizes for repeat in range(repeats)]
    model, model_size = None, None
    for size, repeat in plan:
        if size != model_size:
            del model
            gc.collect()
            model, model_size = sharded_model(size), size
        arms = ARMS if repeat % 2 == 0 else ARMS[::-1]
        for arm in arms:
            url = f"s3://{BUCKET}/sharded-bench/{world}/{size}/{arm}/{repeat}"
            dist.barrier()
            started = time.perf_counter()
            if arm == "gathered":
                parts = gathered_checkpoint(model, url, rank)
            else:
                parts = sharded_checkpoint(model, url, group)
            dist.barrier()
            seconds = time.perf_counter() - started
            gc.collect()
            if rank == 0:
                check_and_clean(url, world, arm, verify=size == sizes[0])
                if repeat >= 0:
                    entry = results.setdefault(str(size), {}).setdefault(arm, [])
                    entry.append({"seconds": seconds, **parts})
                print(
                    f"  {world} ranks, {size} MB, {arm}, repeat {repeat}: {seconds:.2f} s",
                    flush=True,
                )
            dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def run_ranks(world: int, sizes: list[int], repeats: int, work: Path) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    out = work / f"ranks-{world}.json"
    mp.start_processes(
        worker,
        args=(world, free_port(), sizes, repeats, str(out)),
        nprocs=world,
        start_method="spawn",
    )
    return dict(json.loads(out.read_text()))


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians per arm and the sharded / gathered ratio, per rank count and size."""
    summary: dict[str, Any] = {}
    for world, by_size in results.items():
        for size, arms in by_size.items():
            medians = {
                arm: {part: statistics.median(run[part] for run in runs) for part in runs[0]}
                for arm, runs in arms.items()
            }
            ratio = medians["sharded"]["seconds"] / medians["gathered"]["seconds"]
            blocking = medians["sharded"]["blocking_s"] / medians["gathered"]["blocking_s"]
            summary.setdefault(world, {})[size] = {
                "medians": medians,
                "sharded_over_gathered": ratio,
                "blocking_sharded_over_gathered": blocking,
            }
    return summary


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| ranks | state MB | gathered s | of which gather / serialise / upload s "
        "| sharded s | of which copy / write+commit s | sharded / gathered "
        "| blocking sharded / gathered |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, by_size in report["summary"].items():
        for size, row in by_size.items():
            g, s = row["medians"]["gathered"], row["medians"]["sharded"]
            lines.append(
                f"| {world} | {size} | {g['seconds']:.2f} "
                f"| {g['gather_s']:.2f} / {g['serialise_s']:.2f} / {g['commit_s']:.2f} "
                f"| {s['seconds']:.2f} | {s['blocking_s']:.2f} / {s['commit_s']:.2f} "
                f"| **{row['sharded_over_gathered']:.2f}x** "
                f"| {row['blocking_sharded_over_gathered']:.3f}x |"
            )
    largest = str(max(report["sizes_mb"]))
    ratio = report["summary"].get("4", {}).get(largest, {}).get("sharded_over_gathered")
    if ratio is not None:
        met = "met" if ratio <= TARGET else "MISSED"
        lines += [
            "",
            f"4 ranks, {largest} MB: sharded / gathered = {ratio:.2f}x "
            f"(target <= {TARGET}x): {met}",
        ]
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    sizes, ranks, repeats = args.plan
    with embedded_home() as (tmp, _settings):
        import moto
        import torch

        load_before = os.getloadavg()
        with s3_endpoint(in_process=False) as endpoint:
            print(f"moto {moto.__version__} at {endpoint}", flush=True)
            results = {str(world): run_ranks(world, list(sizes), repeats, tmp) for world in ranks}
    report: dict[str, Any] = {
        "benchmark": "sharded_checkpoints",
        "quick": args.quick,
        "sizes_mb": list(sizes),
        "ranks": list(ranks),
        "repeats": repeats,
        "layers": LAYERS,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "moto": moto.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "seconds": results,
    }
    report["summary"] = summarize(results)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 and 50 MB, once")
    parser.add_argument(
        "--output", type=Path, help="JSON results [results/sharded_checkpoints.json]"
    )
    parser.add_argument("--sizes", type=int, nargs="+", help="state sizes in MB (a rerun)")
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts (a rerun)")
    parser.add_argument("--repeats", type=int, help="timed repeats of each arm")
    args = parser.parse_args(argv)
    sizes, ranks, repeats = QUICK if args.quick else FULL
    args.plan = (args.sizes or sizes, args.ranks or ranks, args.repeats or repeats)
    args.output = args.output or results_path("sharded_checkpoints", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run_benchmark(args)
    save_report(report, args.output, markdown(report))


if __name__ == "__main__":
    main()
