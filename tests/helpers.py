"""Small waits and probes shared by the tests that act on running training."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def committed_epochs(storage_dir: Path) -> list[int]:
    """Epochs with a committed checkpoint (manifest written) anywhere under ``storage_dir``."""
    return sorted(
        int(manifest.parent.name.removeprefix("epoch-"))
        for manifest in storage_dir.glob("checkpoints/*/*/epoch-*/MANIFEST.json")
    )
