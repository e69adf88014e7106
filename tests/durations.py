"""Where a run's time went: every test's setup + call + teardown, written to
``test-reports/durations.txt`` (slowest first, with each folder's sum), and the ten slowest
printed at the end of the run. pytest writes ``test-reports/junit.xml`` beside it (addopts)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

SHOWN = 10


def report(terminal: pytest.TerminalReporter, folder: Path) -> None:
    phases: dict[str, dict[str, float]] = defaultdict(dict)
    for reports in terminal.stats.values():
        for entry in reports:
            if isinstance(entry, pytest.TestReport):
                phases[entry.nodeid][entry.when] = entry.duration
    if not phases:
        return
    totals = sorted(((sum(p.values()), nodeid) for nodeid, p in phases.items()), reverse=True)
    by_folder: dict[str, float] = defaultdict(float)
    for seconds, nodeid in totals:
        by_folder[nodeid.split("::")[0].rsplit("/", 1)[0]] += seconds
    lines = [f"{sum(by_folder.values()) / 60:.1f} min in {len(totals)} tests", ""]
    lines += [f"{s / 60:7.1f} min  {name}/" for name, s in sorted(by_folder.items(), key=_second)]
    lines.append("")
    for seconds, nodeid in totals:
        p = phases[nodeid]
        split = " ".join(f"{when} {p.get(when, 0.0):.2f}" for when in ("setup", "call", "teardown"))
        lines.append(f"{seconds:8.2f}s  ({split})  {nodeid}")
    folder.mkdir(exist_ok=True)
    (folder / "durations.txt").write_text("\n".join(lines) + "\n")
    terminal.write_sep("=", f"{SHOWN} slowest tests (setup + call + teardown)")
    for seconds, nodeid in totals[:SHOWN]:
        terminal.write_line(f"{seconds:8.2f}s  {nodeid}")
    terminal.write_line(f"every test's time: {folder / 'durations.txt'}")


def _second(pair: tuple[str, float]) -> float:
    return -pair[1]
