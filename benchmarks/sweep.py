"""Sweeps: plain Optuna vs Ray Tune (with Optuna's sampler) vs our sweep, in one run, 2 at a time.

* **overhead**: N trials (40; 12 with ``--quick``) of an objective that only sleeps 0.5 s; wall
  over the ideal ``N * 0.5 / 2``. ``optuna``: ``study.optimize(n_trials=N, n_jobs=2)`` in memory;
  ``ray-tune``: a ``Tuner`` with ``OptunaSearch`` and ``max_concurrent_trials=2`` running a
  function trainable (1 CPU) that sleeps and reports once (wall: constructing and fitting it);
  ``ours``: :func:`ours_overhead`.
* **by-run**: the overhead part's trials over a user model's own options drawn by a conditional,
  define-by-run space (:func:`blocks_space`: a loop over the blocks drawn, a branch for a
  residual scale). ``ray-tune``: the same function as ``OptunaSearch(space=fn)``, the trainable
  sleeping as above; ``ours``: ``--search-space benchmarks.sweep:blocks_space`` over
  :func:`fixed_work_model`'s options.
* **quality**: an MLP on the digits (standardised, stratified 70/15/15 split, seed 0) searched over
  the project's default space (lr, hidden, dropout, optimizer); batch 32, up to 12 epochs, val
  accuracy reported per epoch. Each arm stops once any trial reaches the target (0.97; 0.95 with
  ``--quick``) or after the budget (180 s; 30 s): time to the target, best accuracy. ``ray-tune``:
  ``OptunaSearch`` + ``ASHAScheduler`` (grace 1, max_t 12), a ``Stopper`` whose ``stop_all`` fires
  at the target and ``time_budget_s``; ``ours``: :func:`ours_quality` with the default median
  pruner; ``ours-sha``: the same with successive halving (like Tune's ASHA). Run once per seed
  (``--seeds``, 5; each seeds the sampler and the training), reported as medians.

Every arm gets the same seed and data. Ray is started once (2 CPUs), not counted; an untimed
Tune fit and an untimed 2-trial campaign of ours come first (the latter starts Prefect's API).
Smoke run: ``.venv/bin/python benchmarks/sweep.py --quick``. All runs on embedded defaults in a
temporary project home.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS_DIR, embedded_home, save_report  # noqa: E402

if TYPE_CHECKING:
    import optuna
    import torch

CONCURRENCY = 2
SEED = 0
WORK_SECONDS = 0.5  # the overhead objective's fixed work
MAX_EPOCHS = 12
BATCH_SIZE = 32
Fn = Callable[..., Any]


def digits_splits(seed: int = SEED) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Train and val of the digits' stratified 70/15/15 split, standardised on train (float32)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    rest, _test = train_test_split(np.arange(len(y)), test_size=0.15, stratify=y, random_state=seed)
    train, val = train_test_split(rest, test_size=0.15 / 0.85, stratify=y[rest], random_state=seed)
    mean, std = x[train].mean(axis=0), x[train].std(axis=0)
    x = ((x - mean) / np.where(std == 0, 1.0, std)).astype(np.float32)
    return {"train": (x[train], y[train]), "val": (x[val], y[val])}


def suggest_mlp(trial: optuna.Trial, seed: int = SEED) -> dict[str, Any]:
    """The quality search space, define-by-run (the form of Optuna and of ``OptunaSearch``);
    the training seed as a constant of the configuration."""
    trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    trial.suggest_int("hidden", 32, 256)
    trial.suggest_float("dropout", 0.0, 0.5)
    trial.suggest_categorical("optimizer", ["adam", "sgd"])
    return {"seed": seed}


def blocks_space(trial: optuna.Trial) -> dict[str, Any]:
    """The by-run part's space: a loop (one width per block drawn) and a branch (a residual
    scale only for residual blocks), over :func:`fixed_work_model`'s own options."""
    blocks = trial.suggest_int("blocks", 1, 3)
    values: dict[str, Any] = {
        "model_options.widths": [trial.suggest_int(f"width_{i}", 4, 16) for i in range(blocks)]
    }
    if trial.suggest_categorical("block", ["plain", "residual"]) == "residual":
        values["model_options.skip_scale"] = trial.suggest_float("skip_scale", 0.1, 1.0)
    return values


def blocks_trainable(config: dict[str, Any]) -> None:
    """Tune's trainable for :func:`blocks_space`: the same fixed work, whatever was drawn."""
    sleep_trainable({"x": float(len(config))})


def build_mlp(hidden: int, dropout: float, depth: int = 2) -> torch.nn.Module:
    """``depth`` hidden layers of ``hidden`` units with ReLU and dropout; 64 in, 10 out."""
    from torch import nn

    layers: list[nn.Module] = []
    for width in [64] + [hidden] * (depth - 1):
        layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


def train_epoch(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One pass in shuffled batches of ``BATCH_SIZE`` (torch's global generator, seeded)."""
    import torch
    import torch.nn.functional as F

    model.train()
    order = torch.randperm(len(y))
    for start in range(0, len(order), BATCH_SIZE):
        index = order[start : start + BATCH_SIZE]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()


def mlp_val_accuracies(config: dict[str, Any], epochs: int = MAX_EPOCHS) -> Iterator[float]:
    """Train one configuration here, on 1 thread; yield the validation accuracy of each epoch."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(int(config.get("seed", SEED)))
    splits = {k: tuple(map(torch.from_numpy, v)) for k, v in digits_splits().items()}
    (train_x, train_y), (val_x, val_y) = splits["train"], splits["val"]
    model = build_mlp(int(config["hidden"]), float(config["dropout"]))
    if config["optimizer"] == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    for _ in range(epochs):
        train_epoch(model, optimizer, train_x, train_y)
        model.eval()
        with torch.no_grad():
            yield float((model(val_x).argmax(dim=1) == val_y).float().mean())


# Objectives and trainables live at module level: Tune's workers unpickle or import them.


def sleep_space(trial: optuna.Trial) -> None:
    trial.suggest_float("x", 0.0, 1.0)


def sleep_objective(trial: optuna.Trial) -> float:
    sleep_space(trial)
    time.sleep(WORK_SECONDS)
    return trial.params["x"]


def sleep_trainable(config: dict[str, Any]) -> None:
    import ray.tune

    time.sleep(WORK_SECONDS)
    ray.tune.report({"score": config["x"]})


def mlp_trainable(config: dict[str, Any]) -> None:
    import ray.tune

    for epoch, val_accuracy in enumerate(mlp_val_accuracies(config), start=1):
        ray.tune.report({"val_accuracy": val_accuracy, "epoch": epoch, "reported_at": time.time()})


def _tuner(
    trainable: Fn, space: Fn, metric: str, run_dir: Path, seed: int = SEED, **options: Any
) -> Any:
    """A ``Tuner`` maximising ``metric``: 1 CPU per trial, seeded ``OptunaSearch`` on ``space``,
    2 trials at a time; ``options`` are ``TuneConfig``'s, plus ``RunConfig``'s ``stop``."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    stop = options.pop("stop", None)
    options.setdefault("max_concurrent_trials", CONCURRENCY)
    search = OptunaSearch(space=space, metric=metric, mode="max", seed=seed)
    return tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        tune_config=tune.TuneConfig(search_alg=search, **options),
        run_config=tune.RunConfig(
            name=run_dir.name, storage_path=str(run_dir.parent), stop=stop, verbose=0
        ),
    )


def optuna_overhead(work_dir: Path, trials: int, concurrency: int) -> float:
    import optuna

    started = time.perf_counter()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=SEED))
    study.optimize(sleep_objective, n_trials=trials, n_jobs=concurrency)
    return time.perf_counter() - started


def ray_tune_overhead(work_dir: Path, trials: int, concurrency: int, by_run: bool = False) -> float:
    """Tune's wall for the overhead trials; ``by_run``: drawn by :func:`blocks_space`."""
    run_dir = work_dir / "ray-results" / f"overhead-{time.time_ns()}"
    options = {"num_samples": trials, "max_concurrent_trials": concurrency}
    trainable, space = (
        (blocks_trainable, blocks_space) if by_run else (sleep_trainable, sleep_space)
    )
    started = time.perf_counter()
    results = _tuner(trainable, space, "score", run_dir, **options).fit()
    wall = time.perf_counter() - started
    if results.num_errors:
        raise RuntimeError(f"{results.num_errors} Ray Tune trials failed: {results.errors[0]}")
    return wall


def fixed_work_model(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    dropout: float = 0.0,
    widths: list[int] | None = None,
    skip_scale: float = 0.0,
) -> torch.nn.Module:
    """A linear model whose training epoch costs ``WORK_SECONDS`` of fixed work (one sleep).

    Our trials train models, so the overhead arm's "objective" is one epoch of this model:
    ``train()`` arms the sleep and the epoch's first forward pass takes it. ``widths`` and
    ``skip_scale`` are the by-run part's options: hidden layers of a cost that rounds to zero.
    """
    import torch

    sizes = [int(np.prod(input_shape)), *(widths or [])]

    class FixedWork(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = torch.nn.Sequential(
                *(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
            )
            self.linear = torch.nn.Linear(sizes[-1], num_classes)
            self.dropout = torch.nn.Dropout(dropout)
            self.skip_scale = skip_scale
            self.armed = False

        def train(self, mode: bool = True) -> FixedWork:
            self.armed = mode
            return super().train(mode)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            if self.armed:
                self.armed = False
                time.sleep(WORK_SECONDS)
            hidden = self.hidden(features.flatten(1))
            return self.linear(self.dropout(hidden * (1.0 + self.skip_scale)))

    return FixedWork()


def tiny_dataset() -> tuple[np.ndarray, np.ndarray]:
    """90 rows, 4 features, 3 classes: the overhead arm's epochs cost their sleep and ~nothing."""
    labels = np.arange(90) % 3
    return np.random.default_rng(SEED).normal(labels[:, None], 0.3, (90, 4)), labels


def _campaign(name: str, training: dict[str, Any], **sweep: Any) -> Any:
    """Our ``hpo_campaign`` flow with everything on: SQLite study, MLflow runs, artifacts;
    ``overhead`` and ``by-run`` campaigns train :func:`fixed_work_model` on
    :func:`tiny_dataset`."""
    from prefect_ml.flows.sweep import hpo_campaign
    from prefect_ml.tasks.params import CampaignParams

    parameters: dict[str, Any] = {
        "experiment": "bench-sweep",
        "training": training,
        "sweep": {"campaign": f"{name}-{time.time_ns()}", "concurrency": CONCURRENCY, **sweep},
    }
    if name in ("overhead", "by-run"):
        parameters["model"] = {"model": "benchmarks.sweep:fixed_work_model"}
        parameters["data"] = {"dataset": "benchmarks.sweep:tiny_dataset"}
    return hpo_campaign(CampaignParams.model_validate(parameters))


def ours_overhead(
    work_dir: Path, trials: int, concurrency: int, by_run: bool = False
) -> dict[str, float]:
    """Our sweep of ``trials`` one-epoch trials of ``WORK_SECONDS``, ``concurrency`` at a time;
    ``by_run``: drawn by :func:`blocks_space` over the model's options.

    ``wall_seconds`` is the trials phase (first trial dispatched to the last MLflow record
    written, leaderboard included); the one-time setup (study, MLflow parent run, warm workers)
    and conclusion (plots) are reported beside it, and ``flow_seconds`` is the whole flow.
    """
    declared = {"dropout": {"type": "float", "low": 0.0, "high": 0.5}}
    started = time.perf_counter()
    result = _campaign(
        "by-run" if by_run else "overhead",
        {"epochs": 1, "batch_size": 32},
        n_trials=trials,
        pruner="none",
        search_space="benchmarks.sweep:blocks_space" if by_run else declared,
    )
    flow_seconds = time.perf_counter() - started
    if result.finished != trials or result.failed:
        raise RuntimeError(
            f"our campaign finished {result.finished} trials, {result.failed} failed"
        )
    return {
        "wall_seconds": result.timings["trials_seconds"],
        "flow_seconds": flow_seconds,
        **result.timings,
    }


def ray_tune_quality(
    work_dir: Path, target: float, budget_s: float, seed: int = SEED
) -> dict[str, Any]:
    from ray.tune import Stopper
    from ray.tune.schedulers import ASHAScheduler

    class TargetStopper(Stopper):
        """Ends the whole search once any trial reported ``val_accuracy >= target``."""

        reached = False

        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            self.reached = self.reached or result.get("val_accuracy", 0.0) >= target
            return False

        def stop_all(self) -> bool:
            return self.reached

    run_dir = work_dir / "ray-results" / f"quality-{time.time_ns()}"
    asha = ASHAScheduler(metric="val_accuracy", mode="max", grace_period=1, max_t=MAX_EPOCHS)
    options = {"scheduler": asha, "stop": TargetStopper(), "time_budget_s": budget_s}
    started_at, started = time.time(), time.perf_counter()
    # num_samples is unbounded: the target or the budget ends the search.
    space = functools.partial(suggest_mlp, seed=seed)
    tuner = _tuner(
        mlp_trainable, space, "val_accuracy", run_dir, seed=seed, num_samples=-1, **options
    )
    results = tuner.fit()
    wall = time.perf_counter() - started
    # Trials that the budget cut before their first report have no metrics.
    frames = [r.metrics_dataframe for r in results if r.metrics_dataframe is not None]
    frames = [f for f in frames if "val_accuracy" in f]
    if results.num_errors and not frames:
        raise RuntimeError(f"every Ray Tune trial failed: {results.errors[0]}")
    hits = [f.loc[f["val_accuracy"] >= target, "reported_at"].min() for f in frames]
    hits = [float(t) for t in hits if not np.isnan(t)]
    return {
        "wall_seconds": wall,
        "seconds_to_target": min(hits) - started_at if hits else None,
        "best_val_accuracy": max((float(f["val_accuracy"].max()) for f in frames), default=0.0),
        "trials": len(results),
        "epochs": sum(len(f) for f in frames),
        "errors": results.num_errors,
    }  # the keys ours_quality returns too


def ours_quality(
    work_dir: Path, target: float, budget_s: float, seed: int = SEED, pruner: str = "median"
) -> dict[str, Any]:
    """Our sweep of the digits MLP (TPE, ``pruner``: the default median pruning, or
    ``successive_halving``, Optuna's asynchronous successive halving with the same minimum
    resource and reduction factor as Tune's ASHA arm) until ``target`` or ``budget_s``.

    Returns what :func:`ray_tune_quality` does. The campaign stops starting trials at the
    target (``stop_at``); time to target counts from the flow call.
    """
    import optuna

    from prefect_ml.integrations.settings import get_settings
    from prefect_ml.tasks.params import default_search_space

    space = {name: d.model_dump(exclude_none=True) for name, d in default_search_space().items()}
    started_at, started = time.time(), time.perf_counter()
    result = _campaign(
        "quality",
        {"epochs": MAX_EPOCHS, "batch_size": BATCH_SIZE, "seed": seed},
        n_trials=None,
        timeout_seconds=budget_s,
        stop_at=target,
        sampler_seed=seed,
        search_space=space,
        pruner=pruner,
    )
    wall = time.perf_counter() - started
    study = optuna.load_study(
        study_name=result.campaign, storage=get_settings().resolved_optuna_storage
    )
    curves = [t.intermediate_values for t in study.trials if t.intermediate_values]
    return {
        "wall_seconds": wall,
        "seconds_to_target": (
            None if result.target_reached_at is None else result.target_reached_at - started_at
        ),
        "best_val_accuracy": max((max(c.values()) for c in curves), default=0.0),
        "trials": result.finished,
        "epochs": sum(len(c) for c in curves),
        "errors": result.failed,
        "pruned": result.pruned,
    }


OVERHEAD_ARMS: dict[str, Fn] = {
    "optuna": optuna_overhead,
    "ray-tune": ray_tune_overhead,
    "ours": ours_overhead,
}
BY_RUN_ARMS: dict[str, Fn] = {
    "ray-tune": functools.partial(ray_tune_overhead, by_run=True),
    "ours": functools.partial(ours_overhead, by_run=True),
}
QUALITY_ARMS: dict[str, Fn] = {
    "ray-tune": ray_tune_quality,
    "ours": ours_quality,
    "ours-sha": functools.partial(ours_quality, pruner="successive_halving"),
}


def quality_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm over the seeds: the median time to target (of the seeds that reached it), how
    many reached it, the median best accuracy, wall and epochs."""
    medians: dict[str, dict[str, Any]] = {}
    for name in runs[0]["arms"]:
        arms = [run["arms"][name] for run in runs]
        reached = [a["seconds_to_target"] for a in arms if a["seconds_to_target"] is not None]
        medians[name] = {
            "seconds_to_target": statistics.median(reached) if reached else None,
            "reached": len(reached),
            "best_val_accuracy": statistics.median(a["best_val_accuracy"] for a in arms),
            "wall_seconds": statistics.median(a["wall_seconds"] for a in arms),
            "trials": statistics.median(a["trials"] for a in arms),
            "epochs": statistics.median(a["epochs"] for a in arms),
        }
    return medians


def wait_for_free_cpus(limit_s: float = 180.0) -> float:
    """Wait (untimed) until Ray's CPUs are free again: Tune's trial actors outlive ``fit()``
    for a while, and an arm started before would find no room for its workers. Seconds
    waited."""
    import ray

    started = time.perf_counter()
    while ray.available_resources().get("CPU", 0.0) < CONCURRENCY:
        if time.perf_counter() - started > limit_s:
            raise RuntimeError(f"Ray's CPUs are still busy after {limit_s:.0f} s")
        time.sleep(0.5)
    return time.perf_counter() - started


def run_part(arms: dict[str, Fn], *args: Any) -> dict[str, dict[str, Any]]:
    """Each arm's numbers (a wall, or a dict), with the load right after it; each starts on a
    Ray whose CPUs are free."""
    out: dict[str, dict[str, Any]] = {}
    for name, fn in arms.items():
        waited = wait_for_free_cpus()
        value = fn(*args)
        out[name] = value if isinstance(value, dict) else {"wall_seconds": value}
        out[name]["loadavg_1m_after"] = os.getloadavg()[0]
        out[name]["waited_for_cpus_seconds"] = waited
    return out


def _ratio(ours: float | None, peer: float | None, digits: int = 2) -> str:
    return "" if ours is None or peer is None else f"{ours / peer:.{digits}f}x"


def overhead_lines(part: dict[str, Any], report: dict[str, Any], what: str) -> list[str]:
    """An overhead part's table: each arm's wall over the ideal and ours over each arm."""
    ours = part["arms"]["ours"]["wall_seconds"]
    ideal = part["ideal_seconds"]
    lines = [
        f"{what}: {part['trials']} trials x {report['work_seconds']} s, concurrency "
        f"{report['concurrency']}, ideal {ideal:.1f} s",
        "",
        "| arm | wall s | wall / ideal | ours / arm (wall) | ours / arm (above ideal) |",
        "|---|---|---|---|---|",
    ]
    for name, arm in part["arms"].items():
        wall = arm["wall_seconds"]
        above = _ratio(max(ours - ideal, 0.0), wall - ideal) if wall > ideal else ""
        lines.append(
            f"| {name} | {wall:.1f} | {wall / ideal:.2f}x | {_ratio(ours, wall)} | {above} |"
        )
    arm = part["arms"]["ours"]
    lines += [
        "",
        f"ours, once per campaign: setup {arm['setup_seconds']:.1f} s (study, MLflow "
        f"parent run, warm workers), conclusion {arm['conclude_seconds']:.1f} s (plots); "
        f"whole flow {arm['flow_seconds']:.1f} s = {arm['flow_seconds'] / ideal:.2f}x ideal",
        "",
    ]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """A table per part, with ours over each peer: lower is better, except accuracy."""
    lines: list[str] = []
    if part := report.get("overhead"):
        lines += overhead_lines(part, report, "Overhead")
    if part := report.get("by-run"):
        lines += overhead_lines(
            part, report, "Define-by-run (a conditional space over the model's options)"
        )
    if part := report.get("quality"):
        ours_arms = [name for name in part["arms"] if name.startswith("ours")]
        lines += [
            f"Quality: digits MLP to val accuracy {part['target']} within "
            f"{part['budget_seconds']:.0f} s (max {report['max_epochs']} epochs), concurrency "
            f"{report['concurrency']}, seeds {part['seeds']}; medians over the seeds (time to "
            "target: of the seeds that reached it)",
            "",
            "| arm | reached | wall s | time to target s | best val acc | trials | epochs | "
            + " | ".join(f"{o} / arm (time to target)" for o in ours_arms)
            + " |",
            "|---|---|---|---|---|---|---|" + "---|" * len(ours_arms),
        ]
        for name, arm in part["arms"].items():
            to_target, best = arm["seconds_to_target"], arm["best_val_accuracy"]
            ratios = [_ratio(part["arms"][o]["seconds_to_target"], to_target) for o in ours_arms]
            lines.append(
                f"| {name} | {arm['reached']}/{len(part['seeds'])} | {arm['wall_seconds']:.1f} "
                f"| {'not reached' if to_target is None else f'{to_target:.1f}'} "
                f"| {best:.4f} | {arm['trials']:g} | {arm['epochs']:g} | "
                + " | ".join(ratios)
                + " |"
            )
        lines += [
            "",
            "| seed | " + " | ".join(f"{n} time to target s" for n in part["arms"]) + " |",
        ]
        lines.append("|---|" + "---|" * len(part["arms"]))
        for run in part["runs"]:
            cells = [run["arms"][n]["seconds_to_target"] for n in part["arms"]]
            shown = ["not reached" if c is None else f"{c:.1f}" for c in cells]
            lines.append(f"| {run['seed']} | " + " | ".join(shown) + " |")
    return "\n".join(lines).strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 12 trials, 30 s, 0.95, 2 seeds"
    )
    parts = ("overhead", "by-run", "quality")
    parser.add_argument("--parts", nargs="+", choices=parts, default=parts, help="[all]")
    parser.add_argument("--seeds", type=int, help="quality runs, one seed each [5; 2 --quick]")
    parser.add_argument("--output", type=Path, help="JSON results [results/sweep.json]")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (2 if args.quick else 5)
    quick, full = (12, 0.95, 30.0, "sweep.quick.json"), (40, 0.97, 180.0, "sweep.json")
    args.trials, args.target, args.budget, name = quick if args.quick else full
    args.output = args.output or RESULTS_DIR / name
    return args


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Every part in every arm under a temporary project home, Ray started once; the report."""
    report: dict[str, Any] = {"benchmark": "sweep", "quick": args.quick, "seed": SEED}
    report |= {"concurrency": CONCURRENCY, "work_seconds": WORK_SECONDS, "max_epochs": MAX_EPOCHS}
    with embedded_home() as (work, _settings):
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        import optuna
        import ray
        import torch

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        load_before = os.getloadavg()
        env_vars = {"PYTHONPATH": os.pathsep.join(sys.path)}
        # "local": a new Ray of its own, never one a ``ray start`` left behind on this machine.
        ray.init(
            address="local",
            num_cpus=CONCURRENCY,
            include_dashboard=False,
            runtime_env={"env_vars": env_vars},
        )
        try:
            ray_tune_overhead(work, CONCURRENCY, CONCURRENCY)  # untimed: start Tune's workers
            wait_for_free_cpus()
            ours_overhead(work, CONCURRENCY, CONCURRENCY)  # untimed: start Prefect's API
            if "overhead" in args.parts:
                ideal = args.trials * WORK_SECONDS / CONCURRENCY
                arms = run_part(OVERHEAD_ARMS, work, args.trials, CONCURRENCY)
                report["overhead"] = dict(trials=args.trials, ideal_seconds=ideal, arms=arms)
            if "by-run" in args.parts:
                ideal = args.trials * WORK_SECONDS / CONCURRENCY
                arms = run_part(BY_RUN_ARMS, work, args.trials, CONCURRENCY)
                report["by-run"] = dict(trials=args.trials, ideal_seconds=ideal, arms=arms)
            if "quality" in args.parts:
                seeds = list(range(SEED, SEED + args.seeds))
                runs = [
                    {
                        "seed": seed,
                        "arms": run_part(QUALITY_ARMS, work, args.target, args.budget, seed),
                    }
                    for seed in seeds
                ]
                report["quality"] = dict(
                    target=args.target,
                    budget_seconds=args.budget,
                    seeds=seeds,
                    runs=runs,
                    arms=quality_medians(runs),
                )
        finally:
            ray.shutdown()
    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m.__name__: m.__version__ for m in (torch, ray, optuna)},
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run_benchmark(args)
    save_report(report, args.output, markdown(report))
    return report


if __name__ == "__main__":
    main()
