"""Edges of the intake and the reconciler found in review: a spec that today's rules refuse on a job an earlier
release took, two pollers racing a tenant's cancel, and a job id held by a workflow of another kind.

Real dev server, LocalLedger, the real poller and reconciler; workflows started on a task queue no worker polls
stand for runs that exist but have not done anything yet.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from activities.chain.client import ChainJob, StatusReport
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter
from tests.pipeline_harness import Pipeline, running_pipeline
from tests.poller_support import FaultyClient, idle_queue, start_idle, terminate_all
from virtengine_hpc.states import JobState
from workers.metrics import MeteredAuditLog, WorkerMetrics
from workers.poller import ChainPoller, PollStats
from workers.reconciler import Reconciler
from workers.wiring import job_settings


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"max_concurrent_jobs": 4}}
    )
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        yield p


async def test_the_reconciler_closes_a_job_whose_spec_todays_rules_refuse(
    pipe: Pipeline, client: Client
) -> None:
    # Taken by an earlier release that allowed 65 environment variables (the limit is 64 now); running; no workflow.
    job_id = pipe.submit(environment={f"V{i}": "x" for i in range(65)})
    for state in (JobState.QUEUED, JobState.RUNNING):
        await pipe.ledger.report_status(
            StatusReport(job_id=job_id, state=state, cluster_id=pipe.cluster_id, scheduler_job_id="77")
        )
    metrics = WorkerMetrics()
    rec = Reconciler(
        FaultyClient(client).as_client(),
        pipe.ledger,
        pipe.config,
        MeteredAuditLog(pipe.config.hpc.audit, metrics),
        task_queue=idle_queue(),
        settings=job_settings(pipe.config),
        metrics=metrics,
    )
    stats = await rec.reconcile_once()
    try:
        assert stats.failed == [], pipe.audit_events("job_reconciled", job_id)
        assert stats.recovered == [job_id], "its recovery run needs only the job's ids, not a valid program"
    finally:
        await terminate_all(client, stats.recovered)


async def test_a_job_whose_id_a_node_workflow_holds_is_refused_not_left_pending(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = f"node-{pipe.cluster_id}-n{uuid.uuid4().hex[:6]}"  # a node workflow id of an earlier release
    node = await client.start_workflow("NodeWorkflow", id=job_id, task_queue=queue)
    try:
        pipe.submit(job_id=job_id)
        poller = ChainPoller(
            client,
            pipe.ledger,
            pipe.config,
            pipe.deps.audit,
            task_queue=queue,
            settings=job_settings(pipe.config),
        )
        stats = await poller.poll_once()
        job = pipe.ledger.job(job_id)
        assert job is not None and job.state == JobState.FAILED, f"chain says {job}; poll {stats}"
        assert "taken by a NodeWorkflow workflow" in job.status_message
        assert (await node.describe()).status == WorkflowExecutionStatus.RUNNING, (
            "the node's workflow is untouched"
        )
    finally:
        await node.terminate("test")


async def test_a_cancelled_job_whose_id_a_node_workflow_holds_is_refused_not_left_pending(
    pipe: Pipeline, client: Client
) -> None:
    """The tenant has cancelled it too: the cancellation loop's signal reaches the node's workflow (which has no use
    for it), and the intake, which leaves cancelled jobs to that loop, still looks at it once it was signalled:
    refused on chain, not pending for ever with its escrow held."""
    queue = idle_queue()
    job_id = f"node-{pipe.cluster_id}-n{uuid.uuid4().hex[:6]}"  # a node workflow id of an earlier release
    node = await client.start_workflow("NodeWorkflow", id=job_id, task_queue=queue)
    try:
        pipe.submit(job_id=job_id)
        pipe.ledger.request_cancel(job_id)
        poller = ChainPoller(
            client,
            pipe.ledger,
            pipe.config,
            pipe.deps.audit,
            task_queue=queue,
            settings=job_settings(pipe.config),
        )
        stats = await poller.poll_once()
        job = pipe.ledger.job(job_id)
        assert job is not None and job.state == JobState.FAILED, f"chain says {job}; poll {stats}"
        assert "taken by a NodeWorkflow workflow" in job.status_message
    finally:
        await node.terminate("test")


class _AnotherPollerStartsIt:
    """The ledger as poller A sees it while poller B starts the job's workflow between A's describe (no workflow
    yet) and A's read of the chain."""

    def __init__(self, pipe: Pipeline, queue: str, job_id: str) -> None:
        self.pipe, self.queue, self.job_id, self.started = pipe, queue, job_id, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pipe.ledger, name)

    async def get_job(self, job_id: str) -> ChainJob | None:
        if job_id == self.job_id and not self.started:
            await start_idle(self.pipe, job_id, self.queue)  # poller B's normal start
            self.started = True
        return await self.pipe.ledger.get_job(job_id)


async def test_a_tenant_cancel_racing_another_pollers_start_never_refunds_a_job_a_workflow_holds(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = pipe.submit()
    pipe.ledger.request_cancel(job_id)
    chain = _AnotherPollerStartsIt(pipe, queue, job_id)
    poller_a = ChainPoller(
        client,
        chain,  # type: ignore[arg-type]
        pipe.config,
        pipe.deps.audit,
        task_queue=queue,
        settings=job_settings(pipe.config),
    )
    try:
        await poller_a._forward_cancellations(PollStats())
        desc = await client.get_workflow_handle(job_id).describe()
        job = pipe.ledger.job(job_id)
        assert job is not None and desc.status == WorkflowExecutionStatus.RUNNING
        assert job.state == JobState.PENDING, (
            "the poller leaves the job to its workflow, which got the cancel"
        )
        assert pipe.ledger.settlement(job_id) is None, "nothing refunded behind the workflow's back"
    finally:
        await terminate_all(client, [job_id])


async def test_a_tenant_cancel_of_a_job_no_workflow_took_is_carried_out_by_its_workflow(
    pipe: Pipeline,
) -> None:
    job_id = pipe.submit()
    pipe.ledger.request_cancel(job_id)  # before any poll: the poller's first round sees the cancel first
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == JobState.CANCELLED
    assert isinstance(pipe.adapter, MemoryAdapter) and pipe.adapter.submits == 0, (
        "nothing reached the scheduler"
    )
    assert pipe.ledger.balance("virtengine1tenant0alice") == 100000, "refunded in full"
