"""A Prefect server for prefect-ml: start one on loopback, find it, set the Ray quota, and build
the deployments that ``deployments/prefect.yaml`` describes so one process can serve them."""

from __future__ import annotations

import atexit
import base64
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import yaml

from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.services import _processes, _timeline
from prefect_ml.integrations.settings import (
    PrefectMLSettings,
    local_server_auth_string,
)

if TYPE_CHECKING:
    from uuid import UUID

    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment

# Every task that occupies the Ray cluster (a training run, a campaign) carries this tag; a tag
# concurrency limit on it bounds how many run at once, whichever flow runs started them.
RAY_TAG = "prefect-ml-ray"
DEFAULT_PREFECT_FILE = Path("deployments/prefect.yaml")
SERVER_STARTUP_TIMEOUT_S = 120.0
SERVER_AUTH_VARIABLE = "PREFECT_SERVER_API_AUTH_STRING"
DATABASE_VARIABLE = "PREFECT_API_DATABASE_CONNECTION_URL"
MIN_AUTH_STRING_LENGTH = 16


def run_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The current flow or task run's logger (shown in the UI and the console); outside a run,
    a logger that Prefect's console handler shows (``prefect.prefect_ml``)."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_logger

    try:
        return get_run_logger()
    except MissingContextError:
        return get_logger("prefect_ml")


def ui_url(api_url: str) -> str:
    """The UI's address for an API address (the server serves both)."""
    return api_url.rstrip("/").removesuffix("/api")


def start_ephemeral_api(settings: PrefectMLSettings) -> None:
    """Start Prefect's ephemeral API now when no server is configured (``PREFECT_API_URL``
    unset), as the first flow run would start it, so that it starts while other things do;
    flow runs in this process then use it.

    It starts deaf to the terminal's Ctrl-C, so that a stopped command can still record how
    its run ended before it stops the server (:func:`stop_ephemeral_api`); it is recorded
    under the home, and one that a killed command left behind is ended here."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    if get_current_settings().api.url is None and not (server := SubprocessASGIServer()).running:
        records = settings.prefect_home / "ephemeral"
        _processes.end_orphans(records)
        with _processes.ctrl_c_passes_by():
            server.start()  # once per process: a command's later flow runs (serve --watch) reuse it
        assert server.server_process is not None  # started, or start() raised
        record = _processes.record_child(records, server.server_process.pid)
        atexit.register(record.unlink, missing_ok=True)
        _timeline.mark("Prefect API started")


def ephemeral_api_pid() -> int | None:
    """The process id of this process's ephemeral API, or None when it runs none."""
    from prefect.server.api.server import SubprocessASGIServer

    process = SubprocessASGIServer().server_process
    return process.pid if process is not None else None


def stop_ephemeral_api() -> None:
    """Stop this process's ephemeral API, when it runs one (a record left behind names a
    process that ended, and the next start drops it)."""
    from prefect.server.api.server import SubprocessASGIServer

    SubprocessASGIServer().stop()


def mark_stopped(flow_run_id: UUID, message: str) -> None:
    """Mark a flow run, and its task runs that had not ended, Cancelled with ``message``: the
    command running them was stopped (Ctrl-C, SIGTERM); the same command resumes the work."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelled

    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        for task_run in task_runs:
            if task_run.state is not None and not task_run.state.is_final():
                client.set_task_run_state(task_run.id, Cancelled(message=message), force=True)
        client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=True)


def server_is_up(api_url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def require_server(api_url: str | None, auth_string: str | None = None) -> str:
    """The API URL of a running Prefect server that accepts ``auth_string`` (basic auth, as
    ``PREFECT_API_AUTH_STRING``), or a clear error saying how to get one."""
    if not api_url:
        raise EnvironmentCheckError(
            "no Prefect server to register deployments with: start one with `prefect-ml ui` "
            "(in another terminal) or set PREFECT_API_URL to a running server's API"
        )
    if not server_is_up(api_url):
        raise EnvironmentCheckError(
            f"no Prefect server answers at {api_url}: start it with `prefect-ml ui`, or fix "
            "PREFECT_API_URL"
        )
    headers = {"Authorization": basic_auth_header(auth_string)} if auth_string else {}
    answer = httpx.get(f"{api_url.rstrip('/')}/admin/version", headers=headers, timeout=10.0)
    if answer.status_code == 401:
        sent = "the credentials in PREFECT_API_AUTH_STRING" if auth_string else "no credentials"
        raise EnvironmentCheckError(
            f"the Prefect server at {api_url} refused {sent}: set PREFECT_API_AUTH_STRING to its "
            "auth string (`prefect-ml ui` keeps it in <home>/prefect/auth_string)"
        )
    return api_url


def server_database(settings: PrefectMLSettings) -> str:
    """Where the server's database is, for people: its URL without the password, or the
    SQLite file Prefect keeps under its home."""
    database = settings.prefect_server_database or os.environ.get(DATABASE_VARIABLE)
    if database is None:
        return f"SQLite under {settings.prefect_home}"
    return masked(database)


def basic_auth_header(auth_string: str) -> str:
    """The Authorization header Prefect's client sends for an auth string."""
    return "Basic " + base64.b64encode(auth_string.encode()).decode()


def server_auth_string(settings: PrefectMLSettings) -> tuple[str, bool]:
    """The basic-auth string of this home's server, and whether it was generated just now.

    PREFECT_SERVER_API_AUTH_STRING wins, then the one recorded in the home, else a new random
    one. It is recorded (mode 0600) where this home's commands find it, as they find the server.
    """
    given = os.environ.get(SERVER_AUTH_VARIABLE)
    if given is not None and len(given) < MIN_AUTH_STRING_LENGTH:
        raise ConfigurationError(
            SERVER_AUTH_VARIABLE,
            f"at least {MIN_AUTH_STRING_LENGTH} characters; unset it to have one generated",
        )
    recorded = local_server_auth_string(settings)
    auth_string = given or recorded or f"prefect-ml:{secrets.token_urlsafe(32)}"
    if auth_string != recorded:
        _write_private(settings.local_server_auth_file, auth_string)
    return auth_string, not (given or recorded)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read, replacing any earlier one at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # whatever mode a leftover file had
        handle.write(text)
    os.replace(partial, path)


# ---------------------------------------------------------------------------------------------
# A local server, and the file through which other prefect-ml commands find it


@contextmanager
def local_server(
    settings: PrefectMLSettings, host: str, port: int, auth_string: str
) -> Iterator[str]:
    """Run ``prefect server start`` (its database ``PREFECT_ML_PREFECT_DATABASE_URL``, else
    under the project home) with basic auth on its API and yield its API URL once it answers;
    stop it on the way out. Other prefect-ml commands on this home use it (with the auth
    string :func:`server_auth_string` recorded)."""
    _processes.check_port_free(host, port, "--port")
    api_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/api"
    environment = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    environment[SERVER_AUTH_VARIABLE] = auth_string
    if database := settings.prefect_server_database:
        environment[DATABASE_VARIABLE] = database
    environment["PREFECT_SERVER_UI_API_URL"] = api_url  # else the UI calls port 4200
    # The classic UI, which the browser test drives; the new one (/v2) stays a click away.
    environment.setdefault("PREFECT_SERVER_UI_V2_ENABLED", "false")
    log_path = settings.prefect_home / "server.log"
    command = [sys.executable, "-m", "prefect", "server", "start"]
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*command, "--host", host, "--port", str(port)],
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
        while not server_is_up(api_url, timeout=1.0):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise EnvironmentCheckError(f"the Prefect server did not start:\n{tail}")
            time.sleep(0.5)
        settings.local_server_file.write_text(json.dumps({"api_url": api_url, "pid": server.pid}))
        yield api_url
    finally:
        settings.local_server_file.unlink(missing_ok=True)
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Quotas


def set_ray_quota(slots: int) -> None:
    """Allow ``slots`` Ray-occupying tasks (training, campaigns) at once across all flow runs."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=RAY_TAG, concurrency_limit=slots)


def ray_quota() -> int | None:
    """The Ray quota's slots on the current Prefect API, or None when none is set."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_concurrency_limit_by_tag(RAY_TAG).concurrency_limit
        except ObjectNotFound:
            return None


def set_tag_quota(tag: str, slots: int) -> None:
    """Allow ``slots`` task runs carrying ``tag`` at once (a tenant's quota); 0 refuses them."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=tag, concurrency_limit=slots)


# ---------------------------------------------------------------------------------------------
# deployments/prefect.yaml


@dataclass(frozen=True)
class DeploymentSpec:
    """One entry of ``deployments:`` in prefect.yaml: what ``prefect-ml deploy`` serves."""

    name: str
    entrypoint: str
    description: str | None = None
    tags: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    schedules: list[dict[str, Any]] = field(default_factory=list)
    concurrency_limit: int | None = None
    enforce_parameter_schema: bool = True


# Keys of a prefect.yaml deployment that only matter to `prefect deploy` and its work pool.
_WORK_POOL_KEYS = {"work_pool", "version", "build", "push", "pull"}


def read_deployment_specs(prefect_file: Path) -> list[DeploymentSpec]:
    """The deployments of a prefect.yaml, checked: each names its entry and key when wrong."""
    if not prefect_file.is_file():
        raise ConfigurationError(
            "--prefect-file",
            f"{prefect_file} does not exist; run from the project root or pass --prefect-file",
        )
    document = yaml.safe_load(prefect_file.read_text()) or {}
    entries = document.get("deployments")
    if not isinstance(entries, list) or not entries:
        raise ConfigurationError("deployments", f"{prefect_file} lists no deployments")
    known = set(DeploymentSpec.__dataclass_fields__) | _WORK_POOL_KEYS
    specs = []
    for index, entry in enumerate(entries):
        where = f"deployments[{index}]"
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ConfigurationError(where, f"unknown keys {unknown}; known: {sorted(known)}")
        fields = {k: v for k, v in entry.items() if k not in _WORK_POOL_KEYS}
        try:
            spec = DeploymentSpec(**fields)
        except TypeError as exc:  # a required key is missing
            raise ConfigurationError(where, f"{exc}; each needs a name and an entrypoint") from None
        for schedule in spec.schedules:
            _schedule(spec.name, schedule)  # fail on a bad schedule before anything registers
        specs.append(spec)
    return specs


def _schedule(deployment: str, entry: dict[str, Any]) -> Any:
    from prefect.schedules import Cron, Interval

    options = {k: entry[k] for k in ("timezone", "active", "parameters") if k in entry}
    if "cron" in entry:
        return Cron(entry["cron"], **options)
    if "interval" in entry:
        return Interval(entry["interval"], **options)
    raise ConfigurationError(
        f"{deployment}.schedules", f"{entry} has neither 'cron' nor 'interval'"
    )


def runner_deployments(specs: list[DeploymentSpec]) -> list[RunnerDeployment]:
    """Each spec's flow (loaded from its entrypoint, relative to the working directory) as a
    deployment that this process can serve."""
    from prefect.flows import load_flow_from_entrypoint

    deployments = []
    for spec in specs:
        flow: Flow[..., Any] = load_flow_from_entrypoint(
            spec.entrypoint, use_placeholder_flow=False
        )
        deployment = cast(
            "RunnerDeployment",
            flow.to_deployment(
                spec.name,
                description=spec.description,
                tags=spec.tags,
                parameters=spec.parameters,
                schedules=[_schedule(spec.name, s) for s in spec.schedules],
                concurrency_limit=spec.concurrency_limit,
                enforce_parameter_schema=spec.enforce_parameter_schema,
            ),
        )
        deployments.append(deployment)
    return deployments


def take_over_from_work_pools(deployments: list[RunnerDeployment]) -> list[str]:
    """Deployments of the same names that ``prefect deploy`` registered for a work pool, made
    loadable by this process; returns their names.

    Serving updates a deployment without touching its code location, and a pool deployment has
    none of its own (its pull step held it), so the runs would look for their flow in "None".
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.exceptions import ObjectNotFound

    taken = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            full_name = f"{deployment.flow_name}/{deployment.name}"
            try:
                existing = client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                client.update_deployment(existing.id, DeploymentUpdate(path="."))
                taken.append(f"{full_name} (work pool {existing.work_pool_name})")
    return taken


def register_deployments(deployments: list[RunnerDeployment]) -> list[UUID]:
    """Register the deployments now (create or update by name) and return their ids, for
    what must name them before serving starts (serving then updates the same deployments)."""
    return [cast("UUID", deployment.apply()) for deployment in deployments]  # sync here


def registered_deployment_ids(deployments: list[RunnerDeployment]) -> list[UUID]:
    """The ids of these deployments as the server has them (registered by ``prefect deploy``
    for a work pool, or by ``prefect-ml deploy``)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    ids = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            full_name = f"{deployment.flow_name}/{deployment.name}"
            try:
                ids.append(client.read_deployment_by_name(full_name).id)
            except ObjectNotFound:
                raise ConfigurationError(
                    "--prefect-file",
                    f"{full_name} is not registered on the server; register it first "
                    "(`prefect deploy --prefect-file deployments/prefect.yaml --all`)",
                ) from None
    return ids
