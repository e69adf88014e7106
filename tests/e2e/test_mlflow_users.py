"""MLflow's basic-auth app configured as the compose stack configures it
(deployments/mlflow/basic_auth.ini: a new user may do nothing until granted), and the admin's
script that deployments/README.md shows (examples/mlflow_users.py): the person it creates reads
the pipeline's experiment and model, and nothing else; writes are refused (full tier: a server).
"""

from __future__ import annotations

import configparser
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient

from examples import mlflow_users
from tests.conftest import REPO_ROOT
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.e2e

ADMIN = ("admin", secrets.token_hex(8))
PIPELINE = ("prefect-ml", secrets.token_hex(8))  # the user mlflow-init creates


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlflow server --app-name basic-auth`` with the stack's basic_auth.ini (only its
    database moved into tmp) and the admin from variables, as compose runs it; its URI."""
    folder = tmp_path_factory.mktemp("mlflow-auth")
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / "deployments" / "mlflow" / "basic_auth.ini")
    config["mlflow"]["database_uri"] = f"sqlite:///{folder / 'auth.db'}"
    with (folder / "basic_auth.ini").open("w") as file:
        config.write(file)
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(folder / "artifacts")]
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(folder / "basic_auth.ini"),
        "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN[0],
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no GenAI job runners beside it
        # mlflow starts uvicorn by name: the virtualenv's bin must be on PATH.
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
    }
    log = folder / "server.log"
    with log.open("wb") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert server.poll() is None, log.read_text()
        try:
            return httpx.get(f"{uri}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 120, "mlflow server --app-name basic-auth to answer")
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def _as(monkeypatch: pytest.MonkeyPatch, user: tuple[str, str]) -> None:
    """MLflow's clients send these credentials from now on, as the README's comment sets them."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", user[1])


def _refused(call: Callable[..., object], *args: object) -> str:
    """The error code of MLflow's answer to a call that must be refused."""
    with pytest.raises(MlflowException) as refused:
        call(*args)
    return str(refused.value.error_code)


def test_the_admins_script_lets_a_person_read_the_pipelines_experiment_and_model_only(
    auth_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _as(monkeypatch, ADMIN)
    AuthServiceClient(auth_server).create_user(*PIPELINE)
    AuthServiceClient(auth_server).create_user("bob", "another-long-password")
    _as(monkeypatch, PIPELINE)  # the pipeline owns (MANAGE) what it creates
    # The registry named as well: a serving or registering test earlier in this process set
    # MLflow's process-wide registry URI (serving._models, tracking), which a client without one
    # would use instead of this server.
    pipeline = MlflowClient(auth_server, registry_uri=auth_server)
    experiment_id = pipeline.create_experiment("prefect-ml")
    run = pipeline.create_run(experiment_id)
    pipeline.log_metric(run.info.run_id, "test_accuracy", 0.97)
    pipeline.create_registered_model("digits-classifier")
    other_id = pipeline.create_experiment("other")

    _as(monkeypatch, ADMIN)
    mlflow_users.give_read_access(auth_server, "alice", "a-long-password")

    _as(monkeypatch, ("alice", "a-long-password"))
    alice = MlflowClient(auth_server, registry_uri=auth_server)
    experiment = alice.get_experiment_by_name("prefect-ml")
    assert experiment is not None and experiment.experiment_id == experiment_id
    assert alice.get_run(run.info.run_id).data.metrics == {"test_accuracy": 0.97}
    assert alice.get_registered_model("digits-classifier").name == "digits-classifier"
    assert _refused(alice.get_experiment, other_id) == "PERMISSION_DENIED"
    assert _refused(alice.create_run, experiment_id) == "PERMISSION_DENIED"
    assert _refused(alice.log_metric, run.info.run_id, "test_accuracy", 1.0) == "PERMISSION_DENIED"
    assert _refused(alice.delete_registered_model, "digits-classifier") == "PERMISSION_DENIED"

    _as(monkeypatch, ("bob", "another-long-password"))  # created, never granted
    bob = MlflowClient(auth_server, registry_uri=auth_server)
    assert _refused(bob.get_experiment, experiment_id) == "PERMISSION_DENIED"
