"""Chaos tests marked ``chaos`` take minutes each: they are kept out of the default run (and
reported as deselected) unless selected with ``-m chaos``."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos" in (config.option.markexpr or ""):
        return
    long_runs = [item for item in items if item.get_closest_marker("chaos")]
    if long_runs:
        config.hook.pytest_deselected(items=long_runs)
        items[:] = [item for item in items if not item.get_closest_marker("chaos")]
