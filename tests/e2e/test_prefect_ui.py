"""The Prefect way, end to end: `prefect-ml ui` starts a real Prefect server, the deployments of
prefect.yaml are registered on it (by `prefect deploy` and by `prefect-ml deploy`), and a person
runs a training from the Prefect UI in headless Chromium."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class PrefectUI:
    ui_url: str
    api_url: str
    home: Path
    env: dict[str, str]  # what a process needs to use this server and home

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30)


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(process: subprocess.Popen[bytes]) -> int:
    """Ctrl-C, the way a person stops it; the exit status."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


@pytest.fixture(scope="module")
def prefect_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectUI]:
    """`prefect-ml ui` on a free loopback port, with its own project home."""
    root = tmp_path_factory.mktemp("prefect-ui")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")
        and not k.startswith("PREFECT_ML_")
    }
    env["PREFECT_ML_HOME"] = str(root / "home")
    log = root / "ui.log"
    server = _start([str(BIN / "prefect-ml"), "ui", "--port", str(free_port())], env, log)
    wait_for(lambda: "Prefect UI:" in log.read_text() or server.poll() is not None, 180, "ui")
    output = log.read_text()
    assert server.poll() is None, output
    ui_url = output.split("Prefect UI:")[1].split()[0]
    assert ui_url.startswith("http://127.0.0.1:")
    env["PREFECT_API_URL"] = f"{ui_url}/api"
    yield PrefectUI(ui_url=ui_url, api_url=f"{ui_url}/api", home=root / "home", env=env)
    assert _stop(server) == 0, log.read_text()[-3000:]
    assert not httpx_ok(f"{ui_url}/api/health")


def httpx_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _deployment(client: httpx.Client, flow_name: str, name: str) -> dict[str, Any]:
    response = client.get(f"/deployments/name/{flow_name}/{name}")
    response.raise_for_status()
    return dict(response.json())


def _run_cli(command: list[str], env: dict[str, str]) -> str:
    finished = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return finished.stdout


def test_prefect_deploy_registers_prefect_yaml_and_schedules_the_nightly_runs(
    prefect_ui: PrefectUI,
) -> None:
    prefect = str(BIN / "prefect")
    _run_cli([prefect, "work-pool", "create", "ml-process", "--type", "process"], prefect_ui.env)
    output = _run_cli(
        [prefect, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"],
        prefect_ui.env,
    )
    assert "nightly" in output
    with prefect_ui.api() as client:
        expected = {
            ("ml-pipeline", "nightly"): "flows/pipeline.py:ml_pipeline",
            ("hpo-campaign", "campaign"): "flows/sweep.py:hpo_campaign",
            ("train-model", "train"): "flows/train.py:train_model",
            ("serve-model", "serve"): "flows/serve.py:serve_model",
        }
        for (flow_name, name), entrypoint in expected.items():
            deployment = _deployment(client, flow_name, name)
            assert deployment["entrypoint"] == entrypoint
            assert deployment["work_pool_name"] == "ml-process"
            assert deployment["enforce_parameter_schema"] is True
        nightly = _deployment(client, "ml-pipeline", "nightly")
        [schedule] = nightly["schedules"]
        assert schedule["schedule"]["cron"] == "0 2 * * *"
        assert schedule["schedule"]["timezone"] == "UTC"
        assert schedule["active"] is True

        def scheduled_runs() -> list[dict[str, Any]]:
            response = client.post(
                "/flow_runs/filter",
                json={"flow_runs": {"deployment_id": {"any_": [nightly["id"]]}}},
            )
            return [r for r in response.json() if r["state_type"] == "SCHEDULED"]

        wait_for(lambda: len(scheduled_runs()) >= 2, 90, "the scheduler to create nightly runs")
        for run in scheduled_runs():
            assert run["expected_start_time"].endswith("T02:00:00Z")


def test_the_train_form_on_the_server_has_titles_enums_defaults_and_refuses_bad_values(
    prefect_ui: PrefectUI,
) -> None:
    with prefect_ui.api() as client:
        deployment = _deployment(client, "train-model", "train")
        schema = deployment["parameter_openapi_schema"]
        training = schema["definitions"]["TrainingParams"]["properties"]
        assert training["epochs"]["title"] == "Epochs"
        assert training["epochs"]["default"] == 12
        assert training["epochs"]["description"]
        assert training["optimizer"]["enum"] == ["adam", "adamw", "sgd"]
        sections = schema["definitions"]["TrainModelParams"]["properties"]
        assert {"data", "model", "training", "registry"} <= set(sections)
        assert sections["training"]["title"] == "Training"

        for bad, field, words in [
            ({"training": {"epochs": 0}}, "params.training.epochs", "less than the minimum"),
            ({"training": {"optimizer": "adamx"}}, "params.training.optimizer", "is not one of"),
            ({"training": {"workers": "two"}}, "params.training.workers", "is not of type"),
            ({"training": {"wokers": 2}}, "params.training", "wokers"),
        ]:
            response = client.post(
                f"/deployments/{deployment['id']}/create_flow_run",
                json={"parameters": {"params": bad}},
            )
            assert response.status_code == 409, response.text
            detail = response.json()["detail"]
            assert field in detail and words in detail, detail
