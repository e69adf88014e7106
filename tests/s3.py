"""A real S3 API on loopback for the tests: moto's server, and a proxy in front of it that fails
a share of the requests the way S3 does under load (503 SlowDown, connection resets).

The proxy is not a mock: every request it lets through is answered by the S3 server, and a
failed one never reaches it, so what the client sees is exactly what an unreliable network
between it and a real S3 endpoint would produce.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request

TEST_BUCKET = "prefect-ml-test"
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected by the test proxy)</Message></Error>"
)


class MotoS3:
    """moto's S3 server on ``127.0.0.1:port``; stopping and starting it keeps the buckets
    (moto's state lives in this process), as a restarted S3 endpoint would."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server: object | None = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None

    def reset(self) -> None:
        """Forget every bucket and object (between tests)."""
        httpx.post(f"{self.endpoint}/moto-api/reset", timeout=10).raise_for_status()

    def client(self, endpoint: str | None = None) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint)


class FaultyProxy:
    """HTTP proxy to ``target_port`` that answers ``rate`` of the requests with a 503 SlowDown
    or a TCP reset (half each) instead of forwarding them, and cuts the bodies of the first
    ``cut_bodies`` GET answers: the headers promise every byte, half of them come, then a reset.
    ``received`` lists what reached the server: each forwarded request's method, path (no
    query) and ``Range`` header."""

    def __init__(self, target_port: int, rate: float, seed: int = 0, cut_bodies: int = 0) -> None:
        self.target_port, self.rate, self.cut_bodies = target_port, rate, cut_bodies
        self.forwarded = self.slow_downs = self.resets = 0
        self.received: list[tuple[str, str, str | None]] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _cut(self) -> bool:
        with self._lock:
            self.cut_bodies -= 1
            return self.cut_bodies >= 0

    def _fault(self, request: tuple[str, str, str | None]) -> str | None:
        with self._lock:
            draw = self._random.random()
            if draw < self.rate / 2:
                self.slow_downs += 1
                return "slow-down"
            if draw < self.rate:
                self.resets += 1
                return "reset"
            self.forwarded += 1
            self.received.append(request)
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _proxy(self) -> None:
                body = self._body()
                path = self.path.split("?", 1)[0]
                fault = proxy._fault((self.command, path, self.headers.get("Range")))
                if fault == "reset":
                    self._reset()
                    return
                if fault == "slow-down":
                    self._reply(503, {"Content-Type": "application/xml"}, _SLOW_DOWN)
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"
                }
                headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    # A HEAD's Content-Length is the object's size (its body is empty).
                    dropped = {"transfer-encoding", "connection"}
                    if self.command != "HEAD":
                        dropped.add("content-length")
                    passed = {k: v for k, v in response.getheaders() if k.lower() not in dropped}
                    data = self.command == "GET" and response.status < 300 and len(payload) > 1
                    self._reply(response.status, passed, payload, cut=data and proxy._cut())
                finally:
                    upstream.close()

            def _reset(self) -> None:
                """RST instead of FIN: the client sees "connection reset"."""
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            def _reply(
                self, status: int, headers: dict[str, str], payload: bytes, cut: bool = False
            ) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if not any(key.lower() == "content-length" for key in headers):
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if cut:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self._reset()
                elif self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy

        return Handler


class MlflowServer:
    """A real ``mlflow server`` on loopback (SQLite backend) proxying artifacts to
    ``artifacts_destination``. It starts when constructed and is waited for in :meth:`ready`,
    so a session can start it early and let it come up while other tests run."""

    def __init__(self, workdir: Path, artifacts_destination: str) -> None:
        from tests.helpers import free_port

        workdir.mkdir(parents=True, exist_ok=True)
        self._log_path = workdir / "mlflow-server.log"
        port = free_port()
        self.uri = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1"]
        command += ["--port", str(port), "--workers", "1"]
        command += ["--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}"]
        command += ["--artifacts-destination", artifacts_destination]
        with self._log_path.open("wb") as log:
            self._process = subprocess.Popen(
                command,
                env={
                    **os.environ,
                    "MLFLOW_S3_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
                    # MLflow 3's job runner (GenAI jobs, unused here) starts seven huey consumer
                    # processes beside the server: about 40 s of CPU at start-up, and they outlive
                    # a terminated server.
                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                    # mlflow starts uvicorn by name: the virtualenv's bin must be on PATH.
                    "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _healthy(self) -> bool:
        if self._process.poll() is not None:
            raise AssertionError(f"mlflow server exited: {self._log_path.read_text()}")
        try:
            return httpx.get(f"{self.uri}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ready(self) -> str:
        """Wait until it answers; its tracking URI."""
        from tests.helpers import wait_for

        wait_for(self._healthy, 120, "mlflow server to answer")
        return self.uri

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=30)
