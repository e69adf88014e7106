"""``prefect-ml serve``, and serving in the foreground until Ctrl-C (``run --serve`` too).

This is the CLI's one module that imports Ray itself: Serve's application is deleted here on
the way out, and a local Ray's HAProxy ports are checked here before it starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from prefect_ml.flows.cli._flags import parameter_flags, parse_parameters
from prefect_ml.flows.cli._flow_runs import run_flow, stop_on_signals
from prefect_ml.flows.cli._output import clear_errors, console, print_serving
from prefect_ml.integrations.services import check_haproxy_ports
from prefect_ml.integrations.settings import get_settings
from prefect_ml.tasks.params import ServeModelParams


@click.command()
@parameter_flags(ServeModelParams)
@click.option(
    "--watch",
    "watch_seconds",
    type=float,
    default=0.0,
    help="Check the alias every N seconds and roll to the version it points at (0: off).",
)
def serve(watch_seconds: float, **flags: Any) -> None:
    """Serve a registered model on Ray Serve (serve_model) in the foreground until Ctrl-C."""
    params = parse_parameters(ServeModelParams, flags)
    if watch_seconds < 0:
        raise click.BadParameter("must be >= 0", param_hint="--watch")
    from prefect_ml.integrations.compute import ray_session

    stop_on_signals()
    check_serving_ports()
    with ray_session(get_settings()):  # the application lives as long as this block
        result = run_flow("serve_model", params)
        print_serving(result)
        watching = watch_seconds > 0 and params.model_version is None
        follow = _alias_follower(params, result.version) if watching else None
        serve_in_foreground(result.app_name, follow, watch_seconds)  # in the tenant's name


def serve_in_foreground(
    app_name: str, follow: Callable[[], Any] | None, watch_seconds: float
) -> None:
    """Keep the application up until Ctrl-C or SIGTERM (:class:`Interrupted`); every
    ``watch_seconds`` call ``follow`` (which rolls the application when the alias moved). The
    application is deleted on the way out."""
    from ray import serve

    stop_on_signals()
    console.print("[bold]Serving until Ctrl-C[/bold]")
    try:
        while True:
            time.sleep(watch_seconds if follow else 3600)
            if follow:
                follow()
    finally:
        console.print("Stopping the application")
        serve.delete(app_name)


def check_serving_ports() -> None:
    """Before a local Ray starts to serve: HAProxy's stats and metrics ports are free, or the
    command fails now naming who holds them (a killed serve's HAProxy is ended first)."""
    import ray

    if not get_settings().ray_address and not ray.is_initialized():
        with clear_errors():
            check_haproxy_ports()


def _alias_follower(params: ServeModelParams, served_version: str) -> Callable[[], None]:
    """A check that redeploys (rolls) when the alias points at another version than served."""
    from prefect_ml.integrations import tracking

    state = {"version": served_version, "refused": ""}

    def follow() -> None:
        client = tracking.client_for(get_settings().resolved_tracking_uri)
        holder = tracking.champion(client, params.model_name, params.alias)
        if holder is None or holder[0] in (state["version"], state["refused"]):
            return
        console.print(f"@{params.alias} moved to v{holder[0]}: rolling the application")
        try:
            result = run_flow("serve_model", params)
        except SystemExit:  # the new version did not come up; the old replicas still serve
            state["refused"] = holder[0]
            console.print(f"v{holder[0]} did not deploy; still serving v{state['version']}")
            return
        state["version"] = result.version
        print_serving(result)

    return follow
