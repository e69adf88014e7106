"""A local Ray whose node does not register in time is started again, once, then refused clearly.

Ray waits a fixed 30 s for a new local node's raylet to register and then raises a bare
``Exception`` (seen at load 18 on 2 CPUs, in a Prefect worker's deployment run). The bad
ordering is forced here: the test freezes (SIGSTOP) the raylet of the command's first start, or
of every start, as soon as it appears. Each test waits out Ray's 30 s at least once, so both
run in the full tier.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from prefect_ml.integrations.compute import _ray_cluster

pytestmark = pytest.mark.full  # each waits out Ray's fixed 30 s node registration at least once

# What a flow's first Ray step does, as its own process (a cold local Ray).
SESSION = """
import prefect  # Prefect's console handler shows prefect-ml's log outside a run
from prefect_ml.integrations.compute import ray_session
from prefect_ml.integrations.settings import get_settings

with ray_session(get_settings()) as resources:
    print("started with", resources["CPU"], "CPU", flush=True)
"""


def _raylets(root: psutil.Process) -> Iterator[psutil.Process]:
    for process in root.children(recursive=True):
        try:
            if process.name() == "raylet":
                yield process
        except psutil.Error:
            continue


def _start_freezing(every_start: bool) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run :data:`SESSION`, freezing the first raylet it starts (or each one); the result and
    the frozen raylets' pids."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PREFECT_ML_RAY_ADDRESS", "RAY_ADDRESS")
    }
    env["PREFECT_ML_LOCAL_RAY_CPUS"] = "1"
    command = subprocess.Popen(
        [sys.executable, "-c", SESSION],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    frozen: list[int] = []
    try:
        root = psutil.Process(command.pid)
        deadline = time.monotonic() + 400
        while command.poll() is None and time.monotonic() < deadline:
            if every_start or not frozen:
                for raylet in _raylets(root):
                    if raylet.pid not in frozen:
                        raylet.send_signal(signal.SIGSTOP)
                        frozen.append(raylet.pid)
            time.sleep(0.05)
        stdout, stderr = command.communicate(timeout=60)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    return subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr), frozen


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_node_that_did_not_register_in_time_is_ended_and_ray_starts_again() -> None:
    result, frozen = _start_freezing(every_start=False)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, output[-4000:]
    assert len(frozen) == 1, "the first start's raylet was frozen"
    assert "started with 1.0 CPU" in output
    assert "did not register within Ray's 30 s" in output and "starts again (2 of 2)" in output
    assert _gone(frozen[0]), "the first start's raylet was ended, not left frozen"


def test_a_node_that_never_registers_fails_naming_the_load_and_the_fix() -> None:
    result, frozen = _start_freezing(every_start=True)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode != 0
    assert len(frozen) == _ray_cluster.LOCAL_RAY_STARTS, output[-4000:]
    assert "EnvironmentCheckError" in output, output[-4000:]
    assert f"did not register within Ray's 30 s, {_ray_cluster.LOCAL_RAY_STARTS} times" in output
    assert "load average" in output and "PREFECT_ML_RAY_ADDRESS=auto" in output
    assert all(_gone(pid) for pid in frozen), "no half-started node is left behind"
