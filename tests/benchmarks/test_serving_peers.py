"""The serving benchmark's peer servers: started as in an activated venv, and a peer that exits
fails its arm with what it printed, not with the readiness wait's "did not answer"."""

from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks.serving import load_curve, running


def test_a_peer_finds_the_venvs_commands_on_path_as_in_an_activated_venv(tmp_path) -> None:
    out = tmp_path / "path.txt"
    command = [
        sys.executable,
        "-c",
        f"import os; open({str(out)!r}, 'w').write(os.environ['PATH'])",
    ]
    with running(command, {"PATH": "/usr/bin"}):
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert out.read_text().split(os.pathsep) == [os.path.dirname(sys.executable), "/usr/bin"]


def test_a_peer_that_exits_fails_its_arm_at_once_with_its_stderr() -> None:
    command = [sys.executable, "-c", "import sys; sys.exit('uvicorn: command not found')"]
    with running(command, dict(os.environ)) as alive:
        with pytest.raises(RuntimeError, match="exited \\(1\\)(?s:.*)uvicorn: command not found"):
            load_curve("http://127.0.0.1:9/invocations", {"inputs": []}, 1.0, alive)
