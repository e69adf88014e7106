from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from integrations.settings import (
    PrefectMLSettings,
    prepare_process_environment,
    running_local_server,
)


def test_defaults_live_under_the_home(home: PrefectMLSettings) -> None:
    root = home.home_dir
    assert home.resolved_storage_url == (root / "storage").as_uri()
    assert home.resolved_tracking_uri == f"sqlite:///{root / 'mlflow.db'}"
    assert home.mlflow_artifact_root == (root / "mlartifacts").as_uri()
    assert home.prefect_home == root / "prefect"
    assert home.ray_address is None


def test_environment_overrides(home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", "s3://bucket/prefix/")
    monkeypatch.setenv("PREFECT_ML_RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5001")
    settings = PrefectMLSettings()
    assert settings.resolved_storage_url == "s3://bucket/prefix"
    assert settings.ray_address == "ray://head:10001"
    assert settings.resolved_tracking_uri == "http://127.0.0.1:5001"
    assert settings.mlflow_artifact_root is None, "a tracking server decides where artifacts go"


def test_own_tracking_setting_wins_over_mlflow_variable(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")
    monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", "http://here:5000")
    assert PrefectMLSettings().resolved_tracking_uri == "http://here:5000"


def test_home_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_ML_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert PrefectMLSettings().home_dir == tmp_path / ".prefect-ml"


def test_commands_find_the_server_that_prefect_ml_ui_runs_for_their_home(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # restored after the test
    home.prefect_home.mkdir(parents=True)
    record = {"api_url": "http://127.0.0.1:4311/api", "pid": os.getpid()}  # a live process
    home.local_server_file.write_text(json.dumps(record))
    assert running_local_server(home) == "http://127.0.0.1:4311/api"
    prepare_process_environment(home)
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4311/api"


def test_a_stale_server_record_is_ignored(home: PrefectMLSettings) -> None:
    home.prefect_home.mkdir(parents=True)
    dead = subprocess.Popen(["true"])  # a process that no longer exists
    dead.wait()
    home.local_server_file.write_text(json.dumps({"api_url": "http://x/api", "pid": dead.pid}))
    assert running_local_server(home) is None
    home.local_server_file.write_text("not json")
    assert running_local_server(home) is None
