"""``prefect-ml``: run the pipeline, train, and check the environment, from a terminal.

Flags are generated from the flow parameter models, so they always mirror the parameter names
(``training.batch_size`` -> ``--batch-size``). Prefect is imported only after the environment
points it at the project home, because Prefect reads its settings at import time.

Behind this face: ``_flags`` (the flags of a parameter model and their parsing back into it),
``_output`` (the summary tables and the errors a command prints), ``_flow_runs`` (a flow run in
the foreground, stopped by a signal), and the commands by what they do: ``_run`` (run, train,
sweep, predict), ``_serve`` (serve, and serving in the foreground), ``_setup`` (ui, deploy,
alerts, tls) and ``_inspect`` (doctor, lineage).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from prefect_ml.flows.cli._flags import Parameters, nested_parameters, parse_parameters
from prefect_ml.flows.cli._flow_runs import Interrupted
from prefect_ml.flows.cli._inspect import doctor, lineage
from prefect_ml.flows.cli._output import console, print_campaign, print_outcome
from prefect_ml.flows.cli._run import predict, run, sweep, train
from prefect_ml.flows.cli._serve import serve
from prefect_ml.flows.cli._setup import alerts_command, deploy, tls, ui
from prefect_ml.integrations.services import prepare_process_environment

__all__ = [
    "Parameters",
    "app",
    "nested_parameters",
    "parse_parameters",
    "print_campaign",
    "print_outcome",
]


class _Commands(click.Group):
    """A command stopped by a signal before or after its flow run (starting Ray, serving in
    the foreground) exits with the signal's status, not click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Interrupted as stop:
            console.print(f"[yellow]stopped by {stop}[/yellow]")
            raise SystemExit(stop.exit_code) from None


@click.group(
    cls=_Commands,
    commands=[run, train, sweep, predict, serve, ui, deploy, alerts_command, tls, lineage, doctor],
)
def app() -> None:
    """prefect-ml: Prefect flows for Ray-distributed PyTorch training tracked in MLflow."""
    # Like `python -m`, resolve user code (`--model my_project.models:build`) from here.
    sys.path.insert(0, os.getcwd())
    prepare_process_environment()
