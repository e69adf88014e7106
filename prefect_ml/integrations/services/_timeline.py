"""Where a flow run's time goes: named moments on the wall clock, counted from the start of the
process that runs the flow (interpreter start-up and imports included).

Any step marks a moment (:func:`mark`); every flow run records the moments of its own span
(:func:`recording`, nested flows each their own) and publishes them as its ``timeline``
artifact (``tasks.report``). Moments of other processes (a Ray Train worker's start, stamped on
the MLflow run) are marked at their own wall-clock time. A command's start-up (a local Ray,
Prefect's API), marked before its flow run records, goes to that flow run too
(:func:`start_up`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Moment:
    """One named moment, in seconds since the epoch."""

    name: str
    at: float


@dataclass
class Timeline:
    """The moments of one flow run, from the process's start."""

    process_started: float
    moments: list[Moment] = field(default_factory=list)

    def rows(self) -> list[tuple[str, float, float]]:
        """``(moment, seconds since the process started, seconds since the moment before)``,
        in time order."""
        rows, previous = [], self.process_started
        for moment in sorted(self.moments, key=lambda m: m.at):
            rows.append((moment.name, moment.at - self.process_started, moment.at - previous))
            previous = moment.at
        return rows


_lock = threading.Lock()
_recording: list[Timeline] = []  # every flow run in progress in this process, outermost first
_start_up: list[list[Moment]] = []  # the moments of a command's start-up, while it collects them


def process_start_time() -> float:
    """When this process started (its creation time, as the kernel reports it)."""
    import psutil

    return float(psutil.Process().create_time())


def mark(name: str, at: float | None = None) -> None:
    """Record that ``name`` happened now (or at ``at``, seconds since the epoch) in every flow
    run recording in this process; outside one, in the start-up of a command collecting it,
    else nowhere."""
    moment = Moment(name, time.time() if at is None else at)
    with _lock:
        for timeline in _recording:
            timeline.moments.append(moment)
        if not _recording:
            for start_up_moments in _start_up:
                start_up_moments.append(moment)


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """Keep the moments marked in the block while no flow run records (a command starting Ray
    and Prefect's API) for the first flow run that records in the block."""
    moments: list[Moment] = []
    with _lock:
        _start_up.append(moments)
    try:
        yield
    finally:
        with _lock:
            _start_up[:] = [kept for kept in _start_up if kept is not moments]


@contextlib.contextmanager
def recording(started: str) -> Iterator[Timeline]:
    """Record the moments of the block (a flow run), starting with ``started``."""
    timeline = Timeline(process_start_time())
    with _lock:
        if not _recording:
            for start_up_moments in _start_up:
                timeline.moments.extend(start_up_moments)
                start_up_moments.clear()
        _recording.append(timeline)
    mark(started)
    try:
        yield timeline
    finally:
        with _lock:
            _recording.remove(timeline)
