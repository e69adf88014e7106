"""A flow run in the foreground of a terminal, and how a signal stops it.

The flow runs in a thread while the main thread waits, so Ctrl-C or a supervisor's SIGTERM
always reaches this command: it records the flow run as Cancelled, stops every process it
started and exits with the signal's status; the same command then resumes the work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import typing
from typing import Any
from uuid import UUID

from pydantic import BaseModel
from rich.markup import escape

from prefect_ml.flows.cli._output import clear_errors, console
from prefect_ml.integrations import services, storage
from prefect_ml.integrations.settings import get_settings


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or a supervisor's SIGTERM reached this command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum  # the shell's convention: 130 for Ctrl-C, 143 for SIGTERM


# A stopped command that has not ended this long after the signal (or at a second one) ends at
# once, with every process it started: the bound is 10 s.
STOP_DEADLINE_S = 8.0


def run_flow(flow_name: str, params: BaseModel) -> Any:
    """Run the named flow on one Ray and the Prefect API, both started here when not running;
    its result, or exit 1 with the flow's error."""
    from prefect_ml.integrations.compute import ray_session

    settings = get_settings()
    with services.start_up(), contextlib.ExitStack() as stack:
        services.mark("parameters checked")
        stack.enter_context(clear_errors())
        if settings.s3_credentials_block:  # exported before a local Ray starts: workers see them
            storage.apply_credentials_block(settings.s3_credentials_block)
        # One Ray for the whole run: the flow-start resource check and every step share it.
        stack.enter_context(ray_session(settings))
        # Prefect's API (when it is ephemeral) starts here rather than in the flow run, so the
        # timeline shows its share. Started beside Ray in a thread, it took as long as both in
        # turn on 2 cores (BENCHMARKS.md, start-up), and delayed a failed Ray start's error.
        services.start_ephemeral_api(settings)
        stop_on_signals()  # after ray.init, whose SIGTERM handler aborts the process
        state = _in_flow_thread(flow_name, _flow(flow_name), params)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        console.print(f"[bold red]{flow_name} failed:[/bold red] {escape(str(error))}")
        raise SystemExit(1)
    return state.result()


def stop_on_signals() -> None:
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


def _end_now(signum: int) -> None:
    services.stop_descendants(grace_s=1.0)
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
            services.mark_stopped(run_id, message)
        except Exception as exc:  # the API may have died with the terminal's process group
            console.print(f"could not mark flow run {run_id} Cancelled: {escape(str(exc))}")
    api_pid = services.ephemeral_api_pid()
    services.stop_descendants(spare=[api_pid] if api_pid else [])
    services.stop_ephemeral_api()
    marked = f"flow run {runs[-1]} marked Cancelled" if runs else "no flow run began"
    console.print(
        f"[bold yellow]{flow_name} stopped by {stop}:[/bold yellow] {marked}; "
        "run the same command again to resume it"
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(stop.exit_code)
