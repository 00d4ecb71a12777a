"""No job left behind: every exit of a job's workflow ends the job on chain, its scheduler job stopped.

Each test drives a real workflow on the real dev server (in-memory scheduler, LocalLedger) through an exit that used
to leave the chain job open or the scheduler job running: a Temporal cancel (the Web UI's Cancel button), a step
that fails for good, a cancel the scheduler keeps refusing, accounting that cannot be sent (parked for an operator),
time the site suspended or requeued the job, a long queue, usage reporting switched off, and the reconciler's
recovery run after an operator terminated a workflow.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError

from activities.chain.client import AccountingReport, Settlement, StatusReport
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SubmitRequest, SubmitResult
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script, _Job
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.errors import ChainError, ChainUnavailable, SchedulerError, SchedulerUnavailable
from virtengine_hpc.messages import (
    JOB_WORKFLOW_NAME,
    JobResult,
    JobStatusView,
    JobWorkflowInput,
    Recovery,
    RetryRequest,
)
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics
from workers.wiring import job_settings
from workflows.hpc_job import LOCAL_STEP_ATTEMPTS, initial_search_attributes

Q, R, S, C = JobState.QUEUED, JobState.RUNNING, JobState.SUSPENDED, JobState.COMPLETED
CANCELLED, FAILED, TIMEOUT = JobState.CANCELLED, JobState.FAILED, JobState.TIMEOUT


class FaultyChain:
    """The ledger, with chosen calls failing the way a real chain can refuse them."""

    def __init__(self, ledger: LocalLedger) -> None:
        self.ledger = ledger
        self.refuse_status: dict[JobState, ChainError] = {}
        self.refuse_accounting: ChainError | None = None
        # The next N reports of a state find the chain busy (a transient refusal, retried).
        self.busy_status: dict[JobState, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def report_status(self, report: StatusReport) -> None:
        refusal = self.refuse_status.get(report.state)
        if refusal is not None:
            raise refusal
        if self.busy_status.get(report.state, 0) > 0:
            self.busy_status[report.state] -= 1
            raise ChainUnavailable("ledger is busy")
        await self.ledger.report_status(report)

    async def report_accounting(self, report: AccountingReport) -> Settlement:
        if self.refuse_accounting is not None:
            raise self.refuse_accounting
        return await self.ledger.report_accounting(report)


@dataclass
class StubbornScheduler(MemoryAdapter):
    """A scheduler whose cancel fails (``cancel_error``) until told otherwise; it counts every attempt."""

    cancel_error: Exception | None = None
    cancel_attempts: list[float] = field(default_factory=list)

    async def cancel(self, scheduler_job_id: str) -> None:
        self.cancel_attempts.append(time.monotonic())
        if self.cancel_error is not None:
            raise self.cancel_error
        await super().cancel(scheduler_job_id)


def new_config(tmp_path: Path, **hpc: Any) -> Any:
    return make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", **hpc})


@pytest.fixture
async def faulty(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    async with running_pipeline(
        client, new_config(tmp_path), key_path, StubbornScheduler(), task_queue, chain=FaultyChain
    ) as p:
        yield p


def sched(p: Pipeline) -> StubbornScheduler:
    assert isinstance(p.adapter, StubbornScheduler)
    return p.adapter


def chain(p: Pipeline) -> FaultyChain:
    assert isinstance(p.poller.chain, FaultyChain)
    return p.poller.chain


async def status(p: Pipeline, job_id: str) -> JobStatusView:
    return await p.handle(job_id).query("status", result_type=JobStatusView)


async def wait_for(p: Pipeline, job_id: str, check: Any, timeout: float = 30) -> JobStatusView:
    deadline = time.monotonic() + timeout
    while True:
        await p.poller.poll_once()
        try:
            view = await status(p, job_id)
            if check(view):
                return view
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{job_id}: condition not reached in {timeout}s")
        await asyncio.sleep(0.2)


def live_jobs_of(scheduler: MemoryAdapter, workflow_id: str) -> list[str]:
    """Scheduler jobs of a workflow that still hold (or will hold) the cluster: not ended, not cancelled."""
    live = []
    for jid, job in scheduler.jobs.items():
        state, _ = scheduler._state(job)
        if job.workflow_id == workflow_id and not state.final:
            live.append(jid)
    return live


async def closed(p: Pipeline, job_id: str, timeout: float = 60) -> WorkflowExecutionStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await p.poller.poll_once()
        desc = await p.handle(job_id).describe()
        if desc.status != WorkflowExecutionStatus.RUNNING:
            assert desc.status is not None
            return desc.status
        await asyncio.sleep(0.2)
    raise AssertionError(f"workflow {job_id} still open after {timeout}s")


async def spec_of(p: Pipeline, job_id: str) -> JobSpec:
    chain_job = await p.ledger.get_job(job_id)
    assert chain_job is not None
    return JobSpec.model_validate(chain_job.raw_spec)


# ---- Temporal cancel (the Web UI's Cancel button) ---------------------------------------------------------------


async def test_temporal_cancel_of_a_running_job_cancels_it_everywhere_and_settles(faulty: Pipeline) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.state == R)
    await asyncio.sleep(1.0)  # let it run a little: it is billed for that

    await faulty.handle(job_id).cancel()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    result: JobResult = await faulty.handle(job_id).result()
    assert result.state == CANCELLED
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == CANCELLED
    assert "Temporal workflow cancel" in job.status_message
    assert sched(faulty).cancels == [result.scheduler_job_id]
    assert live_jobs_of(sched(faulty), job_id) == []
    records = faulty.ledger.usage_records(job_id)
    assert records and records[-1].is_final and [r.is_final for r in records].count(True) == 1
    settlement = faulty.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged > 0


async def test_temporal_cancel_while_the_submit_is_under_way_leaves_no_scheduler_job(
    faulty: Pipeline,
) -> None:
    sched(faulty).submit_delay = 3.0
    sched(faulty).default = Script([(0, Q), (600, R)])
    job_id = faulty.submit()
    await faulty.wait_started(job_id)
    await asyncio.sleep(1.0)  # the submit attempt is inside the scheduler call now

    await faulty.handle(job_id).cancel()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    await asyncio.sleep(3.0)  # anything the attempt was still doing has had the time to land
    assert live_jobs_of(sched(faulty), job_id) == [], "no scheduler job of the cancelled workflow may run on"
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == CANCELLED
    assert faulty.ledger.balance(TENANT) == 100000, "a job that never ran is refunded in full"


# ---- a busy chain --------------------------------------------------------------------------------------------------


def lifecycle_of(p: Pipeline, job_id: str) -> list[str]:
    return [e["details"]["event"] for e in p.audit_events("job_lifecycle_event", job_id=job_id)]


async def test_a_queued_report_the_chain_is_too_busy_for_costs_the_submission_nothing(
    faulty: Pipeline,
) -> None:
    """The submission reports the job queued itself; when the chain is busy the workflow reports it instead: the
    job is submitted once (no submit attempt spent on the chain), reaches every state, and each is audited once."""
    sched(faulty).default = Script([(0, Q), (0.3, R), (2.0, C)], exit_code=0)
    chain(faulty).busy_status[Q] = 1
    job_id = faulty.submit()
    results = await faulty.run_until_done([job_id])
    assert results[job_id].state == C and faulty.states_of(job_id) == [Q, R, C]
    assert sched(faulty).submits == 1 and chain(faulty).busy_status[Q] == 0
    assert lifecycle_of(faulty, job_id) == ["submitted", "started", "completed"]


async def test_a_transition_the_chain_is_too_busy_for_goes_on_as_an_activity(faulty: Pipeline) -> None:
    """A lifecycle report is a local activity; one the chain keeps refusing as busy runs on as an ordinary activity
    (its retries cost the history nothing) after a few local attempts, and the job goes on as before."""
    sched(faulty).default = Script([(0, Q), (0.3, R), (2.0, C)], exit_code=0)
    chain(faulty).busy_status[R] = LOCAL_STEP_ATTEMPTS + 1
    job_id = faulty.submit()
    results = await faulty.run_until_done([job_id], timeout=120)
    assert results[job_id].state == C and faulty.states_of(job_id) == [Q, R, C]
    assert chain(faulty).busy_status[R] == 0
    assert len(faulty.audit_events("status_report_failed", job_id)) == LOCAL_STEP_ATTEMPTS + 1
    assert lifecycle_of(faulty, job_id) == ["submitted", "started", "completed"]
    activities = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        async for e in faulty.handle(job_id).fetch_history_events()
        if e.HasField("activity_task_scheduled_event_attributes")
    ]
    assert activities == ["submit_job", "report_transition"], "only the busy report ran as an activity"


async def test_a_lifecycle_report_run_again_after_the_job_ended_changes_nothing(faulty: Pipeline) -> None:
    """A local step runs again when its workflow task is lost (its marker with it) after the steps that followed
    it reached the chain: seen under load, a job whose ``running`` report ran again after ``completed`` was refused
    as an illegal transition and parked. Such a report of a state the job has left for a final one is done."""
    from temporalio.testing import ActivityEnvironment

    from virtengine_hpc.messages import TransitionInput

    sched(faulty).default = Script([(0, Q), (0.2, R), (0.6, C)], exit_code=0)
    job_id = faulty.submit()
    results = await faulty.run_until_done([job_id])
    assert results[job_id].state == C
    again = TransitionInput(
        job_id=job_id,
        cluster_id=faulty.cluster_id,
        old_state=Q,
        new_state=R,
        scheduler_job_id=results[job_id].scheduler_job_id,
    )
    await ActivityEnvironment().run(faulty.deps.activities.report_transition, again)
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == C
    assert faulty.audit_events("status_report_failed", job_id) == []
    chain(faulty).refuse_status[R] = ChainError("chain refuses running", transient=False)
    with pytest.raises(ApplicationError, match="refuses running"):  # any other refusal still fails the step
        await ActivityEnvironment().run(faulty.deps.activities.report_transition, again)


# ---- a step that fails for good ----------------------------------------------------------------------------------


async def test_a_status_report_refused_for_good_closes_the_job_as_failed_and_stops_it(
    faulty: Pipeline,
) -> None:
    sched(faulty).default = Script([(0, Q), (600, R)])
    chain(faulty).refuse_status[Q] = ChainError("chain refuses the transition", transient=False)
    job_id = faulty.submit()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED, "the workflow does not fail"
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == FAILED
    assert "report_transition failed" in job.status_message and "refuses" in job.status_message
    assert live_jobs_of(sched(faulty), job_id) == [], "the scheduler job it had submitted is cancelled"


async def test_a_routing_step_that_fails_for_good_fails_the_job_on_chain(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        # A cluster this worker has no adapter for: route_job raises ConfigError (non-retryable).
        job_id = p.submit(decide=False)
        other = f"elsewhere-{uuid.uuid4().hex[:6]}"
        inp = JobWorkflowInput(
            job=await spec_of(p, job_id),
            cluster_id=other,
            provider=config.provider.address,
            settings=job_settings(config),
        )
        handle = await client.start_workflow(
            JOB_WORKFLOW_NAME,
            inp,
            id=job_id,
            task_queue=task_queue,
            search_attributes=initial_search_attributes(inp),
            result_type=JobResult,
        )
        result = await asyncio.wait_for(handle.result(), 60)
        assert result.state == FAILED and "route_job failed" in result.message
        job = p.ledger.job(job_id)
        assert job is not None and job.state == FAILED and "no scheduler adapter" in job.status_message


# ---- cancels that fail -------------------------------------------------------------------------------------------


async def test_a_failing_cancel_backs_off_instead_of_looping(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, retry={"max_backoff": "3s"})
    scheduler = StubbornScheduler(default=Script([(0, Q), (0.2, R), (600, C)]))
    scheduler.cancel_error = SchedulerUnavailable("Unable to contact slurm controller")
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        await wait_for(p, job_id, lambda v: v.state == R)
        await p.handle(job_id).execute_update(
            "request_cancel", {"reason": "tenant"}, result_type=JobStatusView
        )
        await asyncio.sleep(12.0)
        attempts = len(scheduler.cancel_attempts)
        # Rounds of three attempts (max_retries 2), then pauses of 3 s and 6 s: three rounds at most in 12 s
        # (without the backoff a round follows the last at once: five or more).
        assert 3 <= attempts <= 9, f"{attempts} cancel attempts in 12 s"
        scheduler.cancel_error = None
        result = await asyncio.wait_for(p.handle(job_id).result(), 60)
        assert result.state == CANCELLED


async def test_a_deadline_cancel_that_fails_backs_off_too(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, job_service={"max_queue_wait": "1s"}, retry={"max_backoff": "3s"})
    scheduler = StubbornScheduler(default=Script([(0, Q)]))
    scheduler.cancel_error = SchedulerUnavailable("Unable to contact slurm controller")
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        await wait_for(p, job_id, lambda v: v.state == Q)
        await asyncio.sleep(12.0)
        attempts = len(scheduler.cancel_attempts)
        # Rounds of three attempts (max_retries 2), then pauses of 3 s and 6 s: three rounds at most in 12 s
        # (without the backoff a round follows the last at once: five or more).
        assert 3 <= attempts <= 9, f"{attempts} cancel attempts in 12 s"
        scheduler.cancel_error = None
        results = await p.run_until_done([job_id], timeout=60)
        assert results[job_id].state == TIMEOUT and "max_queue_wait" in results[job_id].message


async def test_a_cancel_the_scheduler_refuses_for_good_parks_the_job_until_an_operator_retries(
    faulty: Pipeline,
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    sched(faulty).cancel_error = SchedulerError("scancel: Invalid job id specified", transient=False)
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.state == R)
    await faulty.handle(job_id).execute_update(
        "request_cancel", {"reason": "tenant"}, result_type=JobStatusView
    )

    view = await wait_for(faulty, job_id, lambda v: v.parked is not None)
    assert "refuses to cancel" in (view.parked or "")
    tries = len(sched(faulty).cancel_attempts)
    await asyncio.sleep(2.0)
    assert len(sched(faulty).cancel_attempts) == tries, "a parked job does not keep trying"
    assert faulty.audit_events("job_parked", job_id)

    sched(faulty).cancel_error = None
    await faulty.handle(job_id).execute_update(
        "retry_parked", RetryRequest(note="fixed"), result_type=JobStatusView
    )
    result = await asyncio.wait_for(faulty.handle(job_id).result(), 60)
    assert result.state == CANCELLED


# ---- accounting that cannot be sent ------------------------------------------------------------------------------


async def cli(p: Pipeline, tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run ``virtengine-hpc`` as an operator would, against the test's Temporal server; (exit code, stdout)."""
    config = tmp_path / "operator.yaml"
    address = p.client.service_client.config.target_host
    config.write_text(
        json.dumps(
            {
                "hpc": {"cluster_id": p.cluster_id},
                "provider": {"address": p.config.provider.address},
                "temporal": {"address": address, "deployment_name": None},
            }
        )
    )
    exe = Path(sys.executable).parent / "virtengine-hpc"
    proc = await asyncio.create_subprocess_exec(
        str(exe), "-c", str(config), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_accounting_that_cannot_be_sent_parks_the_job_visibly_and_a_retry_settles_it(
    faulty: Pipeline, tmp_path: Path
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0)
    chain(faulty).refuse_accounting = ChainError("accounting rejected: totals mismatch", transient=False)
    job_id = faulty.submit()

    view = await wait_for(faulty, job_id, lambda v: v.parked is not None)
    assert "final usage record and accounting" in (view.parked or "") and "totals mismatch" in (
        view.parked or ""
    )
    job = faulty.ledger.job(job_id)
    assert job is not None and not job.state.final, "not reported final before it settles"
    query = f"WorkflowId = '{job_id}' AND VeJobState = 'parked'"
    for _ in range(50):
        if [w.id async for w in faulty.client.list_workflows(query)]:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("a parked job is not listed under VeJobState = 'parked'")
    [parked] = faulty.audit_events("job_parked", job_id)
    assert "totals mismatch" in parked["error_msg"]

    chain(faulty).refuse_accounting = None
    # What an operator types: the parked job is listed, and `jobs retry` sends it on.
    listed = await cli(faulty, tmp_path, "jobs", "list", "--state", "parked")
    assert listed[0] == 0 and job_id in listed[1] and "parked" in listed[1]
    retried = await cli(faulty, tmp_path, "jobs", "retry", job_id, "--note", "chain fixed")
    assert retried[0] == 0, retried
    result = await asyncio.wait_for(faulty.handle(job_id).result(), 60)
    assert result.state == C and result.charged is not None
    again = await cli(faulty, tmp_path, "jobs", "retry", job_id)
    assert again == (1, f"error: job {job_id}: workflow execution already completed\n"), "a one-line refusal"
    assert faulty.ledger.settlement(job_id) is not None
    assert [r.is_final for r in faulty.ledger.usage_records(job_id)].count(True) == 1


async def test_cancel_of_a_job_parked_while_it_was_being_closed_still_ends_it_everywhere(
    faulty: Pipeline,
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    sched(faulty).cancel_error = SchedulerUnavailable("Unable to contact slurm controller")
    chain(faulty).refuse_status[R] = ChainError("chain refuses running", transient=False)
    job_id = faulty.submit()
    view = await wait_for(faulty, job_id, lambda v: v.parked is not None, timeout=40)
    assert "report_transition failed" in (view.parked or "")

    sched(faulty).cancel_error = None
    chain(faulty).refuse_status.clear()
    await faulty.handle(job_id).cancel()  # the operator gives up on it: Cancel ends it everywhere

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state.final
    assert live_jobs_of(sched(faulty), job_id) == []
    assert (await status(faulty, job_id)).parked is None


async def test_cancel_of_a_job_parked_on_its_terminal_report_sends_no_second_final_record(
    faulty: Pipeline,
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0)
    chain(faulty).refuse_status[C] = ChainError("chain refuses completed", transient=False)
    job_id = faulty.submit()
    view = await wait_for(faulty, job_id, lambda v: v.parked is not None, timeout=40)
    assert "terminal status" in (view.parked or "")
    assert faulty.ledger.settlement(job_id) is not None, "settled; only the terminal report is missing"

    chain(faulty).refuse_status.clear()  # the chain is fixed; the operator presses Cancel instead of retry
    await faulty.handle(job_id).cancel()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == C, "it ends as it really ended: completed"
    assert [r.is_final for r in faulty.ledger.usage_records(job_id)].count(True) == 1


async def test_retry_of_a_job_that_is_not_parked_is_refused(faulty: Pipeline) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.state == R)
    with pytest.raises(WorkflowUpdateFailedError) as refused:
        await faulty.handle(job_id).execute_update("retry_parked", RetryRequest(), result_type=JobStatusView)
    assert "is not parked (running)" in str(refused.value.cause)
    await faulty.handle(job_id).cancel()


# ---- walltime counts running time only; queue waits -------------------------------------------------------------


async def test_walltime_counts_every_run_but_not_suspended_or_requeued_waits(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, job_service={"walltime_grace": "1s", "job_poll_interval": "300ms"})
    scheduler = MemoryAdapter()
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        # walltime 60 s: each job is on the cluster longer than 61 s (70 s, or 58 s and a requeue the chain must
        # see), but runs less than that in all.
        suspended = p.submit(walltime_seconds=60)
        requeued = p.submit(walltime_seconds=60)
        unseen = p.submit(
            walltime_seconds=60
        )  # requeued and running again within 10 ms: no poll sees it queued
        overrun = p.submit(walltime_seconds=60)
        # A job that requeues itself before each run reaches the limit the scheduler gives every run.
        self_requeuing = p.submit(walltime_seconds=60)
        scheduler.scripts = {
            suspended: Script([(0, Q), (0.2, R), (20, S), (50, R), (70, C)], exit_code=0),
            requeued: Script([(0, Q), (0.2, R), (30, Q), (42, R), (70, C)], exit_code=0),
            unseen: Script([(0, Q), (0.2, R), (30, Q), (30.01, R), (58, C)], exit_code=0),
            overrun: Script([(0, Q), (0.2, R), (600, C)], exit_code=0),
            self_requeuing: Script(
                [(0, Q), (0.2, R), (40, Q), (41, R), (81, Q), (82, R), (122, Q), (123, R), (600, C)],
                exit_code=0,
            ),
        }
        results = await p.run_until_done([suspended, requeued, unseen, overrun, self_requeuing], timeout=180)
        assert results[suspended].state == C, results[suspended].message
        assert results[requeued].state == C, results[requeued].message
        assert results[unseen].state == C, results[unseen].message
        assert p.states_of(unseen).count(R) == 2, (
            "the chain sees the requeue (a new start) even between polls"
        )
        assert results[overrun].state == TIMEOUT and "walltime" in results[overrun].message
        assert S in p.states_of(suspended)
        # Stopped in its second run, when its runs add up to walltime + grace, and billed for both runs.
        assert results[self_requeuing].state == TIMEOUT, results[self_requeuing].message
        assert "walltime" in results[self_requeuing].message
        assert p.states_of(self_requeuing).count(R) == 2, "never reached its third run"
        billed = sum_metrics([r.metrics for r in p.ledger.usage_records(self_requeuing)]).wall_clock_seconds
        assert 58 <= billed < 75, billed  # (the in-memory scheduler bills from the first start to the end)


async def test_a_job_that_names_no_walltime_gets_job_timeout_default(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, job_service={"job_timeout_default": "3h"})
    scheduler = MemoryAdapter(default=Script([(0, Q), (0.2, R), (1, C)], exit_code=0))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        unnamed = p.submit(walltime_seconds=None, max_price="1000")  # its budget must cover 3 h
        named = p.submit(walltime_seconds=600)
        results = await p.run_until_done([unnamed, named])
        assert results[unnamed].state == results[named].state == C, results[unnamed].message
        assert scheduler.walltimes == {unnamed: 3 * 3600, named: 600}


async def test_a_long_queue_is_not_a_timeout_unless_max_queue_wait_says_so(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, job_service={"job_timeout_default": "2s"})
    scheduler = MemoryAdapter(default=Script([(0, Q)]))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        await wait_for(p, job_id, lambda v: v.state == Q)
        await asyncio.sleep(5)
        assert (await status(p, job_id)).state == Q, "job_timeout_default is no queue-wait limit"
        assert scheduler.cancels == []
        await p.handle(job_id).cancel()

    config = new_config(tmp_path / "limited", job_service={"max_queue_wait": "2s"})
    scheduler = MemoryAdapter(default=Script([(0, Q)]))
    async with running_pipeline(client, config, key_path, scheduler, task_queue + "-q") as p:
        job_id = p.submit()
        results = await p.run_until_done([job_id], timeout=120)
        assert results[job_id].state == TIMEOUT and "max_queue_wait" in results[job_id].message
        assert scheduler.cancels, "the provider cancels the job in the scheduler"
        assert p.ledger.balance(TENANT) == 100000, "a job that never ran costs nothing"


# ---- usage reporting off -----------------------------------------------------------------------------------------


async def test_with_usage_reporting_off_a_job_that_ran_still_settles(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = new_config(tmp_path, usage_reporting={"enabled": False})
    scheduler = MemoryAdapter(default=Script([(0, Q), (0.2, R), (3, C)], exit_code=0))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        results = await p.run_until_done([job_id])
        assert results[job_id].state == C
        records = p.ledger.usage_records(job_id)
        assert [r.is_final for r in records] == [True], "no period records, exactly one final record"
        settlement = p.ledger.settlement(job_id)
        assert settlement is not None and settlement.charged > 0


# ---- the reconciler's recovery run -------------------------------------------------------------------------------


async def start_recovery(p: Pipeline, job_id: str, reason: str, **fields: Any) -> JobResult:
    spec = await spec_of(p, job_id)
    inp = JobWorkflowInput(
        job=spec,
        cluster_id=p.cluster_id,
        provider=p.config.provider.address,
        settings=job_settings(p.config),
        recovery=Recovery(reason=reason, chain_state=p.ledger.job(job_id).state, **fields),  # type: ignore[union-attr]
    )
    handle = await p.client.start_workflow(
        JOB_WORKFLOW_NAME,
        inp,
        id=job_id,
        task_queue=p.task_queue,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        search_attributes=initial_search_attributes(inp),
        result_type=JobResult,
    )
    return await asyncio.wait_for(handle.result(), 60)


async def test_recovery_run_after_terminate_stops_the_job_and_continues_its_records(
    faulty: Pipeline, key_path: Path
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.state == R and v.usage_records >= 1, timeout=40)
    before = await status(faulty, job_id)
    await faulty.handle(job_id).terminate("operator pressed Terminate")
    assert live_jobs_of(sched(faulty), job_id), "terminate alone leaves the scheduler job running"

    result = await start_recovery(
        faulty,
        job_id,
        "workflow TERMINATED",
        closed_status="TERMINATED",
        scheduler_job_id=before.scheduler_job_id,
    )

    assert result.state == CANCELLED
    assert live_jobs_of(sched(faulty), job_id) == []
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == CANCELLED and "reconciler" in job.status_message
    records = faulty.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1)), "no gap, no second record 1"
    assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
    assert faulty.ledger.settlement(job_id) is not None


async def test_recovery_run_finds_the_scheduler_job_when_the_closed_run_had_no_id(faulty: Pipeline) -> None:
    sched(faulty).default = Script([(0, Q), (600, R)])
    sched(faulty).submit_delay = 2.0
    job_id = faulty.submit()
    await faulty.wait_started(job_id)
    await asyncio.sleep(0.5)
    await faulty.handle(job_id).terminate("terminated during submit")
    await asyncio.sleep(2.5)  # the attempt that was submitting finishes its call

    result = await start_recovery(faulty, job_id, "workflow TERMINATED", closed_status="TERMINATED")

    assert result.state == CANCELLED
    assert live_jobs_of(sched(faulty), job_id) == []
    assert faulty.ledger.job(job_id).state == CANCELLED  # type: ignore[union-attr]


@dataclass
class ThreadedSubmitScheduler(StubbornScheduler):
    """Submits in a worker thread, as blocking transports do: cancelling the activity cannot stop the call."""

    thread_delay: float = 3.0

    async def submit(self, request: SubmitRequest, *, on_submitted: Any = None) -> SubmitResult:
        def blocking() -> SubmitResult:
            time.sleep(self.thread_delay)  # sbatch talking to a busy slurmctld
            job_id = str(1000 + len(self.jobs))
            self.jobs[job_id] = _Job(request.workflow_id, time.monotonic(), self.default)
            return SubmitResult(scheduler_job_id=job_id)

        self.submits += 1
        return await asyncio.get_running_loop().run_in_executor(None, blocking)


async def test_temporal_cancel_during_a_submit_that_cannot_be_interrupted_still_stops_the_job(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    scheduler = ThreadedSubmitScheduler(default=Script([(0, Q), (600, R)]))
    async with running_pipeline(client, new_config(tmp_path), key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        await p.wait_started(job_id)
        await asyncio.sleep(1.0)
        await p.handle(job_id).cancel()
        assert await closed(p, job_id) == WorkflowExecutionStatus.COMPLETED
        await asyncio.sleep(3.0)
        assert [job.workflow_id for job in scheduler.jobs.values()] == [job_id], "the thread did submit"
        assert live_jobs_of(scheduler, job_id) == [], "the job it submitted is found and cancelled"
        assert p.ledger.job(job_id).state == CANCELLED  # type: ignore[union-attr]


@dataclass
class SlowFindScheduler(StubbornScheduler):
    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        await asyncio.sleep(3.0)
        return await super().find(workflow_id, tenant)


async def test_temporal_cancel_during_a_recovery_run_still_closes_the_job(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    scheduler = SlowFindScheduler(default=Script([(0, Q), (0.2, R), (600, C)]))
    async with running_pipeline(client, new_config(tmp_path), key_path, scheduler, task_queue) as p:
        job_id = p.submit()
        await wait_for(p, job_id, lambda v: v.state == R)
        await p.handle(job_id).terminate("operator pressed Terminate")
        recovery = asyncio.create_task(start_recovery(p, job_id, "workflow TERMINATED"))
        await asyncio.sleep(1.5)  # recover_job is looking the scheduler job up
        await p.handle(job_id).cancel()
        result = await recovery
        assert result.state == CANCELLED
        assert live_jobs_of(scheduler, job_id) == []
        assert p.ledger.job(job_id).state == CANCELLED  # type: ignore[union-attr]


async def test_recovery_of_a_job_the_scheduler_lost_closes_it_with_its_recorded_usage(
    faulty: Pipeline,
) -> None:
    sched(faulty).default = Script([(0, Q), (0.2, R), (600, C)])
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.state == R and v.usage_records >= 1, timeout=40)
    await faulty.handle(job_id).terminate("operator pressed Terminate")
    sched(faulty).jobs.clear()  # the scheduler has no trace of it any more (lost with its accounting)

    result = await start_recovery(faulty, job_id, "workflow TERMINATED", closed_status="TERMINATED")

    assert result.state == FAILED and "vanished" in result.message
    records = faulty.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
    settlement = faulty.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged > 0, "it ran: the tenant pays what was recorded"


async def test_a_parked_job_continues_as_new_while_it_waits_and_a_retry_settles_it(faulty: Pipeline) -> None:
    """A job parked for an operator may wait for days. It still moves to a fresh run when its history is long or
    another build became current (the same check as a watch's, every ``max_watch_seconds``), so it never pins an
    old build for ever; the new run is still parked, alerts no second time, and the operator's retry settles it.
    (Before, a parked job waited on its run with no timer: it never continued as new.)"""
    faulty.poller.settings = faulty.poller.settings.model_copy(
        update={"max_watch_seconds": 1.0, "continue_as_new_after_events": 1}
    )
    sched(faulty).default = Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0)
    chain(faulty).refuse_accounting = ChainError("accounting rejected: totals mismatch", transient=False)
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.parked is not None)
    parked_run = (await faulty.handle(job_id).describe()).run_id

    deadline = time.monotonic() + 30
    while (await faulty.handle(job_id).describe()).run_id == parked_run:
        assert time.monotonic() < deadline, "a parked job never continued as new"
        await asyncio.sleep(0.3)
    view = await status(faulty, job_id)
    assert view.parked is not None and "totals mismatch" in view.parked, "the new run is still parked"
    assert len(faulty.audit_events("job_parked", job_id)) == 1, "alerted once"

    chain(faulty).refuse_accounting = None
    await faulty.handle(job_id).execute_update(
        "retry_parked", RetryRequest(note="fixed"), result_type=JobStatusView
    )
    result = await asyncio.wait_for(faulty.handle(job_id).result(), 60)
    assert result.state == C and result.charged is not None
    assert [r.is_final for r in faulty.ledger.usage_records(job_id)].count(True) == 1
    assert faulty.ledger.settlement(job_id) is not None


async def test_cancel_of_a_job_that_continued_as_new_while_parked_ends_it_as_it_ended(
    faulty: Pipeline,
) -> None:
    """Parked on its terminal report (settled, the chain refusing ``completed``), the job continues as new while it
    waits. The operator then presses Cancel on the new run: the job still ends as it really ended (completed), with
    one final record and its settlement untouched."""
    faulty.poller.settings = faulty.poller.settings.model_copy(
        update={"max_watch_seconds": 1.0, "continue_as_new_after_events": 1}
    )
    sched(faulty).default = Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0)
    chain(faulty).refuse_status[C] = ChainError("chain refuses completed", transient=False)
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.parked is not None, timeout=40)
    parked_run = (await faulty.handle(job_id).describe()).run_id
    settled = faulty.ledger.settlement(job_id)
    assert settled is not None
    deadline = time.monotonic() + 30
    while (await faulty.handle(job_id).describe()).run_id == parked_run:
        assert time.monotonic() < deadline, "a parked job never continued as new"
        await asyncio.sleep(0.3)

    chain(faulty).refuse_status.clear()
    await faulty.handle(job_id).cancel()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    result = await faulty.handle(job_id).result()
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == C and result.state == C, "it ends as it really ended: completed"
    records = faulty.ledger.usage_records(job_id)
    assert [r.is_final for r in records].count(True) == 1
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert faulty.ledger.settlement(job_id) == settled


async def test_cancel_of_a_job_that_continued_as_new_while_parked_on_its_accounting_settles_it_once(
    faulty: Pipeline,
) -> None:
    """Parked because the chain refused its accounting (the final record is on chain), the job continues as new
    while it waits; the operator fixes the chain and presses Cancel on the new run. The job settles on the final
    record it sent, ends completed, and no record follows the final one. (Before, the cancel sent the new run back
    to its drive loop, whose watch sent a period record under the final record's sequence and then one after it,
    refused: the job never settled and stayed running on chain.)"""
    faulty.poller.settings = faulty.poller.settings.model_copy(
        update={"max_watch_seconds": 1.0, "continue_as_new_after_events": 1}
    )
    sched(faulty).default = Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0)
    chain(faulty).refuse_accounting = ChainError("accounting rejected: totals mismatch", transient=False)
    job_id = faulty.submit()
    await wait_for(faulty, job_id, lambda v: v.parked is not None, timeout=40)
    parked_run = (await faulty.handle(job_id).describe()).run_id
    deadline = time.monotonic() + 30
    while (await faulty.handle(job_id).describe()).run_id == parked_run:
        assert time.monotonic() < deadline, "a parked job never continued as new"
        await asyncio.sleep(0.3)

    chain(faulty).refuse_accounting = None
    await faulty.handle(job_id).cancel()

    assert await closed(faulty, job_id) == WorkflowExecutionStatus.COMPLETED
    job = faulty.ledger.job(job_id)
    assert job is not None and job.state == C, "it ends as it really ended: completed"
    records = faulty.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True], "the final record is last"
    assert faulty.ledger.settlement(job_id) is not None
