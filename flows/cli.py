"""``prefect-ml``: run the pipeline, train, and check the environment, from a terminal.

Flags are generated from the flow parameter models, so they always mirror the parameter names
(``training.batch_size`` -> ``--batch-size``). Prefect is imported only after the environment
points it at the project home, because Prefect reads its settings at import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import click
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from prefect_ml.integrations import alerts, prefect_server, processes, storage, timeline
from prefect_ml.integrations.errors import ConfigurationError, PrefectMLError
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.serve_ingress import check_haproxy_ports
from prefect_ml.integrations.settings import (
    get_settings,
    prepare_process_environment,
    running_local_server,
)
from prefect_ml.tasks.params import (
    CampaignParams,
    PipelineParams,
    PredictParams,
    ServeModelParams,
    TrainModelParams,
)

console = Console(stderr=True)
Parameters = TypeVar("Parameters", bound=BaseModel)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (``Section`` or ``Section | None``), or None for a leaf."""
    candidates = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    first = candidates[0]
    return first if isinstance(first, type) and issubclass(first, BaseModel) else None


def _parameter_fields(model: type[BaseModel]) -> Iterator[tuple[str | None, str, FieldInfo]]:
    """(section, name, field) for every leaf parameter; section is None for top-level ones.

    An optional section (``sweep`` of the pipeline) is switched on by giving any of its flags.
    """
    for name, field in model.model_fields.items():
        section = _section_model(field.annotation)
        if section is not None:
            for leaf, leaf_field in section.model_fields.items():
                yield name, leaf, leaf_field
        else:
            yield None, name, field


def _mapping_or_text(field: FieldInfo) -> tuple[bool, bool]:
    """Whether a field takes a mapping, and whether it takes text as well (a search space is a
    dict or the import path of a function)."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    forms = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    mapping = any(typing.get_origin(form) is dict for form in forms)
    return mapping, mapping and str in forms


def _is_union(annotation: Any) -> bool:
    return isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union


def _typed_default(field: FieldInfo) -> str:
    """A field's default as a user types it: a mapping as JSON, not as Python's repr."""
    default = field.get_default(call_default_factory=True)
    if isinstance(default, dict) and default:
        return json.dumps(
            {
                k: v.model_dump(mode="json", exclude_defaults=True)
                if isinstance(v, BaseModel)
                else v
                for k, v in default.items()
            }
        )
    return str(default)


def _click_option(name: str, field: FieldInfo) -> click.Option:
    flag = "--" + name.replace("_", "-")
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if _is_union(annotation):
        annotation = args[0]
    help_text = f"{field.description} [default: {_typed_default(field)}]"
    mapping, text = _mapping_or_text(field)
    if mapping:
        also = ", or the path of a JSON/YAML file" + (", or an import path" if text else "")
        help_text += f" (inline JSON/YAML{also})"
        return click.Option([flag, name], type=str, default=None, help=help_text)
    if annotation is bool:
        return click.Option([f"{flag}/--no-{flag[2:]}", name], default=None, help=help_text)
    if typing.get_origin(annotation) is typing.Literal:
        choice = click.Choice([str(c) for c in typing.get_args(annotation)])
        return click.Option([flag, name], type=choice, default=None, help=help_text)
    # A union of kinds (``workers``: a count or a range) arrives as text for the model to parse.
    numeric = annotation in (int, float) and len(args) <= 1
    click_type: type = annotation if numeric else str  # type: ignore[assignment]
    return click.Option([flag, name], type=click_type, default=None, help=help_text)


def _nested_parameters(model: type[BaseModel], flags: dict[str, Any]) -> dict[str, Any]:
    """Turn the given (non-None) flags into the nested dict the parameter model expects."""
    nested: dict[str, Any] = {}
    for section, name, field in _parameter_fields(model):
        value = flags.get(name)
        if value is None:
            continue
        mapping, text = _mapping_or_text(field)
        if mapping:
            value = _mapping_flag(name, value, text=text)
        (nested.setdefault(section, {}) if section else nested)[name] = value
    return nested


def _mapping_flag(name: str, value: str, *, text: bool = False) -> Any:
    """A dict flag: inline JSON or YAML, or the path of a file holding either; with ``text``,
    a plain word stays a string (``--search-space my_project.spaces:space``)."""
    import yaml

    hint = "--" + name.replace("_", "-")
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as handle:
            value = handle.read()
    try:
        loaded = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"not valid JSON or YAML: {exc}", param_hint=hint) from exc
    if text and isinstance(loaded, str):
        return loaded
    if not isinstance(loaded, dict):
        raise click.BadParameter("expected a mapping, e.g. '{\"key\": ...}'", param_hint=hint)
    return loaded


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


def _validated(model: type[Parameters], nested: dict[str, Any]) -> Parameters:
    try:
        return model.model_validate(nested)
    except ValidationError as exc:
        print_validation_error(exc)
        raise SystemExit(2) from exc


def parse_parameters(model: type[Parameters], flags: dict[str, Any]) -> Parameters:
    """Validate flags into the flow's parameter model, or exit 2 naming each bad field."""
    return _validated(model, _nested_parameters(model, flags))


def _with_parameter_flags(model: type[BaseModel]) -> Callable[[Callable[..., Any]], Any]:
    """Add one option per parameter of ``model``, the way ``@click.option`` does."""

    def decorate(function: Callable[..., Any]) -> Any:
        options = [_click_option(name, field) for _s, name, field in _parameter_fields(model)]
        # click reverses the collected list when it builds the command.
        function.__click_params__ = [  # type: ignore[attr-defined]
            *getattr(function, "__click_params__", []),
            *reversed(options),
        ]
        return function

    return decorate


def print_outcome(outcome: Any) -> None:
    """Closing summary: metrics, the registered version, the alias decision, where to look next."""
    settings = get_settings()
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
    tracking_uri = settings.resolved_tracking_uri
    console.print("[bold]Where to look next[/bold]")
    if not tracking_uri.startswith("http"):
        console.print(
            f"  MLflow UI:  mlflow ui --backend-store-uri {masked(tracking_uri)} --port 5000"
        )
    else:
        console.print(f"  MLflow UI:  {masked(tracking_uri)}")
    api_url = os.environ.get("PREFECT_API_URL")
    ui_address = prefect_server.ui_url(api_url) if api_url else "prefect-ml ui"
    console.print(f"  Prefect UI: {ui_address}")
    console.print(
        f"  Serve it:   prefect-ml serve --model-name {registration.model_name} "
        f"--alias {registration.alias}"
    )
    if getattr(outcome, "serving", None) is not None:
        print_serving(outcome.serving)


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


def _flow(flow_name: str) -> Any:
    if flow_name == "ml_pipeline":
        from prefect_ml.flows.pipeline import ml_pipeline as flow_fn
    elif flow_name == "hpo_campaign":
        from prefect_ml.flows.sweep import hpo_campaign as flow_fn  # type: ignore[assignment]
    elif flow_name == "serve_model":
        from prefect_ml.flows.serve import serve_model as flow_fn  # type: ignore[assignment]
    elif flow_name == "batch_predict":
        from prefect_ml.flows.predict import batch_predict as flow_fn  # type: ignore[assignment]
    else:
        from prefect_ml.flows.train import train_model as flow_fn  # type: ignore[assignment]
    return flow_fn


def _run_flow(flow_name: str, params: BaseModel) -> Any:
    from prefect_ml.integrations.ray_cluster import ray_session

    settings = get_settings()
    with timeline.start_up(), contextlib.ExitStack() as stack:
        timeline.mark("parameters checked")
        stack.enter_context(_clear_errors())
        if settings.s3_credentials_block:  # exported before a local Ray starts: workers see them
            storage.apply_credentials_block(settings.s3_credentials_block)
        # One Ray for the whole run: the flow-start resource check and every step share it.
        stack.enter_context(ray_session(settings))
        # Prefect's API (when it is ephemeral) starts here rather than in the flow run, so the
        # timeline shows its share. Started beside Ray in a thread, it took as long as both in
        # turn on 2 cores (BENCHMARKS.md, start-up), and delayed a failed Ray start's error.
        prefect_server.start_ephemeral_api(settings)
        _stop_on_signals()  # after ray.init, whose SIGTERM handler aborts the process
        state = _in_flow_thread(flow_name, _flow(flow_name), params)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        console.print(f"[bold red]{flow_name} failed:[/bold red] {escape(str(error))}")
        raise SystemExit(1)
    return state.result()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or a supervisor's SIGTERM reached this command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM


# A stopped command that has not ended this long after the signal (or at a second one) ends at
# once, with every process it started: the bound is 10 s.
STOP_DEADLINE_S = 8.0


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise :class:`Interrupted` in the main thread, once; a command that
    has not ended :data:`STOP_DEADLINE_S` later, or gets a second signal, ends at once."""
    received: list[int] = []

    def interrupt(signum: int, _frame: Any) -> None:
        if received:
            _end_now(signum)
        received.append(signum)
        deadline = threading.Timer(STOP_DEADLINE_S, _end_now, args=(signum,))
        deadline.daemon = True
        deadline.start()
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _end_now(signum: int) -> None:
    processes.stop_descendants(grace_s=1.0)
    os._exit(128 + signum)


def _in_flow_thread(flow_name: str, flow_fn: Any, params: BaseModel) -> Any:
    """Run the flow in a thread and wait here, in the main thread, where signals arrive.

    Whatever the flow does, a signal then stops the command: in the main thread, Ray Train's
    fit installs its own SIGINT handler, which only aborts the fit (the task then failed, was
    retried or hung on a dead API) and never ended the command."""
    runs: list[UUID] = []

    def running(_flow: Any, flow_run: Any, _state: Any) -> None:
        runs.append(flow_run.id)

    flow_fn = flow_fn.with_options(on_running=[*flow_fn.on_running_hooks, running])
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(flow_fn(params=params, return_state=True))
        except BaseException as exc:  # raised again in the main thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"prefect-ml {flow_name}", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except Interrupted as stop:
        _stop_now(flow_name, stop, runs)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _stop_now(flow_name: str, stop: Interrupted, runs: list[UUID]) -> typing.NoReturn:
    """Record the flow run as Cancelled, stop everything this command started (its local Ray,
    HAProxy, then the ephemeral API that recorded it) and exit with the signal's status. The
    flow's thread is left as it is: the work it was doing resumes in the next command."""
    console.print(f"[yellow]{stop}: stopping {flow_name}[/yellow]")
    message = f"stopped by {stop}; the same command resumes it"
    for run_id in runs:
        try:
            prefect_server.mark_stopped(run_id, message)
        except Exception as exc:  # the API may have died with the terminal's process group
            console.print(f"could not mark flow run {run_id} Cancelled: {escape(str(exc))}")
    api_pid = prefect_server.ephemeral_api_pid()
    processes.stop_descendants(spare=[api_pid] if api_pid else [])
    prefect_server.stop_ephemeral_api()
    marked = f"flow run {runs[-1]} marked Cancelled" if runs else "no flow run began"
    console.print(
        f"[bold yellow]{flow_name} stopped by {stop}:[/bold yellow] {marked}; "
        "run the same command again to resume it"
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(stop.exit_code)


class _Commands(click.Group):
    """A command stopped by a signal before or after its flow run (starting Ray, serving in
    the foreground) exits with the signal's status, not click's "Aborted!" and 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Interrupted as stop:
            console.print(f"[yellow]stopped by {stop}[/yellow]")
            raise SystemExit(stop.exit_code) from None


@click.group(cls=_Commands)
def app() -> None:
    """prefect-ml: Prefect flows for Ray-distributed PyTorch training tracked in MLflow."""
    # Like `python -m`, resolve user code (`--model my_project.models:build`) from here.
    sys.path.insert(0, os.getcwd())
    prepare_process_environment()


def _serve_in_foreground(
    app_name: str, follow: Callable[[], Any] | None, watch_seconds: float
) -> None:
    """Keep the application up until Ctrl-C or SIGTERM (:class:`Interrupted`); every
    ``watch_seconds`` call ``follow`` (which rolls the application when the alias moved). The
    application is deleted on the way out."""
    from ray import serve

    _stop_on_signals()
    console.print("[bold]Serving until Ctrl-C[/bold]")
    try:
        while True:
            time.sleep(watch_seconds if follow else 3600)
            if follow:
                follow()
    finally:
        console.print("Stopping the application")
        serve.delete(app_name)


def _check_serving_ports() -> None:
    """Before a local Ray starts to serve: HAProxy's stats and metrics ports are free, or the
    command fails now naming who holds them (a killed serve's HAProxy is ended first)."""
    import ray

    if not get_settings().ray_address and not ray.is_initialized():
        with _clear_errors():
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
            result = _run_flow("serve_model", params)
        except SystemExit:  # the new version did not come up; the old replicas still serve
            state["refused"] = holder[0]
            console.print(f"v{holder[0]} did not deploy; still serving v{state['version']}")
            return
        state["version"] = result.version
        print_serving(result)

    return follow


@app.command()
@_with_parameter_flags(PipelineParams)
@click.option(
    "--serve",
    "serve_after",
    is_flag=True,
    help="End by serving the alias's version on Ray Serve, in the foreground until Ctrl-C.",
)
def run(serve_after: bool, **flags: Any) -> None:
    """Run the whole pipeline (ml_pipeline); any sweep flag (--campaign, --n-trials, ...) adds
    a campaign whose best values train the final model; --serve (or any serving flag) serves it."""
    nested = _nested_parameters(PipelineParams, flags)
    if serve_after:
        nested.setdefault("serving", {})
    params = _validated(PipelineParams, nested)
    if params.serving is None:
        print_outcome(_run_flow("ml_pipeline", params))
        return
    from prefect_ml.integrations.ray_cluster import ray_session

    _stop_on_signals()
    _check_serving_ports()
    with ray_session(get_settings()):  # the flow's steps share it; it outlives the flow
        outcome = _run_flow("ml_pipeline", params)
        print_outcome(outcome)
        _serve_in_foreground(outcome.serving.app_name, None, 0)  # its name in the tenant's


@app.command()
@_with_parameter_flags(ServeModelParams)
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
    from prefect_ml.integrations.ray_cluster import ray_session

    _stop_on_signals()
    _check_serving_ports()
    with ray_session(get_settings()):  # the application lives as long as this block
        result = _run_flow("serve_model", params)
        print_serving(result)
        watching = watch_seconds > 0 and params.model_version is None
        follow = _alias_follower(params, result.version) if watching else None
        _serve_in_foreground(result.app_name, follow, watch_seconds)  # in the tenant's name


@app.command()
@_with_parameter_flags(TrainModelParams)
def train(**flags: Any) -> None:
    """Train, evaluate and register one model (train_model)."""
    print_outcome(_run_flow("train_model", parse_parameters(TrainModelParams, flags)))


@app.command()
@_with_parameter_flags(CampaignParams)
def sweep(**flags: Any) -> None:
    """Run or continue a hyperparameter campaign (hpo_campaign); same name = same study."""
    print_campaign(_run_flow("hpo_campaign", parse_parameters(CampaignParams, flags)))


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


@app.command()
@_with_parameter_flags(PredictParams)
def predict(**flags: Any) -> None:
    """Score a dataset's files with a registered version (batch_predict) into Parquet."""
    print_predictions(_run_flow("batch_predict", parse_parameters(PredictParams, flags)))


@app.command()
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
    _stop_on_signals()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_clear_errors())
        auth_string, generated = prefect_server.server_auth_string(settings)
        api_url = stack.enter_context(
            prefect_server.local_server(settings, host, port, auth_string)
        )
        console.print(f"[bold green]Prefect UI:[/bold green] {prefect_server.ui_url(api_url)}")
        database = prefect_server.server_database(settings)
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
    block: alerts.NotificationBlock | None, deployments: list[Any], api_url: str
) -> str:
    """Create or update the alert automations for the deployments; what to tell the user."""
    if block is None:
        return (
            "Alerts: off (no notification block: pass --alert-block or set "
            "PREFECT_ML_ALERT_BLOCK; docs/how-to/alerts.md)"
        )
    return _alerts_on(block, prefect_server.register_deployments(deployments), api_url)


def _alerts_on(block: alerts.NotificationBlock, deployment_ids: list[UUID], api_url: str) -> str:
    names = alerts.ensure_automations(block, deployment_ids, alerts.alert_ui_url(api_url))
    return f"Alerts: through {block.reference} (automations: {'; '.join(names)})"


_prefect_file_option = click.option(
    "--prefect-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=str(prefect_server.DEFAULT_PREFECT_FILE),
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


def _alert_block(flag: str | None) -> alerts.NotificationBlock | None:
    """The block of --alert-block, else of PREFECT_ML_ALERT_BLOCK; None when neither is set."""
    name = flag or get_settings().alert_block
    return alerts.find_notification_block(name) if name else None


@app.command()
@_prefect_file_option
@click.option(
    "--ray-slots",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Training and campaign tasks that may run on the Ray cluster at once, across all "
    f"flow runs (the concurrency limit on the tag '{prefect_server.RAY_TAG}').",
)
@click.option("--only", multiple=True, help="Serve only these deployments (repeatable).")
@_alert_block_option
def deploy(
    prefect_file: Path, ray_slots: int, only: tuple[str, ...], alert_block: str | None
) -> None:
    """Register the deployments of prefect.yaml (schedules, parameter forms) on the Prefect
    server and run their flow runs from this process until Ctrl-C; no work pool needed."""
    with _clear_errors():
        api_url = prefect_server.require_server(
            os.environ.get("PREFECT_API_URL"), os.environ.get("PREFECT_API_AUTH_STRING")
        )
        specs = prefect_server.read_deployment_specs(prefect_file)
        unknown = sorted(set(only) - {spec.name for spec in specs})
        if unknown:
            names = [spec.name for spec in specs]
            raise ConfigurationError("--only", f"no {unknown} in {prefect_file}; it has {names}")
        specs = [spec for spec in specs if not only or spec.name in only]
        block = _alert_block(alert_block)  # a wrong name fails before anything is created
        deployments = prefect_server.runner_deployments(specs)
        prefect_server.set_ray_quota(ray_slots)
        for name in prefect_server.take_over_from_work_pools(deployments):
            console.print(f"[yellow]{name}: this process runs it from now on[/yellow]")
        alerts_line = _set_up_alerts(block, deployments, api_url)
    table = Table(title="prefect-ml deployments")
    for column in ("deployment", "entrypoint", "schedule"):
        table.add_column(column)
    for spec in specs:
        schedule = ", ".join(str(s.get("cron") or s.get("interval")) for s in spec.schedules)
        table.add_row(spec.name, spec.entrypoint, schedule or "from the UI")
    console.print(table)
    ui_address = prefect_server.ui_url(api_url)
    console.print(f"Ray quota: {ray_slots} training or campaign task(s) at once")
    console.print(alerts_line)
    console.print(f"Open {ui_address}/deployments and press Run. Ctrl-C stops.")
    from prefect import serve as serve_deployments

    serve_deployments(*deployments, print_starting_message=False)


@app.command(name="alerts")
@_prefect_file_option
@_alert_block_option
def alerts_command(prefect_file: Path, alert_block: str | None) -> None:
    """Create or update the alert automations for the deployments of prefect.yaml that are
    already on the server (a work pool's, registered by `prefect deploy`), then exit.
    `prefect-ml deploy --alert-block` does the same for the deployments it serves."""
    with _clear_errors():
        api_url = prefect_server.require_server(
            os.environ.get("PREFECT_API_URL"), os.environ.get("PREFECT_API_AUTH_STRING")
        )
        block = _alert_block(alert_block)
        if block is None:
            raise ConfigurationError(
                "--alert-block", "name a notification block, or set PREFECT_ML_ALERT_BLOCK"
            )
        deployments = prefect_server.runner_deployments(
            prefect_server.read_deployment_specs(prefect_file)
        )
        ids = prefect_server.registered_deployment_ids(deployments)
        console.print(_alerts_on(block, ids, api_url))


@app.command()
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
    from prefect_ml.integrations import tls as certificates

    settings = get_settings()
    with _clear_errors():
        files = certificates.generate(
            folder or settings.default_tls_dir,
            tuple(dict.fromkeys((*certificates.local_hosts(), *hosts))),
            days=days,
        )
    names = ", ".join(certificates.certificate_hosts(files.node_cert))
    console.print(f"[bold green]Certificates in {files.folder}[/bold green] for {names}")
    console.print(f"  CA: {files.ca_cert} (its key {files.ca_key} signs more; keep it off nodes)")
    console.print("  Ray TLS, on this driver (prefect-ml starts or joins Ray with it):")
    console.print(f"    export PREFECT_ML_RAY_TLS_DIR={files.folder}")
    console.print("  and on every `ray start` node (copy the folder, without ca-key.pem):")
    for variable, value in certificates.ray_environment(files.folder).items():
        console.print(f"    export {variable}={value}")
    console.print("  HTTPS serving:")
    console.print(f"    export PREFECT_ML_SERVE_TLS_CERT={files.serve_cert}")
    console.print(f"    export PREFECT_ML_SERVE_TLS_KEY={files.serve_key}")


@contextlib.contextmanager
def _clear_errors() -> Iterator[None]:
    """prefect-ml's own errors end the command with their message and exit status 1."""
    try:
        yield
    except PrefectMLError as exc:
        console.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
        raise SystemExit(1) from exc


@app.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the chain as JSON (stdout).")
def lineage(model: str, as_json: bool) -> None:
    """Where a registered version comes from and where it is served: data, preprocessing, flow
    runs, training run, checkpoint, version, serving. MODEL is NAME@ALIAS, NAME/VERSION or
    NAME (its @champion)."""
    from prefect_ml.tasks.lineage import trace

    with _clear_errors():
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


@app.command()
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


if __name__ == "__main__":
    app()
