"""Several clusters per provider: a task queue per cluster, workers that serve one or several of them, and routing
that moves a job to the task queue of the cluster it runs on.

Two worker processes (in process here, each with its own activities, adapters and config, as on two hosts) share
one Temporal dev server and one chain, each with the poller of its cluster. A job decided for a cluster is taken by
that cluster's poller, within its ``max_concurrent_jobs``; a job that moves after it started (a permissive fallback)
runs on the other cluster's task queue. What the provider notices is which cluster's scheduler got the job, what
the chain and the audit log say, and that the job's records come from that cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHistory
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Replayer

from activities.audit import read_events
from activities.chain.local_ledger import LocalLedger
from tests.memory_adapter import MemoryAdapter, Script
from tests.poller_support import terminate_all
from tests.production_support import cluster_config, provider_ledger, submit, wait_result
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.models import PricedQueue, Pricing
from virtengine_hpc.states import JobState
from workers.wiring import task_queue
from workers.worker import WorkerProcess
from workflows.hpc_job import PATCH_MULTI_CLUSTER, HPCJobWorkflow

A, B = "cluster-a", "cluster-b"


@dataclass
class Provider:
    config: Config
    ledger: LocalLedger
    adapters: dict[str, MemoryAdapter]
    client: Client

    def audit(self, event: str, job_id: str) -> list[dict[str, Any]]:
        path = self.config.hpc.audit.log_path
        return [e for e in read_events(path) if e["event_type"] == event and e["job_id"] == job_id]

    def queue_full(self, cluster_id: str) -> list[dict[str, Any]]:
        """The ``job_queue_full`` records of a cluster's poller, one per round that left jobs waiting."""
        path = self.config.hpc.audit.log_path
        events = read_events(path)
        return [e for e in events if e["event_type"] == "job_queue_full" and e["cluster_id"] == cluster_id]

    async def workflow_queue(self, job_id: str) -> str | None:
        """The task queue the job's workflow was started on, if it has one."""
        try:
            return (await self.client.get_workflow_handle(job_id).describe()).task_queue
        except RPCError:
            return None


@pytest.fixture
def base(tmp_path: Path) -> Config:
    return cluster_config(tmp_path, [A, B], routing={"enforcement_mode": "permissive"})


@asynccontextmanager
async def serving(
    client: Client, base: Config, key_path: Path, adapters: dict[str, MemoryAdapter]
) -> AsyncIterator[Provider]:
    """Worker 1 serves A (and runs A's poller), worker 2 serves B (and runs B's): the same provider config, each
    host's own ``serve`` flags."""
    ledger = provider_ledger(base, key_path)
    add_offering_b(ledger)
    secrets = Secrets(provider_signing_key_path=key_path)
    workers = []
    try:
        for cluster_id in (A, B):
            process = WorkerProcess(
                cluster_config_serving(base, cluster_id),
                secrets,
                with_poller=True,
                chain=ledger,
                adapters={cluster_id: adapters[cluster_id]},
                client=client,
            )
            await process.start()
            workers.append(process)
        yield Provider(base, ledger, adapters, client)
    finally:
        for process in workers:
            await process.stop()


@pytest.fixture
async def two_workers(client: Client, base: Config, key_path: Path) -> AsyncIterator[Provider]:
    async with serving(client, base, key_path, {A: MemoryAdapter(), B: MemoryAdapter()}) as provider:
        yield provider


OFFERING_B = "offering-b"


def add_offering_b(ledger: LocalLedger) -> None:
    """B's own offering (the pipeline's ``offering-standard`` prices A): a job runs on B only if it bought this."""
    ledger.add_queue(
        PricedQueue(
            offering_id=OFFERING_B,
            cluster_id=B,
            partition="debug",
            pricing=Pricing(node_hour=Decimal("72"), minimum_charge=Decimal("0.01")),
        )
    )


def cluster_config_serving(base: Config, cluster_id: str) -> Config:
    """``base`` as the config of the host that serves only ``cluster_id``."""
    clusters = [c.model_copy(update={"serve": c.cluster_id == cluster_id}) for c in base.hpc.clusters]
    return base.model_copy(update={"hpc": base.hpc.model_copy(update={"clusters": clusters})})


async def test_a_job_decided_for_the_other_workers_cluster_runs_on_its_task_queue(
    two_workers: Provider,
) -> None:
    p = two_workers
    # Bought on B, asked for A, decided for B by the chain: B's poller takes it.
    job_id = submit(p.ledger, p.config, decide=B, offering_id=OFFERING_B, cluster_id=A)
    result = await wait_result(p.client, job_id)
    assert result.state == JobState.COMPLETED
    assert (p.adapters[A].submits, p.adapters[B].submits) == (0, 1), "B's scheduler ran it, A's never saw it"
    assert p.adapters[B].status_queries >= 1 and p.adapters[A].status_queries == 0
    job = p.ledger.job(job_id)
    assert job is not None and job.cluster_id == B
    records = p.ledger.usage_records(job_id)
    assert records and {r.cluster_id for r in records} == {B}
    assert records[-1].record_id == f"{B}/{job_id}/{len(records)}"
    assert [e["cluster_id"] for e in p.audit("job_submitted", job_id)] == [B]
    # Operators find the job under its cluster (and B's poller counts it against B's limit).
    desc = await p.client.get_workflow_handle(job_id).describe()
    assert desc.typed_search_attributes.get(SearchAttributeKey.for_keyword("VeClusterId")) == B
    assert desc.task_queue == task_queue(p.config, B), "started by B's poller on B's task queue"


async def test_permissive_fallback_moves_a_job_from_an_unavailable_cluster_to_the_other_worker(
    two_workers: Provider,
) -> None:
    p = two_workers
    p.ledger.set_cluster_state(A, "offline")
    # Asked for A, bought on B; no decision yet: permissive asks the chain, which picks B as a fallback.
    job_id = submit(p.ledger, p.config, offering_id=OFFERING_B, cluster_id=A)
    result = await wait_result(p.client, job_id)
    assert result.state == JobState.COMPLETED
    assert (p.adapters[A].submits, p.adapters[B].submits) == (0, 1)
    [decision] = p.ledger.decisions(job_id)
    assert decision.selected_cluster_id == B and decision.is_fallback
    [fallback] = p.audit("routing_fallback_used", job_id)
    assert fallback["cluster_id"] == B
    assert fallback["details"]["reason"] == f"requested cluster {A} is unavailable or full"
    violations = [e["details"]["violation_type"] for e in p.audit("routing_violation", job_id)]
    assert violations == ["missing_decision"]
    assert p.ledger.settlement(job_id) is not None

    # The new code path replays from its own history (what CI does with the next release's histories).
    history = await p.client.get_workflow_handle(job_id).fetch_history()
    markers = [
        e.marker_recorded_event_attributes
        for e in history.events
        if e.HasField("marker_recorded_event_attributes")
    ]
    assert any(PATCH_MULTI_CLUSTER.encode() in m.SerializeToString() for m in markers)
    replayer = Replayer(workflows=[HPCJobWorkflow], data_converter=pydantic_data_converter)
    replayed = await replayer.replay_workflow(
        WorkflowHistory.from_json(job_id, history.to_json()), raise_on_replay_failure=False
    )
    assert replayed.replay_failure is None


async def test_a_job_for_a_cluster_nobody_listed_stays_strict(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """Strict routing never follows a decision to a cluster outside the provider's config."""
    base = cluster_config(tmp_path, [A, B])
    ledger = provider_ledger(base, key_path)
    add_offering_b(ledger)
    adapters = {A: MemoryAdapter(), B: MemoryAdapter()}
    process = WorkerProcess(
        base,
        Secrets(provider_signing_key_path=key_path),
        with_poller=True,
        chain=ledger,
        adapters=dict(adapters),
        client=client,
    )
    await process.start()
    try:
        assert process.cluster_ids == [A, B], "one process serves both clusters from one config"
        job_id = submit(ledger, base, decide="cluster-elsewhere")
        result = await wait_result(client, job_id)
        assert result.state == JobState.FAILED and "routing_rejected" in result.message
        ok = submit(ledger, base, decide=B, offering_id=OFFERING_B)
        assert (await wait_result(client, ok)).state == JobState.COMPLETED
        assert (adapters[A].submits, adapters[B].submits) == (0, 1)
    finally:
        await process.stop()


async def test_a_fallback_to_a_cluster_the_offering_does_not_price_is_refused(two_workers: Provider) -> None:
    """Bought on A at A's prices; A goes offline and permissive routing falls back to B. Running there at A's
    prices is what a tenant who picks the cheaper cluster's offering would want: refused, escrow refunded."""
    p = two_workers
    p.ledger.set_cluster_state(A, "offline")
    job_id = submit(p.ledger, p.config)
    result = await wait_result(p.client, job_id)
    assert result.state == JobState.FAILED
    assert result.message == (
        f"validation_failed: offering offering-standard is priced for cluster {A}, not for {B} where the job "
        "was routed"
    )
    assert (p.adapters[A].submits, p.adapters[B].submits) == (0, 0)
    assert [e["cluster_id"] for e in p.audit("routing_fallback_used", job_id)] == [B]
    [refused] = p.audit("job_validation_failed", job_id)
    assert refused["error_msg"] == result.message.removeprefix("validation_failed: ")
    settlement = p.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged == 0 and settlement.refunded == settlement.escrow


def live(adapter: MemoryAdapter) -> int:
    return sum(1 for job in adapter.jobs.values() if job.cancelled_at is None)


async def test_max_concurrent_jobs_bounds_the_cluster_jobs_are_decided_for(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """Nine jobs asked for A and decided for B, both limits 3, both pollers running. B's poller takes them (they
    run on B), so B never runs more than 3 and the rest wait on chain; before, A's poller started them, counted
    only its own cluster's workflows, and all nine ran on B at once."""
    base = cluster_config(
        tmp_path,
        [A, B],
        routing={"enforcement_mode": "permissive"},
        hpc={"job_service": {"max_concurrent_jobs": 3, "job_poll_interval": "1s"}},
    )
    forever = Script(steps=[(0, JobState.QUEUED), (0.5, JobState.RUNNING)])
    adapters = {A: MemoryAdapter(default=forever), B: MemoryAdapter(default=forever)}
    async with serving(client, base, key_path, adapters) as p:
        jobs = [submit(p.ledger, base, decide=B, offering_id=OFFERING_B, cluster_id=A) for _ in range(9)]
        try:
            peak, deadline = 0, time.monotonic() + 60
            while live(adapters[B]) < 3 or len(p.queue_full(B)) < 5:  # a few of B's rounds after the 3 ran
                peak = max(peak, live(adapters[B]))
                assert peak <= 3, f"{peak} jobs ran on cluster B at once for a limit of 3"
                assert time.monotonic() < deadline, f"{live(adapters[B])} jobs run on B"
                await asyncio.sleep(0.1)
            peak = max(peak, live(adapters[B]))
            assert peak == 3, f"{peak} jobs ran on cluster B at once for a limit of 3"
            assert adapters[A].submits == 0 and not p.queue_full(A), "A's poller never saw them"
            assert p.queue_full(B)[-1]["details"] == {"waiting": 6, "running": 3, "max_concurrent_jobs": 3}
            started = [job for job in jobs if (await p.workflow_queue(job)) is not None]
            assert len(started) == 3 and {await p.workflow_queue(job) for job in started} == {
                task_queue(base, B)
            }
        finally:
            await terminate_all(client, jobs)
