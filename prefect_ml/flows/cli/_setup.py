"""The commands that set up the services around the flows: ``ui`` (a local Prefect server),
``deploy`` (the deployments of prefect.yaml, run from this process), ``alerts`` (their
automations) and ``tls`` (the certificates of Ray's TLS and HTTPS serving)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import click
from rich.markup import escape
from rich.table import Table

from prefect_ml.flows.cli._flow_runs import stop_on_signals
from prefect_ml.flows.cli._output import clear_errors, console
from prefect_ml.integrations import services
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import get_settings, running_local_server


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind.")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=4200,
    show_default=True,
    help="Port of the UI and the API.",
)
def ui(host: str, port: int) -> None:
    """Start a local Prefect server (UI and API) for this project home until Ctrl-C.

    While it runs, the other prefect-ml commands on this home send their runs to it.
    """
    settings = get_settings()
    running = running_local_server(settings)
    if running:
        console.print(f"A Prefect server already runs for this home: {running}")
        raise SystemExit(1)
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(
            f"[yellow]The Prefect API on {host} is plain HTTP: its auth string crosses the "
            "network in clear. Put a TLS proxy in front (deployments/README.md).[/yellow]"
        )
    stop_on_signals()
    with contextlib.ExitStack() as stack:
        stack.enter_context(clear_errors())
        auth_string, generated = services.server_auth_string(settings)
        api_url = stack.enter_context(services.local_server(settings, host, port, auth_string))
        console.print(f"[bold green]Prefect UI:[/bold green] {services.ui_url(api_url)}")
        database = services.server_database(settings)
        console.print(f"  API: {api_url}  (database: {database}; logs in {settings.prefect_home})")
        auth_file = settings.local_server_auth_file
        if generated:  # shown this once; later starts reuse it
            console.print(f"  Log in with: {escape(auth_string)}  (kept in {auth_file})")
        else:
            console.print(f"  Log in with the auth string in {auth_file}")
        console.print("  Next, in another terminal: prefect-ml deploy")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            console.print("Stopping the Prefect server")


def _set_up_alerts(
    block: services.NotificationBlock | None, deployments: list[Any], api_url: str
) -> str:
    """Create or update the alert automations for the deployments; what to tell the user."""
    if block is None:
        return (
            "Alerts: off (no notification block: pass --alert-block or set "
            "PREFECT_ML_ALERT_BLOCK; docs/how-to/alerts.md)"
        )
    return _alerts_on(block, services.register_deployments(deployments), api_url)


def _alerts_on(block: services.NotificationBlock, deployment_ids: list[UUID], api_url: str) -> str:
    names = services.ensure_automations(block, deployment_ids, services.alert_ui_url(api_url))
    return f"Alerts: through {block.reference} (automations: {'; '.join(names)})"


_prefect_file_option = click.option(
    "--prefect-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=str(services.DEFAULT_PREFECT_FILE),
    show_default=True,
    help="The deployments to serve; entrypoints are relative to the working directory.",
)
_alert_block_option = click.option(
    "--alert-block",
    default=None,
    help="Prefect notification block (NAME or TYPE/NAME) that alerts go through: a failed or "
    "crashed run of these deployments, a new champion. Default PREFECT_ML_ALERT_BLOCK; "
    "unset: no alerts.",
)


def _alert_block(flag: str | None) -> services.NotificationBlock | None:
    """The block of --alert-block, else of PREFECT_ML_ALERT_BLOCK; None when neither is set."""
    name = flag or get_settings().alert_block
    return services.find_notification_block(name) if name else None


@click.command()
@_prefect_file_option
@click.option(
    "--ray-slots",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Training and campaign tasks that may run on the Ray cluster at once, across all "
    f"flow runs (the concurrency limit on the tag '{services.RAY_TAG}').",
)
@click.option("--only", multiple=True, help="Serve only these deployments (repeatable).")
@_alert_block_option
def deploy(
    prefect_file: Path, ray_slots: int, only: tuple[str, ...], alert_block: str | None
) -> None:
    """Register the deployments of prefect.yaml (schedules, parameter forms) on the Prefect
    server and run their flow runs from this process until Ctrl-C; no work pool needed."""
    with clear_errors():
        api_url = services.require_server(
            os.environ.get("PREFECT_API_URL"), os.environ.get("PREFECT_API_AUTH_STRING")
        )
        specs = services.read_deployment_specs(prefect_file)
        unknown = sorted(set(only) - {spec.name for spec in specs})
        if unknown:
            names = [spec.name for spec in specs]
            raise ConfigurationError("--only", f"no {unknown} in {prefect_file}; it has {names}")
        specs = [spec for spec in specs if not only or spec.name in only]
        block = _alert_block(alert_block)  # a wrong name fails before anything is created
        deployments = services.runner_deployments(specs)
        services.set_ray_quota(ray_slots)
        for name in services.take_over_from_work_pools(deployments):
            console.print(f"[yellow]{name}: this process runs it from now on[/yellow]")
        alerts_line = _set_up_alerts(block, deployments, api_url)
    table = Table(title="prefect-ml deployments")
    for column in ("deployment", "entrypoint", "schedule"):
        table.add_column(column)
    for spec in specs:
        schedule = ", ".join(str(s.get("cron") or s.get("interval")) for s in spec.schedules)
        table.add_row(spec.name, spec.entrypoint, schedule or "from the UI")
    console.print(table)
    ui_address = services.ui_url(api_url)
    console.print(f"Ray quota: {ray_slots} training or campaign task(s) at once")
    console.print(alerts_line)
    console.print(f"Open {ui_address}/deployments and press Run. Ctrl-C stops.")
    from prefect import serve as serve_deployments

    serve_deployments(*deployments, print_starting_message=False)


@click.command(name="alerts")
@_prefect_file_option
@_alert_block_option
def alerts_command(prefect_file: Path, alert_block: str | None) -> None:
    """Create or update the alert automations for the deployments of prefect.yaml that are
    already on the server (a work pool's, registered by `prefect deploy`), then exit.
    `prefect-ml deploy --alert-block` does the same for the deployments it serves."""
    with clear_errors():
        api_url = services.require_server(
            os.environ.get("PREFECT_API_URL"), os.environ.get("PREFECT_API_AUTH_STRING")
        )
        block = _alert_block(alert_block)
        if block is None:
            raise ConfigurationError(
                "--alert-block", "name a notification block, or set PREFECT_ML_ALERT_BLOCK"
            )
        deployments = services.runner_deployments(services.read_deployment_specs(prefect_file))
        ids = services.registered_deployment_ids(deployments)
        console.print(_alerts_on(block, ids, api_url))


@click.command()
@click.option(
    "--dir",
    "folder",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the certificates [default: <home>/tls].",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    help="A DNS name or IP address the certificates are valid for, besides this machine's "
    "(loopback, host name, IP address); repeatable: every other node's address, the serving "
    "host name.",
)
@click.option(
    "--days",
    type=click.IntRange(min=1),
    default=365,
    show_default=True,
    help="How long the certificates are valid, in days.",
)
def tls(folder: Path | None, hosts: tuple[str, ...], days: int) -> None:
    """Create a CA (or reuse the folder's) and the certificates for Ray's TLS between nodes and
    for HTTPS serving; prints the settings that use them."""

    settings = get_settings()
    with clear_errors():
        files = services.generate_tls_files(
            folder or settings.default_tls_dir,
            tuple(dict.fromkeys((*services.local_hosts(), *hosts))),
            days=days,
        )
    names = ", ".join(services.certificate_hosts(files.node_cert))
    console.print(f"[bold green]Certificates in {files.folder}[/bold green] for {names}")
    console.print(f"  CA: {files.ca_cert} (its key {files.ca_key} signs more; keep it off nodes)")
    console.print("  Ray TLS, on this driver (prefect-ml starts or joins Ray with it):")
    console.print(f"    export PREFECT_ML_RAY_TLS_DIR={files.folder}")
    console.print("  and on every `ray start` node (copy the folder, without ca-key.pem):")
    for variable, value in services.ray_environment(files.folder).items():
        console.print(f"    export {variable}={value}")
    console.print("  HTTPS serving:")
    console.print(f"    export PREFECT_ML_SERVE_TLS_CERT={files.serve_cert}")
    console.print(f"    export PREFECT_ML_SERVE_TLS_KEY={files.serve_key}")
