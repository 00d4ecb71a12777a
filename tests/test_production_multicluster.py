"""Several clusters per provider: a task queue per cluster, workers that serve one or several of them, and routing
that moves a job to the task queue of the cluster it runs on.

Two worker processes (in process here, each with its own activities, adapters and config, as on two hosts) share
one Temporal dev server and one chain. The poller of cluster A starts every job on A's task queue; what the
provider notices is which cluster's scheduler got the job, what the chain and the audit log say, and that the
job's records come from that cluster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHistory
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from activities.audit import read_events
from activities.chain.local_ledger import LocalLedger
from tests.memory_adapter import MemoryAdapter
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


@pytest.fixture
def base(tmp_path: Path) -> Config:
    return cluster_config(tmp_path, [A, B], routing={"enforcement_mode": "permissive"})


@pytest.fixture
async def two_workers(client: Client, base: Config, key_path: Path) -> AsyncIterator[Provider]:
    """Worker 1 serves A (and runs A's poller), worker 2 serves B: the same provider config, each host's own
    ``serve`` flags."""
    ledger = provider_ledger(base, key_path)
    add_offering_b(ledger)
    adapters = {A: MemoryAdapter(), B: MemoryAdapter()}
    secrets = Secrets(provider_signing_key_path=key_path)
    workers = []
    for cluster_id, poller in ((A, True), (B, False)):
        config = cluster_config_serving(base, cluster_id)
        process = WorkerProcess(
            config,
            secrets,
            with_poller=poller,
            chain=ledger,
            adapters={cluster_id: adapters[cluster_id]},
            client=client,
        )
        await process.start()
        workers.append(process)
    try:
        yield Provider(base, ledger, adapters, client)
    finally:
        for process in workers:
            await process.stop()


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
    # Bought on B, asked for A (so A's poller takes it), decided for B by the chain.
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
    # Operators find the job under its cluster (and the poller counts it against B's limit).
    desc = await p.client.get_workflow_handle(job_id).describe()
    assert desc.typed_search_attributes.get(SearchAttributeKey.for_keyword("VeClusterId")) == B
    assert desc.task_queue == task_queue(p.config, A), "the workflow itself stays on the queue it started on"


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
