"""Precision and gradient checkpointing: what bf16 (and fp16 on CUDA) and gradient
checkpointing cost and save in our training step, against a bare PyTorch loop, in one run.

An arm is one loop on one workload at one precision, with or without checkpointing:

* ``ours``: ``integrations.training.EpochTrainer`` (the step our Ray Train workers and campaign
  trials run) built from ``TrainLoop.from_options(precision=..., gradient_checkpointing=...)``, on
  in-memory shards, in one process;
* ``bare``: the bare-limit peer, the same catalog model, Adam and batches in a hand-written loop:
  ``torch.autocast`` around the forward, ``torch.amp.GradScaler`` for fp16 only, and
  ``torch.utils.checkpoint.checkpoint_sequential`` (sqrt(len) segments) for checkpointing.

Both loops shuffle the same random data, train ``steps`` batches per epoch (one on CPU) and then
evaluate 8 rows. Every run starts with one untimed warm-up epoch. Each arm is run twice, in
fresh child processes (``--child``; ``--quick`` makes all its runs in one process):

* a **memory** run, alone in its process, so that its peak RSS and step memory are its own;
* a **throughput** run, in one process per workload whose arms take turns epoch by epoch (the
  first arm changes every epoch), so that a slow spell of this shared machine falls on all of
  them alike. On CPU, a post-hook on the optimiser stamps the end of every step; a step's time
  runs from the previous stamp (or its epoch's start) to its own, and samples/s is the batch over
  the median step. On CUDA, whose steps are asynchronous, it is the median synchronised epoch.

**Peak memory per epoch.** CPU: the child's peak RSS (``VmHWM`` in ``/proc/self/status``), reset
at the start of each epoch by writing ``5`` to ``/proc/self/clear_refs`` (what our step's own
``peak_memory_mib`` metric reports, and it agrees); *above resting* subtracts the RSS the child
had before building the model (interpreter, torch, the data). CUDA:
``torch.cuda.max_memory_allocated``, reset per epoch (tensors only; nothing is subtracted). Both
loops import the same modules, so their baselines match.

**Step memory (peak activation memory).** After its epochs, the memory run does one training
forward and backward of one batch with the gradients already allocated
(``zero_grad(set_to_none=False)``): they are the same with or without checkpointing and are not
activations; the optimiser step is left out. *Peak* is the most bytes live during
forward+backward above what was live before it (activations, autocast's low-precision weight
copies, backward's temporaries); *held* is what the forward leaves for the backward. CUDA:
``max_memory_allocated`` and ``memory_allocated`` against the bytes allocated before the forward.
CPU has no allocator statistics, so the step runs under
``torch.profiler.profile(profile_memory=True)``: torch's CPU allocator then reports every
allocation and free, with its size and a nanosecond timestamp, as a ``[memory]`` event. Summing
them in time order gives the bytes live at every moment, exactly, for tensor memory only (not
Python objects, not the allocator's slack). A ``record_function`` marker splits forward from
backward. Frees of tensors that existed before profiling are not reported, which is why the
measured step must free none (the gradients stay, the batch exists before). The method is checked
on known answers first (``method_check`` in the JSON): a Linear's forward allocates exactly its
output; Linear then ReLU peaks at two outputs and holds one. The deep MLP's *held* is also
compared with its expected size: 12 bytes per hidden element per layer in fp32 on CPU (ReLU's
output, dropout's noise tensor and dropout's output are saved for backward; 9 on CUDA, whose fused
dropout keeps a 1-byte mask). Glibc's ``mallinfo2()`` sampled from module hooks was the
alternative; it counts every malloc (Python's too) and only at the moments a hook fires, so peaks
inside an op are missed.

**Workloads** (CPU; a GPU runs larger ones, see ``SIZES``): ``mlp``, ``build_mlp`` hidden 1024,
depth 8 on 64 features, batch 256; ``cnn``, ``build_cnn`` (32 channels) on 1x32x32 images,
batch 128; ``deep-mlp`` (the checkpointing part), ``build_mlp`` hidden 1024, depth 32, batch 512.
Targets (issue 7): checkpointing cuts peak activation memory by >= 50% at <= 35% slowdown.

Run ``make bench`` or ``.venv/bin/python benchmarks/precision.py --quick`` (tiny sizes, the mlp
and deep-mlp workloads, in one process; written to ``results/precision.quick.json``). On a GPU
machine the same command adds fp16 arms and labels the rows with the GPU. ``--from-json PATH``
re-derives the tables of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

if TYPE_CHECKING:
    import torch

ACTIVATION_TARGET = 0.50  # checkpointing must cut peak activation memory by at least this share
SLOWDOWN_TARGET = 0.35  # ... while making a training step at most this much slower
CLASSES = 10
LR = 1e-3
THREADS = 2  # torch threads on CPU: this machine's cores
WARMUP_EPOCHS = 1
VALIDATION_ROWS = 8
MIB = 2**20
BACKWARD_MARK = "precision-benchmark.backward"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
LOOPS = ("ours", "bare")


@dataclass(frozen=True)
class Workload:
    """One model on one kind of random data: ``steps`` batches of ``batch`` rows per epoch."""

    name: str
    model: str  # a catalog name
    input_shape: tuple[int, ...]
    options: dict[str, Any]
    batch: int
    steps: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Workload:
        """From ``asdict`` output that went through JSON (the shape comes back as a list)."""
        return cls(**{**raw, "input_shape": tuple(raw["input_shape"])})

    def describe(self) -> str:
        options = ", ".join(f"{k} {v}" for k, v in self.options.items())
        shape = "x".join(str(d) for d in self.input_shape)
        return f"{self.model} ({options}) on {shape}, batch {self.batch}"


def _workloads(
    mlp: tuple[int, int, int], cnn: tuple[int, int, int], deep: tuple[int, int, int], steps: int
) -> dict[str, Workload]:
    """(hidden, depth, batch) of the MLPs and (channels, image side, batch) of the CNN."""
    return {
        "mlp": Workload("mlp", "mlp", (64,), {"hidden": mlp[0], "depth": mlp[1]}, mlp[2], steps),
        "cnn": Workload("cnn", "cnn", (1, cnn[1], cnn[1]), {"channels": cnn[0]}, cnn[2], steps),
        "deep-mlp": Workload(
            "deep-mlp", "mlp", (64,), {"hidden": deep[0], "depth": deep[1]}, deep[2], steps
        ),
    }


# Sizes where compute dominates. On CPU an epoch is one step, so that the arms of a throughput
# run take turns step by step; bf16 steps there take seconds (no AVX512-BF16/AMX on this CPU).
# A GPU needs far larger models before its step stops being launch-bound.
SIZES = {
    "cpu": _workloads((1024, 8, 256), (32, 32, 128), (1024, 32, 512), steps=1),
    "cuda": _workloads((4096, 8, 4096), (64, 64, 512), (4096, 32, 4096), steps=10),
    "quick": _workloads((256, 4, 128), (8, 16, 32), (256, 16, 256), steps=1),
}
# Measured epochs, after the warm-up, of a memory run and of a throughput run.
EPOCHS = {"full": (2, 12), "quick": (1, 2), "budget": (0, 3)}
# Under --budget-s: throughput runs only (memory from the same runs), the checkpointing part
# first (its targets are the verdict), then the workloads in this order until time runs out.
BUDGET_ORDER = ("deep-mlp", "mlp", "cnn")


# ---------------------------------------------------------------- memory, in the child process


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_memory(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:  # "5" resets only VmHWM to the current RSS (Linux >= 4.0, proc(5))
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")


def peak_memory_bytes(device: torch.device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _proc_status_bytes("VmHWM")


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def live_bytes(
    forward: Callable[[], Any], backward: Callable[[Any], None], device: torch.device
) -> dict[str, int]:
    """Peak bytes live during ``backward(forward())`` and bytes held between the two, both above
    what was live before (see the module docstring for how, on CPU and CUDA)."""
    import torch

    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = forward()
        synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        backward(result)
        synchronize(device)
        return {"peak": torch.cuda.max_memory_allocated(device) - before, "held": held}
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = forward()
        with record_function(BACKWARD_MARK):
            backward(result)
    del result
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    events = prof.profiler.kineto_results.events()
    backward_at = min((e.start_ns() for e in events if e.name() == BACKWARD_MARK), default=None)
    # Stable sort: events with the same timestamp keep the order they were recorded in.
    memory = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"),
        key=lambda event: event[0],
    )
    live = peak = held = 0
    for at, size in memory:
        live += size
        peak = max(peak, live)
        if backward_at is None or at < backward_at:
            held = live
    return {"peak": peak, "held": held}


def method_check(device: torch.device) -> dict[str, Any]:
    """The step-memory method on cases with known answers (bytes measured vs expected)."""
    import torch

    batch, width = 512, 1024
    output = batch * width * 4
    x = torch.randn(batch, width, device=device)
    linear = torch.nn.Linear(width, width).to(device)
    stack = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()).to(device)
    cases = {}
    with torch.no_grad():
        stack(x)  # not measured: a GPU's first matmul allocates the cuBLAS workspace
        got = live_bytes(lambda: linear(x), lambda _: None, device)
        cases["linear forward: peak = held = one output"] = (got, {"peak": output, "held": output})
        got = live_bytes(lambda: stack(x), lambda _: None, device)
        cases["linear+relu forward: peak two outputs, holds one"] = (
            got,
            {"peak": 2 * output, "held": output},
        )
    checks = {
        name: {
            "measured": got,
            "expected": expected,
            "ok": all(abs(got[k] - expected[k]) <= 0.01 * expected[k] for k in expected),
        }
        for name, (got, expected) in cases.items()
    }
    return checks


# ---------------------------------------------------------------- the two loops


class OursArm:
    """Our training step: ``EpochTrainer`` with the arm's precision and checkpointing."""

    def __init__(
        self,
        workload: Workload,
        precision: str,
        checkpointing: bool,
        epochs: int,
        device: torch.device,
        shards: dict[str, Any],
        checkpoint_url: str,
    ) -> None:
        from prefect_ml.integrations.config.loop import TrainLoop
        from prefect_ml.integrations.datasets import ArrayShard
        from prefect_ml.integrations.training import EpochTrainer

        config = TrainLoop.from_options(
            splits_url="",
            sample_shape=list(workload.input_shape),
            num_classes=CLASSES,
            model=workload.model,
            model_options=dict(workload.options),
            epochs=epochs,
            batch_size=workload.batch,
            lr=LR,
            optimizer="adam",
            weight_decay=0.0,
            scheduler="none",
            seed=0,
            checkpoint_url=checkpoint_url,
            tracking_uri="",
            run_id="",
            precision=precision,
            gradient_checkpointing=checkpointing,
            use_gpu=device.type == "cuda",
        )
        self.precision, self.device = precision, device
        arrays = {split: ArrayShard(*rows) for split, rows in shards.items()}
        self.trainer = EpochTrainer(config, device=device, shards=arrays)
        self.model, self.optimizer = self.trainer.model, self.trainer.optimizer

    def autocast(self) -> AbstractContextManager[Any]:
        from prefect_ml.integrations.training import precision_context

        return precision_context(self.precision, self.device)  # type: ignore[no-any-return]

    def train_epoch(self, epoch: int) -> dict[str, float]:
        metrics = self.trainer.train_epoch(epoch)
        return {
            "train_loss": metrics["train_loss"],
            "reported_samples_per_second": metrics["samples_per_second"],
            "reported_peak_memory_mib": metrics["peak_memory_mib"],
        }


class BareArm:
    """The bare limit: the same catalog model and Adam in a plain hand-written loop."""

    def __init__(
        self,
        workload: Workload,
        precision: str,
        checkpointing: bool,
        device: torch.device,
        shards: dict[str, Any],
    ) -> None:
        import torch

        from prefect_ml.integrations.datasets import build_model

        torch.manual_seed(0)
        model = build_model(workload.model, workload.input_shape, CLASSES, dict(workload.options))
        assert isinstance(model, torch.nn.Sequential)  # every built-in model is
        self.model = model.to(device)
        # The split ``enable_gradient_checkpointing`` uses for an nn.Sequential.
        self.segments = max(1, math.isqrt(len(model))) if checkpointing else 0
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.precision, self.device, self.batch = precision, device, workload.batch
        self.features, self.labels = (torch.from_numpy(a).to(device) for a in shards["train"])
        self.val_features, self.val_labels = (torch.from_numpy(a).to(device) for a in shards["val"])

    def autocast(self) -> AbstractContextManager[Any]:
        import torch

        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, DTYPES[self.precision]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint_sequential

        if self.segments:
            return checkpoint_sequential(self.model, self.segments, x, use_reentrant=False)  # type: ignore[no-any-return]
        return self.model(x)  # type: ignore[no-any-return]

    def train_epoch(self, epoch: int) -> dict[str, float]:
        import torch
        import torch.nn.functional as F

        model, optimizer, rows = self.model, self.optimizer, len(self.labels)
        model.train()
        order = torch.randperm(rows, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        for start in range(0, rows, self.batch):
            index = order[start : start + self.batch]
            optimizer.zero_grad(set_to_none=True)
            with self.autocast():
                logits = self.forward(self.features[index])
            loss = F.cross_entropy(logits.float(), self.labels[index])
            if self.scaler is None:
                loss.backward()
                optimizer.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.step(optimizer)
                self.scaler.update()
            loss_sum += loss.detach() * len(index)
        model.eval()
        with torch.no_grad(), self.autocast():
            F.cross_entropy(model(self.val_features).float(), self.val_labels)
        return {"train_loss": float(loss_sum) / rows}


def step_memory(arm: OursArm | BareArm, features: Any, labels: Any) -> dict[str, int]:
    """``live_bytes`` of one training forward and backward of ``arm`` on one batch."""
    import torch.nn.functional as F

    arm.model.train()
    arm.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: not activations

    def forward() -> Any:
        with arm.autocast():
            logits = arm.model(features) if isinstance(arm, OursArm) else arm.forward(features)
        return F.cross_entropy(logits.float(), labels)

    return live_bytes(forward, lambda loss: loss.backward(), arm.device)


def make_shards(workload: Workload) -> dict[str, tuple[Any, Any]]:
    """Random features and labels: ``steps`` batches to train on, a few rows to validate on
    (so that an epoch's wall time is its training steps, in both loops)."""
    import numpy as np

    rng = np.random.default_rng(0)

    def split(rows: int) -> tuple[np.ndarray, np.ndarray]:
        features = rng.standard_normal((rows, *workload.input_shape), dtype=np.float32)
        return features, rng.integers(0, CLASSES, rows).astype(np.int64)

    return {"train": split(workload.batch * workload.steps), "val": split(VALIDATION_ROWS)}


def run_job(specs: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Train the arms of ``specs`` (one workload) side by side in this process, then measure
    each one's step memory.

    Epoch ``e`` of every arm runs before epoch ``e + 1`` of any, starting from a different arm
    each time, so that a slow spell of the machine falls on all of them alike; with one spec
    this is simply that arm's epochs.
    """
    import torch

    device = torch.device(specs[0]["device"])
    workload = Workload.from_dict(specs[0]["workload"])
    shards = make_shards(workload)
    # What the process holds before any model exists: the base of the CPU peak. CUDA's counter
    # starts at zero (it counts only tensors, and the data moves there later).
    resting = _proc_status_bytes("VmRSS") if device.type == "cpu" else 0
    epochs = WARMUP_EPOCHS + specs[0]["epochs"]
    arms: list[OursArm | BareArm] = [
        OursArm(
            workload,
            spec["precision"],
            spec["checkpointing"],
            epochs,
            device,
            shards,
            str(tmp / f"checkpoints-{spec['number']}"),
        )
        if spec["loop"] == "ours"
        else BareArm(workload, spec["precision"], spec["checkpointing"], device, shards)
        for spec in specs
    ]
    rows = workload.batch * workload.steps
    # On CPU every optimiser step stamps the time: a step's seconds run from the previous stamp
    # (or the epoch's start) to its own. On CUDA the steps are asynchronous, so only the
    # synchronised epoch is timed.
    stamps: list[float] = []
    if device.type == "cpu":
        for arm in arms:
            arm.optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    records: list[list[dict[str, Any]]] = [[] for _ in specs]
    for epoch in range(1, epochs + 1):
        first = (epoch - 1) % len(arms)
        for index in [*range(first, len(arms)), *range(first)]:
            synchronize(device)
            reset_peak_memory(device)
            started = time.perf_counter()
            stamps[:] = [started]
            metrics = arms[index].train_epoch(epoch)
            synchronize(device)
            seconds = time.perf_counter() - started
            records[index].append(
                {
                    "epoch": epoch,
                    "seconds": seconds,
                    "samples_per_second": rows / seconds,
                    "step_seconds": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                    "peak_memory_bytes": peak_memory_bytes(device),
                    **metrics,
                }
            )
            print(
                f"    {arm_label(specs[index])}, epoch {epoch}: "
                f"{rows / seconds:,.0f} samples/s, {seconds:.2f} s",
                flush=True,
            )
    batch = torch.from_numpy(shards["train"][0][: workload.batch]).to(device)
    batch_labels = torch.from_numpy(shards["train"][1][: workload.batch]).to(device)
    return [
        {
            **spec,
            "resting_bytes": resting,
            "shared_process": len(specs) > 1,  # then the peak RSS includes the other arms
            "load_1m_after": os.getloadavg()[0],  # other work on the machine meanwhile
            "epochs": records[index],
            "step_memory_bytes": step_memory(arms[index], batch, batch_labels),
        }
        for index, spec in enumerate(specs)
    ]


def run_jobs(jobs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The child process: each job in turn, under one temporary project home."""
    with embedded_home() as (tmp, _settings):
        import torch

        # Both loops import the product's training module, so their RSS baselines match.
        import prefect_ml.integrations.training  # noqa: F401

        torch.set_num_threads(THREADS)
        results = []
        for job in jobs:
            for spec in job:
                print(
                    f"  [{spec['number']}/{spec['runs']}] {arm_label(spec)}: {spec['measure']}",
                    flush=True,
                )
            results += run_job(job, tmp)
    return results


# ---------------------------------------------------------------- the parent: arms, summary, report


def plan(
    device: str, quick: bool, bf16_on_gpu: bool, budget: bool = False
) -> list[list[dict[str, Any]]]:
    """Every run, grouped into jobs (one process each, apart from ``--quick``): a *memory* job
    per arm, alone in its process so that its peak RSS and step memory are its own, then a
    *throughput* job per workload whose arms interleave their epochs.

    With a ``budget`` only the throughput jobs run, in :data:`BUDGET_ORDER`, and each arm's
    memory columns come from its throughput run (a process shared with the other arms)."""
    sizes = SIZES["quick" if quick else device]
    precisions = ["fp32", "bf16"] if device == "cpu" else ["fp32", "fp16"]
    if device == "cuda" and bf16_on_gpu:
        precisions.insert(1, "bf16")
    memory_epochs, throughput_epochs = EPOCHS["quick" if quick else "budget" if budget else "full"]
    arms_by_workload = {
        name: [
            {
                "part": "precision",
                "workload": asdict(sizes[name]),
                "precision": precision,
                "checkpointing": False,
                "loop": loop,
                "device": device,
            }
            for precision in precisions
            for loop in LOOPS
        ]
        for name in (("mlp",) if quick else ("mlp", "cnn"))
    }
    arms_by_workload["deep-mlp"] = [
        {
            "part": "checkpointing",
            "workload": asdict(sizes["deep-mlp"]),
            "precision": "fp32",
            "checkpointing": on,
            "loop": loop,
            "device": device,
        }
        for on in (False, True)
        for loop in LOOPS
    ]
    if budget:
        arms_by_workload = {name: arms_by_workload[name] for name in BUDGET_ORDER}
    jobs = [
        [{**arm, "measure": "memory", "epochs": memory_epochs}]
        for arms in arms_by_workload.values()
        for arm in arms
        if not budget
    ]
    jobs += [
        [{**arm, "measure": "throughput", "epochs": throughput_epochs} for arm in arms]
        for arms in arms_by_workload.values()
    ]
    runs = [run for job in jobs for run in job]
    for number, run in enumerate(runs, start=1):
        run.update(number=number, runs=len(runs))
    return jobs


def group_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per arm: its fields plus ``memory`` and ``throughput``, the runs that measured
    them."""
    measured = {
        "measure",
        "number",
        "runs",
        "resting_bytes",
        "shared_process",
        "load_1m_after",
        "epochs",
        "step_memory_bytes",
    }
    arms: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        key = tuple(
            run[k] if k != "workload" else run[k]["name"]
            for k in ("part", "workload", "precision", "checkpointing", "loop")
        )
        arm = arms.setdefault(key, {k: v for k, v in run.items() if k not in measured})
        arm[run["measure"]] = {k: v for k, v in run.items() if k in measured}
    for arm in arms.values():  # a budgeted run measured memory in its throughput run
        arm.setdefault("memory", arm["throughput"])
    return list(arms.values())


def run_child(jobs: list[list[dict[str, Any]]], work_dir: Path) -> list[dict[str, Any]]:
    """``jobs`` run in turn by one fresh interpreter (``--child``); their arms' results."""
    jobs_path, result_path = work_dir / "jobs.json", work_dir / "results.json"
    jobs_path.write_text(json.dumps(jobs))
    result_path.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, __file__, "--child", str(jobs_path), "--child-output", str(result_path)],
        check=True,
    )
    return json.loads(result_path.read_text())  # type: ignore[no-any-return]


def arm_label(arm: dict[str, Any]) -> str:
    checkpointing = ", checkpointing" if arm["checkpointing"] else ""
    return f"{arm['workload']['name']} {arm['precision']}{checkpointing} {arm['loop']}"


def summarize_arm(arm: dict[str, Any]) -> dict[str, Any]:
    """Throughput (median step) from the arm's throughput run, memory (median epoch peak) from
    its memory run, in samples/s and MiB."""
    memory, throughput = arm["memory"], arm["throughput"]
    measured = throughput["epochs"][WARMUP_EPOCHS:]
    steps = [s for e in measured for s in e["step_seconds"]]
    memory_epochs = memory["epochs"][WARMUP_EPOCHS:]
    summary = {
        # CPU: from the median step; CUDA: the median synchronised epoch (see run_job)
        "samples_per_second": arm["workload"]["batch"] / statistics.median(steps)
        if steps
        else statistics.median(e["samples_per_second"] for e in measured),
        "epoch_samples_per_second": statistics.median(e["samples_per_second"] for e in measured),
        "peak_memory_mib": statistics.median(e["peak_memory_bytes"] for e in memory_epochs) / MIB,
        "step_peak_mib": memory["step_memory_bytes"]["peak"] / MIB,
        "step_held_mib": memory["step_memory_bytes"]["held"] / MIB,
        "resting_mib": memory["resting_bytes"] / MIB,
        "final_train_loss": measured[-1]["train_loss"],
    }
    summary["training_memory_mib"] = summary["peak_memory_mib"] - summary["resting_mib"]
    if arm["loop"] == "ours":
        summary["reported_samples_per_second"] = statistics.median(
            e["reported_samples_per_second"] for e in measured
        )
        summary["reported_peak_memory_mib"] = statistics.median(
            e["reported_peak_memory_mib"] for e in memory_epochs
        )
    return summary


def summarize(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-arm medians, the ratios of the tables, and whether the targets are met."""
    for arm in arms:
        arm["summary"] = summarize_arm(arm)

    def find(**match: Any) -> dict[str, Any]:
        for arm in arms:
            if all(
                arm["workload"]["name"] == v if k == "workload" else arm[k] == v
                for k, v in match.items()
            ):
                return arm["summary"]  # type: ignore[no-any-return]
        raise KeyError(match)

    def ratios(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
        return {
            key: mine[key] / other[key]
            for key in (
                "samples_per_second",
                "peak_memory_mib",
                "training_memory_mib",
                "step_peak_mib",
            )
        }

    for arm in arms:
        s, name = arm["summary"], arm["workload"]["name"]
        same = {"workload": name, "precision": arm["precision"], "part": arm["part"]}
        s["ours_over_bare"] = ratios(
            find(**same, checkpointing=arm["checkpointing"], loop="ours"),
            find(**same, checkpointing=arm["checkpointing"], loop="bare"),
        )
        if arm["part"] == "precision":
            s["over_fp32"] = ratios(
                s, find(part="precision", workload=name, precision="fp32", loop=arm["loop"])
            )
        else:
            off = find(part="checkpointing", checkpointing=False, loop=arm["loop"])
            s["activation_reduction"] = 1 - s["step_peak_mib"] / off["step_peak_mib"]
            s["slowdown"] = off["samples_per_second"] / s["samples_per_second"] - 1
    ours_on = find(part="checkpointing", checkpointing=True, loop="ours")
    targets = {
        "activation_reduction": ours_on["activation_reduction"],
        "activation_target": ACTIVATION_TARGET,
        "activation_met": ours_on["activation_reduction"] >= ACTIVATION_TARGET,
        "slowdown": ours_on["slowdown"],
        "slowdown_target": SLOWDOWN_TARGET,
        "slowdown_met": ours_on["slowdown"] <= SLOWDOWN_TARGET,
    }
    first = next(a for a in arms if a["part"] == "checkpointing")
    deep = first["workload"]
    # Bytes saved for backward per element of a hidden layer in fp32 (see the docstring): ReLU's
    # output, dropout's noise and dropout's output; CUDA's fused dropout keeps a 1-byte mask.
    per_element = 12 if first["device"] == "cpu" else 9
    expected = per_element * deep["batch"] * deep["options"]["hidden"] * deep["options"]["depth"]
    held = find(part="checkpointing", checkpointing=False, loop="bare")["step_held_mib"] * MIB
    check = {
        "bytes_per_element": per_element,
        "expected_held_bytes": expected,
        "measured_held_bytes": held,
        "ratio": held / expected,
    }
    return {"targets": targets, "deep_mlp_held_check": check}


def hardware_label(report: dict[str, Any]) -> str:
    machine = report["machine"]
    if machine["hardware"] == "cuda":
        return f"cuda ({machine['gpu']})"
    return "cpu"


def table_rows(report: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """The cells of the two tables: precision, then checkpointing."""
    hardware = hardware_label(report)
    precision, checkpointing = [], []
    for arm in report["arms"]:
        s, name = arm["summary"], arm["workload"]["name"]
        vs_bare = s["ours_over_bare"]
        bare_cells = (
            [f"{vs_bare['samples_per_second']:.2f}x", f"{vs_bare['training_memory_mib']:.2f}x"]
            if arm["loop"] == "ours"
            else ["", ""]
        )
        memory_cells = [f"{s['peak_memory_mib']:,.0f}", f"{s['training_memory_mib']:,.0f}"]
        if arm["part"] == "precision":
            over = s["over_fp32"]
            precision.append(
                [
                    hardware,
                    name,
                    arm["precision"],
                    arm["loop"],
                    f"{s['samples_per_second']:,.0f}",
                    f"{over['samples_per_second']:.2f}x",
                    *memory_cells,
                    f"{over['training_memory_mib']:.2f}x",
                    f"{s['step_peak_mib']:,.1f}",
                    f"{over['step_peak_mib']:.2f}x",
                    *bare_cells,
                ]
            )
        else:
            on = arm["checkpointing"]
            off = next(
                a["summary"]
                for a in report["arms"]
                if a["part"] == "checkpointing"
                and not a["checkpointing"]
                and a["loop"] == arm["loop"]
            )
            checkpointing.append(
                [
                    hardware,
                    name,
                    "on" if on else "off",
                    arm["loop"],
                    f"{1000 * arm['workload']['batch'] / s['samples_per_second']:,.0f}",
                    f"{s['slowdown']:+.0%}" if on else "",
                    f"{s['step_peak_mib']:,.1f}",
                    f"{-s['activation_reduction']:+.0%}" if on else "",
                    f"{s['step_held_mib']:,.1f}",
                    *memory_cells,
                    f"{s['training_memory_mib'] / off['training_memory_mib'] - 1:+.0%}"
                    if on
                    else "",
                    *bare_cells,
                ]
            )
    return precision, checkpointing


def workload_lines(report: dict[str, Any]) -> list[str]:
    seen = {arm["workload"]["name"]: Workload.from_dict(arm["workload"]) for arm in report["arms"]}
    return [
        f"{name}: {workload.describe()}, {workload.steps} step(s) per epoch"
        for name, workload in seen.items()
    ]


MEMORY_HEADER = ["peak memory MiB", "above resting MiB"]
BARE_HEADER = ["ours/bare samples/s", "ours/bare memory above resting"]
PRECISION_HEADER = [
    "hardware",
    "workload",
    "precision",
    "loop",
    "samples/s",
    "vs fp32",
    *MEMORY_HEADER,
    "vs fp32",
    "step peak MiB",
    "vs fp32",
    *BARE_HEADER,
]
CHECKPOINTING_HEADER = [
    "hardware",
    "workload",
    "checkpointing",
    "loop",
    "ms per step",
    "slowdown vs off",
    "peak activation MiB",
    "vs off",
    "held after forward MiB",
    *MEMORY_HEADER,
    "vs off",
    *BARE_HEADER,
]


def verdict(report: dict[str, Any]) -> list[str]:
    t, check = report["summary"]["targets"], report["summary"]["deep_mlp_held_check"]
    met = "met" if t["activation_met"] and t["slowdown_met"] else "NOT met"
    return [
        f"checkpointing (ours): peak activation memory {-t['activation_reduction']:+.0%} "
        f"(target <= -{t['activation_target']:.0%}: {'met' if t['activation_met'] else 'MISSED'}), "
        f"step time {t['slowdown']:+.0%} (target <= +{t['slowdown_target']:.0%}: "
        f"{'met' if t['slowdown_met'] else 'MISSED'}); targets {met}",
        f"method check: deep-mlp held after forward {check['measured_held_bytes'] / MIB:,.2f} MiB "
        f"vs {check['bytes_per_element']}*batch*hidden*depth = "
        f"{check['expected_held_bytes'] / MIB:,.2f} MiB "
        f"({check['ratio']:.4f}x); known cases "
        + ", ".join("ok" if c["ok"] else "FAILED" for c in report["method_check"].values()),
    ]


def markdown(report: dict[str, Any]) -> str:
    precision, checkpointing = table_rows(report)
    lines = []
    for header, rows in ((PRECISION_HEADER, precision), (CHECKPOINTING_HEADER, checkpointing)):
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines + workload_lines(report) + [""] + verdict(report))


def print_rich(report: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # a torch-only machine (the GPU check): the markdown tables will do
        return

    console = Console(width=200)
    precision, checkpointing = table_rows(report)
    for title, header, rows in (
        ("Precision", PRECISION_HEADER, precision),
        ("Gradient checkpointing", CHECKPOINTING_HEADER, checkpointing),
    ):
        table = Table(title=title)
        for column in header:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in [*workload_lines(report), *verdict(report)]:
        console.print(line)


def machine_info(device: str) -> dict[str, Any]:
    import torch

    cpu_model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    cpu_model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    info: dict[str, Any] = {
        "hardware": device,
        "cpu_model": cpu_model,
        "cores": os.cpu_count(),
        "torch_threads": THREADS,
        # bf16 matmuls are fast only with these; without them they take a slow path.
        "cpu_bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if device == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(0),
            cuda=torch.version.cuda,
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return info


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(THREADS)
    machine = machine_info(device)
    machine["loadavg_before"] = os.getloadavg()
    checks = method_check(torch.device(device))
    budget = args.budget_s is not None
    deadline = time.monotonic() + (args.budget_s or 0)
    jobs = plan(device, args.quick, bool(machine.get("bf16_supported")), budget)
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    longest = 0.0  # the longest job so far: the estimate of the next one under a budget
    # One process per job; --quick runs them all in one, since starting a process that imports
    # torch takes 5-8 s here (its peak memory columns then carry over between arms).
    with tempfile.TemporaryDirectory(prefix="prefect-ml-precision-") as tmp:
        for group in [jobs] if args.quick else [[job] for job in jobs]:
            if budget and runs and time.monotonic() + longest > deadline:
                skipped += [f"{arm_label(arm)} (budget)" for job in group for arm in job]
                continue
            started = time.monotonic()
            runs += run_child(group, Path(tmp))
            longest = max(longest, time.monotonic() - started)
    arms = group_runs(runs)
    machine["loadavg_after"] = os.getloadavg()
    report: dict[str, Any] = {
        "benchmark": "precision",
        "quick": args.quick,
        "budget_s": args.budget_s,
        "skipped_for_budget": skipped,
        "warmup_epochs": WARMUP_EPOCHS,
        "machine": machine,
        "method_check": checks,
        "arms": arms,
    }
    report["summary"] = summarize(arms)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny sizes, one measured epoch"
    )
    parser.add_argument("--output", type=Path, help="JSON results [results/precision.json]")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="fit in about this many seconds: throughput runs only, 3 epochs each, the "
        "checkpointing workload first; workloads that would overrun are skipped and listed",
    )
    parser.add_argument(
        "--from-json", type=Path, help="re-derive the tables of an earlier run from its JSON"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.output = args.output or results_path("precision", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        results = run_jobs(json.loads(args.child.read_text()))
        args.child_output.write_text(json.dumps(results))
        return
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        report["summary"] = summarize(report["arms"])
        print_rich(report)
        print(markdown(report))
        return
    report = run_benchmark(args)
    print_rich(report)
    save_report(report, args.output, markdown(report))


if __name__ == "__main__":
    main()
