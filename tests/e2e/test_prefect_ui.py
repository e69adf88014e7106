"""The Prefect way, end to end: `prefect-ml ui` starts a real Prefect server with basic auth, the
deployments of prefect.yaml are registered on it (by `prefect deploy` and by `prefect-ml deploy`),
and a person logs in and runs a training from the Prefect UI in headless Chromium; the server's
services free the Ray slot of a run that was killed."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefect_ml.integrations import services, tracking
from prefect_ml.integrations.services import RAY_TAG, basic_auth_header, server_is_up
from tests.conftest import REPO_ROOT
from tests.e2e.ui_driver import (
    log_in,
    open_custom_run,
    screenshot_on_failure,
    set_form_value,
    submit_run,
    wait_for_state,
)
from tests.helpers import cold_env, free_port, start_job, wait_for

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright's own download is not reachable here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOTS = REPO_ROOT / "test-artifacts"
EXPECTED_ENTRYPOINTS = {
    "ml-pipeline/nightly": "flows/pipeline.py:ml_pipeline",
    "hpo-campaign/campaign": "flows/sweep.py:hpo_campaign",
    "train-model/train": "flows/train.py:train_model",
    "serve-model/serve": "flows/serve.py:serve_model",
}


class _RetryingTransport(httpx.HTTPTransport):
    """Retries a 503, as Prefect's own client does: the server answers it for errors it calls
    retryable, such as its SQLite database busy on a loaded machine."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for delay in (0.5, 1.0, 2.0, 4.0, 8.0):
            response = super().handle_request(request)
            if response.status_code != 503:
                return response
            response.close()
            time.sleep(delay)
        return super().handle_request(request)


@dataclass(frozen=True)
class PrefectUI:
    ui_url: str
    api_url: str
    home: Path
    auth_string: str
    env: dict[str, str]  # what a process needs to use this server and home

    def api(self) -> httpx.Client:
        """A client of the API with the server's credentials."""
        return httpx.Client(
            base_url=self.api_url,
            headers={"Authorization": basic_auth_header(self.auth_string)},
            timeout=30,
            transport=_RetryingTransport(),
        )


def _wait_for_output(process: subprocess.Popen[bytes], log: Path, marker: str) -> str:
    """The process's output once it printed ``marker``; fails if it exited first."""
    wait_for(lambda: marker in log.read_text() or process.poll() is not None, 180, marker)
    output = log.read_text()
    assert process.poll() is None, output
    return output


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
    """`prefect-ml ui` on a free loopback port, with its own project home; the auth string it
    generated, from the file it keeps it in, is given to other processes as Prefect's clients
    take it (PREFECT_API_AUTH_STRING)."""
    root = tmp_path_factory.mktemp("prefect-ui")
    env = cold_env(root / "home")
    log = root / "ui.log"
    # Its repossessor revokes expired concurrency leases every second instead of every 15 s
    # (test_fault_promises waits on one).
    server_env = {**env, "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1"}
    server = start_job([str(BIN / "prefect-ml"), "ui", "--port", str(free_port())], server_env, log)
    output = _wait_for_output(server, log, "Next, in another terminal")  # its last line
    ui_url = output.split("Prefect UI:")[1].split()[0]
    assert ui_url.startswith("http://127.0.0.1:")
    auth_file = root / "home" / "prefect" / "auth_string"
    auth_string = auth_file.read_text()
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    assert f"Log in with: {auth_string}" in output  # shown once, when generated
    env["PREFECT_API_URL"] = f"{ui_url}/api"
    env["PREFECT_API_AUTH_STRING"] = auth_string
    yield PrefectUI(
        ui_url=ui_url, api_url=f"{ui_url}/api", home=root / "home", auth_string=auth_string, env=env
    )
    assert _stop(server) == 0, log.read_text()[-3000:]
    assert not server_is_up(f"{ui_url}/api")


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


def test_the_api_refuses_requests_without_the_auth_string(prefect_ui: PrefectUI) -> None:
    query = {"limit": 1}
    for headers in ({}, {"Authorization": basic_auth_header("prefect-ml:guessed")}):
        response = httpx.post(f"{prefect_ui.api_url}/flows/filter", json=query, headers=headers)
        assert response.status_code == 401, response.text
    with prefect_ui.api() as client:
        assert client.post("/flows/filter", json=query).status_code == 200
    # Health probes (container healthchecks, `prefect-ml deploy`'s first check) need none.
    assert httpx.get(f"{prefect_ui.api_url}/health").status_code == 200


def test_prefect_ml_deploy_with_wrong_credentials_says_what_to_set(
    prefect_ui: PrefectUI,
) -> None:
    env = prefect_ui.env | {"PREFECT_API_AUTH_STRING": "prefect-ml:not-the-auth-string"}
    finished = subprocess.run(
        [str(BIN / "prefect-ml"), "deploy"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 1
    output = " ".join((finished.stdout + finished.stderr).split())
    assert "refused the credentials in PREFECT_API_AUTH_STRING" in output, output


@pytest.fixture(scope="module")
def registered(prefect_ui: PrefectUI) -> str:
    """prefect.yaml's deployments on the UI's server, as the nightly tutorial registers them:
    the work pool, then `prefect deploy --all`; the command's output. A fixture, so that a test
    of the deployments passes alone or in any order, not only after the test that deploys."""
    prefect = str(BIN / "prefect")
    _run_cli([prefect, "work-pool", "create", "ml-process", "--type", "process"], prefect_ui.env)
    return _run_cli(
        [prefect, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all"],
        prefect_ui.env,
    )


@pytest.mark.entry_point("deployment on a worker")
def test_prefect_deploy_registers_prefect_yaml_and_a_process_worker_runs_its_deployments(
    prefect_ui: PrefectUI, registered: str, tmp_path: Path
) -> None:
    """`prefect deploy` registers prefect.yaml's deployments (the nightly schedule too), and
    `prefect worker start --pool ml-process`, as the nightly tutorial says,
    runs a training of one."""
    prefect = str(BIN / "prefect")
    assert "nightly" in registered
    with prefect_ui.api() as client:
        for full_name, entrypoint in EXPECTED_ENTRYPOINTS.items():
            deployment = _deployment(client, *full_name.split("/"))
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

    worker_log = tmp_path / "worker.log"
    worker_command = [prefect, "worker", "start", "--pool", "ml-process"]
    worker = start_job(worker_command, prefect_ui.env, worker_log)
    try:
        values = {
            "training": {"workers": 1, "epochs": 1},
            "model": {"hidden": 16},
            "registry": {"model_name": "worker-trained"},
        }
        with prefect_ui.api() as client:
            train_id = _deployment(client, "train-model", "train")["id"]
            response = client.post(
                f"/deployments/{train_id}/create_flow_run", json={"parameters": {"params": values}}
            )
            assert response.status_code == 201, response.text
            run_id = response.json()["id"]

            def ended() -> bool:  # or the worker exited
                state = _flow_run(client, run_id)["state_type"]
                return state in ("COMPLETED", "FAILED", "CRASHED") or worker.poll() is not None

            wait_for(ended, 300, "the worker's flow run to end")
            run = _flow_run(client, run_id)
        assert run["state_type"] == "COMPLETED", (run["state"], worker_log.read_text()[-3000:])
        assert run["work_pool_name"] == "ml-process"
        # One local Ray for the whole run, not one per step (placement, training, evaluation).
        with prefect_ui.api() as client:
            timeline = _artifact_markdown(client, run_id, "timeline")
        assert timeline.count("| local Ray started |") == 1, timeline
    finally:
        assert _stop(worker) in (0, 130), worker_log.read_text()[-3000:]
    mlflow = tracking.client_for(f"sqlite:///{prefect_ui.home / 'mlflow.db'}")
    [version] = mlflow.search_model_versions("name = 'worker-trained'")
    assert mlflow.get_run(version.run_id).data.tags[tracking.FLOW_RUN_TAG] == run_id


@pytest.mark.usefixtures("registered")
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
            ({"training": {"batch_size": "two"}}, "params.training.batch_size", "is not of type"),
            ({"training": {"wokers": 2}}, "params.training", "wokers"),
        ]:
            response = client.post(
                f"/deployments/{deployment['id']}/create_flow_run",
                json={"parameters": {"params": bad}},
            )
            assert response.status_code == 409, response.text
            detail = response.json()["detail"]
            assert field in detail and words in detail, detail


def _artifact_keys(client: httpx.Client, flow_run_id: str) -> set[str]:
    response = client.post(
        "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    )
    return {a["key"] for a in response.json() if a["key"]}


def _artifact_markdown(client: httpx.Client, flow_run_id: str, key: str) -> str:
    response = client.post(
        "/artifacts/filter",
        json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": [key]}}},
    )
    [artifact] = response.json()
    return str(artifact["data"])


def _flow_run(client: httpx.Client, flow_run_id: str) -> dict[str, Any]:
    return dict(client.get(f"/flow_runs/{flow_run_id}").json())


@dataclass
class Webhook:
    """A webhook receiver on loopback: what the alert block posts to, and what it received."""

    url: str
    received: list[dict[str, str]] = field(default_factory=list)

    def alert(self, *words: str, timeout: float = 90) -> dict[str, str]:
        """The first notification whose subject and body contain every one of ``words``."""

        def matching() -> list[dict[str, str]]:
            return [m for m in self.received if all(w in m["subject"] + m["body"] for w in words)]

        wait_for(lambda: bool(matching()), timeout, f"an alert naming {words}: {self.received}")
        return matching()[0]


@pytest.fixture(scope="module")
def webhook() -> Iterator[Webhook]:
    received: list[dict[str, str]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Webhook(f"http://127.0.0.1:{server.server_port}/alerts", received)
    server.shutdown()
    server.server_close()
    thread.join()


ALERT_BLOCK = "ml-alerts"


@pytest.fixture(scope="module")
def alert_block(prefect_ui: PrefectUI, webhook: Webhook) -> str:
    """A Custom Webhook notification block on the server, posting to the loopback receiver:
    ``allow_private_urls`` on, for this block only, as docs/how-to/alerts.md says for a
    receiver on your own network (Prefect's SSRF guard refuses loopback otherwise)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    server = {PREFECT_API_URL: prefect_ui.api_url, PREFECT_API_AUTH_STRING: prefect_ui.auth_string}
    with temporary_settings(updates=server):
        CustomWebhookNotificationBlock(
            name="prefect-ml alerts",
            url=webhook.url,
            json_data={"subject": "{{subject}}", "body": "{{body}}"},
            allow_private_urls=True,
        ).save(ALERT_BLOCK)
    return ALERT_BLOCK


def test_deploy_with_an_alert_block_that_does_not_exist_fails_before_creating_anything(
    prefect_ui: PrefectUI,
) -> None:
    finished = subprocess.run(
        [str(BIN / "prefect-ml"), "deploy", "--alert-block", "no-such-block"],
        cwd=REPO_ROOT,
        env=prefect_ui.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 1
    output = " ".join((finished.stdout + finished.stderr).split())
    assert "--alert-block: no notification block named 'no-such-block'" in output, output
    with prefect_ui.api() as client:
        assert client.post("/automations/filter", json={}).json() == []
        limits = client.post("/v2/concurrency_limits/filter", json={}).json()
        assert "tag:prefect-ml-ray" not in {limit["name"] for limit in limits}


@pytest.fixture(scope="module")
def served(
    prefect_ui: PrefectUI, alert_block: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """`prefect-ml deploy --alert-block` serving the deployments, until the module's last test."""
    log = tmp_path_factory.mktemp("deploy") / "deploy.log"
    # No PREFECT_API_URL nor PREFECT_API_AUTH_STRING: `prefect-ml deploy` finds the server
    # `prefect-ml ui` runs for its home, and its credentials, and gives both to its flow runs.
    env = {
        k: v
        for k, v in prefect_ui.env.items()
        if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")
    }
    deploy = start_job([str(BIN / "prefect-ml"), "deploy", "--alert-block", alert_block], env, log)
    try:
        output = _wait_for_output(deploy, log, "Ctrl-C stops")
        assert f"Alerts: through custom-webhook/{alert_block}" in " ".join(output.split())
        with prefect_ui.api() as client:

            def ready() -> bool:  # the process polls for each deployment's runs
                found = [client.get(f"/deployments/name/{name}") for name in EXPECTED_ENTRYPOINTS]
                ready = all(r.status_code == 200 and r.json()["status"] == "READY" for r in found)
                return deploy.poll() is not None or ready

            wait_for(ready, 120, "the deployments to be served")
        assert deploy.poll() is None, log.read_text()[-3000:]
        yield
    finally:
        assert _stop(deploy) == 0, log.read_text()[-3000:]


def test_a_command_as_dataset_through_the_authenticated_api_fails_before_any_task(
    prefect_ui: PrefectUI, served: None, tmp_path: Path
) -> None:
    """The canary of tests/flows/test_untrusted_parameters.py, sent the way an API user would:
    the schema lets the string through, the flow run refuses it when it parses parameters."""
    canary = tmp_path / "canary"
    data = {"dataset": "os:system", "dataset_options": {"command": f"touch {canary}"}}
    with prefect_ui.api() as client:
        train_id = _deployment(client, "train-model", "train")["id"]
        response = client.post(
            f"/deployments/{train_id}/create_flow_run",
            json={"parameters": {"params": {"data": data}}},
        )
        assert response.status_code == 201, response.text
        run_id = response.json()["id"]
        wait_for(
            lambda: _flow_run(client, run_id)["state_type"] in ("FAILED", "CRASHED", "COMPLETED"),
            120,
            "the run to end",
        )
        run = _flow_run(client, run_id)
        assert run["state_type"] == "FAILED", run["state"]
        message = run["state"]["message"]
        assert "data.dataset" in message and "PREFECT_ML_ALLOWED_MODULES" in message, message
        task_runs = client.post(
            "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}
        ).json()
        assert task_runs == []
    assert not canary.exists()


@pytest.mark.entry_point("UI form")
def test_a_training_submitted_from_the_ui_form_completes_and_registers_a_model(
    prefect_ui: PrefectUI, served: None, webhook: Webhook
) -> None:
    """`prefect-ml deploy` serves the deployments; a person logs in to the UI in the browser,
    opens the train deployment, sets 1 epoch, 1 worker and 16 hidden units in the form,
    submits, and watches the run complete."""
    from playwright.sync_api import sync_playwright

    with prefect_ui.api() as client:
        limits = client.post("/v2/concurrency_limits/filter", json={}).json()
        assert {limit["name"]: limit["limit"] for limit in limits}["tag:prefect-ml-ray"] == 1
        # A served model must outlive its flow run: without a Ray cluster it fails at once.
        serve_id = _deployment(client, "serve-model", "serve")["id"]
        response = client.post(f"/deployments/{serve_id}/create_flow_run", json={"parameters": {}})
        assert response.status_code == 201, response.text
        serve_run = response.json()

    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        with screenshot_on_failure(page, SCREENSHOTS / "ui-train-run.png"):
            log_in(page, prefect_ui.ui_url, prefect_ui.auth_string)
            assert "/v2" not in page.url  # the printed URL opens the UI the test drives
            open_custom_run(page, prefect_ui.ui_url, "train-model", "train")
            set_form_value(page, ["Training", "Workers"], 1)
            set_form_value(page, ["Model", "Hidden units"], 16)
            set_form_value(page, ["Training", "Epochs"], 0)
            values = {"training": {"workers": 1, "epochs": 0}, "model": {"hidden": 16}}
            refused = r"(?s)params\.training\.epochs.*minimum of 1"
            with pytest.raises(RuntimeError, match=refused):
                submit_run(page, {"params": values})  # refused; the form stays, values kept
            set_form_value(page, ["Training", "Epochs"], 1)
            values["training"]["epochs"] = 1
            flow_run_id = submit_run(page, {"params": values})
            wait_for_state(page, "Completed", timeout_s=300)
        browser.close()

    with prefect_ui.api() as client:
        flow_run = _flow_run(client, flow_run_id)
        assert flow_run["parameters"]["params"]["training"]["epochs"] == 1
        assert {"training-summary", "test-metrics", "mlflow-run", "registered-model"} <= (
            _artifact_keys(client, flow_run_id)
        )
        wait_for(
            lambda: _flow_run(client, serve_run["id"])["state_type"] in ("FAILED", "CRASHED"),
            120,
            "the serve run to fail",
        )
        failure = _flow_run(client, serve_run["id"])["state"]["message"]
        assert "PREFECT_ML_RAY_ADDRESS" in failure, failure

    mlflow = tracking.client_for(f"sqlite:///{prefect_ui.home / 'mlflow.db'}")
    [run] = mlflow.search_runs(
        [mlflow.get_experiment_by_name("prefect-ml").experiment_id],
        filter_string=f"tags.`{tracking.FLOW_RUN_TAG}` = '{flow_run_id}'",
    )
    assert run.data.params["training.epochs"] == "1"
    assert run.data.params["training.workers"] == "1"
    assert run.data.params["model.hidden"] == "16"
    [version] = mlflow.search_model_versions("name = 'digits-classifier'")
    assert version.run_id == run.info.run_id
    assert str(mlflow.get_model_version_by_alias("digits-classifier", "champion").version) == "1"
    # The real registration above moved the alias: the champion alert says so.
    assert "took @champion from no earlier version" in webhook.alert("digits-classifier v1")["body"]


def test_a_failed_deployment_run_sends_an_alert_that_names_and_links_it(
    prefect_ui: PrefectUI, served: None, webhook: Webhook
) -> None:
    """A run of the train deployment whose parameters pass the schema and fail when the flow
    parses them: the server's automation posts to the webhook, naming the run."""
    with prefect_ui.api() as client:
        train_id = _deployment(client, "train-model", "train")["id"]
        data = {"dataset": "no_such_module:dataset"}
        response = client.post(
            f"/deployments/{train_id}/create_flow_run",
            json={"parameters": {"params": {"data": data}}},
        )
        assert response.status_code == 201, response.text
        run = response.json()
    alert = webhook.alert(run["id"])
    assert f"train-model/train run {run['name']} Failed" in alert["subject"], alert
    assert f"{prefect_ui.ui_url}/runs/flow-run/{run['id']}" in alert["body"], alert
    assert "data.dataset" in alert["body"], alert


def test_a_new_champion_sends_an_alert_with_model_versions_and_reason(
    prefect_ui: PrefectUI, served: None, webhook: Webhook
) -> None:
    """The registry step's emitter, run as a registration runs it, against the server."""
    emit = (
        "from prefect_ml.integrations.services import announce_promotion\n"
        "announce_promotion(model='alerts-demo', version='3', previous_version='2',"
        " alias='champion', reason='test_accuracy 0.97 > 0.95 (v2)', run_id='run-123')\n"
    )
    finished = subprocess.run(
        [sys.executable, "-c", emit], env=prefect_ui.env, capture_output=True, text=True, timeout=60
    )
    assert finished.returncode == 0, finished.stderr
    alert = webhook.alert("alerts-demo")
    assert alert["subject"] == "prefect-ml: alerts-demo v3 is the new @champion", alert
    assert "alerts-demo v3 took @champion from v2." in alert["body"], alert
    assert "Reason: test_accuracy 0.97 > 0.95 (v2)" in alert["body"], alert
    assert "MLflow run: run-123" in alert["body"], alert


def test_prefect_ml_alerts_again_updates_the_automations_and_adds_none(
    prefect_ui: PrefectUI, served: None, alert_block: str
) -> None:
    """What the compose stack runs after `prefect deploy`: same names, so no second copy."""
    _run_cli([str(BIN / "prefect-ml"), "alerts", "--alert-block", alert_block], prefect_ui.env)
    with prefect_ui.api() as client:
        names = [a["name"] for a in client.post("/automations/filter", json={}).json()]
    assert sorted(names) == sorted([services.FAILED_RUN_AUTOMATION, services.CHAMPION_AUTOMATION])


_SLOT_HOLDER = """
import sys, time
from pathlib import Path
from prefect import flow, task

@task(tags=[sys.argv[1]])
def occupy() -> None:
    Path(sys.argv[2]).touch()
    if sys.argv[3] == "hold":
        time.sleep(3600)

@flow
def holder() -> None:
    occupy()

holder()
"""


def _slot_holders(prefect_ui: PrefectUI) -> list[str]:
    with prefect_ui.api() as client:  # authenticated; retries the server's 503s
        response = client.get(f"/concurrency_limits/tag/{RAY_TAG}")
    response.raise_for_status()
    return [str(holder) for holder in response.json()["active_slots"]]


def test_a_killed_runs_ray_slot_frees_itself(prefect_ui: PrefectUI, tmp_path: Path) -> None:
    """A run holding the only Ray slot is SIGKILLed; the next run's task, waiting for the slot,
    starts once the server has revoked the dead run's lease (Prefect's task lease lasts 60 s;
    the fixture's repossessor looks every second, 15 s by default). ``prefect-ml ui`` is a real
    server, with its services."""
    with prefect_ui.api() as client:
        created = client.post("/concurrency_limits/", json={"tag": RAY_TAG, "concurrency_limit": 1})
    created.raise_for_status()
    env = {**prefect_ui.env, "PREFECT_HOME": str(tmp_path / "prefect")}

    def run(name: str, mode: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-c", _SLOT_HOLDER, RAY_TAG, str(tmp_path / name), mode]
        return start_job(command, env, tmp_path / f"{name}.log")

    first = run("first", "hold")
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (tmp_path / "first").exists(), 120, "the first run to take the slot")
        assert len(_slot_holders(prefect_ui)) == 1
        second = run("second", "finish")
        os.killpg(first.pid, signal.SIGKILL)  # a lost machine: no release, no renewal
        first.wait()
        assert not (tmp_path / "second").exists(), "the dead run's slot was still held"
        wait_for(lambda: (tmp_path / "second").exists(), 240, "the second run to get the slot")
        assert second.wait(timeout=120) == 0, (tmp_path / "second.log").read_text()
        assert _slot_holders(prefect_ui) == []
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
