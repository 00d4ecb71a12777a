"""Prometheus metrics of a worker: the project's own counters beside the Temporal SDK's runtime metrics.

One ``/metrics`` endpoint per process (``workers/health.py``) serves both: the SDK's core exports its metrics
(``temporal_*``: polls, task latencies, slots, sticky cache) on a private loopback port of its own, and the
endpoint appends them to the project's registry (``virtengine_hpc_*``), so Prometheus scrapes one target.

The project's counters are fed without touching the activities:

* **audit events** (``MeteredAuditLog``): every ``AuditLog.record`` call is counted before the audit switches
  apply, so a provider that turns job events off still counts them — transitions by state, submissions,
  usage records and accounting sent and failed, routing outcomes and violations by type;
* **scheduler calls** (``instrument_adapter``): submit, status, cancel and usage calls of each adapter are timed
  into one histogram by cluster, operation and outcome;
* **status queries** (``watch_batchers``): the ``queries`` and ``failures`` counts of the cluster monitor's rounds
  that ran on this worker and of each cluster's ``StatusBatcher`` (jobs that still watch the old way), read at
  scrape time (invariant 4 in docs/architecture.md: one query per poll interval per cluster, summed over workers);
* **jobs by state** (``refresh_job_gauge``): counts of running job workflows per cluster and state from
  Temporal's visibility store, every ``metrics.jobs_refresh_interval`` (the provider's view: every worker
  reports the same numbers, so aggregate with ``max``);
* **node API** (``instrument_node_api``): heartbeats and registrations accepted and rejected, by reason.

Label values are ids and fixed names only (clusters, states, violation types, reasons): never tenant strings,
so a tenant cannot blow up the number of series.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from temporalio.client import Client
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    PrometheusConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from activities.attempts import LOST_ATTEMPTS
from activities.audit import AuditLog
from activities.schedulers.base import SchedulerAdapter
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import AuditConfig
from virtengine_hpc.messages import JOB_WORKFLOW_NAME
from virtengine_hpc.states import JobState

if TYPE_CHECKING:
    from activities.jobs import JobActivities
    from virtengine_hpc.signing import Signer

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "virtengine_hpc"
SCHEDULER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ACTIVE_STATES = tuple(s for s in JobState if not s.final)


class WorkerMetrics:
    """The project's metrics, in a registry of their own (tests make one per worker)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.transitions = Counter(
            f"{PREFIX}_job_transitions",
            "Job state changes reported to the chain, by cluster and new state.",
            ["cluster", "state"],
            registry=r,
        )
        self.submissions = Counter(
            f"{PREFIX}_submissions",
            "Scheduler submissions by outcome: submitted, adopted (a retried submit found its job), rejected "
            "(the scheduler refused it), retries_exhausted, duplicate_cancelled (the extra job of a submit "
            "attempt that raced another, cancelled).",
            ["cluster", "outcome"],
            registry=r,
        )
        self.validation_failures = Counter(
            f"{PREFIX}_job_validation_failures",
            "Jobs refused as malformed or out of a partition's bounds.",
            ["cluster"],
            registry=r,
        )
        self.usage_records = Counter(
            f"{PREFIX}_usage_records",
            "Signed usage records by outcome: sent (accepted by the chain) or failed (given up).",
            ["cluster", "outcome"],
            registry=r,
        )
        self.accounting = Counter(
            f"{PREFIX}_accounting_reports",
            "Final accounting reports by outcome: sent or failed.",
            ["cluster", "outcome"],
            registry=r,
        )
        self.routing = Counter(
            f"{PREFIX}_routing_decisions",
            "Routing enforcement outcomes: passed, fallback (passed on another cluster), rejected.",
            ["outcome"],
            registry=r,
        )
        self.violations = Counter(
            f"{PREFIX}_routing_violations",
            "Routing violations by type and whether the mode enforced them (audit_only does not).",
            ["type", "enforced"],
            registry=r,
        )
        self.scheduler_seconds = Histogram(
            f"{PREFIX}_scheduler_call_seconds",
            "Latency of scheduler adapter calls by cluster, operation (submit, status_batch, cancel, usage) and "
            "outcome (ok, error).",
            ["cluster", "operation", "outcome"],
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        )
        self.heartbeats = Counter(
            f"{PREFIX}_node_heartbeats",
            "Node heartbeats at the node API by outcome (accepted, rejected, unavailable) and reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.registrations = Counter(
            f"{PREFIX}_node_registrations",
            "Node registrations at the node API by outcome and reason.",
            ["outcome", "reason"],
            registry=r,
        )
        self.jobs = Gauge(
            f"{PREFIX}_jobs",
            "Job workflows running now by cluster and state (Temporal visibility; the provider's view).",
            ["cluster", "state"],
            registry=r,
        )
        self.jobs_refreshed = Gauge(
            f"{PREFIX}_jobs_refreshed_timestamp_seconds",
            "When the jobs gauge was last read from Temporal (unix time).",
            registry=r,
        )
        # ---- the chain poller and its reconciler (the poller process) ----
        self.parked = Gauge(
            f"{PREFIX}_jobs_parked",
            "Job workflows parked for an operator (their final accounting or a cancel could not be sent), by "
            "cluster (Temporal visibility, read by the poller's reconciler every reconcile_interval).",
            ["cluster"],
            registry=r,
        )
        self.chain_pending = Gauge(
            f"{PREFIX}_chain_pending_jobs",
            "Pending chain jobs the poller's last poll left without a workflow: waiting for a free slot, or held "
            "back after their start failed.",
            ["cluster"],
            registry=r,
        )
        self.free_slots = Gauge(
            f"{PREFIX}_poller_free_slots",
            "max_concurrent_jobs minus the cluster's running job workflows at the poller's last poll.",
            ["cluster"],
            registry=r,
        )
        self.starts = Counter(
            f"{PREFIX}_poller_starts",
            "Job workflows the poller started.",
            ["cluster"],
            registry=r,
        )
        self.start_failures = Counter(
            f"{PREFIX}_poller_start_failures",
            "Workflow starts that failed for one job (that job is retried with backoff; the others go on).",
            ["cluster"],
            registry=r,
        )
        self.poll_failures = Counter(
            f"{PREFIX}_poll_failures",
            "Poll rounds that failed, by cause: chain (the chain client) or temporal.",
            ["cluster", "cause"],
            registry=r,
        )
        self.last_poll = Gauge(
            f"{PREFIX}_poller_last_poll_timestamp_seconds",
            "When the poller last completed a poll round (unix time).",
            ["cluster"],
            registry=r,
        )
        self.reconciled = Counter(
            f"{PREFIX}_reconciled_jobs",
            "Recovery runs started for jobs not final on chain while no workflow was open for them, by how the "
            "earlier run closed (terminated, failed, timed_out, canceled, completed; none: no workflow at all).",
            ["cluster", "closed_status"],
            registry=r,
        )
        self.reconcile_failures = Counter(
            f"{PREFIX}_reconcile_failures",
            "Recovery runs that could not be started (retried with backoff).",
            ["cluster"],
            registry=r,
        )
        self.reconciler_retrying = Gauge(
            f"{PREFIX}_reconciler_retrying_jobs",
            "Jobs still not final on chain, with no open workflow, after a recovery attempt (last round).",
            ["cluster"],
            registry=r,
        )
        self.swept = Counter(
            f"{PREFIX}_swept_jobs",
            "Scheduler jobs the sweep found that no workflow names, by kind (duplicate: the workflow names another "
            "job; unowned: no open workflow, chain job settled; unmarked: a tenant account's job without a valid "
            "marker, such as one the tenant submitted itself) and action (cancelled, reported).",
            ["cluster", "kind", "action"],
            registry=r,
        )
        self.unbilled_cpu_seconds = Counter(
            f"{PREFIX}_unbilled_cpu_seconds",
            "CPU-seconds (allocated CPUs times run time) of the jobs of tenants' accounts that ran and ended between "
            "two sweep rounds without a valid marker: compute no chain job billed (jobs the sweep cancelled while "
            "live are counted in swept_jobs only).",
            ["cluster"],
            registry=r,
        )
        self.last_sweep = Gauge(
            f"{PREFIX}_sweep_last_round_timestamp_seconds",
            "When the sweep for scheduler jobs no workflow names last completed a round (unix time).",
            ["cluster"],
            registry=r,
        )
        self.last_reconcile = Gauge(
            f"{PREFIX}_reconciler_last_round_timestamp_seconds",
            "When the reconciler last completed a round (unix time).",
            ["cluster"],
            registry=r,
        )
        self.up = Gauge(
            f"{PREFIX}_worker_info",
            "Always 1; labels say which build serves which clusters.",
            ["build_id", "clusters"],
            registry=r,
        )
        self._batchers: list[JobActivities] = []
        self.registry.register(_BatcherCollector(self._batchers))
        self.registry.register(_AttemptsCollector())

    # ---- audit events ---------------------------------------------------------------------------------------

    def observe_audit(
        self, event_type: str, cluster_id: str | None, success: bool, details: Mapping[str, Any]
    ) -> None:
        """Count one audit event (called for every ``AuditLog.record``, whatever the audit switches say)."""
        cluster = cluster_id or ""
        handler = _AUDIT_HANDLERS.get(event_type)
        if handler is not None:
            handler(self, cluster, success, details)

    def watch_poller(self, cluster_id: str) -> None:
        """Create the poller's series of ``cluster_id`` at zero, so rate and increase see them from the start."""
        self.starts.labels(cluster_id)
        self.start_failures.labels(cluster_id)
        self.reconcile_failures.labels(cluster_id)
        for cause in ("chain", "temporal"):
            self.poll_failures.labels(cluster_id, cause)

    # ---- status queries -------------------------------------------------------------------------------------

    def watch_batchers(self, activities: JobActivities) -> None:
        """Export the status-query counts of the ``StatusBatcher``s of ``activities`` (one per cluster)."""
        self._batchers.append(activities)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _transition(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    state = d.get("to")
    if isinstance(state, str) and state in JobState._value2member_map_:
        m.transitions.labels(cluster, state).inc()


def _submitted(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    m.submissions.labels(cluster, "adopted" if d.get("adopted") else "submitted").inc()


def _violation(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    kind = d.get("violation_type")
    if isinstance(kind, str):
        m.violations.labels(kind, "true" if d.get("enforced", True) else "false").inc()


_CLOSED_STATUSES = frozenset({"TERMINATED", "FAILED", "TIMED_OUT", "CANCELED", "COMPLETED"})


def _reconciled(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    if not success:
        m.reconcile_failures.labels(cluster).inc()
        return
    status = d.get("closed_status")
    m.reconciled.labels(cluster, status.lower() if status in _CLOSED_STATUSES else "none").inc()


def _duplicate_cancelled(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    if d.get("found_by") == "sweep":
        m.swept.labels(cluster, "duplicate", "cancelled").inc()
    else:
        m.submissions.labels(cluster, "duplicate_cancelled").inc()


def _unowned_found(m: WorkerMetrics, cluster: str, success: bool, d: Mapping[str, Any]) -> None:
    m.swept.labels(cluster, str(d.get("kind", "unowned")), "reported").inc()
    allocated = d.get("allocated")
    if d.get("ended") and isinstance(allocated, Mapping):
        cpus, elapsed = allocated.get("cpus"), d.get("elapsed_seconds")
        if isinstance(cpus, int) and isinstance(elapsed, int) and cpus > 0 and elapsed > 0:
            m.unbilled_cpu_seconds.labels(cluster).inc(cpus * elapsed)


_AUDIT_HANDLERS: dict[str, Callable[[WorkerMetrics, str, bool, Mapping[str, Any]], None]] = {
    AuditEvent.JOB_LIFECYCLE_EVENT: _transition,
    AuditEvent.JOB_SUBMITTED: _submitted,
    AuditEvent.JOB_SUBMISSION_FAILED: lambda m, c, s, d: m.submissions.labels(c, "rejected").inc(),
    AuditEvent.JOB_MAX_RETRIES_EXCEEDED: lambda m, c, s, d: m.submissions.labels(
        c, "retries_exhausted"
    ).inc(),
    AuditEvent.DUPLICATE_JOB_CANCELLED: _duplicate_cancelled,
    AuditEvent.UNOWNED_JOB_CANCELLED: lambda m, c, s, d: m.swept.labels(
        c, str(d.get("kind", "unowned")), "cancelled"
    ).inc(),
    AuditEvent.UNOWNED_JOB_FOUND: _unowned_found,
    AuditEvent.JOB_VALIDATION_FAILED: lambda m, c, s, d: m.validation_failures.labels(c).inc(),
    # A retried report the chain answers "duplicate" sent nothing new: the chain keeps the first attempt's record.
    AuditEvent.USAGE_REPORTED: lambda m, c, s, d: m.usage_records.labels(
        c, "duplicate" if d.get("duplicate") else "sent"
    ).inc(),
    AuditEvent.USAGE_REPORT_FAILED: lambda m, c, s, d: m.usage_records.labels(c, "failed").inc(),
    AuditEvent.ACCOUNTING_REPORTED: lambda m, c, s, d: m.accounting.labels(c, "sent").inc(),
    AuditEvent.ACCOUNTING_REPORT_FAILED: lambda m, c, s, d: m.accounting.labels(c, "failed").inc(),
    AuditEvent.ROUTING_ENFORCEMENT_PASSED: lambda m, c, s, d: m.routing.labels("passed").inc(),
    AuditEvent.ROUTING_FALLBACK_USED: lambda m, c, s, d: m.routing.labels("fallback").inc(),
    AuditEvent.ROUTING_ENFORCEMENT_FAILED: lambda m, c, s, d: m.routing.labels("rejected").inc(),
    AuditEvent.ROUTING_VIOLATION: _violation,
    AuditEvent.JOB_RECONCILED: _reconciled,
}


class MeteredAuditLog(AuditLog):
    """The audit log, counting every event into ``WorkerMetrics`` before it is (perhaps) written."""

    def __init__(
        self,
        config: AuditConfig,
        metrics: WorkerMetrics,
        *,
        fsync: bool = False,
        anchor_signer: Signer | None = None,
    ) -> None:
        super().__init__(config, fsync=fsync, anchor_signer=anchor_signer)
        self.metrics = metrics

    def record(self, event_type: AuditEvent, **kwargs: Any) -> dict[str, Any] | None:
        try:
            self.metrics.observe_audit(
                event_type, kwargs.get("cluster_id"), kwargs.get("success", True), kwargs.get("details") or {}
            )
        except Exception:  # a metrics bug must never lose an audit record
            log.exception("counting audit event %s failed", event_type)
        return super().record(event_type, **kwargs)


class _BatcherCollector(Collector):
    """Reads the batchers' counters at scrape time (they are plain ints the batcher increments)."""

    def __init__(self, sources: list[JobActivities]) -> None:
        self.sources = sources

    def collect(self) -> Iterable[CounterMetricFamily]:
        queries = CounterMetricFamily(
            f"{PREFIX}_scheduler_queries",
            "Batched status queries this worker sent to each cluster's scheduler (the cluster monitor's rounds it "
            "ran, and the batches of jobs that still watch the old way).",
            labels=["cluster"],
        )
        failures = CounterMetricFamily(
            f"{PREFIX}_scheduler_query_failures",
            "Batched status queries that failed (never a state change; retried next interval).",
            labels=["cluster"],
        )
        totals: dict[str, tuple[int, int]] = {}
        for source in self.sources:
            counts = [(c, b.queries, b.failures) for c, b in list(source.batchers.items())]
            monitor = source.monitor  # the cluster monitor's rounds that ran on this worker
            counts += [(c, monitor.queries[c], monitor.failures[c]) for c in list(monitor.queries)]
            for cluster, queries_, failures_ in counts:
                q, f = totals.get(cluster, (0, 0))
                totals[cluster] = (q + queries_, f + failures_)
        for cluster, (q, f) in sorted(totals.items()):
            queries.add_metric([cluster], q)
            failures.add_metric([cluster], f)
        yield queries
        yield failures

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []


class _AttemptsCollector(Collector):
    """Activity attempts this process saw cancelled by Temporal (``activities.attempts.LOST_ATTEMPTS``)."""

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            f"{PREFIX}_activity_attempts_cancelled",
            "Activity attempts Temporal cancelled while this worker ran them, by activity and reason: timed_out "
            "and not_found mean the server had already given the attempt up (its heartbeat timeout passed) and "
            "retried it; cancelled is a cancel request (a watch whose job got a cancel, a workflow cancel).",
            labels=["activity", "reason"],
        )
        for (activity_type, reason), count in sorted(LOST_ATTEMPTS.items()):
            family.add_metric([activity_type, reason], count)
        yield family

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []


# ---- scheduler calls ------------------------------------------------------------------------------------------

_TIMED = ("submit", "status_batch", "cancel", "usage")


def instrument_adapter(adapter: SchedulerAdapter, cluster_id: str, metrics: WorkerMetrics) -> None:
    """Time the adapter's scheduler calls. Wraps the bound methods on the instance (the class is untouched, and
    everything else about the adapter, its name and node calls included, stays as it is); idempotent."""
    if getattr(adapter, "_ve_metered", False):
        return
    for name in _TIMED:
        original = getattr(adapter, name)
        setattr(adapter, name, _timed(original, metrics.scheduler_seconds, cluster_id, name))
    adapter._ve_metered = True  # type: ignore[attr-defined]


def _timed(
    call: Callable[..., Awaitable[T]], histogram: Histogram, cluster: str, operation: str
) -> Callable[..., Awaitable[T]]:
    async def timed(*args: Any, **kwargs: Any) -> T:
        start = time.perf_counter()
        outcome = "error"
        try:
            result = await call(*args, **kwargs)
            outcome = "ok"
            return result
        finally:
            histogram.labels(cluster, operation, outcome).observe(time.perf_counter() - start)

    timed.__name__ = getattr(call, "__name__", operation)
    return timed


# ---- jobs by state --------------------------------------------------------------------------------------------


async def refresh_job_gauge(client: Client, metrics: WorkerMetrics, clusters: Iterable[str]) -> None:
    """Set ``virtengine_hpc_jobs{cluster,state}`` from Temporal's visibility store (one count per pair)."""
    for cluster in clusters:
        for state in ACTIVE_STATES:
            query = (
                f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND ExecutionStatus = 'Running' "
                f"AND VeClusterId = '{cluster}' AND VeJobState = '{state.value}'"
            )
            count = await client.count_workflows(query)
            metrics.jobs.labels(cluster, state.value).set(count.count)
    metrics.jobs_refreshed.set(time.time())


async def keep_job_gauge_fresh(
    client: Client, metrics: WorkerMetrics, clusters: list[str], interval: float, stop: asyncio.Event
) -> None:
    """Refresh the jobs gauge every ``interval`` seconds until ``stop``; a failed read keeps the last values."""
    while not stop.is_set():
        try:
            await refresh_job_gauge(client, metrics, clusters)
        except Exception as exc:
            log.warning("cannot read job counts from Temporal: %s", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)


# ---- the Temporal SDK's metrics -------------------------------------------------------------------------------


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that is free now (the SDK core binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def make_runtime(*, sdk_metrics: bool, forward_logs: bool) -> tuple[Runtime, str | None]:
    """A Temporal runtime whose core exports Prometheus metrics on a private loopback port (returned as the URL
    ``/metrics`` appends), and forwards the core's own log lines to Python logging (so they come out as JSON
    too) when ``forward_logs``."""
    url = None
    metrics_config = None
    if sdk_metrics:
        address = f"127.0.0.1:{free_loopback_port()}"
        metrics_config = PrometheusConfig(bind_address=address, durations_as_seconds=True)
        url = f"http://{address}/metrics"
    logging_config = LoggingConfig.default
    if forward_logs:
        logging_config = LoggingConfig(
            filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
            forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
        )
    runtime = Runtime(telemetry=TelemetryConfig(metrics=metrics_config, logging=logging_config))
    return runtime, url


async def fetch_sdk_metrics(url: str, timeout: float = 2.0) -> bytes:
    """The SDK core's exposition text (empty on failure: the project's own metrics are still served)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            response = await http.get(url)
            response.raise_for_status()
            return response.content
    except httpx.HTTPError as exc:
        log.warning("cannot read the Temporal SDK's metrics from %s: %s", url, exc)
        return b""


class MetricsSource:
    """What ``/metrics`` serves: the project's registry, then the SDK's exposition."""

    def __init__(self, metrics: WorkerMetrics, sdk_url: str | None = None) -> None:
        self.metrics = metrics
        self.sdk_url = sdk_url

    async def __call__(self) -> bytes:
        text = self.metrics.exposition()
        if self.sdk_url:
            sdk = await fetch_sdk_metrics(self.sdk_url)
            if sdk:
                text = text + (b"" if text.endswith(b"\n") else b"\n") + sdk
        return text


# ---- the node API ---------------------------------------------------------------------------------------------


def instrument_node_api(api: Any, metrics: WorkerMetrics) -> None:
    """Count the node API's answers: wraps ``NodeAPI.heartbeat`` and ``NodeAPI.register`` on the instance and
    reads the status and error code of what they return (200 accepted, 503 unavailable, else rejected)."""

    def wrap(name: str, counter: Counter) -> None:
        call = getattr(api, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            status, body = await call(*args, **kwargs)
            if status == 200:
                counter.labels("accepted", "").inc()
            elif status == 503:
                counter.labels("unavailable", getattr(body, "error", "") or "").inc()
            else:
                counter.labels("rejected", getattr(body, "error", "") or str(status)).inc()
            return status, body

        setattr(api, name, counted)

    wrap("heartbeat", metrics.heartbeats)
    wrap("register", metrics.registrations)


def add_node_api_endpoints(app: Any, metrics: WorkerMetrics, checks: Mapping[str, Any]) -> None:
    """Give the node API (a FastAPI app) ``/metrics`` and ``/readyz`` beside its own ``/healthz``.

    ``checks`` are readiness checks as in ``workers/health.py`` (async callables that raise when not ready),
    e.g. Temporal's health check and a read of the node ledger.
    """
    from fastapi.responses import JSONResponse, Response

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/readyz", summary="Readiness", include_in_schema=False)
    async def readyz() -> JSONResponse:
        results: dict[str, str] = {}
        for name, check in checks.items():
            try:
                await asyncio.wait_for(check(), timeout=5)
                results[name] = "ok"
            except Exception as exc:
                results[name] = (str(exc) or type(exc).__name__)[:300]
        ok = all(r == "ok" for r in results.values())
        body = {"status": "ready" if ok else "not ready", "checks": results}
        return JSONResponse(body, status_code=200 if ok else 503)


__all__ = [
    "MeteredAuditLog",
    "MetricsSource",
    "WorkerMetrics",
    "add_node_api_endpoints",
    "instrument_adapter",
    "instrument_node_api",
    "keep_job_gauge_fresh",
    "make_runtime",
    "refresh_job_gauge",
]
