"""What every benchmark shares: an isolated project home on embedded defaults, and its report."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_ml.integrations.settings import PrefectMLSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# Variables that would point the run at someone's real services instead of embedded defaults.
FOREIGN_ENV = (
    "MLFLOW_TRACKING_URI",
    "PREFECT_API_URL",
    "PREFECT_HOME",
    "PREFECT_ML_RAY_ADDRESS",
    "PREFECT_ML_STORAGE_URL",
    "PREFECT_ML_MLFLOW_TRACKING_URI",
)


@contextlib.contextmanager
def embedded_home() -> Iterator[tuple[Path, PrefectMLSettings]]:
    """A temporary work directory whose ``home`` holds all state, deleted afterwards.

    Service variables are dropped and Prefect is pointed at the home before it is imported.
    The repository goes on ``sys.path`` first: Ray workers (which inherit it) import the
    benchmarks' own datasets and models by path.
    """
    sys.path.insert(0, str(REPO_ROOT))
    with tempfile.TemporaryDirectory(prefix="prefect-ml-bench-", ignore_cleanup_errors=True) as tmp:
        for name in FOREIGN_ENV:
            os.environ.pop(name, None)
        os.environ["PREFECT_ML_HOME"] = str(Path(tmp) / "home")
        # The benchmarks' datasets and models are user code: the allow-list must admit them.
        os.environ["PREFECT_ML_ALLOWED_MODULES"] = "benchmarks,tests.fixtures"
        from prefect_ml.integrations.services import prepare_process_environment

        yield Path(tmp), prepare_process_environment()


def results_path(name: str, quick: bool) -> Path:
    """Where a benchmark's raw results go: a smoke run (``--quick``) never replaces a full run's,
    and is not committed."""
    return RESULTS_DIR / (f"{name}.quick.json" if quick else f"{name}.json")


def save_report(report: dict[str, Any], output: Path, table: str) -> None:
    """Write the raw JSON results and print the markdown table."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(table)
    print(f"\nraw results: {output}")


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def wait_until_idle(
    busy_below: float = 0.15, window_s: float = 0.5, timeout_s: float = 60.0
) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_below`` of a ``window_s`` window
    (what the previous arm left running: its Ray actors stopping, its flow's API calls), or
    ``timeout_s``. Returns the last window's busy share, for the report."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy_before, total_before = _cpu_times()
        time.sleep(window_s)
        busy_after, total_after = _cpu_times()
        share = (busy_after - busy_before) / max(total_after - total_before, 1)
        if share < busy_below or time.monotonic() >= deadline:
            return share
