"""Connecting to a production Temporal: TLS, mutual TLS, the server name, an API key from the environment.

The dev server (``temporal server start-dev``) has no TLS options, so these tests put a TLS-terminating proxy
in front of it: Python's ``ssl`` with a test CA, ALPN h2, and (for mutual TLS) a required client certificate,
piping the bytes to the dev server. The worker's Rust client does a real handshake against it, so what is tested
is the certificate handling a production cluster (or Temporal Cloud) sees; the server behind the proxy is the
real one. Failure modes must be typed errors that name the setting or the address, never the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from temporalio.testing import WorkflowEnvironment

from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter
from tests.production_support import provider_ledger, submit, wait_result
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.states import JobState
from workers.wiring import TemporalUnavailable, connect
from workers.worker import WorkerProcess

# ---- a test PKI ------------------------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
    *,
    sans: Sequence[x509.GeneralName] = (),
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=2))
        .add_extension(x509.BasicConstraints(ca=usage is None, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class PKI:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name

    def write(self, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
        self.path(f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            self.path(f"{name}.key").write_bytes(pem)
            self.path(f"{name}.key").chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """A CA, a server certificate for 127.0.0.1 and localhost, one for temporal.internal only, a client
    certificate, and a second CA that signed nothing here."""
    pki = PKI(tmp_path_factory.mktemp("pki"))
    ca_key, other_key = _key(), _key()
    pki.write("ca", _cert("test-ca", ca_key))
    pki.write("other-ca", _cert("other-ca", other_key))
    ca = ("test-ca", ca_key)
    local = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, named_key, client_key = _key(), _key(), _key()
    pki.write(
        "server",
        _cert("localhost", server_key, ca, sans=local, usage=ExtendedKeyUsageOID.SERVER_AUTH),
        server_key,
    )
    named = _cert(
        "temporal.internal",
        named_key,
        ca,
        sans=[x509.DNSName("temporal.internal")],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    pki.write("named", named, named_key)
    pki.write("client", _cert("worker-1", client_key, ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH), client_key)
    return pki


# ---- the proxy -------------------------------------------------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@contextlib.asynccontextmanager
async def tls_proxy(
    upstream: str, pki: PKI, *, cert: str = "server", client_ca: bool = False
) -> AsyncIterator[str]:
    """``127.0.0.1:<port>`` speaking TLS (HTTP/2 by ALPN) and piping to the plaintext dev server."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.path(f"{cert}.pem"), pki.path(f"{cert}.key"))
    context.set_alpn_protocols(["h2"])
    if client_ca:
        context.load_verify_locations(pki.path("ca.pem"))
        context.verify_mode = ssl.CERT_REQUIRED
    host, port = upstream.rsplit(":", 1)
    tasks: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        both = asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        tasks.add(both)  # type: ignore[arg-type]
        await both

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def tls_config(tmp_path: Path, address: str, **temporal: object) -> Config:
    return make_config(tmp_path, temporal={"address": address, **temporal})


@pytest.fixture
def upstream(temporal_env: WorkflowEnvironment) -> str:
    return temporal_env.client.service_client.config.target_host


# ---- tests -----------------------------------------------------------------------------------------------------


async def test_a_worker_runs_a_job_over_mutual_tls(
    upstream: str, pki: PKI, tmp_path: Path, key_path: Path
) -> None:
    async with tls_proxy(upstream, pki, client_ca=True) as address:
        config = make_config(
            tmp_path,
            hpc={"cluster_id": "tls-cluster"},
            temporal={
                "address": address,
                "task_queue": f"tq-{tmp_path.name[-8:]}",
                "tls_server_ca_cert": str(pki.path("ca.pem")),
                "tls_client_cert": str(pki.path("client.pem")),
                "tls_client_key": str(pki.path("client.key")),
            },
        )
        ledger = provider_ledger(config, key_path)
        worker = WorkerProcess(
            config,
            Secrets(provider_signing_key_path=key_path),
            with_poller=True,
            chain=ledger,
            adapters={"tls-cluster": MemoryAdapter()},
        )
        await worker.start()
        try:
            assert worker.client is not None
            assert worker.client.service_client.config.target_host == address
            job_id = submit(ledger, config, decide="tls-cluster")
            result = await wait_result(worker.client, job_id)
            assert result.state == JobState.COMPLETED
        finally:
            await worker.stop()


async def test_without_the_client_certificate_mutual_tls_is_refused(
    upstream: str, pki: PKI, tmp_path: Path
) -> None:
    async with tls_proxy(upstream, pki, client_ca=True) as address:
        config = tls_config(tmp_path, address, tls_server_ca_cert=str(pki.path("ca.pem")))
        with pytest.raises(
            TemporalUnavailable, match=rf"^cannot connect to Temporal at {address} \(namespace default, TLS\)"
        ):
            await connect(config)


async def test_a_server_certificate_from_another_ca_is_refused(
    upstream: str, pki: PKI, tmp_path: Path
) -> None:
    async with tls_proxy(upstream, pki) as address:
        config = tls_config(tmp_path, address, tls_server_ca_cert=str(pki.path("other-ca.pem")))
        with pytest.raises(TemporalUnavailable, match="UnknownIssuer"):
            await connect(config)
        plaintext = tls_config(tmp_path, address)
        with pytest.raises(TemporalUnavailable, match="plaintext"):
            await connect(plaintext)


async def test_the_server_name_setting_checks_a_certificate_issued_for_another_name(
    upstream: str, pki: PKI, tmp_path: Path
) -> None:
    async with tls_proxy(upstream, pki, cert="named") as address:
        ca = str(pki.path("ca.pem"))
        with pytest.raises(TemporalUnavailable, match="NotValidForName"):
            await connect(tls_config(tmp_path, address, tls_server_ca_cert=ca))
        client = await connect(
            tls_config(tmp_path, address, tls_server_ca_cert=ca, tls_server_name="temporal.internal")
        )
        assert await client.service_client.check_health()


async def test_an_api_key_comes_from_the_named_variable_and_turns_tls_on(
    upstream: str, pki: PKI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "tmprl-api-key-1234567890abcdef"
    monkeypatch.setenv("TEMPORAL_API_KEY", secret)
    async with tls_proxy(upstream, pki) as address:
        config = tls_config(
            tmp_path, address, tls_server_ca_cert=str(pki.path("ca.pem")), api_key_env="TEMPORAL_API_KEY"
        )
        client = await connect(config)
        assert client.service_client.config.api_key == secret
        assert client.service_client.config.tls  # on, though `tls` was never set
        assert (await client.count_workflows("WorkflowType = 'Nothing'")).count == 0  # the server answered
    # Against the plaintext dev server the key would travel in clear: TLS is on, so the handshake fails, and the
    # error names the address, never the key.
    config = tls_config(tmp_path, upstream, api_key_env="TEMPORAL_API_KEY")
    with pytest.raises(TemporalUnavailable) as failure:
        await connect(config)
    assert secret not in str(failure.value) and "TLS" in str(failure.value)


async def test_settings_that_cannot_work_are_config_errors(tmp_path: Path, pki: PKI) -> None:
    async def refused(**temporal: object) -> str:
        with pytest.raises(ConfigError) as failure:
            await connect(tls_config(tmp_path, "127.0.0.1:1", **temporal))
        return str(failure.value)

    missing = tmp_path / "nope.pem"
    assert (await refused(tls_server_ca_cert=str(missing))).startswith(
        f"temporal.tls_server_ca_cert: cannot read CA certificate {missing}"
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    assert await refused(tls_server_ca_cert=str(garbage)) == (
        f"temporal.tls_server_ca_cert: {garbage} is not a PEM file (CA certificate)"
    )
    assert await refused(api_key_env="VE_TEST_UNSET_KEY") == (
        "temporal.api_key_env names VE_TEST_UNSET_KEY, but that environment variable is not set or empty"
    )
    with pytest.raises(ConfigError, match=r"tls_client_cert and temporal\.tls_client_key go together"):
        tls_config(tmp_path, "x:1", tls_client_cert=str(pki.path("client.pem")))
    with pytest.raises(ConfigError, match=r"temporal\.api_key_env: String should match pattern"):
        tls_config(tmp_path, "x:1", api_key_env="NOT A NAME")
