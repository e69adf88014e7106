"""Start-up: where the wall time of ``prefect-ml run`` on digits goes (embedded defaults).

Each run is the CLI as a user starts it, in a fresh child process and a fresh temporary home
(so no earlier run's training is reused): its wall time, and the moments of the flow run's
``timeline`` artifact, read from the home's Prefect database afterwards. ``--ui`` first starts
``prefect-ml ui`` on the run's home and waits until it is up, so the run sends its flow run to
that warm server instead of starting Prefect's ephemeral API.

Run ``.venv/bin/python benchmarks/startup.py`` (about a minute per run; ``--runs N``, default 2;
``--quick``: one run).
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


def one_run(workdir: Path, with_ui: bool) -> tuple[float, list[tuple[str, float, float]]]:
    home = workdir / "home"
    environment = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    environment["PREFECT_ML_HOME"] = str(home)
    with ui_server(home, environment) if with_ui else contextlib.nullcontext():
        started = time.perf_counter()
        subprocess.run([CLI, "run"], cwd=workdir, env=environment, check=True, capture_output=True)
        wall = time.perf_counter() - started
    return wall, timeline(home)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ui", action="store_true", help="run against a warm `prefect-ml ui`")
    parser.add_argument("--quick", action="store_true", help="one run")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    walls, tables = [], []
    for index in range(1 if args.quick else args.runs):
        workdir = Path(tempfile.mkdtemp(prefix="prefect-ml-startup-"))
        try:
            wall, rows = one_run(workdir, args.ui)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        walls.append(wall)
        runs.append({"wall_s": wall, "timeline": rows})
        lines = [f"run {index + 1}: `prefect-ml run` took {wall:.1f} s wall", ""]
        lines += ["| moment | at (s) | since the previous (s) |", "|---|---:|---:|"]
        lines += [f"| {moment} | {at:.1f} | {took:.1f} |" for moment, at, took in rows]
        tables.append("\n".join(lines))
    tables.append(f"wall: median {statistics.median(walls):.1f} s over {len(walls)} run(s)")
    name = "startup-ui" if args.ui else "startup"
    save_report({"ui": args.ui, "runs": runs}, results_path(name, args.quick), "\n\n".join(tables))


if __name__ == "__main__":
    main()
