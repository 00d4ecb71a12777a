"""The worker's /metrics, /healthz and /readyz endpoint, scraped after a known run.

A worker process (in process, with its own Temporal runtime so the SDK's metrics are exported) runs a known set
of jobs through the real poller: one completes with usage records, one is refused by strict routing, one is
refused by the scheduler, one is cancelled while it runs. The counters a provider alerts on must say exactly
that. The node API's counters are checked against real signed documents.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.audit import AuditLog
from activities.chain.local_ledger import LocalLedger
from activities.chain.node_ledger import NodeLedger
from tests.memory_adapter import MemoryAdapter, Script
from tests.node_support import PROVIDER, SimulatedNode
from tests.production_support import cluster_config, provider_ledger, scrape, submit, value, wait_result
from virtengine_hpc.config import AuditConfig, NodesConfig, Secrets, default_build_id
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import CancelRequest, JobStatusView
from virtengine_hpc.node.lifecycle import NodeBeat, NodeRegistered
from virtengine_hpc.states import JobState
from workers.health import HealthServer, Probes
from workers.metrics import WorkerMetrics, add_node_api_endpoints, instrument_node_api
from workers.node_api import NodeAPI, create_app
from workers.worker import WorkerProcess

Q, R, C = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED
A = "cluster-m"


@pytest.fixture
async def process(
    temporal_env: WorkflowEnvironment, tmp_path: Path, key_path: Path
) -> AsyncIterator[tuple[WorkerProcess, MemoryAdapter]]:
    config = cluster_config(
        tmp_path,
        [A],
        hpc={"usage_reporting": {"report_interval": "1s"}},
        temporal={"address": temporal_env.client.service_client.config.target_host},
        metrics={"listen": "127.0.0.1:0", "jobs_refresh_interval": "300ms"},
    )
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    worker = WorkerProcess(
        config,
        Secrets(provider_signing_key_path=key_path),
        with_poller=True,
        chain=ledger,
        adapters={A: adapter},
    )
    await worker.start()
    try:
        yield worker, adapter
    finally:
        await worker.stop()


async def get(worker: WorkerProcess, path: str) -> httpx.Response:
    assert worker.health is not None
    async with httpx.AsyncClient(base_url=worker.health.url, timeout=10) as http:
        return await http.get(path)


async def metrics_now(worker: WorkerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    answer = await get(worker, "/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    return scrape(answer.text)


async def test_counters_after_a_known_run(
    process: tuple[WorkerProcess, MemoryAdapter], client: Client
) -> None:
    worker, adapter = process
    assert worker.deps is not None
    ledger = worker.deps.chain
    assert isinstance(ledger, LocalLedger)
    config = worker.config
    adapter.default = Script([(0, Q), (0.2, R), (3.0, C)], exit_code=0)

    done = submit(ledger, config, decide=A)
    refused = submit(ledger, config)  # strict routing: no decision, refused
    rejected = submit(ledger, config, decide=A)
    adapter.reject[rejected] = "Invalid account or account/partition combination specified"
    running = submit(ledger, config, decide=A)
    adapter.scripts[running] = Script([(0, Q), (0.2, R), (600, C)], exit_code=0)

    # The jobs gauge sees the long job running (read from Temporal's visibility store).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        samples = await metrics_now(worker)
        if value(samples, "virtengine_hpc_jobs", cluster=A, state="running") >= 1:
            break
        await asyncio.sleep(0.3)
    assert value(samples, "virtengine_hpc_jobs", cluster=A, state="running") >= 1
    view: JobStatusView = await client.get_workflow_handle(running).execute_update(
        "request_cancel", CancelRequest(reason="operator"), result_type=JobStatusView
    )
    assert view.cancel_requested

    results = {j: await wait_result(client, j) for j in (done, refused, rejected, running)}
    assert [results[j].state for j in (done, refused, rejected, running)] == [
        C,
        JobState.FAILED,
        JobState.FAILED,
        JobState.CANCELLED,
    ]
    records = len(ledger.usage_records(done)) + len(ledger.usage_records(running))
    assert records >= 3

    s = await metrics_now(worker)
    # Submissions: three reached the scheduler, one was refused there.
    assert value(s, "virtengine_hpc_submissions_total", cluster=A, outcome="submitted") == 2
    assert value(s, "virtengine_hpc_submissions_total", cluster=A, outcome="rejected") == 1
    # Jobs by state: what the chain was told.
    assert value(s, "virtengine_hpc_job_transitions_total", cluster=A, state="queued") == 2
    assert value(s, "virtengine_hpc_job_transitions_total", cluster=A, state="running") == 2
    assert value(s, "virtengine_hpc_job_transitions_total", cluster=A, state="completed") == 1
    assert value(s, "virtengine_hpc_job_transitions_total", cluster=A, state="failed") == 2
    assert value(s, "virtengine_hpc_job_transitions_total", cluster=A, state="cancelled") == 1
    # Usage: every record the chain holds was counted as sent, none failed; two final accountings.
    assert value(s, "virtengine_hpc_usage_records_total", cluster=A, outcome="sent") == records
    assert value(s, "virtengine_hpc_usage_records_total", cluster=A, outcome="failed") == 0
    assert value(s, "virtengine_hpc_accounting_reports_total", cluster=A, outcome="sent") == 2
    # Routing: three passed, one rejected for its missing decision.
    assert value(s, "virtengine_hpc_routing_decisions_total", outcome="passed") == 3
    assert value(s, "virtengine_hpc_routing_decisions_total", outcome="rejected") == 1
    assert value(s, "virtengine_hpc_routing_violations_total", type="missing_decision", enforced="true") == 1
    # The scheduler: the cluster monitor's status queries (as many as the adapter answered; no job held a watch
    # activity of its own) and call latencies.
    monitor = worker.deps.activities.monitor
    queries = value(s, "virtengine_hpc_scheduler_queries_total", cluster=A)
    assert queries == monitor.queries[A] >= adapter.status_queries >= 1
    assert A not in worker.deps.activities.batchers
    assert value(s, "virtengine_hpc_scheduler_query_failures_total", cluster=A) == 0
    assert (
        value(s, "virtengine_hpc_scheduler_call_seconds_count", cluster=A, operation="submit", outcome="ok")
        == 2
    )
    assert (
        value(
            s, "virtengine_hpc_scheduler_call_seconds_count", cluster=A, operation="submit", outcome="error"
        )
        == 1
    )
    assert (
        value(s, "virtengine_hpc_scheduler_call_seconds_count", cluster=A, operation="cancel", outcome="ok")
        == 1
    )
    # The Temporal SDK's own runtime metrics come through the same endpoint.
    names = {name for name, _ in s}
    assert any(n.startswith("temporal_") for n in names), sorted(names)[:20]
    assert any(n.startswith("temporal_workflow_completed") for n in names)
    # Unset build_id: the package version and the workflow code digest label the worker.
    assert value(s, "virtengine_hpc_worker_info", build_id=default_build_id(), clusters=A) == 1
    # The poller and its reconciler (run by this process): four starts, none failed, nothing left behind.
    assert value(s, "virtengine_hpc_poller_starts_total", cluster=A) == 4
    assert value(s, "virtengine_hpc_poller_start_failures_total", cluster=A) == 0
    assert value(s, "virtengine_hpc_poll_failures_total", cluster=A, cause="chain") == 0
    assert value(s, "virtengine_hpc_poller_last_poll_timestamp_seconds", cluster=A) > 0
    assert value(s, "virtengine_hpc_reconciler_last_round_timestamp_seconds", cluster=A) > 0
    assert value(s, "virtengine_hpc_jobs_parked", cluster=A) == 0
    assert value(s, "virtengine_hpc_reconcile_failures_total", cluster=A) == 0
    # Nothing runs any more.
    deadline = time.monotonic() + 10
    while value(s, "virtengine_hpc_jobs", cluster=A, state="running") != 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        s = await metrics_now(worker)
    assert value(s, "virtengine_hpc_jobs", cluster=A, state="running") == 0


async def test_liveness_and_readiness(process: tuple[WorkerProcess, MemoryAdapter]) -> None:
    worker, _ = process
    live = await get(worker, "/healthz")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    ready = await get(worker, "/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"temporal": "ok", "chain": "ok", "search_attributes": "ok"}
    assert (await get(worker, "/nope")).status_code == 404
    # SIGTERM: readiness goes off at once, before running activities have finished.
    worker.request_stop()
    stopping = await get(worker, "/readyz")
    assert stopping.status_code == 503 and stopping.json()["status"] == "stopping"


async def test_readiness_names_the_failing_check_and_liveness_a_dead_worker() -> None:
    async def chain() -> None:
        raise RuntimeError("ledger is locked")

    async def slow() -> None:
        await asyncio.sleep(10)

    problems: list[str] = []
    server = HealthServer(
        "127.0.0.1:0",
        Probes(live=lambda: problems, checks={"chain": chain, "temporal": slow}, check_timeout=0.2),
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["checks"] == {
                "chain": "ledger is locked",
                "temporal": "timed out after 0.2 s",
            }
            assert (await http.get("/healthz")).status_code == 200
            problems.append("worker for cluster c1 stopped: poll failed")
            dead = await http.get("/healthz")
            assert dead.status_code == 500 and dead.json()["problems"] == problems
            assert (await http.post("/healthz")).status_code == 405
            assert (await http.get("/metrics")).status_code == 404, "no metrics source configured"
    finally:
        await server.stop()


class Forwarded:
    """The node API's forwarder without Temporal: records what would be signalled."""

    def __init__(self) -> None:
        self.beats: list[NodeBeat] = []

    async def heartbeat(self, cluster_id: str, node_id: str, beat: NodeBeat) -> None:
        self.beats.append(beat)

    async def registered(self, cluster_id: str, node_id: str, registration: NodeRegistered) -> None:
        return None


async def test_node_api_counts_heartbeats_accepted_and_rejected_by_reason(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    audit = AuditLog(AuditConfig(log_path=tmp_path / "audit.log"))
    api = NodeAPI(
        ledger,
        audit,
        Forwarded(),
        provider_address=PROVIDER,
        settings=NodesConfig(audit_rate_window=timedelta(0)),
    )
    metrics = WorkerMetrics()
    instrument_node_api(api, metrics)
    app = create_app(api)

    async def ledger_ok() -> None:
        await asyncio.to_thread(ledger.list_nodes)

    add_node_api_endpoints(app, metrics, {"ledger": ledger_ok})
    node = SimulatedNode("c1", "n1")
    stranger = SimulatedNode("c1", "n2")
    ledger.allow(node.cluster_id, node.node_id, node.public_key)

    def raw(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc).encode()

    assert (await api.register(raw(stranger.registration()), "test"))[0] == 401
    assert (await api.register(raw(node.registration()), "test"))[0] == 200
    for sequence in (1, 2, 3):
        assert (await api.heartbeat("n1", raw(node.heartbeat(sequence)), {}, "test"))[0] == 200
    assert (await api.heartbeat("n1", raw(node.heartbeat(2)), {}, "test"))[0] == 409
    impostor = SimulatedNode("c1", "n1")  # same node id, another key
    assert (await api.heartbeat("n1", raw(impostor.heartbeat(4)), {}, "test"))[0] == 401

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node-api") as http:
        text = (await http.get("/metrics")).text
        ready = await http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"ledger": "ok"}
    s = scrape(text)
    assert value(s, "virtengine_hpc_node_heartbeats_total", outcome="accepted", reason="") == 3
    assert (
        value(s, "virtengine_hpc_node_heartbeats_total", outcome="rejected", reason="sequence_replayed") == 1
    )
    assert (
        value(s, "virtengine_hpc_node_heartbeats_total", outcome="rejected", reason="signature_invalid") == 1
    )
    assert value(s, "virtengine_hpc_node_registrations_total", outcome="accepted", reason="") == 1
    assert value(s, "virtengine_hpc_node_registrations_total", outcome="rejected", reason="unknown_node") == 1
    ledger.close()


async def test_the_node_api_process_answers_readiness_and_metrics(
    temporal_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    from tests.node_support import CLUSTER, Provider

    provider = Provider(tmp_path, temporal_env.client.service_client.config.target_host)
    provider.start_api()
    try:
        async with httpx.AsyncClient(base_url=provider.url, timeout=10) as http:
            ready = await http.get("/readyz")
            assert ready.status_code == 200 and ready.json()["checks"] == {"temporal": "ok", "ledger": "ok"}
            stranger = SimulatedNode(CLUSTER, "n-unknown")
            answer = await http.post("/api/v1/hpc/nodes/register", json=stranger.registration())
            assert answer.status_code == 401
            s = scrape((await http.get("/metrics")).text)
        assert (
            value(s, "virtengine_hpc_node_registrations_total", outcome="rejected", reason="unknown_node")
            == 1
        )
    finally:
        provider.stop()


class _Attributes:
    def __init__(self, names: list[str]) -> None:
        self.custom_attributes = dict.fromkeys(names, 2)

    async def list_search_attributes(self, request: object) -> _Attributes:
        return self


class _NoAttributesClient:
    def __init__(self, names: list[str]) -> None:
        self.operator_service = _Attributes(names)


async def test_readiness_says_which_search_attributes_the_namespace_lacks() -> None:
    from workers.worker import search_attributes_check

    check = search_attributes_check(_NoAttributesClient(["VeJobState"]), "prod")  # type: ignore[arg-type]
    with pytest.raises(HPCError) as failure:
        await check()
    message = str(failure.value)
    assert message.startswith("namespace prod lacks the search attributes VeClusterId, VeSchedulerJobId")
    assert (
        "temporal operator search-attribute create --namespace prod --name VeClusterId --type Keyword"
        in message
    )
    every = ["VeJobState", "VeClusterId", "VeSchedulerJobId", "VeTenant", "VeTemplate"]
    await search_attributes_check(_NoAttributesClient(every), "prod")()  # type: ignore[arg-type]
