"""What a killed command left behind is ended by the next one: by recorded pid and start time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

from prefect_ml.integrations import services

KILLED_OWNER = """
import os, signal, subprocess, sys
from pathlib import Path
from prefect_ml.integrations import services

child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
services.record_child(Path(sys.argv[1]), child.pid)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as a supervisor's or the OOM killer's SIGKILL
"""


def test_a_child_whose_owner_was_killed_is_ended_and_a_live_owners_is_not(tmp_path: Path) -> None:
    """Issue 37: a stopped command's ephemeral Prefect API lived on for 80 minutes and more."""
    owner = subprocess.run(
        [sys.executable, "-c", KILLED_OWNER, str(tmp_path)], capture_output=True, text=True
    )
    orphan = psutil.Process(int(owner.stdout))
    ours = subprocess.Popen(["sleep", "600"])
    services.record_child(tmp_path, ours.pid)
    try:
        assert services.end_orphans(tmp_path) == [orphan.pid]
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
        assert ours.poll() is None, "the child of a live owner (this test) is left alone"
        assert [p.name for p in tmp_path.iterdir()] == [f"{psutil.Process().pid}.json"]
    finally:
        ours.kill()
        ours.wait()
        if orphan.is_running():
            orphan.kill()
