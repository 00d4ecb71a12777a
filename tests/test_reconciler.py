"""The reconciler on a real Temporal dev server: it finds the chain jobs that are not final while no workflow is
open for them, starts one recovery run for each with what it knows (why, how the earlier run closed, its scheduler
job, the chain state), audits and counts each finding, leaves open workflows and waiting jobs alone, and never
hammers a job it could not close.

Workflows here run on a task queue that no worker serves, so that what is tested is the reconciler's own decision
(the recovery run's behaviour is the job workflow's, tested with it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCStatusCode

from activities.chain.client import ChainJob, StatusReport
from activities.chain.local_ledger import LocalLedger
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter
from tests.pipeline_harness import Pipeline, running_pipeline
from tests.poller_support import (
    FaultyClient,
    idle_queue,
    rpc_error,
    start_idle,
    started_input,
    terminate_all,
    visibility_shows,
)
from virtengine_hpc.messages import Recovery
from virtengine_hpc.states import JobState
from workers.metrics import MeteredAuditLog, WorkerMetrics
from workers.reconciler import Reconciler
from workers.wiring import job_settings
from workflows.hpc_job import SA_SCHEDULER_JOB, SA_STATE

INTERVAL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        yield p


def reconciler(
    pipe: Pipeline, client: FaultyClient, queue: str, metrics: WorkerMetrics, clock: Clock, page_size: int = 2
) -> Reconciler:
    return Reconciler(
        client.as_client(),
        pipe.ledger,
        pipe.config,
        MeteredAuditLog(pipe.config.hpc.audit, metrics),
        task_queue=queue,
        settings=job_settings(pipe.config),
        metrics=metrics,
        clock=clock,
        page_size=page_size,
    )


async def report(pipe: Pipeline, job_id: str, *states: JobState, scheduler_job_id: str | None = None) -> None:
    for state in states:
        await pipe.ledger.report_status(
            StatusReport(
                job_id=job_id, state=state, cluster_id=pipe.cluster_id, scheduler_job_id=scheduler_job_id
            )
        )


def counted(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(f"virtengine_hpc_{name}", labels) or 0.0


async def test_closed_or_missing_workflows_get_one_recovery_run_and_open_ones_are_left_alone(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    terminated = pipe.submit()  # ran, then an operator pressed Terminate
    await start_idle(pipe, terminated, queue, scheduler_job_id="4242")
    await report(pipe, terminated, JobState.QUEUED, JobState.RUNNING)
    await client.get_workflow_handle(terminated).terminate("operator")

    never_reported = pipe.submit()  # its workflow closed before it reported anything: still pending on chain
    await (await start_idle(pipe, never_reported, queue)).terminate("operator")

    orphan = pipe.submit()  # the chain shows it running, but there is no workflow at all
    await report(pipe, orphan, JobState.QUEUED, JobState.RUNNING, scheduler_job_id="77")

    running = pipe.submit()  # an open workflow owns it
    await start_idle(pipe, running, queue)
    await report(pipe, running, JobState.QUEUED)
    waiting = pipe.submit()  # pending, no workflow yet: the intake's, not a finding
    done = pipe.submit()  # final on chain: nothing to do even though its workflow is closed
    await (await start_idle(pipe, done, queue)).terminate("after it finished")
    await report(pipe, done, JobState.QUEUED, JobState.COMPLETED)
    closed_runs = dict.fromkeys([terminated, never_reported, done], WorkflowExecutionStatus.TERMINATED)
    await visibility_shows(client, {**closed_runs, running: WorkflowExecutionStatus.RUNNING})

    counting, metrics, clock = FaultyClient(client), WorkerMetrics(), Clock()
    rec = reconciler(pipe, counting, queue, metrics, clock)
    stats = await rec.reconcile_once()
    assert sorted(stats.recovered) == sorted([terminated, never_reported, orphan])
    assert stats.failed == [] and stats.checked == 5  # done is final: not even listed

    inputs = {job_id: (await started_input(client, job_id)).recovery for job_id in stats.recovered}
    assert inputs[terminated] == Recovery(
        reason="its workflow closed (TERMINATED) while the chain shows the job running",
        closed_status="TERMINATED",
        scheduler_job_id="4242",
        cluster_id=pipe.cluster_id,
        chain_state=JobState.RUNNING,
    )
    pending_one = inputs[never_reported]
    assert pending_one is not None
    assert (pending_one.closed_status, pending_one.chain_state) == ("TERMINATED", JobState.PENDING)
    assert inputs[orphan] == Recovery(
        reason="no workflow exists for the job while the chain shows it running",
        closed_status="",
        scheduler_job_id="77",
        chain_state=JobState.RUNNING,
    )
    described = await client.get_workflow_handle(terminated).describe()
    assert described.status == WorkflowExecutionStatus.RUNNING
    assert described.typed_search_attributes.get(SA_STATE) == "running"
    assert described.typed_search_attributes.get(SA_SCHEDULER_JOB) == "4242"

    events = {e["job_id"]: e for e in pipe.audit_events("job_reconciled")}
    assert sorted(events) == sorted(stats.recovered)
    assert events[terminated]["details"]["reason"] == (
        "its workflow closed (TERMINATED) while the chain shows the job running"
    )
    assert events[terminated]["details"]["closed_status"] == "TERMINATED"
    assert events[orphan]["details"]["closed_status"] == ""
    assert counted(metrics, "reconciled_jobs_total", cluster=pipe.cluster_id, closed_status="terminated") == 2
    assert counted(metrics, "reconciled_jobs_total", cluster=pipe.cluster_id, closed_status="none") == 1

    for _ in range(2):  # the recovery runs are open now: never a second one
        clock.now += 10 * INTERVAL
        again = await rec.reconcile_once()
        assert again.recovered == [] and again.retrying == 0
    assert counting.start_attempts == {terminated: 1, never_reported: 1, orphan: 1}, (
        f"{waiting} was left alone"
    )
    assert len(pipe.audit_events("job_reconciled")) == 3
    await terminate_all(client, [terminated, never_reported, orphan, running])


async def test_a_recovery_that_cannot_start_is_retried_with_backoff_and_reported(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = pipe.submit()
    await (await start_idle(pipe, job_id, queue)).terminate("operator")
    await report(pipe, job_id, JobState.QUEUED)
    await visibility_shows(client, {job_id: WorkflowExecutionStatus.TERMINATED})
    faulty = FaultyClient(client, start_errors={job_id: rpc_error(RPCStatusCode.INVALID_ARGUMENT)})
    metrics, clock = WorkerMetrics(), Clock()
    rec = reconciler(pipe, faulty, queue, metrics, clock)

    assert (await rec.reconcile_once()).failed == [job_id]
    [event] = pipe.audit_events("job_reconciled", job_id)
    assert event["success"] is False and "cannot start the recovery run" in event["error_msg"]
    assert counted(metrics, "reconcile_failures_total", cluster=pipe.cluster_id) == 1

    for _ in range(5):  # rounds come every interval or faster: the job is not tried again before its wait
        stats = await rec.reconcile_once()
        assert (stats.failed, stats.retrying, stats.deferred) == ([], 1, 1)
    assert faulty.start_attempts[job_id] == 1
    assert counted(metrics, "reconciler_retrying_jobs", cluster=pipe.cluster_id) == 1

    clock.now += INTERVAL  # first wait: one interval; then two
    assert (await rec.reconcile_once()).failed == [job_id]
    clock.now += INTERVAL
    assert (await rec.reconcile_once()).failed == []
    assert faulty.start_attempts[job_id] == 2

    faulty.start_errors.clear()
    clock.now += INTERVAL
    stats = await rec.reconcile_once()
    assert stats.recovered == [job_id]
    recovery = (await started_input(client, job_id)).recovery
    assert recovery is not None and recovery.chain_state == JobState.QUEUED
    assert [e["details"]["attempt"] for e in pipe.audit_events("job_reconciled", job_id)] == [1, 2, 3]
    await terminate_all(client, [job_id])


async def test_a_recovery_run_that_ends_without_closing_the_job_is_not_restarted_at_once(
    pipe: Pipeline, client: Client
) -> None:
    queue = idle_queue()
    job_id = pipe.submit()
    await report(pipe, job_id, JobState.QUEUED, JobState.RUNNING)  # no workflow at all
    counting, metrics, clock = FaultyClient(client), WorkerMetrics(), Clock()
    rec = reconciler(pipe, counting, queue, metrics, clock)
    assert (await rec.reconcile_once()).recovered == [job_id]

    await client.get_workflow_handle(job_id).terminate("the recovery run was terminated too")
    await visibility_shows(client, {job_id: WorkflowExecutionStatus.TERMINATED})
    stats = await rec.reconcile_once()
    assert (stats.recovered, stats.retrying, stats.deferred) == ([], 1, 1)
    clock.now += INTERVAL
    assert (await rec.reconcile_once()).recovered == [job_id]
    assert counting.start_attempts[job_id] == 2
    recovery = (await started_input(client, job_id)).recovery
    assert recovery is not None and recovery.closed_status == "TERMINATED"
    await terminate_all(client, [job_id])


async def test_the_parked_gauge_counts_parked_job_workflows_of_the_cluster(
    pipe: Pipeline, client: Client
) -> None:
    from temporalio.common import SearchAttributePair

    from virtengine_hpc.messages import JOB_WORKFLOW_NAME, JobWorkflowInput
    from virtengine_hpc.models import JobSpec
    from workflows.hpc_job import initial_search_attributes

    queue = idle_queue()
    parked = [pipe.submit(), pipe.submit()]
    for job_id in parked:  # as the job workflow marks a job parked for an operator
        job = pipe.ledger.job(job_id)
        assert job is not None
        inp = JobWorkflowInput(
            job=JobSpec.model_validate(job.raw_spec), cluster_id=pipe.cluster_id, provider=job.provider
        )
        await client.start_workflow(
            JOB_WORKFLOW_NAME,
            inp,
            id=job_id,
            task_queue=queue,
            search_attributes=initial_search_attributes(inp).updated(SearchAttributePair(SA_STATE, "parked")),
        )
        await report(pipe, job_id, JobState.QUEUED, JobState.RUNNING)
    metrics = WorkerMetrics()
    rec = reconciler(pipe, FaultyClient(client), queue, metrics, Clock())
    for _ in range(300):  # visibility lists new workflows a moment after they start
        await rec.reconcile_once()
        if counted(metrics, "jobs_parked", cluster=pipe.cluster_id) == 2:
            break
    assert counted(metrics, "jobs_parked", cluster=pipe.cluster_id) == 2
    assert counted(metrics, "reconciler_last_round_timestamp_seconds", cluster=pipe.cluster_id) > 0
    await terminate_all(client, parked)


async def test_a_round_that_breaks_does_not_end_the_reconciler(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(
        tmp_path,
        hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"reconcile_interval": "100ms"}},
    )
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        job_id = p.submit()
        await report(p, job_id, JobState.QUEUED, JobState.RUNNING)  # no workflow: a finding
        broken = BrokenOnce(p.ledger)
        rec = Reconciler(
            client, broken, config, p.deps.audit, task_queue=idle_queue(), settings=job_settings(config)
        )
        stop = asyncio.Event()
        loop = asyncio.create_task(rec.run(stop))
        try:
            for _ in range(300):
                if rec.rounds:
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await loop
        assert rec.rounds >= 1 and broken.calls >= 2
        assert "reconcile round failed" in caplog.text
        assert [e["job_id"] for e in p.audit_events("job_reconciled")] == [job_id]
        await terminate_all(client, [job_id])


class BrokenOnce:
    """The ledger, whose first ``open_jobs`` fails with an unexpected error (a bug, not an outage)."""

    def __init__(self, ledger: LocalLedger) -> None:
        self.ledger = ledger
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def open_jobs(self, *args: Any, **kwargs: Any) -> list[ChainJob]:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("unexpected")
        return await self.ledger.open_jobs(*args, **kwargs)
