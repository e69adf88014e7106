"""The five-minute GPU check: what prefect-ml does on a GPU, run where only torch is installed.

    python3 benchmarks/gpu_check.py [--budget-s 300] [--output PATH]

Needs torch, numpy, pydantic, pydantic-settings and pytest; no Ray, Prefect or MLflow (machines
lent for quick GPU checks often have only the torch stack). In order, within the budget:

1. **tests**: the torch-only test files (device detection, DDP/FSDP, precision, collectives,
   serving's forward pass), ``@gpu`` tests included, with ``--noconftest`` so that the suite's
   conftest (which starts Prefect and moto) is not imported;
2. **training**: ``EpochTrainer``, the step of every Ray Train worker and campaign trial, in a
   real process group (NCCL on GPUs, gloo on CPU): DDP and FSDP, each precision, with and without
   gradient checkpointing; two epochs, a checkpoint, then a fresh trainer that must resume at
   epoch 3;
3. **serving**: the replica's forward pass (``integrations.serving.Predictor``) on the device a
   GPU replica gets: one-row latency and 32-row throughput per precision;
4. **precision**: ``benchmarks/precision.py --budget-s`` with the time left (ours/bare samples/s
   per precision, gradient checkpointing's activation memory cut and slowdown).

On a CPU machine the same command runs the CPU equivalents and lists what it skipped and why.
It writes one JSON (``benchmarks/results/gpu_check.<cuda|cpu>.json``) and exits 1 when a test or
a training combination failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

TORCH_ONLY_TESTS = [
    "tests/integrations/test_devices.py",
    "tests/integrations/test_collectives.py",
    "tests/integrations/test_inference.py",
    "tests/integrations/test_parallel_training.py",
]
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
SERVING_CALLS = 200
FEATURES, CLASSES = 64, 10  # of the training check's data
PARTS = ("tests", "training", "serving", "precision")
PRECISION_BENCHMARK_MIN_S = 45  # below this, the precision run is skipped rather than cut short


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": "cuda" if cuda else "cpu",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "bf16_supported": bool(cuda and torch.cuda.is_bf16_supported()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return info


# ---------------------------------------------------------------- 1. the torch-only tests


def run_tests(timeout_s: float) -> dict[str, Any]:
    """The torch-only test files in a child pytest; counts, failures and skip reasons."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        report = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--noconftest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            *TORCH_ONLY_TESTS,
        ]
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command,
                cwd=REPO_ROOT,
                # Only pytest itself: plugins of a fuller environment may import what is not here.
                env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"pytest ran past {timeout_s:.0f} s"}
        if not report.exists():
            return {"ok": False, "error": (done.stdout + done.stderr)[-4000:]}
        cases = list(ElementTree.parse(report).getroot().iter("testcase"))
    outcome: dict[str, Any] = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            outcome["failed"].append({"test": name, "message": failure.get("message", "")})
        elif skipped is not None:
            outcome["skipped"].append({"test": name, "reason": skipped.get("message", "")})
        else:
            outcome["passed"].append(name)
    return {
        "ok": done.returncode == 0 and not outcome["failed"],
        "seconds": round(time.perf_counter() - started, 1),
        "counts": {key: len(value) for key, value in outcome.items()},
        "failed": outcome["failed"],
        "skipped": outcome["skipped"],
        "tail": done.stdout[-1500:] if done.returncode else "",
    }


# ---------------------------------------------------------------- 2. training in a process group


def training_combinations(device_type: str) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Every (strategy, precision, checkpointing) to run here, and the ones skipped with why."""
    import torch

    run, skipped = [], []
    for strategy in STRATEGIES:
        for precision in PRECISIONS:
            for checkpointing in (False, True):
                combo = {
                    "strategy": strategy,
                    "precision": precision,
                    "gradient_checkpointing": checkpointing,
                }
                if precision == "fp16" and device_type == "cpu":
                    skipped.append({**combo, "reason": "fp16 trains on GPUs only"})  # type: ignore[dict-item]
                elif (
                    precision == "bf16"
                    and device_type == "cuda"
                    and not (torch.cuda.is_bf16_supported())
                ):
                    skipped.append({**combo, "reason": "this GPU has no bf16"})  # type: ignore[dict-item]
                else:
                    run.append(combo)
    return run, skipped


def _worker_shard(rank: int, world: int) -> tuple[Any, Any]:
    """This rank's rows of a learnable random dataset (the label: the largest of 10 columns)."""
    import numpy as np

    from prefect_ml.integrations.datasets import shard_bounds

    rows = 4096
    x = np.random.default_rng(0).standard_normal((rows, FEATURES), dtype=np.float32)
    y = x[:, :CLASSES].argmax(axis=1).astype(np.int64)
    start, stop = shard_bounds(rows, rank, world)
    return x[start:stop], y[start:stop]


def _trainer(
    combo: dict[str, Any], checkpoint_url: str, shard: Any, rank: int, world: int, device: Any
) -> Any:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from prefect_ml.integrations.config.loop import TrainLoop
    from prefect_ml.integrations.datasets import ArrayShard
    from prefect_ml.integrations.training import EpochTrainer

    def ddp(model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(device)
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None
        )

    config = TrainLoop.from_options(
        splits_url="",
        sample_shape=[FEATURES],
        num_classes=CLASSES,
        model="mlp",
        model_options={"hidden": 256, "depth": 4, "dropout": 0.0},
        epochs=3,
        batch_size=256,
        lr=3e-3,
        optimizer="adam",
        weight_decay=0.0,
        scheduler="none",
        seed=0,
        checkpoint_url=checkpoint_url,
        tracking_uri="",
        run_id="",
        precision=combo["precision"],
        gradient_checkpointing=combo["gradient_checkpointing"],
        use_gpu=device.type == "cuda",
        strategy=combo["strategy"],
    )
    return EpochTrainer(
        config,
        rank=rank,
        world_size=world,
        device=device,
        prepare_model=ddp,
        shards={"train": ArrayShard(*shard), "val": ArrayShard(*shard)},
    )


def _train_and_resume(
    combo: dict[str, Any], root: Path, shard: Any, rank: int, world: int, device: Any
) -> dict[str, Any]:
    """Two epochs and a checkpoint, then a fresh trainer that resumes at epoch 3."""
    import torch.distributed as dist

    from prefect_ml.integrations import training

    url = (
        root / f"{combo['strategy']}-{combo['precision']}-{combo['gradient_checkpointing']}"
    ).as_uri()
    trainer = _trainer(combo, url, shard, rank, world, device)
    epochs = [trainer.train_epoch(epoch) for epoch in (1, 2)]
    files = trainer.snapshot(2)  # a collective under FSDP: every rank calls it
    if isinstance(files, training.ShardedSnapshot):  # every rank writes its part
        training.commit_sharded(trainer.store, 2, files)
    elif rank == 0:
        trainer.store.save(2, files)
    dist.barrier()
    resumed = _trainer(combo, url, shard, rank, world, device)
    third = resumed.train_epoch(resumed.first_epoch)
    if resumed.first_epoch != 3:
        raise AssertionError(f"resumed at epoch {resumed.first_epoch}, not 3")
    if not third["train_loss"] < epochs[0]["train_loss"]:
        raise AssertionError(
            f"loss did not fall: {epochs[0]['train_loss']} -> {third['train_loss']}"
        )
    return {
        "train_loss": [round(e["train_loss"], 4) for e in (*epochs, third)],
        "val_accuracy": round(third["val_accuracy"], 4),
        "samples_per_second": round(
            statistics.median(e["samples_per_second"] for e in epochs[1:] + [third])
        ),
        "peak_memory_mib": round(max(e["peak_memory_mib"] for e in (*epochs, third)), 1),
    }


def _training_worker(
    rank: int, world: int, port: int, combos: list[dict[str, Any]], out: str
) -> None:
    import torch
    import torch.distributed as dist

    from prefect_ml.integrations import compute

    use_gpu = torch.cuda.is_available()
    if use_gpu:
        torch.cuda.set_device(rank)
    device = compute.training_device(use_gpu, local_rank=rank)
    backend = compute.collective_backend(use_gpu)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = []
    root = Path(out).parent / "checkpoints"  # shared by the ranks
    shard = _worker_shard(rank, world)
    for combo in combos:
        started = time.perf_counter()
        try:
            measured = _train_and_resume(combo, root, shard, rank, world, device)
            results.append({**combo, "ok": True, **measured})
        except Exception as exc:  # reported in the JSON; the check carries on
            failure = f"{type(exc).__name__}: {exc}"
            results.append(
                {
                    **combo,
                    "ok": False,
                    "error": failure,
                    "traceback": traceback.format_exc()[-2000:],
                }
            )
        results[-1]["seconds"] = round(time.perf_counter() - started, 2)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"backend": backend, "device": str(device), "results": results})
        )
    # FSDP's device meshes hold process groups: freed after the group is destroyed (at
    # interpreter exit), gloo's threads abort the process now and then.
    gc.collect()
    dist.destroy_process_group()


def run_training() -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    combos, skipped = training_combinations(device_type)
    # NCCL wants one GPU per rank; on CPU two gloo ranks make the reductions real.
    world = min(2, torch.cuda.device_count()) if device_type == "cuda" else 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "training.json"
        started = time.perf_counter()
        mp.start_processes(
            _training_worker,
            args=(world, free_port(), combos, str(out)),
            nprocs=world,
            start_method="spawn",
        )
        found = json.loads(out.read_text())
    return {
        **found,
        "workers": world,
        "ok": all(r["ok"] for r in found["results"]),
        "seconds": round(time.perf_counter() - started, 1),
        "skipped": skipped,
    }


# ---------------------------------------------------------------- 3. serving's forward pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _latencies(predictor: Any, rows: Any, count: int) -> list[float]:
    """Seconds of each of ``count`` forward passes of ``rows`` (host to host, synchronous)."""
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        predictor.probabilities(rows)
        seconds.append(time.perf_counter() - started)
    return seconds


def run_serving() -> dict[str, Any]:
    """The replica's forward pass where a one-GPU replica computes: p50/p99 of one row at a
    time (c=1) and rows/s of 32-row batches (what the batcher sends under load)."""
    import numpy as np
    import torch

    from prefect_ml.integrations.datasets import build_model
    from prefect_ml.integrations.serving import Predictor, serving_device

    cuda = torch.cuda.is_available()
    device = serving_device(1.0 if cuda else 0.0, cuda)
    rows = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    results, skipped = [], []
    for precision in PRECISIONS:
        if precision != "fp32" and not cuda:
            skipped.append(
                {"precision": precision, "reason": "bf16/fp16 inference needs a GPU replica"}
            )
            continue
        torch.manual_seed(0)
        model = build_model("cnn", [1, 8, 8], 10, {}).eval()
        reference = Predictor(model, [1, 8, 8], torch.device("cpu")).probabilities(rows)
        predictor = Predictor(model, [1, 8, 8], device, precision)  # type: ignore[arg-type]
        found = predictor.probabilities(rows)
        agrees = bool(np.allclose(found, reference, atol=1e-4 if precision == "fp32" else 3e-2))
        on_device = all(p.device.type == device.type for p in predictor.model.parameters())
        _latencies(predictor, rows[:1], 20)  # warm-up: kernels, allocator
        single = _latencies(predictor, rows[:1], SERVING_CALLS)
        batched = _latencies(predictor, rows, SERVING_CALLS // 4)
        results.append(
            {
                "precision": precision,
                "device": asdict(predictor.describe()),
                "ok": agrees and on_device,
                "agrees_with_cpu_fp32": agrees,
                "model_on_device": on_device,
                "c1_p50_ms": round(1000 * statistics.median(single), 3),
                "c1_p99_ms": round(1000 * sorted(single)[int(0.99 * len(single)) - 1], 3),
                "batch32_rows_per_second": round(32 / statistics.median(batched)),
            }
        )
    return {"ok": all(r["ok"] for r in results), "results": results, "skipped": skipped}


# ---------------------------------------------------------------- 4. the budgeted precision run


def run_precision(budget_s: float) -> dict[str, Any]:
    if budget_s < PRECISION_BENCHMARK_MIN_S:
        return {"skipped": f"{budget_s:.0f} s left, under {PRECISION_BENCHMARK_MIN_S} s"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        output = Path(tmp) / "precision.json"
        command = [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "precision.py"),
            "--budget-s",
            str(int(budget_s)),
            "--output",
            str(output),
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + 60)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "the precision run overran its budget"}
        if done.returncode != 0 or not output.exists():
            return {"ok": False, "error": (done.stdout + done.stderr)[-3000:]}
        report = json.loads(output.read_text())
    return {
        "ok": True,
        "skipped_for_budget": report.get("skipped_for_budget", []),
        "summary": report["summary"],
        "arms": [
            {
                "workload": arm["workload"]["name"],
                "precision": arm["precision"],
                "checkpointing": arm["checkpointing"],
                "loop": arm["loop"],
                "samples_per_second": round(arm["summary"]["samples_per_second"]),
                "ours_over_bare_samples_per_second": round(
                    arm["summary"]["ours_over_bare"]["samples_per_second"], 3
                ),
                "step_peak_mib": round(arm["summary"]["step_peak_mib"], 1),
            }
            for arm in report["arms"]
        ],
    }


# ---------------------------------------------------------------- the command


def _combo_label(combo: dict[str, Any]) -> str:
    checkpointing = " + gradient checkpointing" if combo["gradient_checkpointing"] else ""
    return f"{combo['strategy']} {combo['precision']}{checkpointing}"


def skipped_lines(report: dict[str, Any]) -> list[str]:
    """Everything the check did not run here, each with its reason."""
    lines = [f"{part}: {report[part]['skipped']}" for part in PARTS if _part_skipped(report[part])]
    details = {
        "tests": lambda s: f"test {s['test']}: {s['reason']}",
        "training": lambda s: f"training {_combo_label(s)}: {s['reason']}",
        "serving": lambda s: f"serving {s['precision']}: {s['reason']}",
    }
    for part, line in details.items():
        if not _part_skipped(report[part]):
            lines += [line(item) for item in report[part].get("skipped", [])]
    lines += [f"precision: {s}" for s in report["precision"].get("skipped_for_budget", [])]
    return lines


def _part_skipped(result: dict[str, Any]) -> bool:
    return isinstance(result.get("skipped"), str)


def progress_line(part: str, result: dict[str, Any]) -> str:
    if _part_skipped(result):
        return f"  {part}: skipped ({result['skipped']})"
    if "error" in result:
        return f"  {part}: FAILED ({result['error'][-300:]})"
    if part == "tests":
        return f"  tests: {result['counts']} in {result['seconds']} s"
    if part == "training":
        good = sum(r["ok"] for r in result["results"])
        return f"  training: {good}/{len(result['results'])} combinations ok ({result['backend']})"
    if part == "serving":
        latencies = ", ".join(f"{r['precision']} {r['c1_p50_ms']} ms" for r in result["results"])
        return f"  serving: p50 at c=1: {latencies}"
    return f"  {part}: {'ok' if result['ok'] else 'FAILED'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--budget-s", type=float, default=300, help="wall-clock budget [300]")
    parser.add_argument(
        "--output", type=Path, help="JSON [benchmarks/results/gpu_check.<device>.json]"
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of {', '.join(PARTS)} [all]",
    )
    args = parser.parse_args(argv)
    chosen = args.parts.split(",")
    if unknown := sorted(set(chosen) - set(PARTS)):
        parser.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    deadline = time.monotonic() + args.budget_s
    report: dict[str, Any] = {"check": "gpu", "budget_s": args.budget_s}
    report["environment"] = env = environment()
    output = args.output or REPO_ROOT / "benchmarks" / "results" / f"gpu_check.{env['device']}.json"
    print(f"gpu check on {env['device']} {env['gpus']}, budget {args.budget_s:.0f} s", flush=True)
    parts = {
        "tests": lambda: run_tests(timeout_s=max(30.0, 0.4 * args.budget_s)),
        "training": run_training,
        "serving": run_serving,
        "precision": lambda: run_precision(deadline - time.monotonic() - 10),
    }
    for part, run in parts.items():
        report[part] = run() if part in chosen else {"skipped": "not in --parts"}
        print(progress_line(part, report[part]), flush=True)
    report["skipped"] = skipped_lines(report)
    report["ok"] = all(report[part].get("ok", True) for part in parts)
    report["seconds"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"skipped ({len(report['skipped'])}):")
    for line in report["skipped"]:
        print(f"  - {line}")
    print(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s; results: {output}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
