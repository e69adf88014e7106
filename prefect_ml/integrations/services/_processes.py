"""What a prefect-ml command starts ends with it, and what a killed command left is ended later.

A terminal's Ctrl-C reaches every process of the command's group at once: a child that died
of it (Prefect's ephemeral API) could no longer record how the run ended, so such children
start with SIGINT blocked and are stopped by the command, in order. A command killed outright
cannot stop anything: its children are recorded (pid and start time, so that a reused pid is
never hit) and the next command ends those whose owner is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

from prefect_ml.integrations.errors import ConfigurationError

# A Ray worker's process title ("ray::HAProxyManager", "ray::IDLE"): HAProxy runs under one.
_RAY_WORKER_TITLE = "ray::"


@contextlib.contextmanager
def ctrl_c_passes_by() -> Iterator[None]:
    """Children started in this block (from this thread) do not die of the terminal's Ctrl-C:
    they inherit SIGINT blocked, as Ray starts its own processes. A Ctrl-C meanwhile reaches
    this process when the block ends."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def descendant_pids() -> set[int]:
    """The pids of every process below this one now."""
    return {process.pid for process in psutil.Process().children(recursive=True)}


def stop_descendants(spare: Iterable[int] = (), grace_s: float = 3.0) -> None:
    """SIGTERM every process below this one (a local Ray's raylet, workers and agents,
    HAProxy) but ``spare``, and SIGKILL those still alive after ``grace_s``."""
    kept = set(spare)
    _end([p for p in psutil.Process().children(recursive=True) if p.pid not in kept], grace_s)


def _identity(pid: int) -> list[float]:
    return [pid, psutil.Process(pid).create_time()]


def _alive(identity: list[float]) -> psutil.Process | None:
    """The process of a recorded (pid, start time), or None when it ended (or the pid is
    another process's now)."""
    try:
        process = psutil.Process(int(identity[0]))
        return process if process.create_time() == identity[1] else None
    except (psutil.Error, ValueError, IndexError, TypeError):
        return None


def record_child(folder: Path, child: int) -> Path:
    """Record that this process started ``child`` (both by pid and start time) in ``folder``;
    the caller removes the record once it stopped the child."""
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / f"{os.getpid()}.json"
    record.write_text(json.dumps({"owner": _identity(os.getpid()), "child": _identity(child)}))
    return record


def end_orphans(folder: Path) -> list[int]:
    """End the children recorded in ``folder`` whose owner is gone (a command killed before it
    could stop them); returns their pids. Records of live owners are left alone."""
    ended = []
    for record in folder.glob("*.json"):
        try:
            entry = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if _alive(entry.get("owner", [])) is not None:
            continue
        child = _alive(entry.get("child", []))
        if child is not None:
            _end([child])
            ended.append(child.pid)
        record.unlink(missing_ok=True)
    return ended


def end_orphan_haproxy(config_path: str) -> list[int]:
    """End HAProxy processes started with ``config_path`` (prefect-ml's private one) that no
    Ray worker owns any more: their Ray was killed, and they would hold the serving, stats and
    metrics ports against every later serve. Returns their pids."""
    orphans = []
    for process in psutil.process_iter(["cmdline", "ppid"]):
        cmdline = process.info["cmdline"] or []
        if "-f" not in cmdline or config_path not in cmdline:
            continue
        try:
            owner = " ".join(psutil.Process(process.info["ppid"]).cmdline())
        except psutil.Error:
            owner = ""
        if not owner.startswith(_RAY_WORKER_TITLE):
            orphans.append(process)
    _end(orphans)
    return [process.pid for process in orphans]


def _end(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM ``processes``, then SIGKILL those still alive ``grace_s`` later."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _gone, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def port_holder(port: int) -> str:
    """Which process listens on TCP ``port``, in words (pid and command line), for a message
    that tells the user what to stop; another user's process shows no pid."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            if connection.pid is None:
                return "a process of another user"
            try:
                command = " ".join(psutil.Process(connection.pid).cmdline())
            except psutil.Error:
                command = "?"
            return f"pid {connection.pid} ({command[:200]})"
    return "no process found (the port may be reserved or closing)"


def check_port_free(
    host: str, port: int, field: str, change: str = "choose another --port"
) -> None:
    """Fail before starting a server whose port is taken, naming the parameter to change and
    the process that holds the port."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(
                field,
                f"{host}:{port} is not available ({exc.strerror}; held by "
                f"{port_holder(port)}); stop that process or {change}",
            ) from None
