"""Chaos tests marked ``chaos`` take minutes each: they run only when selected (``-m chaos``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason="minutes of kills and reruns: select with -m chaos (`make chaos` runs the long one)"
    )
    for item in items:
        if item.get_closest_marker("chaos"):
            item.add_marker(skip)
