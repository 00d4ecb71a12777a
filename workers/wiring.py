"""Builds the real dependencies of a worker from its config: Temporal client, chain, adapters, signer, audit.

The only place that turns configuration into live objects; activities receive them ready-made.
A worker may serve several clusters (``hpc.clusters``): it gets one adapter per served cluster, and routing knows
every cluster of the provider, so a job can be routed to a cluster whose task queue another worker runs.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from temporalio.client import Client, Interceptor
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from activities.jobs import BodyResolver, JobActivities, script_only_body
from activities.routing import CapacityProbe, RoutingEnforcer
from activities.schedulers.base import SchedulerAdapter
from activities.schedulers.registry import adapter_class
from virtengine_hpc.config import Config, Secrets, TemporalConfig
from virtengine_hpc.errors import ConfigError, HPCError, SecurityError
from virtengine_hpc.messages import JobSettings, RetrySettings
from virtengine_hpc.signing import Signer
from virtengine_hpc.tls import read_pem

if TYPE_CHECKING:
    from workers.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class TemporalUnavailable(HPCError):
    """Temporal cannot be reached, or refused the connection (address, TLS, certificates, API key)."""

    code = "temporal_unavailable"
    transient = True


def task_queue(config: Config, cluster_id: str | None = None) -> str:
    """One task queue per cluster, so a cluster's activities run on workers that can reach its scheduler."""
    return f"{config.temporal.task_queue}.{cluster_id or config.hpc.cluster_id}"


def task_queues(config: Config) -> dict[str, str]:
    """The task queue of every cluster of the provider (served here or by other workers)."""
    return {cluster_id: task_queue(config, cluster_id) for cluster_id in config.cluster_ids()}


def job_settings(config: Config, cluster_id: str | None = None) -> JobSettings:
    """What a job workflow of ``cluster_id`` (default ``hpc.cluster_id``) needs from the config."""
    hpc = config.for_cluster(cluster_id).hpc if cluster_id else config.hpc
    return JobSettings(
        poll_interval_seconds=hpc.scheduler_poll_interval.total_seconds(),
        report_interval_seconds=hpc.usage_reporting.report_interval.total_seconds(),
        usage_enabled=hpc.usage_reporting.enabled,
        retry_on_failure=hpc.usage_reporting.retry_on_failure,
        job_timeout_default_seconds=hpc.job_service.job_timeout_default.total_seconds(),
        max_queue_wait_seconds=(
            hpc.job_service.max_queue_wait.total_seconds() if hpc.job_service.max_queue_wait else None
        ),
        walltime_grace_seconds=hpc.job_service.walltime_grace.total_seconds(),
        vanished_grace_seconds=hpc.job_service.vanished_job_grace.total_seconds(),
        continue_as_new_after_events=hpc.job_service.continue_as_new_after_events,
        heartbeat_timeout_seconds=hpc.job_service.activity_heartbeat_timeout.total_seconds(),
        cluster_monitor=hpc.job_service.cluster_monitor,
        retry=RetrySettings(
            max_retries=hpc.retry.max_retries,
            initial_backoff_seconds=hpc.retry.initial_backoff.total_seconds(),
            max_backoff_seconds=hpc.retry.max_backoff.total_seconds(),
            backoff_multiplier=hpc.retry.backoff_multiplier,
        ),
        task_queues=task_queues(config),
    )


def tls_config(t: TemporalConfig) -> TLSConfig | bool:
    """The SDK's TLS settings from ``temporal.tls*``; ``False`` for plaintext (a local dev server).

    Certificates are read once here, so a missing or unreadable file is a ``ConfigError`` naming the key, not a
    handshake failure later. Without ``tls_server_ca_cert`` the system's roots verify the server.
    """
    if not t.uses_tls:
        return False
    return TLSConfig(
        server_root_ca_cert=read_pem(t.tls_server_ca_cert, "temporal.tls_server_ca_cert", "CA certificate")
        if t.tls_server_ca_cert
        else None,
        client_cert=read_pem(t.tls_client_cert, "temporal.tls_client_cert", "client certificate")
        if t.tls_client_cert
        else None,
        client_private_key=read_pem(t.tls_client_key, "temporal.tls_client_key", "client key")
        if t.tls_client_key
        else None,
        domain=t.tls_server_name,
    )


def api_key(t: TemporalConfig, env: os._Environ[str] | dict[str, str] | None = None) -> str | None:
    """The API key from the variable ``temporal.api_key_env`` names; a named but empty variable is an error
    (a worker that silently connects without its key fails later with a confusing permission error)."""
    if not t.api_key_env:
        return None
    value = (os.environ if env is None else env).get(t.api_key_env, "").strip()
    if not value:
        raise ConfigError(
            f"temporal.api_key_env names {t.api_key_env}, but that environment variable is not set or empty"
        )
    return value


async def connect(
    config: Config,
    secrets: Secrets | None = None,
    *,
    runtime: Runtime | None = None,
    interceptors: Sequence[Interceptor] = (),
    identity: str | None = None,
) -> Client:
    """Connect to Temporal with the pydantic converter (every client: workers, poller, CLI, tests).

    ``temporal.address`` and ``namespace``, TLS or mutual TLS from certificate files, an API key from the
    environment (docs/production.md). Raises ``ConfigError`` for unusable settings and ``TemporalUnavailable``
    (with the address and the cause, never the key) when the server cannot be reached or refuses the handshake.
    """
    t = config.temporal
    tls = tls_config(t)
    key = api_key(t)
    try:
        return await Client.connect(
            t.address,
            namespace=t.namespace,
            tls=tls,
            api_key=key,
            data_converter=pydantic_data_converter,
            runtime=runtime,
            interceptors=interceptors,
            identity=identity,
        )
    except RuntimeError as exc:
        cause = str(exc).removeprefix("Failed client connect: ")
        if key:
            cause = cause.replace(key, "[api key]")
        mode = "mutual TLS" if t.tls_client_cert else "TLS" if tls else "plaintext"
        raise TemporalUnavailable(
            f"cannot connect to Temporal at {t.address} (namespace {t.namespace}, {mode}): {cause[:400]}"
        ) from None


async def missing_search_attributes(client: Client, namespace: str) -> list[str]:
    """The job workflow's search attributes the namespace lacks: without them the poller cannot start a job and
    ``status`` cannot count them. ``[]`` too when the server does not let this client list them."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.service import RPCError, RPCStatusCode

    from workflows.hpc_job import SEARCH_ATTRIBUTES

    try:
        answer = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
    except RPCError as exc:
        if exc.status in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED):
            return []
        raise
    have = set(answer.custom_attributes)
    return [key.name for key in SEARCH_ATTRIBUTES if key.name not in have]


def search_attribute_commands(namespace: str, names: Sequence[str]) -> str:
    return "; ".join(
        f"temporal operator search-attribute create --namespace {namespace} --name {name} --type Keyword"
        for name in names
    )


def tracing_interceptors(config: Config) -> list[Interceptor]:
    """The Temporal SDK's OpenTelemetry interceptor when ``tracing.enabled`` (the optional ``tracing`` extra).

    Spans cover workflow starts (poller, CLI), workflow runs, signals and queries, and every activity, with
    Temporal's trace context carried in headers across processes. With ``tracing.otlp_endpoint`` this process
    exports them over OTLP/HTTP; without it, spans go to the global tracer provider the process already has
    (set up by ``opentelemetry-instrument`` or by the embedding application).
    """
    tracing = config.tracing
    if not tracing.enabled:
        return []
    hint = "install the tracing extra: pip install 'virtengine-hpc[tracing]'"
    try:
        from opentelemetry import trace
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError as exc:
        raise ConfigError(f"tracing.enabled needs OpenTelemetry ({exc.name} is missing); {hint}") from None
    if tracing.otlp_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                f"tracing.otlp_endpoint needs the OpenTelemetry SDK and OTLP exporter ({exc.name} is missing); "
                f"{hint}"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": tracing.service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=tracing.otlp_endpoint)))
        trace.set_tracer_provider(provider)
    return [TracingInterceptor(trace.get_tracer(tracing.service_name))]


def open_chain(config: Config) -> ChainClient:
    from activities.chain.local_ledger import LocalLedger

    return LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)


def build_adapter(config: Config, secrets: Secrets, cluster_id: str | None = None) -> SchedulerAdapter:
    """The adapter of ``cluster_id`` (default ``hpc.cluster_id``), from that cluster's scheduler settings."""
    cluster_id = cluster_id or config.hpc.cluster_id
    config = config.for_cluster(cluster_id)
    kind = config.hpc.scheduler_type
    return adapter_class(kind).from_config(config, secrets, cluster_id)


def load_signer(secrets: Secrets) -> Signer:
    if secrets.provider_signing_key_path is None:
        raise SecurityError(
            "PROVIDER_SIGNING_KEY_PATH is not set: usage records must be signed with the provider's Ed25519 key "
            "(create one with `virtengine-hpc dev keygen PATH`)"
        )
    return Signer.from_file(secrets.provider_signing_key_path)


def anchor_signer(secrets: Secrets) -> Signer | None:
    """The key that signs the audit log's head in processes that need no key of their own (poller, node API):
    the provider's, when ``PROVIDER_SIGNING_KEY_PATH`` is set; else their lines wait for a worker's next anchor."""
    if secrets.provider_signing_key_path is None:
        log.warning("PROVIDER_SIGNING_KEY_PATH is not set: this process does not sign the audit log's head")
        return None
    try:
        return Signer.from_file(secrets.provider_signing_key_path)
    except SecurityError as exc:  # the worker, which needs the key, refuses to start; this process goes on
        log.warning("this process does not sign the audit log's head: %s", exc)
        return None


def body_resolver(chain: ChainClient | None = None, audit: AuditLog | None = None) -> BodyResolver:
    """The template resolver when templates are installed (with the chain: custom templates and price checks),
    else scripts only."""
    try:
        module = importlib.import_module("activities.templates")
    except ModuleNotFoundError:
        return script_only_body
    factory = getattr(module, "make_resolver", None)
    if factory is not None and chain is not None and audit is not None:
        made: BodyResolver = factory(chain, audit)
        return made
    resolver: BodyResolver = getattr(module, "resolve_body", script_only_body)
    return resolver


@dataclass
class WorkerDeps:
    config: Config
    chain: ChainClient
    audit: AuditLog
    signer: Signer
    adapters: dict[str, SchedulerAdapter]
    activities: JobActivities
    extra_activities: list[Callable[..., Any]] = field(default_factory=list)
    extra_workflows: list[type] = field(default_factory=list)
    metrics: WorkerMetrics | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def cluster_ids(self) -> list[str]:
        """The clusters this worker serves (one task queue each)."""
        return list(self.adapters)

    async def close(self) -> None:
        for adapter in self.adapters.values():
            await adapter.close()
        for close in self.closers:
            close()


def build_worker_deps(
    config: Config,
    secrets: Secrets,
    *,
    chain: ChainClient | None = None,
    adapters: dict[str, SchedulerAdapter] | None = None,
    capacity_probe: CapacityProbe | None = None,
    clusters: Sequence[str] | None = None,
    metrics: WorkerMetrics | None = None,
    nodes: bool = True,
    node_capacity: bool = False,
) -> WorkerDeps:
    """Everything a worker runs, for the clusters it serves.

    ``clusters`` (default: ``Config.served_cluster_ids``) chooses the served clusters, one adapter each; tests
    pass ``adapters`` instead. Routing may send a job to any cluster of the provider the config lists. With
    ``metrics``, audit events, scheduler calls and status queries are counted (``workers/metrics.py``). With
    ``nodes``, the worker also runs the node lifecycle (``NodeWorkflow``), whose signals the node API sends to
    the cluster's task queue; with ``node_capacity`` as well, routing checks a cluster's room against its active
    nodes (those whose heartbeats have not gone quiet) once any node of it has registered.
    """
    chain = chain or open_chain(config)
    node_ledger = None
    if nodes:
        from activities.chain.node_ledger import NodeLedger

        node_ledger = NodeLedger(config.ledger_path)
        if node_capacity and capacity_probe is None:
            capacity_probe = node_ledger.available_nodes
    signer = load_signer(secrets)
    if metrics is not None:
        from workers.metrics import MeteredAuditLog

        audit: AuditLog = MeteredAuditLog(config.hpc.audit, metrics, anchor_signer=signer)
    else:
        audit = AuditLog(config.hpc.audit, anchor_signer=signer)
    if adapters is None:
        served = list(clusters) if clusters else config.served_cluster_ids()
        if not served:
            raise ConfigError("hpc.clusters: this worker serves no cluster (every entry has serve: false)")
        adapters = {cluster_id: build_adapter(config, secrets, cluster_id) for cluster_id in served}
    if metrics is not None:
        from workers.metrics import instrument_adapter

        for cluster_id, adapter in adapters.items():
            instrument_adapter(adapter, cluster_id, metrics)
    enforcer = RoutingEnforcer(
        chain,
        audit,
        config.routing,
        served_clusters=frozenset(adapters) | frozenset(config.cluster_ids()),
        capacity_probe=capacity_probe,
    )
    activities = JobActivities(
        config=config,
        adapters=adapters,
        chain=chain,
        signer=signer,
        audit=audit,
        enforcer=enforcer,
        resolve_body=body_resolver(chain, audit),
    )
    deps = WorkerDeps(config, chain, audit, signer, adapters, activities, metrics=metrics)
    from workflows.cluster_monitor import ClusterMonitorWorkflow

    deps.extra_workflows.append(
        ClusterMonitorWorkflow
    )  # one per cluster task queue: its jobs' status queries
    if metrics is not None:
        metrics.watch_batchers(activities)
    if node_ledger is not None:
        from activities.nodes import NodeActivities
        from workflows.node import NodeWorkflow

        deps.extra_activities.extend(NodeActivities(node_ledger, adapters, audit).all())
        deps.extra_workflows.append(NodeWorkflow)
        deps.closers.append(node_ledger.close)
    return deps
