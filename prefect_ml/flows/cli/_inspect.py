"""The commands that look at what is there: ``doctor`` (the environment) and ``lineage`` (where
a registered version comes from)."""

from __future__ import annotations

import sys

import click
from rich.markup import escape
from rich.table import Table

from prefect_ml.flows.cli._output import clear_errors, console
from prefect_ml.integrations.settings import get_settings


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the chain as JSON (stdout).")
def lineage(model: str, as_json: bool) -> None:
    """Where a registered version comes from and where it is served: data, preprocessing, flow
    runs, training run, checkpoint, version, serving. MODEL is NAME@ALIAS, NAME/VERSION or
    NAME (its @champion)."""
    from prefect_ml.tasks.lineage import trace

    with clear_errors():
        chain = trace(model)
    if as_json:
        click.echo(chain.model_dump_json(indent=2))
        return
    table = Table(title=f"lineage of {chain.model_name} v{chain.version}", title_style="bold")
    for column in ("stage", "what", "link"):
        table.add_column(column, overflow="fold")
    for step in chain.steps:
        table.add_row(step.stage, escape(step.what), escape(step.link or ""))
    console.print(table)


@click.command()
def doctor() -> None:
    """Check Ray, MLflow and storage; print versions and devices; exit 1 if anything is wrong."""
    from prefect_ml.tasks.doctor import run_checks

    checks = run_checks(get_settings())
    table = Table(title="prefect-ml doctor")
    for column in ("check", "status", "detail"):
        table.add_column(column)
    for check in checks:
        if not check.ok:
            status = "[bold red]FAIL[/bold red]"
        else:
            status = "[yellow]warn[/yellow]" if check.warning else "[green]ok[/green]"
        table.add_row(check.name, status, check.detail)
    console.print(table)
    sys.exit(0 if all(check.ok for check in checks) else 1)
