"""prefect-ml as a user installs it: the wheel, built from a copy of the repository, installed
into a fresh virtual environment next to a Prefect project that has its own ``flows`` and
``tasks`` packages; the project's flow, composed from prefect-ml's public tasks, trains,
evaluates and registers on the embedded defaults (local Ray, ephemeral Prefect, MLflow on
SQLite)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.helpers import linked_venv

pytestmark = pytest.mark.e2e

# What a build needs from the repository: the package (the top-level flows/, tasks/ and
# integrations/ are links into it).
SOURCES = ("pyproject.toml", "README.md", "prefect_ml")

USER_PROJECT = {
    "flows/__init__.py": "",
    "tasks/__init__.py": "",
    "my_pkg/__init__.py": "",
    # The user's own task, in the user's own ``tasks`` package.
    "tasks/features.py": '''
        import numpy as np
        import pandas as pd
        from prefect import task


        @task
        def write_churn_table(path: str) -> str:
            """Two well separated groups of customers, as a CSV with a label column."""
            rng = np.random.default_rng(3)
            label = np.arange(240) % 2
            table = pd.DataFrame(
                {f"f{i}": rng.normal(3.0 * label, 0.5) for i in range(5)} | {"churned": label}
            )
            table.to_csv(path, index=False)
            return path
    ''',
    "my_pkg/models.py": """
        from torch import nn


        def build(input_shape, num_classes, width: int = 16):
            return nn.Sequential(
                nn.Flatten(),
                nn.Linear(input_shape[0], width),
                nn.ReLU(),
                nn.Linear(width, num_classes),
            )
    """,
    # The user's flow, in the user's own ``flows`` package, from prefect-ml's public tasks.
    "flows/churn.py": """
        import json
        import sys
        from pathlib import Path

        from prefect import flow
        from prefect.plugins import load_prefect_collections

        import prefect_ml
        from prefect_ml import evaluate, preprocess, register, train
        from tasks.features import write_churn_table


        @flow
        def churn_pipeline(csv_path: str) -> dict:
            url = write_churn_table(csv_path)
            data = preprocess(dataset="tabular", url=url, label_column="churned")
            run = train(data, model="my_pkg.models:build", model_options={"width": 8},
                        epochs=3, workers=1, batch_size=16)
            metrics = evaluate(run, data)
            registration = register(run, metrics, model_name="churn", promote_if={"macro_f1": 0.0})
            return {
                "run_id": run.run_id,
                "metrics": metrics.metrics,
                "registration": registration.model_dump(),
            }


        if __name__ == "__main__":
            outcome = churn_pipeline(str(Path.cwd() / "churn.csv"))
            modules = ("prefect_ml", "flows", "tasks", "my_pkg.models")
            outcome["files"] = {name: sys.modules[name].__file__ for name in modules}
            outcome["collections"] = sorted(load_prefect_collections())
            outcome["public"] = prefect_ml.__all__
            print("OUTCOME " + json.dumps(outcome))
    """,
}


def build_wheel(tmp_path: Path) -> Path:
    """The wheel, built by pip from a clean copy of what the repository tracks for the package."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        origin = REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, symlinks=True, ignore=_caches)
        else:
            shutil.copy2(origin, source / name)
    wheels = tmp_path / "wheels"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*command, "-q", "-w", str(wheels), str(source)], check=True, timeout=300)
    (wheel,) = wheels.glob("prefect_ml-*.whl")
    return wheel


def _caches(_folder: str, names: list[str]) -> list[str]:
    return [name for name in names if name == "__pycache__"]


def fresh_environment(tmp_path: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel installed. Its dependencies (torch, Ray,
    Prefect, MLflow: gigabytes) come from this environment's site-packages through a folder of
    links that leaves out this checkout's editable prefect-ml, so only the wheel provides it."""
    dependencies = tmp_path / "dependencies"
    dependencies.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if "prefect_ml" not in entry.name and "prefect-ml" not in entry.name:
            (dependencies / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    python = linked_venv(venv, dependencies)
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)
    return venv


def write_user_project(folder: Path) -> None:
    for name, text in USER_PROJECT.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def user_environment(tmp_path: Path) -> dict[str, str]:
    """A clean environment: nothing of this session (its Prefect API, home, allow-list, S3)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PREFECT", "AWS_", "MLFLOW", "PYTHON", "RAY_"))
    }
    return {
        **env,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_ML_HOME": str(tmp_path / "home"),
        "PREFECT_ML_ALLOWED_MODULES": "my_pkg",
        "DO_NOT_TRACK": "1",
        # As docs/how-to/configuration.md tells users who run their own flows on the ephemeral
        # API: its first start (a new database) can pass Prefect's 20 s default on 2 busy cores.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        # A Ray of its own even where a `ray start` cluster of another test is up.
        "RAY_ADDRESS": "local",
    }


def test_a_user_project_with_its_own_flows_package_runs_a_flow_of_public_tasks(
    tmp_path: Path,
) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(
            next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
    top_level = {name.split("/")[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"prefect_ml"}
    assert {
        "prefect_ml/py.typed",
        "prefect_ml/flows/pipeline.py",
        "prefect_ml/tasks/campaign/run.py",
        "prefect_ml/integrations/storage/__init__.py",
    } <= set(names)
    assert "[prefect.collections]\nprefect_ml = prefect_ml" in entry_points
    assert "prefect-ml = prefect_ml.flows.cli:app" in entry_points

    venv = fresh_environment(tmp_path, wheel)
    project = tmp_path / "project"
    write_user_project(project)
    env = user_environment(tmp_path)
    cli = subprocess.run(
        [venv / "bin" / "prefect-ml", "--help"], env=env, capture_output=True, text=True
    )
    assert cli.returncode == 0 and "train" in cli.stdout, cli.stderr

    run = subprocess.run(
        [venv / "bin" / "python", "-m", "flows.churn"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-4000:]
    outcome = json.loads(lines[-1].removeprefix("OUTCOME "))

    files = outcome["files"]
    assert files["prefect_ml"].startswith(str(venv)), files  # the wheel, not this checkout
    for name in ("flows", "tasks", "my_pkg.models"):
        assert files[name].startswith(str(project)), files  # the user's own packages
    assert "prefect_ml" in outcome["collections"]
    assert {"preprocess", "train", "evaluate", "register", "serve", "campaign"} <= set(
        outcome["public"]
    )
    registration = outcome["registration"]
    assert registration["model_name"] == "churn" and registration["version"] == "1"
    assert registration["promoted"] and "test_macro_f1" in registration["reason"]
    assert outcome["metrics"]["accuracy"] > 0.9  # two separated groups

    from prefect_ml.integrations import tracking

    client = tracking.client_for(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    version = client.get_model_version("churn", "1")
    assert version.run_id == outcome["run_id"]
    assert version.tags[tracking.FEATURE_NAMES_TAG] == json.dumps([f"f{i}" for i in range(5)])
    run_params = client.get_run(outcome["run_id"]).data.params
    assert run_params["model.model"] == "my_pkg.models:build"
    assert run_params["data.label_column"] == "churned"
