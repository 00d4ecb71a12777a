"""TLS for the HTTP simulators (MOAB Web Services, the OIDC identity provider) and the node API: a throwaway CA
the tests trust, and client certificates it signs (``issue_client_cert``, for mutual TLS).

The adapters verify certificates (never disabled): they are given the CA's certificate as their CA bundle, and the
server certificate names 127.0.0.1 and localhost. A second, unrelated CA lets a test check that a server whose
certificate does not chain to the configured CA is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class TestCA:
    __test__ = False  # not a pytest test class, even when a test module imports it

    ca_cert: Path
    server_cert: Path
    server_key: Path
    ca_key: Path | None = None
    """The CA's private key (PEM), to issue client certificates with ``issue_client_cert``."""


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _authority_key_id(ca_key: ec.EllipticCurvePrivateKey) -> x509.AuthorityKeyIdentifier:
    # Python 3.13's default contexts verify with VERIFY_X509_STRICT, which requires it in issued certificates.
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def make_ca(
    base: Path, name: str = "vehpc test CA", hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> TestCA:
    """A CA and a server certificate for ``hosts`` (DNS names or IP addresses) under ``base``."""
    base.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([_san(host) for host in hosts]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_authority_key_id(ca_key), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = TestCA(base / "ca.pem", base / "server.pem", base / "server.key", base / "ca.key")
    out.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(out.server_key, key)
    assert out.ca_key is not None
    _write_key(out.ca_key, ca_key)
    return out


def issue_client_cert(ca: TestCA, base: Path, name: str) -> tuple[Path, Path]:
    """A client certificate (``clientAuth``, common name ``name``) signed by ``ca``: ``(cert.pem, key.pem)``,
    the key with mode 0600."""
    assert ca.ca_key is not None, "this TestCA was made without its key"
    base.mkdir(parents=True, exist_ok=True)
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    issuer = x509.load_pem_x509_certificate(ca.ca_cert.read_bytes()).subject
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(_authority_key_id(ca_key), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = base / f"{name}.pem", base / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert_path, key_path


class HttpsServer:
    """A threaded HTTPS server on a free loopback port; ``handler`` is a ``BaseHTTPRequestHandler`` class."""

    def __init__(
        self, ca: TestCA, handler: type[BaseHTTPRequestHandler], setup: Callable[[ThreadingHTTPServer], None]
    ):
        self.ca = ca
        self.handler = handler
        self.setup = setup
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> None:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca.server_cert, self.ca.server_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        self.setup(server)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
