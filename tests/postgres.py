"""A real PostgreSQL for the tests and benchmarks: Debian's server (``make test`` installs the
``postgresql`` package), a throw-away cluster in a temporary folder, on a free loopback port.

PostgreSQL refuses to run as root, so as root the cluster belongs to the ``postgres`` user and
``initdb`` and the server run as that user. Loopback connections are trusted (no password: the
cluster lives as long as the session and listens on 127.0.0.1 only).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import free_port, wait_for

SUPERUSER = "postgres"
INSTALL_HINT = "install Debian's postgresql (`make test` does: apt-get install -y postgresql)"


def server_binaries() -> Path:
    """The newest installed PostgreSQL's ``bin`` folder (Debian keeps it off ``PATH``)."""
    found = sorted(
        (Path(initdb).parent for initdb in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
        key=lambda folder: int(folder.parent.name) if folder.parent.name.isdigit() else 0,
    )
    if found:
        return found[-1]
    on_path = shutil.which("initdb")
    if on_path is None:
        raise RuntimeError(f"no PostgreSQL server binaries (initdb) found: {INSTALL_HINT}")
    return Path(on_path).resolve().parent


class PostgresServer:
    """One PostgreSQL cluster of its own: ``start`` creates and starts it, ``stop`` stops it by
    its process id and deletes it.

    Args:
        durable: keep PostgreSQL's defaults (fsync on, as in production), for benchmarks; the
            tests turn fsync off, since their cluster is thrown away.
        max_connections: server limit (64 benchmark processes hold a connection each).
    """

    def __init__(self, *, durable: bool = False, max_connections: int = 200) -> None:
        self.durable, self.max_connections = durable, max_connections
        self.port = 0
        self.folder: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def _run_as(self) -> dict[str, Any]:
        """``Popen`` arguments that run a command as the cluster's owner (the postgres user
        when we are root, so that the pid ``Popen`` returns is the server's own)."""
        if os.geteuid() != 0:
            return {}
        return {"user": SUPERUSER, "group": SUPERUSER, "extra_groups": []}

    def start(self) -> PostgresServer:
        """Create the cluster, start the server and wait until it accepts connections."""
        binaries = server_binaries()
        self.folder = Path(tempfile.mkdtemp(prefix="prefect-ml-postgres-"))
        if os.geteuid() == 0:
            shutil.chown(self.folder, SUPERUSER, SUPERUSER)
        data, log = str(self.folder / "data"), self.folder / "server.log"
        subprocess.run(
            [str(binaries / "initdb"), "-D", data, "-U", SUPERUSER, "--auth=trust", "--no-sync"]
            + ["--encoding=UTF8", "--locale=C"],
            check=True,
            capture_output=True,
            **self._run_as,
        )
        self.port = free_port()
        command = [str(binaries / "postgres"), "-D", data, "-k", str(self.folder)]
        command += ["-h", "127.0.0.1", "-p", str(self.port)]
        command += ["-c", f"max_connections={self.max_connections}", "-c", "shared_buffers=64MB"]
        if not self.durable:
            command += ["-c", "fsync=off", "-c", "synchronous_commit=off"]
        with log.open("wb") as output:
            self._process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._run_as,
            )
        wait_for(self._accepts_connections, 60, f"PostgreSQL on port {self.port}")
        return self

    def _accepts_connections(self) -> bool:
        import psycopg

        assert self._process is not None and self.folder is not None
        if self._process.poll() is not None:
            raise AssertionError(f"PostgreSQL exited: {(self.folder / 'server.log').read_text()}")
        try:
            psycopg.connect(self.url("postgres"), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def url(self, database: str, driver: str = "postgresql") -> str:
        """The SQLAlchemy URL of ``database`` (``driver``: e.g. ``postgresql+asyncpg``)."""
        return f"{driver}://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self, name: str) -> str:
        """Create the empty database ``name``; its ``postgresql://`` URL."""
        self.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def execute(self, sql: str, database: str = "postgres") -> list[tuple[Any, ...]]:
        """Run one statement outside a transaction (as CREATE DATABASE must); its rows."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as connection:
            cursor = connection.execute(sql.encode())
            return cursor.fetchall() if cursor.description else []

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are ended, not waited for) and delete
        the cluster; SIGKILL if it has not stopped within 30 s."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
