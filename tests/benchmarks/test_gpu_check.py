"""The GPU check runs where only the torch stack is installed.

The tests run it in a fresh venv that holds only torch, numpy, pydantic, pydantic-settings,
pytest and what they need (linked from this venv), as on a GPU machine lent for a quick check:
no Ray, Prefect or MLflow. On this CPU machine the check runs the CPU equivalents and lists what
it skipped.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import linked_venv

REPO_ROOT = Path(__file__).resolve().parents[2]
# What a GPU machine lent for a quick check has (and what these need), nothing else.
TORCH_STACK = ("torch", "numpy", "pydantic", "pydantic-settings", "pytest")


def _closure(names: tuple[str, ...]) -> set[str]:
    """The installed distributions ``names`` need, transitively (no extras)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    needed, todo = set(), list(names)
    while todo:
        name = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional dependency of another platform
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in needed:
            continue
        needed.add(key)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return needed


def _top_level_entries(name: str) -> set[Path]:
    """The files and folders a distribution puts at the top of site-packages."""
    from importlib.metadata import distribution

    dist = distribution(name)
    site = Path(str(dist.locate_file("")))
    entries = set()
    for file in dist.files or []:
        first = Path(file).parts[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__"):
            continue
        entries.add(site / first)
    return entries


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh venv whose only packages are the torch stack's (linked from this one's)."""
    root = tmp_path_factory.mktemp("torch-only")
    packages = root / "packages"
    packages.mkdir()
    for name in _closure(TORCH_STACK):
        for entry in _top_level_entries(name):
            if entry.exists() and not (packages / entry.name).exists():
                (packages / entry.name).symlink_to(entry)
    python = linked_venv(root / "venv", packages)
    for missing in ("ray", "prefect", "mlflow", "s3fs", "fastapi", "rich", "psutil"):
        probe = subprocess.run([python, "-c", f"import {missing}"], capture_output=True)
        assert probe.returncode != 0, f"{missing} is importable in the torch-only venv"
    return str(python)


def test_the_torch_only_test_files_collect_without_prefect_ray_or_mlflow(
    torch_only_python: str,
) -> None:
    from benchmarks.gpu_check import TORCH_ONLY_TESTS

    done = subprocess.run(
        [torch_only_python, "-m", "pytest", "--collect-only", "-q", "--noconftest"]
        + ["-p", "no:cacheprovider", *TORCH_ONLY_TESTS],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) > 30
    assert any("nccl" in line for line in collected)  # the @gpu tests are among them


@pytest.mark.full  # the whole GPU check script on CPU, about 40 s (tests/tiers.py)
def test_the_gpu_check_trains_resumes_and_serves_on_cpu_and_lists_what_it_skipped(
    torch_only_python: str, tmp_path: Path
) -> None:
    output = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [torch_only_python, "benchmarks/gpu_check.py", "--parts", "training,serving"]
        + ["--budget-s", "120", "--output", str(output)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    training = report["training"]
    assert training["backend"] == "gloo" and training["workers"] == 2
    trained = {
        (r["strategy"], r["precision"], r["gradient_checkpointing"]) for r in training["results"]
    }
    assert trained == {
        (strategy, precision, checkpointing)
        for strategy in ("ddp", "fsdp")
        for precision in ("fp32", "bf16")
        for checkpointing in (False, True)
    }
    assert all(r["ok"] and r["train_loss"][2] < r["train_loss"][0] for r in training["results"])
    serving = report["serving"]["results"]
    assert [r["precision"] for r in serving] == ["fp32"] and serving[0]["ok"]
    assert serving[0]["device"]["type"] == "cpu"
    skipped = "\n".join(report["skipped"])
    assert "tests: not in --parts" in skipped and "precision: not in --parts" in skipped
    assert "training ddp fp16: fp16 trains on GPUs only" in skipped
    assert "serving bf16: bf16/fp16 inference needs a GPU replica" in skipped
    assert "OK in" in done.stdout
