"""What the commands print: the summary table that closes each command, and its errors.

Everything goes to stderr through one rich console; stdout stays for what a script reads
(``lineage --json``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prefect_ml.integrations import services
from prefect_ml.integrations.errors import PrefectMLError
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.settings import get_settings

console = Console(stderr=True)


def print_validation_error(error: ValidationError) -> None:
    """One line per invalid field: its name, the value given and what to do."""
    table = Table(title="Invalid parameters", title_style="bold red")
    for column in ("parameter", "given", "problem"):
        table.add_column(column)
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "parameters"
        given = item.get("input")
        table.add_row(location, "" if isinstance(given, dict) else repr(given), item["msg"])
    console.print(table)


@contextlib.contextmanager
def clear_errors() -> Iterator[None]:
    """prefect-ml's own errors end the command with their message and exit status 1."""
    try:
        yield
    except PrefectMLError as exc:
        console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
        raise SystemExit(1) from exc


def print_outcome(outcome: Any) -> None:
    """Closing summary: metrics, the registered version, the alias decision, where to look next."""
    table = Table(title="prefect-ml: training summary", title_style="bold green")
    table.add_column("item")
    table.add_column("value")
    for name, value in outcome.evaluation.metrics.items():
        table.add_row(f"test {name}", f"{value:.4f}")
    from prefect_ml.tasks.register import training_notes  # imports Prefect: not at module load

    registration, trained = outcome.registration, outcome.trained
    table.add_row("model version", f"{registration.model_name} v{registration.version}")
    verdict = "promoted: " if registration.promoted else "kept previous: "
    table.add_row(
        f"alias @{registration.alias}",
        ("reused: " if trained.reused else verdict) + registration.reason,
    )
    table.add_row("MLflow run", trained.run_id)
    table.add_row("checkpoints", trained.checkpoint_url)
    if trained.early_stopped:
        table.add_row("early stopped", trained.early_stopped)
    for label, text in training_notes(trained, registration):
        table.add_row(label.lower(), text)
    console.print(table)
    _print_where_to_look(registration)
    if getattr(outcome, "serving", None) is not None:
        print_serving(outcome.serving)


def _print_where_to_look(registration: Any) -> None:
    """The MLflow and Prefect UIs of this home, and the command that serves the version."""
    tracking_uri = get_settings().resolved_tracking_uri
    console.print("[bold]Where to look next[/bold]")
    if not tracking_uri.startswith("http"):
        console.print(
            f"  MLflow UI:  mlflow ui --backend-store-uri {masked(tracking_uri)} --port 5000"
        )
    else:
        console.print(f"  MLflow UI:  {masked(tracking_uri)}")
    api_url = os.environ.get("PREFECT_API_URL")
    ui_address = services.ui_url(api_url) if api_url else "prefect-ml ui"
    console.print(f"  Prefect UI: {ui_address}")
    console.print(
        f"  Serve it:   prefect-ml serve --model-name {registration.model_name} "
        f"--alias {registration.alias}"
    )


def print_serving(result: Any) -> None:
    """Where the model answers, which version, and the smoke request's result."""
    table = Table(title=f"serving {result.model_name} v{result.version}", title_style="bold green")
    table.add_column("item")
    table.add_column("value")
    table.add_row("predict", f"POST {result.url}/predict")
    table.add_row("docs", f"{result.url}/docs")
    table.add_row("model", f"{result.model_uri} (run {result.run_id})")
    table.add_row("bearer token", "required" if result.authenticated else "not required")
    table.add_row("listening", result.listening)
    if result.smoke is not None:
        predictions = result.smoke.response["predictions"]
        table.add_row("smoke request", f"{predictions} in {result.smoke.latency_ms:.1f} ms")
    if result.canary is not None:
        report = result.canary
        verdict = "promoted" if report.promoted else f"rolled back to v{report.stable_version}"
        table.add_row(f"canary v{report.canary_version}", f"{verdict}: {report.reason}")
    console.print(table)


def print_campaign(result: Any) -> None:
    """The campaign's leaderboard and best trial(s), and how to look at the study."""
    settings = get_settings()
    title = f"campaign {result.campaign}: {result.finished} finished trials"
    table = Table(title=title, title_style="bold green")
    objectives = list(result.objectives)
    for column in ("trial", "state", *objectives, "params"):
        table.add_column(column)
    for row in result.leaderboard:
        values = [f"{row.values[n]:.4f}" if n in row.values else "" for n in objectives]
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in sorted(row.params.items())
        )
        table.add_row(str(row.number), row.state, *values, params)
    console.print(table)
    console.print(
        f"complete {result.complete}, pruned {result.pruned}, failed {result.failed}; "
        f"best trial(s): {', '.join(str(b.number) for b in result.best)}; "
        f"MLflow parent run {result.parent_run_id}"
    )
    console.print("[bold]Watch it[/bold]")
    console.print(f"  optuna-dashboard {masked(settings.resolved_optuna_storage)}")


def print_predictions(result: Any) -> None:
    """Which version scored what, how fast, where the predictions are, or that they were reused."""
    manifest = result.manifest
    title = f"batch predictions of {manifest.model_name} v{manifest.model_version}"
    table = Table(title=title, title_style="bold green")
    table.add_column("item")
    table.add_column("value")
    table.add_row("input", f"{manifest.input_url} ({len(manifest.inputs)} files)")
    table.add_row("rows", f"{manifest.rows:,}")
    if result.reused:
        table.add_row("scored", f"reused, from {manifest.created} (--force scores again)")
    else:
        table.add_row("scored", f"{manifest.seconds:.1f} s, {manifest.rows_per_second:,.0f} rows/s")
    table.add_row("output", manifest.output_url)
    table.add_row("MLflow run", manifest.run_id)
    table.add_row("passed through", ", ".join(manifest.passthrough_columns) or "-")
    console.print(table)
