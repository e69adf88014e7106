from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from prefect_ml.integrations.services import prepare_process_environment
from prefect_ml.integrations.settings import (
    PrefectMLSettings,
    get_settings,
    running_local_server,
    worker_environment,
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


def test_settings_are_read_again_once_the_environment_or_directory_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked again in the same environment, the same settings (a trial worker asks five
    times per trial); a changed variable or working directory is seen at once."""
    monkeypatch.delenv("PREFECT_ML_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    first = get_settings()
    assert get_settings() is first
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "mine,theirs")
    assert get_settings().allowed_module_prefixes == ("mine", "theirs")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert get_settings().home_dir == tmp_path / "elsewhere" / ".prefect-ml"


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


def test_every_process_we_start_refuses_pickled_models(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # a user's own setting
    prepare_process_environment(home)
    assert os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] == "false"
    monkeypatch.setenv("PREFECT_ML_ALLOWED_MODULES", "my_project")
    monkeypatch.setenv("PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S", "12.5")
    assert worker_environment(PrefectMLSettings()) == {
        "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false",
        "PREFECT_ML_ALLOWED_MODULES": "my_project",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "12.5",
    }


_WORKER = """
import json, os, ray
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.settings import PrefectMLSettings

@ray.remote
def worker():
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray.util.state import list_nodes

    seen = {"pickle": os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")}
    try:  # where Ray's state API (Ray Train's placement-group cleaner) looks from a worker
        seen["state_api_cluster"] = canonicalize_bootstrap_address_or_die(None)
        seen["nodes"] = len(list_nodes(timeout=20))
    except Exception as exc:
        seen["state_api_error"] = repr(exc)
    return seen

with ray_session(PrefectMLSettings()):
    seen = ray.get(worker.remote())
    print("worker:", json.dumps({**seen, "own": ray.get_runtime_context().gcs_address}))
"""


@pytest.fixture(scope="module")
def worker_view(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a worker of the product's own local Ray (``ray_session``) sees, on a machine whose
    record of its newest Ray (``/tmp/ray/ray_current_cluster``, written by ``ray start``)
    names a cluster that is gone, as a stopped cluster leaves it; with a driver that allows
    pickled models."""
    from ray._common.utils import get_ray_address_file

    record = Path(get_ray_address_file(None))
    before = record.read_text() if record.exists() else None
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("127.0.0.1:1")
    env = {**os.environ, "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "true"}
    env["PREFECT_ML_HOME"] = str(tmp_path_factory.mktemp("worker-view") / "home")
    env["PREFECT_ML_LOCAL_RAY_CPUS"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WORKER],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        if before is None:
            record.unlink(missing_ok=True)
        else:
            record.write_text(before)
    line = next((x for x in done.stdout.splitlines() if x.startswith("worker: ")), None)
    assert line, done.stdout + done.stderr[-4000:]
    return cast(dict[str, Any], json.loads(line.removeprefix("worker: ")))


def test_ray_workers_we_start_refuse_pickled_models(worker_view: dict[str, Any]) -> None:
    """Shipped in the job's runtime environment, whatever the driver's environment says."""
    assert worker_view["pickle"] == "false"


def test_ray_workers_we_start_query_their_own_cluster_whatever_the_machine_recorded(
    worker_view: dict[str, Any],
) -> None:
    """Ray's state API in a worker looked up the cluster named in ray_current_cluster: a gone
    one, where every query waited for a GCS that never answered (each training's end took
    about 12 s longer: Ray Train's placement-group cleaner stopped only after its query timed
    out), or another live one, whose placement groups and actors it would then have watched."""
    assert "state_api_error" not in worker_view, worker_view
    assert worker_view["state_api_cluster"] == worker_view["own"]
    assert worker_view["nodes"] == 1
