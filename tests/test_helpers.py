"""The test helpers' own contracts, where a wrong helper would make scenarios flaky."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port, wait_while_running


def test_a_moment_that_held_once_is_not_asked_again(tmp_path: Path) -> None:
    """The bad ordering forced: the condition holds when the wait looks, and has passed by any
    later look (a campaign's trial mid-way, then finished), while the command still runs. The
    wait must end on what it saw, not fail with 'the command exited (None)'."""
    looks: list[bool] = []

    def once() -> bool:
        looks.append(True)
        return len(looks) == 1

    log = tmp_path / "command.log"
    log.write_text("")
    command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_while_running(command, log, once, 10, "the moment")
        assert command.poll() is None and looks == [True]
    finally:
        command.kill()
        command.wait()


def test_a_free_port_is_one_the_kernel_never_hands_out_on_its_own() -> None:
    """A server port picked early and bound later (HAProxy's stats port in test_stopping) was
    taken in between by a process that asked the kernel for any port."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert all(not low <= port <= high and port >= 20000 for port in ports), ports
