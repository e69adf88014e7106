"""Start-up: where the wall time of ``prefect-ml run`` on digits goes (embedded defaults).

Each run is the CLI as a user starts it, in a fresh child process and a fresh temporary home
(so no earlier run's training is reused), then ``prefect-ml run --force`` in that home (as a
user's next run: the Prefect and MLflow databases exist; it trains again): their wall times, and
the moments of each flow run's ``timeline`` artifact, read from the home's Prefect database.
``--ui`` first starts ``prefect-ml ui`` on the run's home and waits until it is up, so the runs
send their flow runs to that warm server instead of starting Prefect's ephemeral API.

Each run is followed by the **floor**: what the same steps cost with nothing of ours, in a fresh
child process of their own: a local Ray started as ``prefect-ml run`` starts it, Prefect's
ephemeral API started as the first flow run starts it, and a Ray Train ``TorchTrainer`` (2
workers, 1 CPU each) whose loop only builds a one-layer model and reports once: the moment rank 0
enters the loop, and the moment ``fit`` returns. The difference per phase is what is ours.

Run ``.venv/bin/python benchmarks/startup.py`` (about four minutes per run; ``--runs N``, default
2; ``--quick``: one run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import FOREIGN_ENV, results_path, save_report  # noqa: E402

CLI = str(Path(sys.executable).with_name("prefect-ml"))
ROW = re.compile(r"^\| (?P<moment>.+?) \| (?P<at>[\d.]+) \| (?P<took>[\d.]+) \|")


def timeline(home: Path) -> list[tuple[str, float, float]]:
    """(moment, seconds since the process started, since the previous) of the latest
    ``timeline`` artifact in the home's Prefect database."""
    with contextlib.closing(sqlite3.connect(home / "prefect" / "prefect.db")) as db:
        found = db.execute(
            "SELECT data FROM artifact WHERE key = 'timeline' ORDER BY created DESC LIMIT 1"
        ).fetchone()
    markdown = json.loads(found[0])  # the artifact's data column holds JSON
    rows = (ROW.match(line) for line in markdown.splitlines())
    return [(m["moment"], float(m["at"]), float(m["took"])) for m in rows if m]


@contextlib.contextmanager
def ui_server(home: Path, environment: dict[str, str]) -> Iterator[None]:
    """``prefect-ml ui`` on the home, on a free port, until the block ends."""
    from prefect_ml.integrations.settings import PrefectMLSettings, running_local_server
    from tests.helpers import free_port, wait_for

    server = subprocess.Popen(
        [CLI, "ui", "--port", str(free_port())],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        settings = PrefectMLSettings(home=home)
        wait_for(lambda: running_local_server(settings) is not None, 120, "prefect-ml ui")
        yield
    finally:
        server.terminate()
        server.wait(timeout=60)


Timeline = list[tuple[str, float, float]]


def one_run(workdir: Path, with_ui: bool) -> tuple[tuple[float, Timeline], tuple[float, Timeline]]:
    """``prefect-ml run`` in a new home, then ``prefect-ml run --force`` in that home (its
    databases exist): each one's wall time and timeline."""
    home = workdir / "home"
    environment = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    environment["PREFECT_ML_HOME"] = str(home)
    walls = []
    with ui_server(home, environment) if with_ui else contextlib.nullcontext():
        for command in ([CLI, "run"], [CLI, "run", "--force"]):
            started = time.perf_counter()
            subprocess.run(command, cwd=workdir, env=environment, check=True, capture_output=True)
            walls.append((time.perf_counter() - started, timeline(home)))
    return walls[0], walls[1]


def timeline_table(title: str, wall: float, rows: Timeline) -> list[str]:
    lines = [f"{title} took {wall:.1f} s wall", ""]
    lines += ["| moment | at (s) | since the previous (s) |", "|---|---:|---:|"]
    return lines + [f"| {moment} | {at:.1f} | {took:.1f} |" for moment, at, took in rows]


def floor_loop(config: dict[str, Any]) -> None:
    """The floor's training loop: enter (rank 0 notes when), build a model, report."""
    import ray.train
    import torch

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["marks"]).write_text(str(time.time()))
    torch.nn.Linear(4, 4)
    ray.train.report({"done": 1})


def floor_child(started: float, marks: Path) -> None:
    """The floor's steps in this process; its timeline (seconds since ``started``) to stdout."""
    import logging

    import ray

    moments: list[tuple[str, float]] = []
    ray.init(
        address="local",
        num_cpus=2,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
        include_dashboard=True,  # as ours: Ray Train v2 polls the dashboard's state API
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
    )
    moments.append(("local Ray started", time.time() - started))
    from prefect.server.api.server import SubprocessASGIServer  # each imported when first used

    server = SubprocessASGIServer()
    server.start()
    moments.append(("Prefect API started", time.time() - started))
    fit_started = time.time()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        floor_loop,
        train_loop_config={"marks": str(marks)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(marks.parent / "ray"), name="floor"),
    ).fit()
    ended = time.time()
    in_loop = float(marks.read_text())
    moments.append(("training worker group ready (bare loop entered)", in_loop - started))
    moments.append(("fit returned", ended - started))
    moments.append(("fit: worker group start", in_loop - fit_started))
    moments.append(("fit: after the loop (report, teardown)", ended - in_loop))
    server.stop()
    ray.shutdown()
    print(json.dumps(moments))


def floor_run(workdir: Path) -> list[tuple[str, float]]:
    environment = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    # As prefect-ml's process environment has it (integrations.settings), without the rest.
    environment.update(
        PREFECT_HOME=str(workdir / "prefect"),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        RAY_USAGE_STATS_ENABLED="0",
    )
    started = time.time()
    child = subprocess.run(
        [sys.executable, __file__, "--floor-child", str(started), str(workdir / "marks")],
        env=environment,
        capture_output=True,
        text=True,
    )
    wall = time.time() - started
    if child.returncode != 0:
        raise RuntimeError(f"the floor's process failed:\n{child.stderr[-4000:]}")
    moments = json.loads(child.stdout.strip().splitlines()[-1])
    return [*[(m, float(at)) for m, at in moments], ("process ends", wall)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ui", action="store_true", help="run against a warm `prefect-ml ui`")
    parser.add_argument("--quick", action="store_true", help="one run")
    parser.add_argument("--floor-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_child:
        floor_child(float(args.floor_child[0]), Path(args.floor_child[1]))
        return
    runs: list[dict[str, Any]] = []
    walls, repeat_walls, tables = [], [], []
    for index in range(1 if args.quick else args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="prefect-ml-startup-"))
        try:
            (wall, rows), (repeat_wall, repeat_rows) = one_run(workdir, args.ui)
            floor = floor_run(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        walls.append(wall)
        repeat_walls.append(repeat_wall)
        runs.append(
            {
                "wall_s": wall,
                "timeline": rows,
                "repeat": {"wall_s": repeat_wall, "timeline": repeat_rows},
                "floor": floor,
            }
        )
        lines = timeline_table(f"run {index + 1}: `prefect-ml run` in a new home", wall, rows)
        lines += ["", *timeline_table("then `prefect-ml run --force`", repeat_wall, repeat_rows)]
        lines += ["", f"run {index + 1}, the floor (nothing of ours):", ""]
        lines += ["| moment | at (s) |", "|---|---:|"]
        lines += [f"| {moment} | {at:.1f} |" for moment, at in floor]
        tables.append("\n".join(lines))
    tables.append(
        f"wall: median {statistics.median(walls):.1f} s in a new home, "
        f"{statistics.median(repeat_walls):.1f} s repeated, over {len(walls)} run(s)"
    )
    name = "startup-ui" if args.ui else "startup"
    save_report({"ui": args.ui, "runs": runs}, results_path(name, args.quick), "\n\n".join(tables))


if __name__ == "__main__":
    main()
