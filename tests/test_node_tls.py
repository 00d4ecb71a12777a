"""HTTPS and mutual TLS between ``hpc-node-agent`` and the node API, with real processes and real handshakes.

The node API process (``python -m workers.node_api``) serves a certificate from a throwaway CA
(``tests/sim/https.py``); real ``hpc-node-agent`` processes verify it with ``ca-file``. An agent that does not
trust that CA, or reaches the API under a name its certificate does not carry, is refused by its own TLS layer
with a message naming the problem, and the API accepts nothing from it. With ``nodes.tls_client_ca_file`` an
agent needs a client certificate from that CA: none, one from another CA, or one from the server's CA are all
refused before the application sees a byte. Configuration errors on either side stop the process with one line
naming the key, never a traceback. No TLS code is mocked.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.node_support import (
    CLUSTER,
    Agent,
    Provider,
    audit_events,
    reaches,
    wait_for,
)
from tests.sim.https import TestCA, issue_client_cert, make_ca
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.node.lifecycle import NodeState
from virtengine_hpc.tls import client_context, server_context


@dataclass(frozen=True)
class PKI:
    api: TestCA
    """The node API's CA; its server certificate names 127.0.0.1 only (``localhost`` is a wrong name)."""
    other: TestCA
    """An unrelated CA with a certificate for the same address."""
    clients: TestCA
    """The CA of the node agents' client certificates (``nodes.tls_client_ca_file``)."""
    node: tuple[Path, Path]
    """A client certificate and key from ``clients``."""
    probe: tuple[Path, Path]
    """The test's own client certificate (``/healthz`` while waiting for the API)."""


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    clients = make_ca(tmp_path / "pki" / "clients", "node client CA")
    return PKI(
        api=make_ca(tmp_path / "pki" / "api", "node API CA", hosts=("127.0.0.1",)),
        other=make_ca(tmp_path / "pki" / "other", "someone else"),
        clients=clients,
        node=issue_client_cert(clients, tmp_path / "pki" / "issued", "node-client"),
        probe=issue_client_cert(clients, tmp_path / "pki" / "issued", "probe"),
    )


def temporal_address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


def probe_context(pki: PKI, *, mutual: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.api.ca_cert))
    if mutual:
        context.load_cert_chain(*pki.probe)
    return context


@pytest.fixture
def https_provider(tmp_path: Path, temporal_env: WorkflowEnvironment, pki: PKI) -> Iterator[Provider]:
    provider = Provider(
        tmp_path,
        temporal_address(temporal_env),
        nodes={"tls_cert_file": str(pki.api.server_cert), "tls_key_file": str(pki.api.server_key)},
        probe_verify=probe_context(pki, mutual=False),
    )
    provider.start_api()
    yield provider
    provider.stop()


@pytest.fixture
def mtls_provider(tmp_path: Path, temporal_env: WorkflowEnvironment, pki: PKI) -> Iterator[Provider]:
    provider = Provider(
        tmp_path,
        temporal_address(temporal_env),
        nodes={
            "tls_cert_file": str(pki.api.server_cert),
            "tls_key_file": str(pki.api.server_key),
            "tls_client_ca_file": str(pki.clients.ca_cert),
        },
        probe_verify=probe_context(pki, mutual=True),
    )
    provider.start_api()
    yield provider
    provider.stop()


async def allowed_agent(tmp_path: Path, provider: Provider, node_id: str, **settings: Any) -> Agent:
    agent = Agent(tmp_path, node_id, provider, **settings)
    await provider.cli("allow", node_id, "--public-key", await agent.init(), "--cluster", CLUSTER)
    return agent


async def refused_registration(agent: Agent) -> str:
    """``hpc-node-agent register`` against an API that must not accept it: exit 2, one line, no traceback."""
    done = await agent.run("register", "--config", str(agent.config_path))
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: provider unreachable: TLS: "), done.stderr
    return line


def accepted_nothing(provider: Provider) -> None:
    """Nothing reached the application: no registration, and not even a rejection to audit."""
    for kind in ("node_registered", "node_registration_rejected", "heartbeat_rejected"):
        assert audit_events(provider.audit_path, kind) == [], kind


def started(provider: Provider) -> dict[str, Any]:
    [event] = audit_events(provider.audit_path, "service_started")
    return dict(event["details"])


# ---- HTTPS ---------------------------------------------------------------------------------------------------


async def test_an_agent_with_the_ca_registers_and_its_heartbeats_are_accepted_over_https(
    client: Client, https_provider: Provider, pki: PKI, tmp_path: Path
) -> None:
    provider = https_provider
    assert provider.url.startswith("https://127.0.0.1:")
    assert started(provider) == {
        "service": "node_api",
        "listen": f"127.0.0.1:{provider.port}",
        "url": provider.url,
        "tls": "tls",
    }
    assert f"node API listening on {provider.url}" in (provider.dir / "node-api.log").read_text()
    # The port speaks TLS only: a plain-HTTP request gets no answer.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{provider.port}/healthz", timeout=5)

    async with provider.node_worker(client, tmp_path) as nodes:
        agent = await allowed_agent(tmp_path, provider, "node-tls", **{"ca-file": str(pki.api.ca_cert)})
        try:
            agent.start()
            await reaches(client, "node-tls", NodeState.ACTIVE, 20)
            await wait_for(
                lambda: (row := nodes.ledger.get(CLUSTER, "node-tls")) is not None and row.last_sequence >= 3,
                15,
                "heartbeats accepted over https",
            )
            assert (await agent.status())["last_heartbeat"]["ok"] is True
            assert [
                e["details"]["node_id"] for e in audit_events(provider.audit_path, "node_registered")
            ] == ["node-tls"]
            assert audit_events(provider.audit_path, "heartbeat_rejected") == []
        finally:
            agent.stop()
    assert (
        f"to {provider.url} (TLS verified against CA {pki.api.ca_cert})"
        in (agent.dir / "agent.log").read_text()
    )


async def test_an_agent_that_does_not_trust_the_api_is_refused_with_the_reason(
    https_provider: Provider, pki: PKI, tmp_path: Path
) -> None:
    provider = https_provider
    # ca-file unset: the system's CAs, which do not know the test CA.
    system = await allowed_agent(tmp_path, provider, "node-sys")
    assert await refused_registration(system) == (
        "error: provider unreachable: TLS: the node API's certificate was refused: unable to get local issuer "
        "certificate (verified against the system's CAs (ca-file is unset); it must chain to that CA and name "
        f"the host of {provider.url})"
    )
    # Another CA (which has a certificate for 127.0.0.1 too, but not this one).
    other = await allowed_agent(tmp_path, provider, "node-other", **{"ca-file": str(pki.other.ca_cert)})
    message = await refused_registration(other)
    assert "certificate was refused: unable to get local issuer certificate" in message
    assert f"verified against ca-file {pki.other.ca_cert}" in message
    # The right CA, the wrong name: the certificate names 127.0.0.1, the agent asks for localhost.
    misnamed = await allowed_agent(
        tmp_path,
        provider,
        "node-name",
        **{"ca-file": str(pki.api.ca_cert), "provider-daemon-url": f"https://localhost:{provider.port}"},
    )
    message = await refused_registration(misnamed)
    assert "certificate was refused: Hostname mismatch, certificate is not valid for 'localhost'" in message

    # A running agent does not crash on it: it logs the reason as an error each round and keeps trying.
    other.start()
    try:
        await wait_for(lambda: (other.dir / "agent.key.status.json").exists(), 15, "the agent's first round")
        await wait_for(lambda: other.log().count("certificate was refused") >= 2, 15, "a second round")
        assert other.proc is not None and other.proc.poll() is None, "the agent keeps running"
        last = (await other.status())["last_heartbeat"]
        assert last["ok"] is False and last["error"] == "unreachable"
        assert last["message"].startswith("provider unreachable: TLS: the node API's certificate was refused")
        assert " ERROR hpc-node-agent: provider unreachable: TLS:" in other.log()
        assert "Traceback" not in other.log()
    finally:
        other.stop()
    accepted_nothing(provider)


# ---- mutual TLS ----------------------------------------------------------------------------------------------


async def test_mutual_tls_refuses_agents_without_a_certificate_from_the_client_ca(
    client: Client, mtls_provider: Provider, pki: PKI, tmp_path: Path
) -> None:
    provider = mtls_provider
    assert started(provider)["tls"] == "mutual"
    log = (provider.dir / "node-api.log").read_text()
    assert f"(mutual TLS: clients need a certificate from {pki.clients.ca_cert})" in log
    trust = {"ca-file": str(pki.api.ca_cert)}

    # No client certificate.
    bare = await allowed_agent(tmp_path, provider, "node-bare", **trust)
    message = await refused_registration(bare)
    assert "client certificate" in message and "client-cert-file" in message
    # A certificate from another CA, and one from the server's CA (trusted for the server, not for clients).
    for node_id, ca in (("node-rogue", pki.other), ("node-wrong-ca", pki.api)):
        cert, key = issue_client_cert(ca, tmp_path / "pki" / "issued", node_id)
        agent = await allowed_agent(
            tmp_path,
            provider,
            node_id,
            **trust,
            **{"client-cert-file": str(cert), "client-key-file": str(key)},
        )
        message = await refused_registration(agent)
        assert "client certificate" in message, message
    accepted_nothing(provider)

    # A certificate from the client CA: registered, heartbeats accepted.
    async with provider.node_worker(client, tmp_path) as nodes:
        cert, key = pki.node
        agent = await allowed_agent(
            tmp_path,
            provider,
            "node-mtls",
            **trust,
            **{"client-cert-file": str(cert), "client-key-file": str(key)},
        )
        try:
            agent.start()
            await reaches(client, "node-mtls", NodeState.ACTIVE, 20)
            await wait_for(
                lambda: (
                    (row := nodes.ledger.get(CLUSTER, "node-mtls")) is not None and row.last_sequence >= 3
                ),
                15,
                "heartbeats accepted over mutual TLS",
            )
        finally:
            agent.stop()
    assert [e["details"]["node_id"] for e in audit_events(provider.audit_path, "node_registered")] == [
        "node-mtls"
    ]
    assert audit_events(provider.audit_path, "node_registration_rejected") == []


# ---- configuration errors ------------------------------------------------------------------------------------


def api_config(tmp_path: Path, nodes: dict[str, Any]) -> Path:
    """A provider config whose Temporal address has nothing behind it: TLS errors must come first."""
    path = tmp_path / "provider.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "hpc": {
                    "job_service": {"state_store_path": str(tmp_path / "state")},
                    "audit": {"log_path": str(tmp_path / "audit.log")},
                },
                "temporal": {"address": "127.0.0.1:1"},
                "nodes": {"listen_port": 1, **nodes},
            }
        )
    )
    return path


def run_quickly(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)


def test_bad_tls_configuration_stops_the_node_api_with_one_line(tmp_path: Path, pki: PKI) -> None:
    cert, key, ca = str(pki.api.server_cert), str(pki.api.server_key), str(pki.clients.ca_cert)
    missing = tmp_path / "missing.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    open_key = tmp_path / "open.key"
    open_key.write_bytes(pki.api.server_key.read_bytes())
    open_key.chmod(0o644)
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"tls_cert_file": cert},
            "error: invalid configuration: nodes: nodes.tls_cert_file and nodes.tls_key_file go together",
        ),
        (
            {"tls_client_ca_file": ca},
            "error: invalid configuration: nodes: nodes.tls_client_ca_file (mutual TLS) needs "
            "nodes.tls_cert_file and nodes.tls_key_file",
        ),
        (
            {"tls_cert_file": str(missing), "tls_key_file": key},
            f"error: nodes.tls_cert_file: cannot read server certificate {missing}: No such file or directory",
        ),
        (
            {"tls_cert_file": cert, "tls_key_file": str(missing)},
            f"error: nodes.tls_key_file: cannot read private key {missing}: No such file or directory",
        ),
        (
            {"tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": str(missing)},
            f"error: nodes.tls_client_ca_file: cannot read client CA bundle {missing}: No such file or directory",
        ),
        (
            {"tls_cert_file": str(garbage), "tls_key_file": key},
            f"error: nodes.tls_cert_file: {garbage} is not a PEM file (server certificate)",
        ),
        (
            {"tls_cert_file": cert, "tls_key_file": str(pki.other.server_key)},
            f"error: nodes.tls_cert_file {cert} and nodes.tls_key_file {pki.other.server_key} are not a usable "
            "certificate and key: KEY_VALUES_MISMATCH",
        ),
        (
            {"tls_cert_file": cert, "tls_key_file": str(open_key)},
            f"error: nodes.tls_key_file: private key {open_key} is accessible by others (mode 644)",
        ),
    ]
    for nodes, expected in cases:
        done = run_quickly("-m", "workers.node_api", "--config", str(api_config(tmp_path, nodes)))
        assert done.returncode == 2, (nodes, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(expected), (expected, done.stderr)
    # The same through `virtengine-hpc nodes serve`.
    config = api_config(tmp_path, {"tls_cert_file": str(missing), "tls_key_file": key})
    done = run_quickly("-m", "virtengine_hpc", "--config", str(config), "nodes", "serve")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"error: nodes.tls_cert_file: cannot read server certificate {missing}" in done.stderr


async def test_bad_tls_configuration_stops_the_agent_with_one_line(tmp_path: Path, pki: PKI) -> None:
    provider = Provider(tmp_path, "127.0.0.1:1")  # never started: the agent fails before it sends anything
    provider.tls = True
    missing = tmp_path / "missing.pem"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    cert, key = pki.node
    encrypted = tmp_path / "encrypted.key"
    from cryptography.hazmat.primitives import serialization

    loaded = serialization.load_pem_private_key(key.read_bytes(), password=None)
    encrypted.write_bytes(
        loaded.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    encrypted.chmod(0o600)
    cases: list[tuple[dict[str, str], str]] = [
        (
            {"client-cert-file": str(cert)},
            "error: invalid hpc-node-agent configuration: client-cert-file and client-key-file go together",
        ),
        (
            {"ca-file": str(pki.api.ca_cert), "provider-daemon-url": "http://127.0.0.1:8081"},
            "error: invalid hpc-node-agent configuration: ca-file needs an https:// provider-daemon-url",
        ),
        (
            {"ca-file": str(missing)},
            f"error: ca-file: cannot read CA bundle {missing}: No such file or directory",
        ),
        ({"ca-file": str(garbage)}, f"error: ca-file: {garbage} holds no usable certificate (CA bundle)"),
        (
            {"client-cert-file": str(cert), "client-key-file": str(pki.other.server_key)},
            f"error: client-cert-file {cert} and client-key-file {pki.other.server_key} are not a usable "
            "certificate and key: KEY_VALUES_MISMATCH",
        ),
        (
            {"client-cert-file": str(cert), "client-key-file": str(encrypted)},
            f"error: client-key-file: private key {encrypted} is encrypted",
        ),
    ]
    for index, (settings, expected) in enumerate(cases):
        agent = Agent(tmp_path, f"node-bad-{index}", provider, **settings)
        await agent.init()
        done = await agent.run("register", "--config", str(agent.config_path))
        assert done.returncode == 2, (settings, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(expected), (expected, done.stderr)


# ---- the contexts themselves ---------------------------------------------------------------------------------


def test_client_contexts_always_verify_and_server_contexts_require_client_certificates(pki: PKI) -> None:
    for context in (
        client_context(None, None, None),
        client_context(pki.api.ca_cert, None, None),
        client_context(pki.api.ca_cert, *pki.node),
    ):
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    # Only the configured bundle is trusted, not the system's roots besides it.
    assert len(client_context(pki.api.ca_cert, None, None).get_ca_certs()) == 1
    plain = server_context(pki.api.server_cert, pki.api.server_key, None)
    assert plain.verify_mode == ssl.CERT_NONE
    mutual = server_context(pki.api.server_cert, pki.api.server_key, pki.clients.ca_cert)
    assert mutual.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match="tls_key_file: cannot read private key"):
        server_context(pki.api.server_cert, pki.api.server_key.with_name("nope"), None)
