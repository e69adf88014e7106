"""``prefect-ml tls`` and the settings that use its certificates; a TLS cluster and HTTPS
serving are in ``tests/e2e/test_tls.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations import services
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import SERVE_INGRESS_ENVIRONMENT, prepare_process_environment
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.conftest import REPO_ROOT


def test_tls_command_writes_a_ca_and_certificates_with_private_keys(tmp_path: Path) -> None:
    from cryptography import x509

    folder = tmp_path / "tls"
    env = {**os.environ, "PREFECT_ML_HOME": str(tmp_path / "home"), "COLUMNS": "400"}
    command = [
        sys.executable,
        "-m",
        "prefect_ml.flows.cli",
        "tls",
        "--dir",
        str(folder),
        "--host",
        "head.lan",
    ]
    run = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"PREFECT_ML_RAY_TLS_DIR={folder}" in run.stderr
    files = services.TLSFiles(folder)
    for key in (files.ca_key, files.node_key, files.serve_key):
        assert key.stat().st_mode & 0o777 == 0o600
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    for cert_path in (files.node_cert, files.serve_cert):
        names = services.certificate_hosts(cert_path)
        assert names[:2] == ["127.0.0.1", "localhost"] and names[-1] == "head.lan"
        assert set(services.local_hosts()) <= set(names), "this machine's name and IP address"
        x509.load_pem_x509_certificate(cert_path.read_bytes()).verify_directly_issued_by(ca)

    again = subprocess.run([*command[:-2], "--host", "10.1.2.3"], env=env, capture_output=True)
    assert again.returncode == 0
    assert x509.load_pem_x509_certificate(files.ca_cert.read_bytes()) == ca, "the CA is kept"
    assert "10.1.2.3" in services.certificate_hosts(files.node_cert)


def test_missing_certificates_are_named_with_the_command_that_makes_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="prefect-ml tls --dir"):
        services.ray_environment(tmp_path / "nowhere")
    files = services.generate_tls_files(tmp_path / "tls")
    environment = services.ray_environment(files.folder)
    assert environment["RAY_USE_TLS"] == "1"
    assert environment["RAY_TLS_CA_CERT"] == str(files.ca_cert)


def test_https_serving_needs_both_files_and_leaves_haproxy_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = services.generate_tls_files(tmp_path / "tls")
    monkeypatch.setenv("PREFECT_ML_SERVE_TLS_CERT", str(files.serve_cert))
    with pytest.raises(ConfigurationError, match="set both"):
        _ = PrefectMLSettings().serve_tls
    monkeypatch.setenv("PREFECT_ML_SERVE_TLS_KEY", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigurationError, match="missing.pem is missing"):
        _ = PrefectMLSettings().serve_tls
    monkeypatch.setenv("PREFECT_ML_SERVE_TLS_KEY", str(files.serve_key))
    assert PrefectMLSettings().serve_tls == (files.serve_cert, files.serve_key)
    for variable in SERVE_INGRESS_ENVIRONMENT:
        monkeypatch.delenv(variable, raising=False)
    prepare_process_environment()
    assert not set(SERVE_INGRESS_ENVIRONMENT) & set(os.environ), "HAProxy speaks plain HTTP only"
