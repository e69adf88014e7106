"""Training: bare PyTorch vs a plain Ray Train ``TorchTrainer`` vs our ``train`` step, in one run.

Each workload (same data files, model, optimizer, batch size and epochs) is trained four ways:

* ``a-bare``   one process, a plain PyTorch loop, no Ray;
* ``b-ray``    Ray Train v2 ``TorchTrainer``, 2 workers (DDP over gloo), the same loop, no
  checkpoints, ``ray.train.report`` after every epoch as Ray's docs do;
* ``b-lean``   the same, with one ``ray.train.report`` at the end (what our loop does);
* ``c-ours``   ``tasks.train.train_distributed`` inside a Prefect flow: per-epoch verified
  checkpoints and MLflow logging, 2 workers;
* ``d-hooked`` the same with the same network behind its own ``training_step`` and
  ``validation_step`` (``integrations.training``): what the hook path costs over the built-in one.

Steady state is every epoch after the first, measured as wall time per epoch *including* its
per-epoch overheads (reports, checkpoints, MLflow logging): for a and b from timestamps taken
inside the loop, for c from the ``epoch_seconds`` metric rank 0 logs per epoch. End-to-end
wall is the call that trains (for b, constructing and fitting the trainer; for c,
``train_distributed``), with Ray already started; data preparation is not counted.

Run ``make bench`` (or ``.venv/bin/python benchmarks/training.py --quick`` for a smoke run).
Everything runs on embedded defaults under a temporary project home that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    RESULTS_DIR,
    embedded_home,
    save_report,
    wait_until_idle,
)

if TYPE_CHECKING:
    import torch

    from prefect_ml.integrations.config.loop import TrainLoop
    from prefect_ml.tasks.data import PreparedData
    from prefect_ml.tasks.params import TrainModelParams
    from prefect_ml.tasks.train import TrainResult

WORKERS = 2
THROUGHPUT_TARGET = 0.9  # steady-state samples/s of c over b
CHECKPOINT_TARGET = 0.05  # seconds the loop is blocked by checkpoints over epoch seconds (c)
# Steady samples/s of c over b-lean (issue 24): what our per-epoch work may cost.
LEAN_TARGETS = {"digits-mlp": 0.9, "synthetic-mlp": 0.95}

Report = Literal["epoch", "final"] | None
# The modes in the order they run; a and b are the plain loop, reporting to Ray like this.
PLAIN_MODES: dict[str, Report] = {"a-bare": None, "b-ray": "epoch", "b-lean": "final"}
OURS = {"c-ours": "", "d-hooked": "benchmarks.training:hooked_mlp"}  # mode -> model override
MODES = (*PLAIN_MODES, *OURS)
HOOKED_TARGET = 0.95  # steady samples/s of d over c


def hooked_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden: int = 128,
    depth: int = 2,
    dropout: float = 0.1,
) -> torch.nn.Module:
    """The built-in MLP of the workload's ``hidden``, ``depth`` and ``dropout`` (named, so the
    factory receives them), trained through hooks that compute what the built-in path does
    (cross-entropy; validation loss and accuracy), as a LightningModule-shaped user model
    would. Its validation_step returns the task's metrics, so the trainer's own validation pass
    is skipped, as for any such model."""
    import torch.nn.functional as F
    from torch import nn

    from prefect_ml.integrations.datasets import build_mlp

    class HookedMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.network = build_mlp(
                input_shape, num_classes, hidden=hidden, depth=depth, dropout=dropout
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.network(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            features, labels = batch
            return F.cross_entropy(self(features).float(), labels)

        def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
            features, labels = batch
            logits = self(features).float()
            return {
                "loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean(),
            }

    return HookedMLP()


def synthetic_dataset(
    rows: int = 20_000, features: int = 512, classes: int = 10, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A dataset of any size: Gaussian features labelled by a random linear map plus noise.

    A user dataset loader (``benchmarks.training:synthetic_dataset``) for the catalog. The labels
    carry signal but the task is hard (about 35% validation accuracy); only the compute matters.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    teacher = rng.standard_normal((features, classes), dtype=np.float32)
    noise = rng.standard_normal((rows, classes), dtype=np.float32) * np.sqrt(features)
    return x, np.argmax(x @ teacher + noise, axis=1)


@dataclass(frozen=True)
class PlainLoopConfig:
    """What the plain loop (a and b) needs: our workers' config plus how to report and time."""

    loop: TrainLoop  # what our workers receive
    report: Report  # None: no Ray at all (a); "epoch" (b); "final" (b-lean)
    marks_path: str  # rank 0 writes its timestamps here (the workers run on this machine)


def _read_shard(splits_url: str, split: str, rank: int, world: int) -> tuple[Any, Any]:
    """Equal contiguous shards of one split, as tensors."""
    import torch

    from prefect_ml.integrations import storage

    features = storage.read_array(storage.join(splits_url, f"{split}_features.npy"))
    labels = storage.read_array(storage.join(splits_url, f"{split}_labels.npy"))
    per_worker = len(labels) // world
    rows = slice(rank * per_worker, (rank + 1) * per_worker)
    return torch.from_numpy(features[rows]), torch.from_numpy(labels[rows])


def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, size: int) -> float:
    """Mean cross-entropy of ``model`` on ``(x, y)``."""
    import torch
    import torch.nn.functional as F

    model.eval()
    with torch.no_grad():
        total = sum(
            float(F.cross_entropy(model(x[i : i + size]), y[i : i + size], reduction="sum"))
            for i in range(0, len(y), size)
        )
    return total / max(len(y), 1)


def plain_loop(config_dict: dict[str, Any]) -> None:
    """The peer's loop: train, validate, optionally ``ray.train.report``; nothing else per epoch."""
    import torch
    import torch.nn.functional as F

    from prefect_ml.integrations.datasets import build_model

    config = PlainLoopConfig(**config_dict)
    loop, training = config.loop, config.loop.training
    rank, world = 0, 1
    if config.report is not None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(training.seed)
    data = loop.data
    options = loop.model.factory_options()
    model = build_model(loop.model.model, data.sample_shape, data.num_classes, options)
    if config.report is not None:
        model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=training.lr)
    train_x, train_y = _read_shard(loop.data.splits_url, "train", rank, world)
    val_x, val_y = _read_shard(loop.data.splits_url, "val", rank, world)
    generator = torch.Generator().manual_seed(training.seed + rank)

    marks, train_seconds, metrics = [time.time()], [], {}
    for epoch in range(1, training.epochs + 1):
        started = time.perf_counter()
        model.train()
        order = torch.randperm(len(train_y), generator=generator)
        loss_sum = 0.0
        for start in range(0, len(order), training.batch_size):
            index = order[start : start + training.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train_x[index]), train_y[index])
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * len(index)
        train_seconds.append(time.perf_counter() - started)
        val_loss = _evaluate(model, val_x, val_y, max(training.batch_size, 256))
        metrics = {"epoch": epoch, "train_loss": loss_sum / len(train_y), "val_loss": val_loss}
        if config.report == "epoch":
            ray.train.report(metrics)
        marks.append(time.time())
    if config.report == "final":
        ray.train.report(metrics)
    if rank == 0:
        threads = torch.get_num_threads()
        record = {"marks": marks, "train_seconds": train_seconds, "threads": threads}
        Path(config.marks_path).write_text(json.dumps(record))


@dataclass
class Measurement:
    """One mode of one workload. ``epoch_seconds`` are the steady-state epochs (2..E)."""

    mode: str
    samples_per_epoch: int
    steps_per_epoch: int
    epoch_seconds: list[float]
    train_seconds: list[float]  # training steps only, same epochs
    end_to_end_seconds: float
    checkpoint_blocking_seconds: list[float] = field(default_factory=list)  # c: loop blocked
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        """Back from :meth:`as_dict` (derived numbers are recomputed, not read)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @property
    def samples_per_second(self) -> float:
        """Steady-state throughput: samples of epochs 2..E over their total wall time."""
        return self.samples_per_epoch * len(self.epoch_seconds) / sum(self.epoch_seconds)

    @property
    def epoch_ms(self) -> float:
        return 1000 * float(np.mean(self.epoch_seconds))

    @property
    def epoch_ms_median(self) -> float:
        """Less sensitive than the mean to bursts of load from other processes."""
        return 1000 * float(np.median(self.epoch_seconds))

    @property
    def step_ms(self) -> float:
        return 1000 * sum(self.train_seconds) / (len(self.train_seconds) * self.steps_per_epoch)

    @property
    def non_step_ms(self) -> float:
        """Per-epoch time outside the training steps: validation, reports, checkpoints, logging."""
        return 1000 * float(np.mean(np.subtract(self.epoch_seconds, self.train_seconds)))

    @property
    def checkpoint_share(self) -> float | None:
        if not self.checkpoint_blocking_seconds:
            return None
        return sum(self.checkpoint_blocking_seconds) / sum(self.epoch_seconds)

    def as_dict(self) -> dict[str, Any]:
        derived = (
            "samples_per_second",
            "epoch_ms",
            "epoch_ms_median",
            "step_ms",
            "non_step_ms",
            "checkpoint_share",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


def run_plain(
    params: TrainModelParams, data: PreparedData, mode: str, report: Report, work_dir: Path
) -> Measurement:
    """Run the plain loop in this process (``report=None``) or on a ``TorchTrainer``."""
    from prefect_ml.tasks.training import train_loop

    world = 1 if report is None else WORKERS
    per_worker = data.rows["train"] // world
    marks_path = work_dir / f"marks-{mode}-{time.time_ns()}.json"
    loop = train_loop(params, data, checkpoint_url="", tracking_uri="", run_id="")
    config = PlainLoopConfig(loop=loop, report=report, marks_path=str(marks_path))
    started = time.perf_counter()
    if report is None:
        plain_loop(asdict(config))
    else:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        TorchTrainer(
            plain_loop,
            train_loop_config=asdict(config),
            scaling_config=ScalingConfig(
                num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=RunConfig(name=marks_path.stem, storage_path=str(work_dir / "ray")),
        ).fit()
    wall = time.perf_counter() - started
    record = json.loads(marks_path.read_text())
    marks = record["marks"]
    return Measurement(
        mode=mode,
        samples_per_epoch=per_worker * world,
        steps_per_epoch=math.ceil(per_worker / params.training.batch_size),
        epoch_seconds=np.diff(marks)[1:].tolist(),
        train_seconds=record["train_seconds"][1:],
        end_to_end_seconds=wall,
        extra={"torch_threads_rank0": record["threads"], "workers": world},
    )


def _timed_train(params: TrainModelParams, data: PreparedData) -> tuple[TrainResult, float]:
    """The body of the benchmark's flow: our train step, timed."""
    from prefect_ml.tasks.train import train_distributed

    started = time.perf_counter()
    result = train_distributed(params, data)
    return result, time.perf_counter() - started


def run_ours(params: TrainModelParams, data: PreparedData, mode: str) -> Measurement:
    """Our train step in a Prefect flow; per-epoch walls from its ``epoch_seconds`` metric."""
    from prefect import flow

    from prefect_ml.integrations import tracking
    from prefect_ml.integrations.settings import get_settings

    flow_started = time.perf_counter()
    bench_flow = flow(name="benchmark-train-step", validate_parameters=False)(_timed_train)
    result, wall = bench_flow(params, data)
    flow_wall = time.perf_counter() - flow_started
    client = tracking.client_for(get_settings().resolved_tracking_uri)

    def history(key: str) -> list[Any]:
        return sorted(client.get_metric_history(result.run_id, key), key=lambda m: m.step)

    weights = [int(m.step) for m in history("checkpoint_weights") if m.value]
    workers = params.training.worker_range[1]
    per_worker = data.rows["train"] // workers
    samples = per_worker * workers
    return Measurement(
        mode=mode,
        samples_per_epoch=samples,
        steps_per_epoch=math.ceil(per_worker / params.training.batch_size),
        epoch_seconds=[m.value for m in history("epoch_seconds")[1:]],
        # samples_per_second = rows / mean worker training seconds, so this inverts it. Worker
        # 1's training time includes waiting for worker 0's checkpoint and MLflow write.
        train_seconds=[samples / m.value for m in history("samples_per_second")[1:]],
        end_to_end_seconds=wall,
        checkpoint_blocking_seconds=[m.value for m in history("checkpoint_blocking_seconds")[1:]],
        extra={
            "flow_seconds": flow_wall,
            "run_id": result.run_id,
            "workers": WORKERS,
            # Epochs that committed their weights at their end (the checkpoint budget's choice;
            # the others committed their metrics only).
            "epochs_with_weights": weights,
        },
    )


def measure(mode: str, params: TrainModelParams, data: PreparedData, work_dir: Path) -> Measurement:
    """One mode, started once the machine is idle (what the previous mode left running has
    stopped), noting how busy it was before and right after (it may be shared)."""
    busy_before = wait_until_idle()
    if mode in PLAIN_MODES:
        measurement = run_plain(params, data, mode, PLAIN_MODES[mode], work_dir)
    else:
        if OURS[mode]:
            params = params.model_copy(deep=True)
            params.model.model = OURS[mode]
        measurement = run_ours(params, data, mode)
    measurement.extra["busy_share_before"] = busy_before
    measurement.extra["loadavg_1m_after"] = os.getloadavg()[0]
    return measurement


def workloads(args: argparse.Namespace) -> dict[str, TrainModelParams]:
    """The two sizes: the default digits MLP, and a synthetic set with >= 20 ms steps."""
    from prefect_ml.tasks.params import TrainModelParams

    digits = {"experiment": "bench-digits", "training": {"epochs": args.digits_epochs}}
    synthetic = {
        "experiment": "bench-synthetic",
        "data": {
            "dataset": "benchmarks.training:synthetic_dataset",
            "dataset_options": {"rows": args.synthetic_rows, "features": 512},
        },
        "model": {"hidden": 512, "depth": 4},
        "training": {"epochs": args.synthetic_epochs, "batch_size": 256},
    }
    return {
        "digits-mlp": TrainModelParams.model_validate(digits),
        "synthetic-mlp": TrainModelParams.model_validate(synthetic),
    }


def ratios(modes: dict[str, Measurement]) -> dict[str, float]:
    """c over each peer: steady throughput (higher is better) and end-to-end wall (lower is)."""
    ours = modes["c-ours"]
    out: dict[str, float] = {}
    for short, peer in (("b", "b-ray"), ("b_lean", "b-lean"), ("a", "a-bare")):
        out[f"throughput_c_over_{short}"] = ours.samples_per_second / modes[peer].samples_per_second
        out[f"wall_c_over_{short}"] = ours.end_to_end_seconds / modes[peer].end_to_end_seconds
    if "d-hooked" in modes:
        out["throughput_d_over_c"] = modes["d-hooked"].samples_per_second / ours.samples_per_second
    return out


def _hooked_cell(r: dict[str, float]) -> str:
    if "throughput_d_over_c" not in r:
        return "not run"
    ratio = r["throughput_d_over_c"]
    return f"{ratio:.2f}x {'met' if ratio >= HOOKED_TARGET else 'missed'}"


def summarize(modes: dict[str, Measurement]) -> dict[str, Any]:
    """The JSON of one workload's measurements: raw data, derived numbers and ratios."""
    return {"modes": {mode: m.as_dict() for mode, m in modes.items()}, "ratios": ratios(modes)}


def markdown(measured: dict[str, dict[str, Measurement]]) -> str:
    """The two tables of BENCHMARKS.md: ratios first, then the measurements behind them."""
    lines = [
        "| workload | throughput c/b | c/b-lean | c/a | wall c/b | c/b-lean | c/a "
        "| c checkpoint share | c epochs with weights "
        "| targets (>= 0.9x b, b-lean as issue 24, <= 5%) | hooked d/c (>= 0.95x) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, modes in measured.items():
        ours = modes["c-ours"]
        r, share = ratios(modes), ours.checkpoint_share or 0.0
        lean = LEAN_TARGETS.get(name, THROUGHPUT_TARGET)
        met = (
            r["throughput_c_over_b"] >= THROUGHPUT_TARGET
            and r["throughput_c_over_b_lean"] >= lean
            and share <= CHECKPOINT_TARGET
        )
        weights = ours.extra.get("epochs_with_weights")
        committed = "n/a" if weights is None else f"{len(weights)} of {len(ours.epoch_seconds) + 1}"
        lines.append(
            f"| {name} | {r['throughput_c_over_b']:.2f}x | {r['throughput_c_over_b_lean']:.2f}x "
            f"| {r['throughput_c_over_a']:.2f}x | {r['wall_c_over_b']:.2f}x "
            f"| {r['wall_c_over_b_lean']:.2f}x | {r['wall_c_over_a']:.2f}x | {share:.1%} "
            f"| {committed} | {'met' if met else 'missed'} (b-lean >= {lean}x) "
            f"| {_hooked_cell(r)} |"
        )
    lines += [
        "",
        "| workload | mode | steady samples/s | epoch ms (mean / median) | step ms "
        "| non-step ms/epoch | end-to-end s | load 1m |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, modes in measured.items():
        for mode, m in modes.items():
            lines.append(
                f"| {name} | {mode} | {m.samples_per_second:,.0f} "
                f"| {m.epoch_ms:,.0f} / {m.epoch_ms_median:,.0f} | {m.step_ms:.1f} "
                f"| {m.non_step_ms:,.0f} | {m.end_to_end_seconds:.1f} "
                f"| {m.extra.get('loadavg_1m_after', float('nan')):.1f} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 epochs, small data")
    parser.add_argument("--digits-epochs", type=int, help="epochs of the digits MLP [60]")
    parser.add_argument("--synthetic-epochs", type=int, help="epochs of the synthetic MLP [8]")
    parser.add_argument("--synthetic-rows", type=int, help="rows of the synthetic set [20000]")
    parser.add_argument("--output", type=Path, help="JSON results [results/training.json]")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="train nothing: recompute the derived numbers of an earlier run's JSON from its "
        "raw per-epoch data, rewrite them there and print the tables",
    )
    args = parser.parse_args(argv)
    quick, full = (3, 3, 4_000, "training.quick.json"), (60, 8, 20_000, "training.json")
    defaults = quick if args.quick else full
    args.digits_epochs = args.digits_epochs or defaults[0]
    args.synthetic_epochs = args.synthetic_epochs or defaults[1]
    args.synthetic_rows = args.synthetic_rows or defaults[2]
    args.output = args.from_json or args.output or RESULTS_DIR / defaults[3]
    if min(args.digits_epochs, args.synthetic_epochs) < 2:
        parser.error("steady state needs at least 2 epochs")
    return args


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Train every workload in every mode under a temporary project home; the JSON report."""
    with embedded_home() as (tmp, settings):
        import ray
        import torch

        from prefect_ml.tasks.data import inspect_dataset, preprocess_dataset

        params_by_name = workloads(args)
        prepared = {
            name: preprocess_dataset(
                params.data, inspect_dataset(params).fingerprint, settings.resolved_storage_url
            )
            for name, params in params_by_name.items()
        }
        load_before = os.getloadavg()
        # A Ray of its own (as the other benchmarks), never a cluster another process started.
        ray.init(
            address="local", num_cpus=WORKERS, include_dashboard=True, dashboard_host="127.0.0.1"
        )
        try:
            # One untimed fit of each kind first, so no mode pays the process's first Ray Train
            # fit, nor (ours) its first Prefect flow run and MLflow experiment.
            first = next(iter(params_by_name))
            warm = params_by_name[first].model_copy(deep=True)
            warm.training.epochs = 2
            run_plain(warm, prepared[first], "warm-up", "final", tmp)
            run_ours(warm, prepared[first], "warm-up")
            results: dict[str, dict[str, Any]] = {}
            for name, params in params_by_name.items():
                data = prepared[name]
                modes = {mode: measure(mode, params, data, tmp) for mode in MODES}
                results[name] = {
                    "params": params.model_dump(mode="json"),
                    "rows": data.rows,
                    **summarize(modes),
                }
        finally:
            ray.shutdown()
    return {
        "benchmark": "training",
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.is_available(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ray": ray.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "workloads": results,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        report = run_benchmark(args)
    measured = {
        name: {mode: Measurement.from_dict(m) for mode, m in workload["modes"].items()}
        for name, workload in report["workloads"].items()
    }
    for name, modes in measured.items():
        report["workloads"][name].update(summarize(modes))
    save_report(report, args.output, markdown(measured))
    return report


if __name__ == "__main__":
    main()
