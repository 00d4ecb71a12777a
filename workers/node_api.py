"""The provider's node API: node registration and signed heartbeats (FastAPI, served by uvicorn).

``POST /api/v1/hpc/nodes/register`` and ``POST /api/v1/hpc/nodes/{node_id}/heartbeat`` (docs/node-agent.md).
Each request is checked in this order, and the first failure answers and writes a security audit record:

1. size (413) and shape: plain JSON without floats or duplicate keys (docs/node-agent.md, "Canonical
   form"), then the schema (422);
2. the node's key was allowed by the provider and not revoked (401 ``unknown_node`` / ``key_revoked``), a
   registration carries that very key (401 ``key_mismatch``), the document names this provider (401
   ``wrong_provider``);
3. the Ed25519 signature over the canonical form of the JSON *as received* (401 ``signature_invalid``);
4. the timestamp within ``nodes.max_clock_skew`` of the provider's clock (401 ``clock_skew``);
5. heartbeats only: the node registered (401 ``not_registered``) and its sequence is larger than every one
   accepted before, as persisted in the ledger (409 ``sequence_replayed`` with ``last_sequence``).

An accepted heartbeat is forwarded to the node's ``NodeWorkflow`` by signal-with-start (503 if Temporal cannot
be reached; the sequence stays consumed and the agent's next one is larger). Rejections are audited once per
``nodes.audit_rate_window`` for each peer address and reason, with a count of the suppressed ones: a flood of
forged requests, whatever node and cluster ids it makes up, writes a bounded number of records per sender
(IPv6 senders counted per /64, the block one host usually holds).

Run it with ``virtengine-hpc nodes serve`` or ``python -m workers.node_api`` (127.0.0.1:8081 by default; HTTPS
with ``nodes.tls_cert_file``/``tls_key_file``, mutual TLS with ``nodes.tls_client_ca_file``).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import ssl
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.audit import AuditLog
from activities.chain.node_ledger import NodeLedger
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config, NodesConfig, Secrets, load_config
from virtengine_hpc.errors import HPCError, SecurityError, ValidationError
from virtengine_hpc.models import Identifier
from virtengine_hpc.node.heartbeat import (
    HEARTBEAT_DOMAIN,
    REGISTRATION_DOMAIN,
    APIError,
    HeartbeatAck,
    RegistrationAck,
    SignedHeartbeat,
    SignedRegistration,
    parse_signed_json,
    signature_valid,
)
from virtengine_hpc.node.lifecycle import (
    NODE_WORKFLOW_NAME,
    NodeBeat,
    NodeRegistered,
    NodeSettings,
    NodeWorkflowInput,
    legacy_workflow_id,
    workflow_id,
)
from virtengine_hpc.signing import public_key_from_b64

log = logging.getLogger("virtengine_hpc.node_api")
_IDENTIFIER: TypeAdapter[str] = TypeAdapter(Identifier)


def _identifier(value: object) -> str | None:
    """``value`` if it is a valid id (safe to put in an audit record), else ``None``."""
    if not isinstance(value, str):
        return None
    try:
        return _IDENTIFIER.validate_python(value)
    except PydanticValidationError:
        return None


REGISTER_PATH = "/api/v1/hpc/nodes/register"
HEARTBEAT_PATH = "/api/v1/hpc/nodes/{node_id}/heartbeat"


class Forwarder(Protocol):
    async def heartbeat(self, cluster_id: str, node_id: str, beat: NodeBeat) -> None: ...

    async def registered(self, cluster_id: str, node_id: str, registration: NodeRegistered) -> None: ...


def node_settings(nodes: NodesConfig) -> NodeSettings:
    return NodeSettings(
        stale_after=nodes.stale_after,
        offline_after=nodes.offline_after,
        metadata_interval=nodes.metadata_interval,
        drain_poll_interval=nodes.drain_poll_interval,
    )


async def running_node_workflow(client: Client, cluster_id: str, node_id: str) -> str | None:
    """The id of the node's running ``NodeWorkflow``: under ``workflow_id``, else under the id workflows had
    before (``legacy_workflow_id``, kept by one started then); ``None`` when neither runs. A workflow of another
    type under the old id (a chain job named like it) is not the node's."""
    for wf_id in (workflow_id(cluster_id, node_id), legacy_workflow_id(cluster_id, node_id)):
        try:
            description = await client.get_workflow_handle(wf_id).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                raise
            continue
        if (
            description.status == WorkflowExecutionStatus.RUNNING
            and description.workflow_type == NODE_WORKFLOW_NAME
        ):
            return wf_id
    return None


class TemporalForwarder:
    """Delivers to the node's ``NodeWorkflow``: plain signals to one this process has seen running, else
    signal-with-start under ``workflow_id`` unless one runs already (``running_node_workflow``).

    A plain signal costs the server about 2.5x less than signal-with-start (docs/benchmarks.md); it is tried
    first for a workflow this process has seen running, and a ``NOT_FOUND`` (the workflow ended) falls back to
    the lookup. A workflow started by an earlier version under the old id keeps receiving the node's signals:
    starting a second lifecycle beside it would have two workflows drain and resume the same node.
    """

    def __init__(
        self, client: Client, *, task_queue_for: Callable[[str], str], settings: NodeSettings
    ) -> None:
        self.client = client
        self.task_queue_for = task_queue_for
        self.settings = settings
        self._running: dict[tuple[str, str], str] = {}

    async def _signal(self, cluster_id: str, node_id: str, name: str, arg: BaseModel) -> None:
        from workflows.node import NodeWorkflow

        key = (cluster_id, node_id)
        wf_id = self._running.get(key) or await running_node_workflow(self.client, cluster_id, node_id)
        if wf_id is not None:
            try:
                await self.client.get_workflow_handle(wf_id).signal(name, arg)
                self._running[key] = wf_id
                return
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
                self._running.pop(key, None)
        wf_id = workflow_id(cluster_id, node_id)
        await self.client.start_workflow(
            NodeWorkflow.run,
            NodeWorkflowInput(cluster_id=cluster_id, node_id=node_id, settings=self.settings),
            id=wf_id,
            task_queue=self.task_queue_for(cluster_id),
            start_signal=name,
            start_signal_args=[arg],
        )
        self._running[key] = wf_id

    async def heartbeat(self, cluster_id: str, node_id: str, beat: NodeBeat) -> None:
        await self._signal(cluster_id, node_id, "heartbeat", beat)

    async def registered(self, cluster_id: str, node_id: str, registration: NodeRegistered) -> None:
        await self._signal(cluster_id, node_id, "registered", registration)


class AuditRateLimiter:
    """Lets one record per key through per window; counts the rest so the next record can say how many."""

    def __init__(self, window: float, max_keys: int = 10_000) -> None:
        self.window = window
        self.max_keys = max_keys
        self._seen: OrderedDict[tuple[str, ...], tuple[float, int]] = OrderedDict()

    def admit(self, key: tuple[str, ...]) -> int | None:
        """``None`` to suppress, else the number suppressed since the last admitted record."""
        now = time.monotonic()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.window:
            self._seen[key] = (last[0], last[1] + 1)
            return None
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return last[1] if last else 0


def peer_key(remote: str) -> str:
    """The sender a rejection is counted against: its IPv4 address, or the /64 of its IPv6 address."""
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return remote[:64]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class Rejected(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, severity: int, last_sequence: int | None = None
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.severity = severity
        self.last_sequence = last_sequence


def _summarize(exc: PydanticValidationError) -> str:
    parts = []
    for item in exc.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


class NodeAPI:
    """The checks behind the endpoints, independent of the HTTP framework."""

    def __init__(
        self,
        ledger: NodeLedger,
        audit: AuditLog,
        forwarder: Forwarder,
        *,
        provider_address: str,
        settings: NodesConfig,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.ledger = ledger
        self.audit = audit
        self.forwarder = forwarder
        self.provider_address = provider_address
        self.settings = settings
        self.clock = clock
        self.limiter = AuditRateLimiter(settings.audit_rate_window.total_seconds())
        self.accepted = 0

    async def _audit_rejection(
        self, event: AuditEvent, rejected: Rejected, cluster_id: str | None, node_id: str | None, remote: str
    ) -> None:
        # Keyed by who sent it, never by the ids in the request: a forger chooses those freely.
        suppressed = self.limiter.admit((event, rejected.code, peer_key(remote)))
        if suppressed is None:
            return
        details: dict[str, Any] = {"node_id": node_id, "reason": rejected.code, "remote": remote}
        if suppressed:
            details["suppressed_since_last"] = suppressed
        await asyncio.to_thread(
            self.audit.record,
            event,
            cluster_id=cluster_id,
            success=False,
            severity=rejected.severity,
            error_msg=rejected.message[:500],
            details=details,
        )

    def _parse(self, raw: bytes) -> dict[str, Any]:
        if len(raw) > self.settings.max_body_bytes:
            raise Rejected(
                413, "body_too_large", f"body exceeds {self.settings.max_body_bytes} bytes", severity=2
            )
        try:
            return parse_signed_json(raw)
        except ValidationError as exc:
            raise Rejected(422, "malformed", str(exc), severity=2) from None

    def _check_fresh(self, timestamp: datetime) -> None:
        skew = abs(self.clock() - timestamp)
        if skew > self.settings.max_clock_skew:
            raise Rejected(
                401,
                "clock_skew",
                f"timestamp is {skew.total_seconds():.0f} s from the provider's clock "
                f"(allowed {self.settings.max_clock_skew.total_seconds():.0f} s)",
                severity=3,
            )

    def _check_signature(self, data: dict[str, Any], domain: str, key_b64: str) -> None:
        try:
            key = public_key_from_b64(key_b64)
        except SecurityError as exc:
            raise Rejected(401, "key_invalid", str(exc), severity=4) from None
        if not signature_valid(data, domain, key):
            raise Rejected(
                401, "signature_invalid", "signature does not verify with the allowed key", severity=5
            )

    def _check_provider(self, address: str) -> None:
        if address != self.provider_address:
            raise Rejected(401, "wrong_provider", f"this provider is {self.provider_address}", severity=3)

    @staticmethod
    def _ids(data: dict[str, Any]) -> tuple[str | None, str | None]:
        return _identifier(data.get("cluster_id")), _identifier(data.get("node_id"))

    async def register(self, raw: bytes, remote: str) -> tuple[int, BaseModel]:
        cluster_id = node_id = None
        try:
            data = self._parse(raw)
            cluster_id, node_id = self._ids(data)
            try:
                body = SignedRegistration.model_validate(data)
            except PydanticValidationError as exc:
                raise Rejected(422, "malformed", _summarize(exc), severity=2) from None
            allowed = await asyncio.to_thread(self.ledger.allowed, body.cluster_id, body.node_id)
            if allowed is None:
                raise Rejected(401, "unknown_node", "the provider has not allowed this node", severity=4)
            if not allowed.active:
                raise Rejected(401, "key_revoked", "this node was deregistered; ask the provider", severity=4)
            if allowed.public_key != body.public_key:
                raise Rejected(401, "key_mismatch", "this is not the key the provider allowed", severity=5)
            self._check_provider(body.provider_address)
            self._check_signature(data, REGISTRATION_DOMAIN, allowed.public_key)
            self._check_fresh(body.timestamp)
        except Rejected as rejected:
            await self._audit_rejection(
                AuditEvent.NODE_REGISTRATION_REJECTED, rejected, cluster_id, node_id, remote
            )
            return rejected.status, _error(rejected)
        row = await asyncio.to_thread(
            self.ledger.register,
            body.cluster_id,
            body.node_id,
            public_key_b64=body.public_key,
            hostname=body.hostname,
            agent_version=body.agent_version,
            capacity=body.capacity,
            placement=body.placement,
        )
        try:
            await self.forwarder.registered(
                body.cluster_id,
                body.node_id,
                NodeRegistered(registered_at=self.clock(), hostname=body.hostname),
            )
        except Exception as exc:  # Temporal unreachable: the agent retries its registration
            log.warning("cannot start the workflow of node %s: %s", body.node_id, exc)
            return 503, APIError(error="unavailable", message="node lifecycle service unavailable; retry")
        await asyncio.to_thread(
            self.audit.record,
            AuditEvent.NODE_REGISTERED,
            cluster_id=body.cluster_id,
            details={"node_id": body.node_id, "hostname": body.hostname, "remote": remote},
        )
        return 200, RegistrationAck(
            node_id=body.node_id,
            cluster_id=body.cluster_id,
            state=row.state.value,
            last_sequence=row.last_sequence,
            server_time=self.clock(),
        )

    async def heartbeat(
        self, path_node_id: str, raw: bytes, headers: dict[str, str], remote: str
    ) -> tuple[int, BaseModel]:
        cluster_id: str | None = None
        node_id = _identifier(path_node_id)
        try:
            data = self._parse(raw)
            cluster_id, node_id = self._ids(data)
            try:
                body = SignedHeartbeat.model_validate(data)
            except PydanticValidationError as exc:
                raise Rejected(422, "malformed", _summarize(exc), severity=2) from None
            for where, value in (
                ("path", path_node_id),
                ("X-Node-ID", headers.get("x-node-id", body.node_id)),
            ):
                if value != body.node_id:
                    raise Rejected(422, "malformed", f"{where} names another node than the body", severity=3)
            if headers.get("x-cluster-id", body.cluster_id) != body.cluster_id:
                raise Rejected(
                    422, "malformed", "X-Cluster-ID names another cluster than the body", severity=3
                )
            auth = await asyncio.to_thread(self.ledger.heartbeat_auth, body.cluster_id, body.node_id)
            if auth is None:
                raise Rejected(401, "unknown_node", "the provider has not allowed this node", severity=4)
            if auth.revoked:
                raise Rejected(401, "key_revoked", "this node was deregistered", severity=4)
            self._check_provider(body.provider_address)
            self._check_signature(data, HEARTBEAT_DOMAIN, auth.public_key)
            self._check_fresh(body.timestamp)
            if not auth.registered:
                raise Rejected(401, "not_registered", "register before sending heartbeats", severity=2)
            received = self.clock()
            outcome = await asyncio.to_thread(
                self.ledger.accept_sequence, body.cluster_id, body.node_id, body.sequence_number, received
            )
            if not outcome.accepted:
                raise Rejected(
                    409,
                    "sequence_replayed",
                    f"sequence {body.sequence_number} is not above {outcome.last_sequence}",
                    severity=4,
                    last_sequence=outcome.last_sequence,
                )
        except Rejected as rejected:
            await self._audit_rejection(AuditEvent.HEARTBEAT_REJECTED, rejected, cluster_id, node_id, remote)
            return rejected.status, _error(rejected)
        beat = NodeBeat(
            sequence_number=body.sequence_number,
            sent_at=body.timestamp,
            received_at=received,
            capacity=body.capacity,
            health=body.health,
            placement=body.placement,
            latency=body.latency,
        )
        try:
            await self.forwarder.heartbeat(body.cluster_id, body.node_id, beat)
        except Exception as exc:
            log.warning("cannot forward heartbeat of node %s: %s", body.node_id, exc)
            return 503, APIError(error="unavailable", message="node lifecycle service unavailable; retry")
        self.accepted += 1
        return 200, HeartbeatAck(
            sequence_number=body.sequence_number,
            state=outcome.state.value if outcome.state else None,
            server_time=received,
        )


def _error(rejected: Rejected) -> APIError:
    return APIError(error=rejected.code, message=rejected.message, last_sequence=rejected.last_sequence)


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": APIError, "description": "Unknown or revoked node, bad signature, clock skew."},
    413: {"model": APIError, "description": "Body too large."},
    422: {"model": APIError, "description": "Malformed body."},
    503: {"model": APIError, "description": "The node lifecycle service (Temporal) is unreachable."},
}


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def create_app(api: NodeAPI) -> FastAPI:
    app = FastAPI(
        title="VirtEngine HPC node API",
        version="1",
        description="Registration and signed heartbeats of hpc-node-agent (docs/node-agent.md).",
    )

    async def read_body(request: Request) -> bytes:
        """The body, but never more than one byte past the limit (``_parse`` then answers 413)."""
        limit = api.settings.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                break
        return b"".join(chunks)[: limit + 1]

    def respond(status: int, model: BaseModel) -> JSONResponse:
        return JSONResponse(model.model_dump(mode="json", exclude_none=True), status_code=status)

    @app.post(
        REGISTER_PATH,
        response_model=RegistrationAck,
        responses=_ERRORS,
        openapi_extra=_body(SignedRegistration),
        summary="Register a node whose key the provider allowed",
    )
    async def register(request: Request) -> JSONResponse:
        remote = request.client.host if request.client else ""
        return respond(*await api.register(await read_body(request), remote))

    @app.post(
        HEARTBEAT_PATH,
        response_model=HeartbeatAck,
        responses={
            **_ERRORS,
            409: {"model": APIError, "description": "Sequence not above the last accepted."},
        },
        openapi_extra=_body(SignedHeartbeat),
        summary="A signed, sequence-numbered heartbeat",
    )
    async def heartbeat(node_id: str, request: Request) -> JSONResponse:
        remote = request.client.host if request.client else ""
        headers = {
            k.lower(): v for k, v in request.headers.items() if k.lower() in ("x-node-id", "x-cluster-id")
        }
        return respond(*await api.heartbeat(node_id, await read_body(request), headers, remote))

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (SignedHeartbeat, SignedRegistration):
            generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(generated.pop("$defs", {}))
            components[model.__name__] = generated
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def build_api(config: Config, client: Client) -> NodeAPI:
    from workers.wiring import anchor_signer, task_queue

    return NodeAPI(
        NodeLedger(config.ledger_path),
        AuditLog(config.hpc.audit, anchor_signer=anchor_signer(Secrets.from_env())),
        TemporalForwarder(
            client,
            task_queue_for=lambda cluster: task_queue(config, cluster),
            settings=node_settings(config.nodes),
        ),
        provider_address=config.provider.address,
        settings=config.nodes,
    )


def _with_probes(config: Config, api: NodeAPI, client: Client) -> FastAPI:
    """The app plus ``/readyz`` (Temporal and the node ledger answer) and ``/metrics`` (heartbeats and
    registrations by outcome and reason), for systemd/Kubernetes probes and Prometheus (docs/production.md)."""
    from virtengine_hpc.logging import setup_logging
    from workers.metrics import WorkerMetrics, add_node_api_endpoints, instrument_node_api

    if config.logging.format == "json" or config.logging.level:
        setup_logging(config.logging.format, config.logging.level, static={"role": "node_api"})
    metrics = WorkerMetrics()
    instrument_node_api(api, metrics)
    app = create_app(api)

    async def temporal() -> None:
        if not await client.service_client.check_health(timeout=config.metrics.readiness_timeout):
            raise HPCError("Temporal answers but its workflow service is not serving")

    async def ledger() -> None:
        await asyncio.to_thread(api.ledger.list_allowed, "-")

    add_node_api_endpoints(app, metrics, {"temporal": temporal, "ledger": ledger})
    return app


def server_tls(nodes: NodesConfig) -> dict[str, Any]:
    """uvicorn's TLS arguments from ``nodes.tls_*`` (none: plain HTTP).

    The files are loaded here first, into the same kind of context uvicorn builds, so that a missing,
    unreadable or mismatched file stops the process with a ``ConfigError`` naming the key before it connects
    to Temporal, instead of a traceback from inside the server. With ``tls_client_ca_file`` every client must
    present a certificate signed by that CA (mutual TLS).
    """
    if nodes.tls_cert_file is None or nodes.tls_key_file is None:
        return {}
    from virtengine_hpc.tls import server_context

    server_context(
        nodes.tls_cert_file,
        nodes.tls_key_file,
        nodes.tls_client_ca_file,
        labels=("nodes.tls_cert_file", "nodes.tls_key_file", "nodes.tls_client_ca_file"),
    )
    options: dict[str, Any] = {
        "ssl_certfile": str(nodes.tls_cert_file),
        "ssl_keyfile": str(nodes.tls_key_file),
    }
    if nodes.tls_client_ca_file is not None:
        options["ssl_ca_certs"] = str(nodes.tls_client_ca_file)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options


async def serve(config: Config, *, host: str | None = None, port: int | None = None) -> None:
    import uvicorn

    from workers.wiring import connect

    tls = server_tls(config.nodes)
    client = await connect(config)
    api = build_api(config, client)
    host = host or config.nodes.listen_host
    port = port or config.nodes.listen_port
    server = uvicorn.Server(
        uvicorn.Config(
            _with_probes(config, api, client),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            **tls,
        )
    )
    mode = config.nodes.tls
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    api.audit.record(
        AuditEvent.SERVICE_STARTED,
        details={"service": "node_api", "listen": f"{host}:{port}", "url": url, "tls": mode},
    )
    if mode == "mutual":
        log.info(
            "node API listening on %s (mutual TLS: clients need a certificate from %s)",
            url,
            config.nodes.tls_client_ca_file,
        )
    else:
        log.info("node API listening on %s", url)
    try:
        await server.serve()
    finally:
        api.audit.record(
            AuditEvent.SERVICE_STOPPED, details={"service": "node_api", "accepted": api.accepted}
        )
        api.ledger.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.node_api", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", metavar="FILE", default=os.environ.get("VIRTENGINE_HPC_CONFIG"))
    parser.add_argument("--host", help="bind address (default nodes.listen_host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default nodes.listen_port, 8081)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(load_config(args.config), host=args.host, port=args.port))
    except HPCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    from virtengine_hpc.cli.common import exit_process

    exit_process(main)
