"""A real multi-node Ray cluster on this machine: one ``ray start --head`` and worker nodes
joined with ``ray start --address``, each its own raylet with its own CPUs, resources and IP.

Ray hands workers the driver's ``sys.path``, so on one host every node would import the
checkout and prove nothing about code shipping. Each node therefore starts in its own mount
namespace (``unshare --mount``) with an empty tmpfs over the checkout's source folders (and any
other folder the driver's user code lives in), from a clean environment, in a working directory
outside the checkout: its Python has the dependencies in site-packages and nothing of the
project unless a job ships it. Token authentication stays on: the nodes use the token of
``~/.ray/auth_token`` (what ``ray start --head`` writes), and the driver finds it there.

Nodes are stopped, or killed to simulate a lost host, by process id: the node's ``ray start``
and every process under it (raylet, GCS, workers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prefect_ml.integrations.compute._ray_cluster import _NODE_START_TIMEOUT as NODE_START_TIMEOUT
from tests.helpers import free_port, wait_for
from tests.s3 import TEST_BUCKET, MotoS3

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_IPS = ("127.0.0.2", "127.0.0.3")  # the session cluster's worker nodes, node-a and node-b
# What a node must not see of this checkout: everything importable from it (the top-level
# flows/, tasks/ and integrations/ are links into prefect_ml/, dangling once it is hidden).
SOURCE_FOLDERS = ("prefect_ml", "tests", "examples", "benchmarks")
# The package's folders, hidden inside a visible prefect_ml/ (a partial copy of it).
PACKAGE_FOLDERS = ("flows", "tasks", "integrations")
# Mount tmpfs over each folder given as arguments, then run the rest (the node's `ray start`).
_HIDE_AND_RUN = 'for d in "$@"; do [ "$d" = -- ] && break; mount -t tmpfs tmpfs "$d"; done; '
_HIDE_AND_RUN += 'while [ "$1" != -- ]; do shift; done; shift; exec "$@"'


def _ray_executable() -> str:

    return str(Path(sys.executable).parent / "ray")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    return found


def _kill(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


NODE_STARTS = 3


@dataclass
class ClusterNode:
    """One node: its ``ray start --block`` process (in its own namespace) and what it declares."""

    name: str
    ip: str
    cpus: int
    resources: dict[str, float]
    process: subprocess.Popen[bytes]
    log: Path
    ended: bool = False  # stopped or killed on purpose

    def pids(self) -> list[int]:
        return process_tree(self.process.pid)

    def kill(self) -> list[int]:
        """SIGKILL the node's raylet, workers and everything else it started, at once, as a
        host that loses power; returns the pids killed."""
        self.ended = True
        pids = self.pids()
        _kill(pids, signal.SIGKILL)
        self.process.wait(timeout=30)
        wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 30, "node exit")
        return pids

    def stop(self) -> None:
        self.ended = True
        if self.process.poll() is not None:
            return
        pids = self.pids()
        _kill(pids, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _kill(self.pids() + pids, signal.SIGKILL)


@dataclass
class LocalCluster:
    """A head and worker nodes started here; :attr:`address` is what a driver joins."""

    root: Path
    hidden: tuple[Path, ...]
    environment: dict[str, str]
    port: int = field(default_factory=free_port)
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(
        self,
        name: str,
        ip: str,
        cpus: int,
        resources: dict[str, float],
        *args: str,
        hidden: Sequence[Path] | None = None,
    ) -> ClusterNode:
        """Start a node and wait until the cluster counts it; a node whose registration Ray's
        fixed 30 s timed out (``ray start`` exits, its processes with it) starts again, up to
        :data:`NODE_STARTS` times: the full tier's two workers load 2 cores to 20-36."""
        log = self.root / f"{name}.log"
        folders = self.hidden if hidden is None else hidden
        hide = ["sh", "-c", _HIDE_AND_RUN, "sh", *map(str, folders), "--"]
        work = self.root / name
        work.mkdir(parents=True, exist_ok=True)
        for start in range(1, NODE_STARTS + 1):
            command = [
                _ray_executable(),
                "start",
                "--block",
                f"--node-ip-address={ip}",
                f"--num-cpus={cpus}",
                "--num-gpus=0",
                f"--resources={json.dumps(resources)}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                "--disable-usage-stats",
                *args,
            ]
            process = subprocess.Popen(
                [*_unshare(), *hide, *command],
                cwd=work,
                env=self.environment,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            node = ClusterNode(name, ip, cpus, resources, process, log)
            self.nodes.append(node)
            try:
                self.wait_for_nodes(self.alive_count())
                return node
            except AssertionError:
                if start == NODE_STARTS or NODE_START_TIMEOUT not in log.read_text(
                    errors="replace"
                ):
                    raise
                node.stop()
                self.nodes.remove(node)
        raise AssertionError("unreachable")

    def start_head(self, cpus: int, resources: dict[str, float] | None = None) -> ClusterNode:
        return self._start(
            "head",
            "127.0.0.1",
            cpus,
            resources or {},
            "--head",
            f"--port={self.port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        )

    def add_node(
        self,
        name: str,
        ip: str,
        cpus: int,
        resources: dict[str, float] | None = None,
        *,
        visible: Sequence[str] = (),
    ) -> ClusterNode:
        """Join a node; ``visible`` names folders of the checkout it sees (hidden on the others),
        e.g. ``prefect_ml``: a node with a partial copy of the project at the driver's path (the
        package's ``__init__`` without its flows, tasks and integrations)."""
        hidden = [
            path for path in self.hidden if path.name not in visible or path.parent != REPO_ROOT
        ]
        if "prefect_ml" in visible:
            hidden += [REPO_ROOT / "prefect_ml" / name for name in PACKAGE_FOLDERS]
        return self._start(
            name, ip, cpus, resources or {}, f"--address={self.address}", hidden=hidden
        )

    def alive_count(self) -> int:
        return sum(not node.ended for node in self.nodes)

    def status(self) -> str:
        return subprocess.run(
            [_ray_executable(), "status", f"--address={self.address}"],
            env=self.environment,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout

    def active_nodes(self) -> int:
        """Alive nodes as the GCS counts them (``ray status``)."""
        text = self.status()
        if "Active:" not in text:
            return 0
        active = text.split("Active:", 1)[1].split("Pending:", 1)[0]
        return sum(line.strip().startswith("1 node_") for line in active.splitlines())

    def wait_for_nodes(self, count: int, timeout: float = 90) -> None:
        def ready() -> bool:
            for node in self.nodes:
                if node.process.poll() is not None and not node.ended:
                    raise AssertionError(f"node {node.name} exited: {node.log.read_text()[-3000:]}")
            return self.active_nodes() == count

        wait_for(ready, timeout, f"{count} alive Ray nodes")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


def _unshare() -> list[str]:
    """A private mount namespace (root can mount in it; others map themselves to root)."""
    if os.geteuid() == 0:
        return ["unshare", "--mount", "--propagation", "private"]
    return ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]


def node_environment(extra: dict[str, str]) -> dict[str, str]:
    """A clean environment for a node: its PATH, HOME (where the token lives), token mode, and
    what the host's image would give it (``extra``: e.g. the S3 endpoint and credentials)."""

    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        # A lost node is declared dead after about 3 s of missed health checks, not Ray's 30 s.
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
        **extra,
    }


def start_cluster(
    root: Path,
    *,
    head_cpus: int,
    workers: Sequence[tuple[str, int, dict[str, float]]],
    hidden: Sequence[Path] = (),
    environment: dict[str, str] | None = None,
) -> LocalCluster:
    """Start a head and ``workers`` (name, CPUs, custom resources), each node at its own
    loopback address (127.0.0.2, 127.0.0.3, ...), none able to import the checkout."""
    hidden_paths = tuple(REPO_ROOT / name for name in SOURCE_FOLDERS) + tuple(hidden)
    cluster = LocalCluster(root, hidden_paths, node_environment(environment or {}))
    try:
        cluster.start_head(head_cpus)
        for index, (name, cpus, resources) in enumerate(workers, start=2):
            cluster.add_node(name, f"127.0.0.{index}", cpus, resources)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def cli_environment(
    cluster: LocalCluster, home: Path, storage_url: str, tracking_uri: str
) -> dict[str, str]:
    """The environment of a ``prefect-ml`` command run against ``cluster``: its own home, the
    storage and tracking URIs, and the session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_ML_HOME": str(home),
        "PREFECT_ML_RAY_ADDRESS": cluster.address,
        "PREFECT_ML_STORAGE_URL": storage_url,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
    }


@contextmanager
def cli_process(
    command: list[str], env: dict[str, str], log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running from the checkout with its output in ``log_path``; killed on the way
    out if it still runs."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def cli_command(*arguments: str) -> list[str]:
    """``prefect-ml <arguments>`` as this Python runs it."""

    return [sys.executable, "-m", "prefect_ml.flows.cli", *arguments]


def run_doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``prefect-ml doctor`` in ``env`` (:func:`cli_environment`), its table wide enough that a
    node's row keeps each of its lines on one; the table is on stderr."""
    return subprocess.run(
        cli_command("doctor"),
        cwd=REPO_ROOT,
        env={**env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def bucket_keys(moto_s3: MotoS3, prefix: str) -> list[str]:
    """The keys under ``prefix`` in the tests' bucket."""
    pages = moto_s3.client().get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    return [
        item["Key"]
        for page in pages.paginate(Bucket=TEST_BUCKET, Prefix=prefix)
        for item in page.get("Contents", [])
    ]
