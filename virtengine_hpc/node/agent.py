"""The agent's runtime: register, then one signed heartbeat every ``heartbeat-interval``.

Ticks follow a fixed schedule (no drift from the time a heartbeat takes). A provider that is down costs a
logged warning and nothing else; answers steer the agent: ``401 not_registered`` makes it register again,
any other ``401`` is logged (the provider revoked or re-keyed the node), and so is ``409 sequence_replayed``:
answers are not signed, so the agent never takes a sequence number from one (a forged ``last_sequence`` of
2^63 - 1 would otherwise end the node's heartbeats for good); its own numbers never fall below its clock
(``node/sequence.py``), which is how an agent that lost its sequence file is accepted again. The last result is
written to ``<key-file>.status.json`` for ``hpc-node-agent status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import time
from datetime import UTC, datetime
from typing import Any

import httpx

from virtengine_hpc.errors import HPCError
from virtengine_hpc.node.config import NodeAgentConfig
from virtengine_hpc.node.heartbeat import (
    AGENT_VERSION,
    HEARTBEAT_DOMAIN,
    REGISTRATION_DOMAIN,
    HeartbeatBody,
    RegistrationBody,
    sign_document,
)
from virtengine_hpc.node.latency import probe_all
from virtengine_hpc.node.metrics import MetricsCollector
from virtengine_hpc.node.sequence import SequenceStore
from virtengine_hpc.signing import Signer, public_key_b64

log = logging.getLogger("hpc-node-agent")
REGISTER_PATH = "/api/v1/hpc/nodes/register"


def heartbeat_path(node_id: str) -> str:
    return f"/api/v1/hpc/nodes/{node_id}/heartbeat"


class ProviderRefused(HPCError):
    """The provider answered with an error (its reason code is ``code``) or could not be reached."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        transient: bool,
        status: int | None = None,
        last_sequence: int | None = None,
    ) -> None:
        super().__init__(message, code=code, transient=transient)
        self.status = status
        self.last_sequence = last_sequence


def tls_verify(config: NodeAgentConfig) -> ssl.SSLContext | bool:
    """What the HTTP client verifies the node API with: for an ``https://`` URL a context from ``ca-file``
    (default: the system's CAs) holding the client certificate when one is configured; the certificate chain
    and host name are always checked. ``ConfigError`` naming the key when a file cannot be used."""
    if not config.uses_tls:
        return True
    from virtengine_hpc.tls import client_context

    return client_context(config.ca_file, config.client_cert_file, config.client_key_file)


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def describe_failure(exc: httpx.HTTPError, config: NodeAgentConfig) -> str:
    """Why a request got no answer. A TLS failure says so, with OpenSSL's reason and the keys that fix it."""
    chain = _causes(exc)
    tls = next((e for e in chain if isinstance(e, ssl.SSLError)), None)
    if isinstance(tls, ssl.SSLCertVerificationError):
        reason = (tls.verify_message or tls.reason or "certificate verify failed").rstrip(".")
        trusted = f"ca-file {config.ca_file}" if config.ca_file else "the system's CAs (ca-file is unset)"
        return (
            f"TLS: the node API's certificate was refused: {reason} (verified against {trusted}; it must chain "
            f"to that CA and name the host of {config.provider_daemon_url})"
        )
    if tls is not None:
        reason = str(tls.reason or tls)
        if "CERTIFICATE_REQUIRED" in reason:
            hint = "the node API requires a client certificate: set client-cert-file and client-key-file"
        elif any(word in reason for word in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN")):
            hint = f"the node API refused the client certificate {config.client_cert_file}"
        elif "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER_FAILURE" in reason:
            hint = "the node API does not answer in TLS; does it serve HTTPS (nodes.tls_cert_file)?"
        else:
            hint = "handshake failed"
        return f"TLS: {hint} ({reason})"
    cause = chain[-1]
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else repr(cause)
    detail = str(exc).rstrip(".") or f"{type(exc).__name__} ({reason})"
    if config.uses_tls and isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError):
        # A TLS 1.3 server checks the client's certificate after the client's side of the handshake is done:
        # a refused (or missing) one shows up as the connection being closed before any answer.
        if config.client_cert_file is None:
            why = "it may require a client certificate (mutual TLS): set client-cert-file and client-key-file"
        else:
            why = (
                f"it may have refused the client certificate {config.client_cert_file} (not signed by the CA in "
                "its nodes.tls_client_ca_file, or not for client authentication)"
            )
        return f"TLS: the node API closed the connection without an answer: {detail}; {why}"
    if not config.uses_tls and isinstance(exc, httpx.RemoteProtocolError):
        return f"{detail} (if the node API serves HTTPS, provider-daemon-url must start with https://)"
    return detail


class NodeAgent:
    def __init__(
        self,
        config: NodeAgentConfig,
        signer: Signer,
        *,
        sequence: SequenceStore | None = None,
        collector: MetricsCollector | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        config.require("node-id", "cluster-id", "provider-address", "provider-daemon-url")
        self.config = config
        self.signer = signer
        self.sequence = sequence
        self.collector = collector or MetricsCollector(config.storage_path)
        self.http = http or httpx.AsyncClient(
            base_url=str(config.provider_daemon_url), timeout=httpx.Timeout(10.0), verify=tls_verify(config)
        )
        self.registered = False

    async def close(self) -> None:
        await self.http.aclose()

    def _headers(self) -> dict[str, str]:
        return {"X-Node-ID": str(self.config.node_id), "X-Cluster-ID": str(self.config.cluster_id)}

    async def register(self) -> dict[str, Any]:
        capacity, _ = await asyncio.to_thread(self.collector.collect)
        body = RegistrationBody(
            node_id=str(self.config.node_id),
            cluster_id=str(self.config.cluster_id),
            provider_address=str(self.config.provider_address),
            public_key=public_key_b64(self.signer.public_key),
            timestamp=datetime.now(UTC),
            agent_version=AGENT_VERSION,
            hostname=(socket.gethostname() or "unknown")[:253],
            capacity=capacity,
            placement=self.config.placement,
        )
        answer = await self._post(REGISTER_PATH, sign_document(body, REGISTRATION_DOMAIN, self.signer))
        self.registered = True
        log.info("registered node %s in cluster %s", self.config.node_id, self.config.cluster_id)
        return answer

    async def build_heartbeat(self, sequence_number: int) -> dict[str, Any]:
        capacity, health = await asyncio.to_thread(self.collector.collect)
        latency = await probe_all(list(self.config.latency_targets))
        body = HeartbeatBody(
            node_id=str(self.config.node_id),
            cluster_id=str(self.config.cluster_id),
            provider_address=str(self.config.provider_address),
            sequence_number=sequence_number,
            timestamp=datetime.now(UTC),
            agent_version=AGENT_VERSION,
            capacity=capacity,
            health=health,
            placement=self.config.placement,
            latency=latency,
        )
        return sign_document(body, HEARTBEAT_DOMAIN, self.signer)

    async def heartbeat(self) -> dict[str, Any]:
        """Send one heartbeat. A replay answer is reported, never followed: its ``last_sequence`` is unsigned."""
        assert self.sequence is not None, "heartbeats need the persisted sequence"
        sent = self.sequence.next()
        document = await self.build_heartbeat(sent)
        try:
            return await self._post(heartbeat_path(str(self.config.node_id)), document)
        except ProviderRefused as exc:
            if exc.code == "sequence_replayed":
                raise ProviderRefused(
                    f"{exc}; this agent sent {sent} and does not take a sequence from an unsigned answer: its next "
                    "numbers follow its clock (if the clock went back, heartbeats are accepted again once it "
                    "passes the time of the last accepted one, or write a larger number into the sequence file)",
                    code=exc.code,
                    transient=exc.transient,
                    status=exc.status,
                    last_sequence=exc.last_sequence,
                ) from None
            raise

    async def _post(self, path: str, document: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self.http.post(path, json=document, headers=self._headers())
        except httpx.HTTPError as exc:
            reason = describe_failure(exc, self.config)
            # A TLS failure is logged as an error (a certificate to fix), the API being down as a warning;
            # the agent goes on trying either way.
            raise ProviderRefused(
                f"provider unreachable: {reason}", code="unreachable", transient=not reason.startswith("TLS:")
            ) from None
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.status_code >= 400:
            code = str(answer.get("error", f"http_{response.status_code}"))
            last = answer.get("last_sequence")
            raise ProviderRefused(
                f"provider refused ({response.status_code} {code}): "
                f"{answer.get('message', response.text[:200])}",
                code=code,
                transient=response.status_code >= 500,
                status=response.status_code,
                last_sequence=last if isinstance(last, int) else None,
            )
        return answer if isinstance(answer, dict) else {}

    def _record(self, result: dict[str, Any]) -> None:
        path = self.config.status_file
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(result, handle, indent=2, default=str)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    async def tick(self) -> dict[str, Any]:
        """One round: register if needed, send a heartbeat, record the outcome."""
        result: dict[str, Any] = {"at": datetime.now(UTC).isoformat()}
        try:
            if not self.registered:
                await self.register()
            answer = await self.heartbeat()
            result.update(ok=True, sequence_number=answer.get("sequence_number"), state=answer.get("state"))
        except ProviderRefused as exc:
            result.update(ok=False, error=exc.code, message=str(exc), sequence_number=self.sequence_value())
            if exc.code in ("not_registered", "unknown_node"):
                self.registered = False
            (log.warning if exc.transient else log.error)("%s", exc)
        self._record(result)
        return result

    def sequence_value(self) -> int | None:
        return self.sequence.current if self.sequence else None

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.config.heartbeat_interval.total_seconds()
        next_at = time.monotonic()
        while not stop.is_set():
            await self.tick()
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # a slow round: skip the missed ticks rather than burst
                next_at = time.monotonic()
                delay = 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
