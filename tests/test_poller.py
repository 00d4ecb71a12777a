"""The chain poller on a real Temporal dev server: tenant cancellations never touch the chain while a workflow may
still run the job, and no job, however stuck, keeps the others from starting.

Workflows started on a task queue that no worker serves stay open and do nothing, which holds a job exactly where a
test needs it (pending on chain while its workflow is open); faults are injected by a thin wrapper around the real
client (``tests/poller_support.py``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCStatusCode

from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from tests.poller_support import (
    FaultyClient,
    idle_queue,
    rpc_error,
    start_idle,
    started_input,
    terminate_all,
    visibility_shows,
)
from virtengine_hpc.messages import JobResult
from virtengine_hpc.states import JobState
from workers.metrics import WorkerMetrics
from workers.poller import ChainPoller
from workers.wiring import job_settings
from workers.worker import make_worker

FUNDS = Decimal("100000")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"max_concurrent_jobs": 4}},
    )
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        yield p


def poller(
    pipe: Pipeline,
    client: Client | FaultyClient,
    queue: str,
    *,
    metrics: WorkerMetrics | None = None,
    clock: Clock | None = None,
) -> ChainPoller:
    real = client.as_client() if isinstance(client, FaultyClient) else client
    return ChainPoller(
        real,
        pipe.ledger,
        pipe.config,
        pipe.deps.audit,
        task_queue=queue,
        settings=job_settings(pipe.config),
        metrics=metrics,
        **({"clock": clock} if clock else {}),
    )


def sample(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(f"virtengine_hpc_{name}", labels) or 0.0


# ---- tenant cancellations --------------------------------------------------------------------------------------


async def test_a_tenant_cancel_that_reaches_a_workflow_before_it_submitted_is_audited_once(
    pipe: Pipeline, client: Client
) -> None:
    """The poller started the job's workflow and the tenant cancels before it submitted anything (here no worker
    has run it yet): the cancel reaches the running workflow as a signal and the job ends cancelled without a
    scheduler job. That writes one ``job_cancelled`` record with the tenant's reason, as every other cancel does
    (before: only ``job_lifecycle_event`` and ``status_reported``)."""
    queue = idle_queue()
    job_id = pipe.submit()
    assert (await poller(pipe, client, queue).poll_once()).started == [job_id]
    pipe.ledger.request_cancel(job_id)
    assert (await poller(pipe, client, queue).poll_once()).cancelled == [job_id]
    assert pipe.audit_events("job_cancelled", job_id) == [], "signalled: the workflow closes the job"
    async with make_worker(client, pipe.deps, queue=queue):
        result = await client.get_workflow_handle(job_id, result_type=JobResult).result()
    assert result.state == JobState.CANCELLED and result.scheduler_job_id is None
    assert isinstance(pipe.adapter, MemoryAdapter) and pipe.adapter.submits == 0, (
        "nothing reached the scheduler"
    )
    records = pipe.audit_events("job_cancelled", job_id)
    assert [(r["details"]["reason"], r["details"]["scheduler_job_id"]) for r in records] == [
        ("cancelled by the tenant on chain", None)
    ]


async def test_a_cancel_signal_that_fails_for_another_reason_than_not_found_leaves_the_chain_alone(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = pipe.submit()
    assert (await poller(pipe, client, queue).poll_once()).started == [job_id]  # open, not yet on chain
    pipe.ledger.request_cancel(job_id)

    unavailable = FaultyClient(client, signal_error=rpc_error(RPCStatusCode.UNAVAILABLE, "connection reset"))
    flaky = poller(pipe, unavailable, queue)
    for _ in range(2):
        assert (await flaky.poll_once()).cancelled == []
    job = pipe.ledger.job(job_id)
    assert job is not None and job.state == JobState.PENDING, "the workflow still owns the job"
    assert pipe.ledger.settlement(job_id) is None and pipe.ledger.balance(TENANT) == FUNDS - Decimal("100")
    assert pipe.audit_events("job_cancelled", job_id) == []
    assert (await client.get_workflow_handle(job_id).describe()).status == WorkflowExecutionStatus.RUNNING

    # Once Temporal answers, the cancel reaches the workflow, which ends the job on chain (and refunds it).
    assert (await poller(pipe, client, queue).poll_once()).cancelled == [job_id]
    async with make_worker(client, pipe.deps, queue=queue):
        result = await client.get_workflow_handle(job_id, result_type=JobResult).result()
    assert result.state == JobState.CANCELLED
    assert pipe.ledger.job(job_id).status_message == "cancelled by the tenant on chain"  # type: ignore[union-attr]
    assert pipe.ledger.balance(TENANT) == FUNDS


async def test_a_job_cancelled_before_any_workflow_ran_is_cancelled_and_refunded_on_chain(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = make_config(
        tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"max_concurrent_jobs": 1}}
    )
    scheduler = MemoryAdapter(default=Script([(0, JobState.QUEUED), (600, JobState.RUNNING)]))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        first, waiting = p.submit(), p.submit()
        chain_poller = poller(p, client, task_queue)
        assert (await chain_poller.poll_once()).started == [first]  # the only slot
        p.ledger.request_cancel(waiting)
        stats = await chain_poller.poll_once()
        assert stats.cancelled == [waiting] and stats.started == []
        # Its workflow is started with the cancel in it (signal-with-start) and ends it on chain itself, so no
        # other poller can start it behind a refund; it never reaches the scheduler.
        results = await p.run_until_done([waiting])
        assert results[waiting].state == JobState.CANCELLED
        assert p.ledger.job(waiting).state == JobState.CANCELLED  # type: ignore[union-attr]
        assert p.ledger.settlement(waiting) is not None
        assert [job.workflow_id for job in scheduler.jobs.values()] == [first]
        assert [e["details"]["reason"] for e in p.audit_events("job_cancelled", waiting)] == [
            "cancelled before it started"
        ]
        await terminate_all(client, [first])


async def test_a_cancel_for_a_closed_workflow_goes_to_the_reconciler_not_straight_to_the_chain(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = pipe.submit()
    handle = await start_idle(pipe, job_id, queue)
    await handle.terminate("operator pressed Terminate")  # perhaps after it had submitted: nobody knows
    pipe.ledger.request_cancel(job_id)

    stats = await poller(pipe, client, queue).poll_once()
    assert stats.cancelled == []
    assert pipe.ledger.job(job_id).state == JobState.PENDING, "never closed behind a scheduler job's back"  # type: ignore[union-attr]
    recovery = (await started_input(client, job_id)).recovery
    assert recovery is not None
    assert (recovery.closed_status, recovery.chain_state) == ("TERMINATED", JobState.PENDING)
    assert "tenant asked to cancel" in recovery.reason
    [event] = pipe.audit_events("job_reconciled", job_id)
    assert event["details"]["closed_status"] == "TERMINATED"
    await terminate_all(client, [job_id])


# ---- intake never stalls ---------------------------------------------------------------------------------------


async def test_jobs_whose_workflows_closed_do_not_keep_a_fresh_job_from_starting(
    pipe: Pipeline, client: Client
) -> None:
    """More stuck jobs than the fetch window (max_concurrent_jobs + 100) ahead of a fresh one: the reference
    retried their starts for ever (REJECT_DUPLICATE) and the fresh job was never even fetched."""
    queue = idle_queue()
    stuck = [pipe.submit() for _ in range(pipe.config.hpc.job_service.max_concurrent_jobs + 101)]
    for chunk in range(0, len(stuck), 25):
        handles = await asyncio.gather(*(start_idle(pipe, j, queue) for j in stuck[chunk : chunk + 25]))
        await asyncio.gather(*(h.terminate("closed before it reported") for h in handles))
    await visibility_shows(client, dict.fromkeys(stuck, WorkflowExecutionStatus.TERMINATED))
    fresh = pipe.submit()

    counting = FaultyClient(client)
    chain_poller = poller(pipe, counting, queue)
    stats = await chain_poller.poll_once()
    assert stats.started == [fresh]
    assert sorted(stats.recovered) == sorted(stuck), "each stuck job got the run that closes it"
    assert len(pipe.audit_events("job_reconciled")) == len(stuck)

    again = await chain_poller.poll_once()
    assert again.recovered == [] and again.started == []
    assert {counting.start_attempts[j] for j in stuck} == {2}, "one refused start and one recovery run each"
    await terminate_all(client, [*stuck, fresh])


async def test_a_job_whose_start_fails_is_held_back_while_the_others_start(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    bad, good = pipe.submit(), pipe.submit()
    # Any failure of this one start but the size of its input (that job is refused outright: test_payloads.py).
    faulty = FaultyClient(client, start_errors={bad: rpc_error(RPCStatusCode.INVALID_ARGUMENT)})
    metrics, clock = WorkerMetrics(), Clock()
    chain_poller = poller(pipe, faulty, queue, metrics=metrics, clock=clock)

    stats = await chain_poller.poll_once()
    assert stats.started == [good] and stats.held == [bad]
    assert sample(metrics, "poller_starts_total", cluster=pipe.cluster_id) == 1
    assert sample(metrics, "poller_start_failures_total", cluster=pipe.cluster_id) == 1
    assert sample(metrics, "chain_pending_jobs", cluster=pipe.cluster_id) == 1  # the held one

    assert (await chain_poller.poll_once()).held == [bad]
    assert faulty.start_attempts[bad] == 1, "not tried again before its backoff is over"

    clock.now += 60
    faulty.start_errors.clear()
    assert (await chain_poller.poll_once()).started == [bad]
    assert faulty.start_attempts[bad] == 2
    job = pipe.ledger.job(bad)
    assert job is not None and job.state == JobState.PENDING
    await terminate_all(client, [bad, good])
