"""TLS end to end: ``prefect-ml tls`` certificates, a Ray cluster with Ray's mutual TLS that
``prefect-ml train`` trains on and strangers cannot join, and a model served over HTTPS."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prefect.settings import PREFECT_API_URL
from sklearn.datasets import load_digits

from prefect_ml.integrations import services, tracking
from prefect_ml.integrations.services import SERVE_INGRESS_ENVIRONMENT
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.conftest import REPO_ROOT
from tests.e2e.test_resume_after_kill import _kill_tree
from tests.helpers import free_port, wait_for

RAY_TLS_VARIABLES = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


@dataclass
class TLSCluster:
    address: str
    certificates: services.TLSFiles
    token: str
    home: Path
    # A bare driver started with the cluster (_start_plaintext_driver), judged 45 s later.
    plaintext_driver: subprocess.Popen[str] | None = None
    plaintext_started: float = field(default=0.0)

    def driver_environment(self, **extra: str) -> dict[str, str]:
        """A driver of this cluster: the token and our settings, none of Ray's TLS variables
        (PREFECT_ML_RAY_TLS_DIR must be what turns TLS on)."""
        # Without Serve's HAProxy ingress, too: the head starts Serve's HTTP path.
        dropped = {*RAY_TLS_VARIABLES, *SERVE_INGRESS_ENVIRONMENT}
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env.update(
            PREFECT_ML_HOME=str(self.home),
            PREFECT_API_URL=str(PREFECT_API_URL.value()),
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=self.token,
            COLUMNS="400",  # rich wraps long paths at 80
        )
        return {**env, **extra}


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSCluster]:
    """``ray start --head`` with Ray's TLS and token auth on loopback ports, in its own
    process group, stopped by its process id; without Serve's HAProxy (plain HTTP only)."""
    base = tmp_path_factory.mktemp("tls-cluster")
    certificates = services.generate_tls_files(base / "certs")
    cluster = TLSCluster("", certificates, secrets.token_hex(32), base / "home")
    port = free_port()
    cluster.address = f"127.0.0.1:{port}"
    env = cluster.driver_environment(**services.ray_environment(certificates.folder))
    temp_dir = tempfile.mkdtemp(prefix="rtls", dir="/tmp")  # Ray's socket paths must be short
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block"]
    command += ["--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2"]
    command += ["--include-dashboard=true", "--dashboard-host=127.0.0.1"]
    for flag in (
        "dashboard-port",
        "ray-client-server-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ):
        command.append(f"--{flag}={free_port()}")
    command.append(f"--temp-dir={temp_dir}")
    log = base / "ray-head.log"
    with log.open("wb") as sink:
        head = subprocess.Popen(
            command, env=env, stdout=sink, stderr=sink, start_new_session=True, cwd=REPO_ROOT
        )
    try:
        wait_for(lambda: "Ray runtime started" in log.read_text(errors="replace"), 120, "Ray")
        _start_plaintext_driver(cluster)
        yield cluster
    except BaseException:
        print(log.read_text(errors="replace")[-5000:])
        raise
    finally:
        if cluster.plaintext_driver is not None and cluster.plaintext_driver.poll() is None:
            cluster.plaintext_driver.kill()
            cluster.plaintext_driver.wait()
        # --block stops the node's processes on SIGTERM; what is left after 5 s is killed, as
        # the cluster fixture's nodes are (waiting for all of it took 35 s under load).
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _kill_tree(head)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


PLAINTEXT_PATIENCE_S = 45.0


def _start_plaintext_driver(cluster: TLSCluster) -> None:
    """A bare driver with the token but none of Ray's TLS variables (``ray.init`` and a task),
    started as soon as the cluster is up so that its 45 s of trying overlap the other tests."""
    script = (
        "import ray\n"
        f"ray.init(address={cluster.address!r})\n"
        "print('answer', ray.get(ray.remote(lambda: 42).remote()))\n"
    )
    cluster.plaintext_driver = subprocess.Popen(
        [sys.executable, "-c", script],
        env=cluster.driver_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    cluster.plaintext_started = time.monotonic()


def _plaintext_driver_connected(cluster: TLSCluster) -> bool:
    """Whether the bare driver got its answer: a member connects within seconds; one still
    trying 45 s after it started did not get in (waits for the rest of the 45 s, if any)."""
    driver = cluster.plaintext_driver
    assert driver is not None
    remaining = PLAINTEXT_PATIENCE_S - (time.monotonic() - cluster.plaintext_started)
    try:
        output, _ = driver.communicate(timeout=max(remaining, 0.1))
    except subprocess.TimeoutExpired:
        return False
    return "answer 42" in output


def _gcs_answers(cluster: TLSCluster, client: services.TLSFiles) -> bool:
    """Whether Ray's GCS answers an HTTP/2 preface from a TLS client presenting ``client``'s
    node certificate (the server itself verified with the cluster's CA)."""
    context = ssl.create_default_context(cafile=str(cluster.certificates.ca_cert))
    context.load_cert_chain(client.node_cert, client.node_key)
    context.set_alpn_protocols(["h2"])
    host, port = cluster.address.rsplit(":", 1)
    try:
        with (
            socket.create_connection((host, int(port)), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname=host) as connection,
        ):
            connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            return bool(connection.recv(9))  # the server's SETTINGS frame header
    except (ssl.SSLError, ConnectionError):
        return False


@pytest.mark.e2e
def test_prefect_ml_trains_on_a_tls_cluster_and_serves_over_https(
    tls_cluster: TLSCluster, tmp_path: Path
) -> None:
    """``prefect-ml train`` with PREFECT_ML_RAY_TLS_DIR trains and registers on the TLS cluster;
    ``prefect-ml serve`` with PREFECT_ML_SERVE_TLS_* serves it over HTTPS to clients that trust
    the CA, and a plain-HTTP or untrusting client gets nothing."""
    certificates = tls_cluster.certificates
    env = tls_cluster.driver_environment(
        PREFECT_ML_RAY_ADDRESS=tls_cluster.address,
        PREFECT_ML_RAY_TLS_DIR=str(certificates.folder),
    )
    train = [
        sys.executable,
        "-m",
        "prefect_ml.flows.cli",
        "train",
        "--epochs",
        "1",
        "--workers",
        "1",
    ]
    trained = subprocess.run(
        train, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400
    )
    assert trained.returncode == 0, trained.stderr[-4000:]
    settings = PrefectMLSettings(home=tls_cluster.home)
    client = tracking.client_for(settings.resolved_tracking_uri)
    assert tracking.champion(client, "digits-classifier", "champion") is not None

    port = free_port()
    env.update(
        PREFECT_ML_SERVE_TLS_CERT=str(certificates.serve_cert),
        PREFECT_ML_SERVE_TLS_KEY=str(certificates.serve_key),
    )
    serve = [sys.executable, "-m", "prefect_ml.flows.cli", "serve", "--port", str(port)]
    haproxy = {**env, "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    refused = subprocess.run(serve, env=haproxy, cwd=REPO_ROOT, capture_output=True, timeout=300)
    assert refused.returncode == 1
    assert b"HAProxy ingress serves plain HTTP only" in refused.stderr, "never plain HTTP"
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [*serve, "--replica-cpus", "0.5"], env=env, cwd=REPO_ROOT, stdout=sink, stderr=sink
        )
    url = f"https://127.0.0.1:{port}"
    row = load_digits().data[:1].tolist()
    trusting = httpx.Client(verify=services.trusting(certificates.ca_cert), timeout=10)

    def answers() -> bool:
        try:
            return trusting.post(f"{url}/predict", json={"inputs": row}).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(lambda: answers() or server.poll() is not None, 240, "an answer over HTTPS")
        assert server.poll() is None, "the server exited"
        serving = lambda: "Serving until Ctrl-C" in log.read_text(errors="replace")  # noqa: E731
        wait_for(serving, 120, "the CLI's smoke request and summary")
        body = trusting.post(f"{url}/predict", json={"inputs": row}).json()
        assert len(body["predictions"]) == 1
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.post(f"{url}/predict", json={"inputs": row})  # the system CAs do not know ours
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/predict", json={"inputs": row}, timeout=5)
        server.send_signal(signal.SIGINT)
        server.wait(timeout=90)
    except BaseException:
        print(log.read_text(errors="replace")[-5000:])
        raise
    finally:
        trusting.close()
        if server.poll() is None:
            _kill_tree(server)
    text = log.read_text(errors="replace")
    assert server.returncode == 128 + signal.SIGINT, text[-3000:]  # a stopped command's status
    assert f"{url}/predict" in text, "the CLI names the https endpoint"


@pytest.mark.e2e
def test_a_driver_without_the_cluster_certificates_cannot_connect(
    tls_cluster: TLSCluster, tmp_path: Path
) -> None:
    # TLS, but a certificate of another CA
    stranger = services.generate_tls_files(tmp_path / "other-ca")
    assert not _gcs_answers(tls_cluster, stranger), "a client certificate of another CA"
    assert _gcs_answers(tls_cluster, tls_cluster.certificates), "the probe reaches a member"
    assert not _plaintext_driver_connected(tls_cluster), "a driver without TLS"
