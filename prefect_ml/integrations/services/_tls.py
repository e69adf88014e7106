"""Certificates for TLS between Ray nodes and for HTTPS serving, generated with ``cryptography``.

One folder holds a private CA and the certificates it signs:

- ``ca.pem`` / ``ca-key.pem``: the CA; every node trusts it, its key signs new certificates.
- ``node.pem`` / ``node-key.pem``: a Ray node's certificate (server and client: Ray's gRPC TLS
  is mutual), given to Ray through ``RAY_TLS_SERVER_CERT``/``RAY_TLS_SERVER_KEY``.
- ``serve.pem`` / ``serve-key.pem``: the HTTPS certificate of the serving endpoint.

Key files are written 0600. An existing CA is reused, so certificates issued later (for more
hosts) are trusted by nodes that already run.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
NODE_CERT, NODE_KEY = "node.pem", "node-key.pem"
SERVE_CERT, SERVE_KEY = "serve.pem", "serve-key.pem"


@dataclass(frozen=True)
class TLSFiles:
    """The paths of one TLS folder's files."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / CA_CERT

    @property
    def ca_key(self) -> Path:
        return self.folder / CA_KEY

    @property
    def node_cert(self) -> Path:
        return self.folder / NODE_CERT

    @property
    def node_key(self) -> Path:
        return self.folder / NODE_KEY

    @property
    def serve_cert(self) -> Path:
        return self.folder / SERVE_CERT

    @property
    def serve_key(self) -> Path:
        return self.folder / SERVE_KEY


def local_hosts() -> tuple[str, ...]:
    """Loopback, this machine's name and its outward IP address: Ray nodes reach each other by
    the node IP (``ray start`` replaces 127.0.0.1 with it), and TLS checks that name."""
    hosts = [*DEFAULT_HOSTS, socket.gethostname()]
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("8.8.8.8", 80))  # chooses the route only; nothing is sent (as Ray does)
        hosts.append(probe.getsockname()[0])
    return tuple(dict.fromkeys(hosts))


def generate_tls_files(
    folder: Path, hosts: tuple[str, ...] | None = None, *, days: int = 365
) -> TLSFiles:
    """Write (or reuse) the CA, then issue node and serving certificates valid for ``hosts``.

    Args:
        folder: where the files go; created 0700 if missing.
        hosts: DNS names and IP addresses the certificates name (subject alternative names);
            default :func:`local_hosts`.
        days: validity of the node and serving certificates (the CA gets ten times as long).
    """
    hosts = hosts or local_hosts()
    if days < 1:
        raise ConfigurationError("--days", "must be at least 1")
    files = TLSFiles(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if files.ca_cert.exists() and files.ca_key.exists():
        ca_cert, ca_key = _load_ca(files)
    else:
        ca_key = _new_key()
        ca_cert = _ca_certificate(ca_key, days * 10)
        _write_key(files.ca_key, ca_key)
        _write_cert(files.ca_cert, ca_cert)
    for cert_path, key_path, client_auth in (
        (files.node_cert, files.node_key, True),
        (files.serve_cert, files.serve_key, False),
    ):
        key = _new_key()
        _write_key(key_path, key)
        _write_cert(cert_path, _leaf_certificate(key, ca_cert, ca_key, hosts, days, client_auth))
    return files


def ray_environment(folder: Path) -> dict[str, str]:
    """The variables that turn on Ray's TLS with this folder's node certificate; every Ray node
    (``ray start``) and every driver needs them, or it cannot talk to the others."""
    files = TLSFiles(folder.expanduser().resolve())
    for path in (files.ca_cert, files.node_cert, files.node_key):
        if not path.is_file():
            raise ConfigurationError(
                "PREFECT_ML_RAY_TLS_DIR",
                f"{path} is missing; create the certificates with `prefect-ml tls --dir {folder}`",
            )
    return {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(files.node_cert),
        "RAY_TLS_SERVER_KEY": str(files.node_key),
        "RAY_TLS_CA_CERT": str(files.ca_cert),
    }


def trusting(certificate: Path) -> ssl.SSLContext:
    """A client context that trusts exactly this certificate (or the CA that signed it), with
    the host name checked: how our own smoke request reaches an endpoint we serve."""
    context = ssl.create_default_context(cafile=str(certificate))
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf as trust anchor
    return context


def certificate_hosts(path: Path) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    from cryptography import x509

    names = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    return [str(name.value) for name in names.value]


def _new_key() -> EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "prefect-ml"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, key: EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    from cryptography import x509

    # Back-dated a little: a node whose clock is slightly behind must still accept it.
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _ca_certificate(key: EllipticCurvePrivateKey, days: int) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    name = _name("prefect-ml CA")
    return (
        _builder(name, name, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _leaf_certificate(
    key: EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: EllipticCurvePrivateKey,
    hosts: tuple[str, ...],
    days: int,
    client_auth: bool,
) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    if client_auth:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    return (
        _builder(_name(hosts[0]), ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _alt_names(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _load_ca(files: TLSFiles) -> tuple[x509.Certificate, EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(files.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigurationError(
            "--dir", f"{files.ca_key} is not a CA key this command wrote; use another folder"
        )
    return x509.load_pem_x509_certificate(files.ca_cert.read_bytes()), key


def _write_key(path: Path, key: EllipticCurvePrivateKey) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.unlink(missing_ok=True)  # created 0600 below, never readable by others in between
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
