"""Where a flow run's time goes: named moments on the wall clock, counted from the start of the
process that runs the flow (interpreter start-up and imports included).

Any step marks a moment (:func:`mark`); every flow run records the moments of its own span
(:func:`recording`, nested flows each their own) and publishes them as its ``timeline``
artifact (``tasks.report``). Moments of other processes (a Ray Train worker's start, stamped on
the MLflow run) are marked at their own wall-clock time.
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


def process_start_time() -> float:
    """When this process started (its creation time, as the kernel reports it)."""
    import psutil

    return float(psutil.Process().create_time())


def mark(name: str, at: float | None = None) -> None:
    """Record that ``name`` happened now (or at ``at``, seconds since the epoch) in every flow
    run recording in this process; nothing outside one."""
    moment = Moment(name, time.time() if at is None else at)
    with _lock:
        for timeline in _recording:
            timeline.moments.append(moment)


@contextlib.contextmanager
def recording(started: str) -> Iterator[Timeline]:
    """Record the moments of the block (a flow run), starting with ``started``."""
    timeline = Timeline(process_start_time())
    with _lock:
        _recording.append(timeline)
    mark(started)
    try:
        yield timeline
    finally:
        with _lock:
            _recording.remove(timeline)
