"""What a person sees of where a flow run's time went: its timeline as a markdown artifact."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prefect.artifacts import create_markdown_artifact

from prefect_ml.integrations import services


def timeline_markdown(recorded: services.Timeline, flow_name: str) -> str:
    """The timeline as a table with a bar per step: where the run's wall time went."""
    rows = recorded.rows()
    longest = max((took for _name, _at, took in rows), default=0.0) or 1.0
    lines = [
        f"# Timeline of {flow_name}",
        "",
        "Seconds since the process started (interpreter start-up and imports included).",
        "",
        "| moment | at (s) | since the previous (s) | |",
        "|---|---:|---:|---|",
    ]
    for name, at, took in rows:
        bar = "█" * max(1, round(24 * took / longest)) if took >= 0.05 else ""
        lines.append(f"| {name} | {at:.1f} | {took:.1f} | {bar} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def published_timeline(flow_name: str) -> Iterator[None]:
    """Record the moments of a flow run's body and publish them as its ``timeline`` artifact,
    also when the run fails."""
    with services.recording("flow run started (Prefect API ready)") as recorded:
        try:
            yield
        finally:
            services.mark("flow run ends")
            create_markdown_artifact(
                timeline_markdown(recorded, flow_name),
                key="timeline",
                description=f"Where {flow_name}'s time went",
            )
