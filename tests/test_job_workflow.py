"""HPCJobWorkflow end to end through the poller, on a real Temporal dev server, with a scripted in-memory scheduler.

What a provider would notice: the state the chain ends in, the usage records (signed, gapless, one final, adding
up), the settlement, the audit trail, and that nothing is submitted twice.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle

from activities.schedulers.base import SubmitRequest, SubmitResult
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.errors import SchedulerUnavailable
from virtengine_hpc.messages import CancelRequest, JobStatusView, JobWorkflowInput, monitor_workflow_id
from virtengine_hpc.models import JobSpec, PricedQueue, Pricing
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.tenancy import TenantAccountError
from virtengine_hpc.usage import sum_metrics, verify_record
from workers.poller import ChainPoller
from workers.wiring import job_settings
from workflows.hpc_job import initial_search_attributes

Q, R, C, F = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.FAILED


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        yield p


def adapter(p: Pipeline) -> MemoryAdapter:
    assert isinstance(p.adapter, MemoryAdapter)
    return p.adapter


def check_usage(p: Pipeline, job_id: str, key_path: Path) -> None:
    """Records verify, sequences are gapless, exactly one is final and last, and they add up to the settlement."""
    records = p.ledger.usage_records(job_id)
    assert records, "a job that ran has usage records"
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True]
    public = Signer.from_file(key_path).public_key
    assert all(verify_record(r, public) for r in records)
    for earlier, later in itertools.pairwise(records):
        assert earlier.period_end <= later.period_start
    settlement = p.ledger.settlement(job_id)
    assert settlement is not None
    assert settlement.charged + settlement.refunded == settlement.escrow
    total = sum_metrics([r.metrics for r in records])
    assert total.wall_clock_seconds > 0


async def test_job_completes_with_signed_usage_and_settlement(pipe: Pipeline, key_path: Path) -> None:
    adapter(pipe).default = Script([(0, Q), (0.3, R), (4.5, C)], exit_code=0)
    job_id = pipe.submit()
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == C
    assert pipe.states_of(job_id) == [Q, R, C]
    records = pipe.ledger.usage_records(job_id)
    assert len(records) >= 2, "report_interval 2s over a 4 s run gives a period record and the final one"
    check_usage(pipe, job_id, key_path)
    events = [e["event_type"] for e in pipe.audit_events(job_id=job_id)]
    for expected in (
        "routing_enforcement_passed",
        "job_submitted",
        "job_lifecycle_event",
        "status_reported",
        "usage_reported",
        "accounting_reported",
        "settlement_completed",
    ):
        assert expected in events
    assert adapter(pipe).submits == 1
    assert results[job_id].final_record_id == f"{pipe.cluster_id}/{job_id}/{len(records)}"


async def test_failed_job_keeps_exit_code_and_is_charged_for_what_it_used(
    pipe: Pipeline, key_path: Path
) -> None:
    adapter(pipe).default = Script([(0, Q), (0.2, R), (0.8, F)], exit_code=3, reason="exit code 3")
    job_id = pipe.submit()
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == F
    job = pipe.ledger.job(job_id)
    assert job is not None and job.exit_code == 3 and "exit code 3" in job.status_message
    check_usage(pipe, job_id, key_path)


async def test_a_job_that_failed_at_once_started_and_has_one_final_record(
    pipe: Pipeline, key_path: Path
) -> None:
    """No poll saw it run (queued, then failed), but the scheduler says it started: the chain sees it start
    (the ``started`` callback) and then fail, and it settles on exactly one final record."""
    adapter(pipe).default = Script([(0, Q), (0.6, F)], exit_code=3, reason="exit code 3", started_at=0.6)
    job_id = pipe.submit()
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == F
    assert pipe.states_of(job_id) == [Q, R, F]
    events = [
        e["details"]["event"]
        for e in pipe.audit_events("job_lifecycle_event", job_id=job_id)
        if e["details"]["event"] is not None
    ]
    assert events == ["submitted", "started", "failed"]
    records = pipe.ledger.usage_records(job_id)
    assert [r.is_final for r in records] == [True] and records[0].job_state == F
    assert results[job_id].final_record_id == records[0].record_id
    assert pipe.ledger.settlement(job_id) is not None


async def test_strict_routing_without_decision_rejects_and_refunds(pipe: Pipeline) -> None:
    before = pipe.ledger.balance(TENANT)
    job_id = pipe.submit(decide=False, max_price="50")
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == F
    assert "routing_rejected" in results[job_id].message
    assert adapter(pipe).submits == 0
    assert pipe.ledger.balance(TENANT) == before
    violations = pipe.audit_events("routing_violation", job_id)
    assert [v["details"]["violation_type"] for v in violations] == ["missing_decision"]
    assert violations[0]["severity"] == 4
    assert pipe.audit_events("job_routing_rejected", job_id)


async def test_cancel_by_update_while_running(pipe: Pipeline) -> None:
    adapter(pipe).default = Script([(0, Q), (0.2, R), (600, C)], exit_code=0)
    job_id = pipe.submit()
    await pipe.wait_started(job_id)
    for _ in range(100):
        view: JobStatusView = await pipe.handle(job_id).query("status", result_type=JobStatusView)
        if view.state == R:
            break
        await asyncio.sleep(0.1)
    assert view.state == R
    view = await pipe.handle(job_id).execute_update(
        "request_cancel", CancelRequest(reason="operator test"), result_type=JobStatusView
    )
    assert view.cancel_requested
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == JobState.CANCELLED
    assert adapter(pipe).cancels == [results[job_id].scheduler_job_id]
    assert pipe.ledger.job(job_id).status_message == "operator test"  # type: ignore[union-attr]
    assert pipe.audit_events("job_cancelled", job_id)


async def test_tenant_cancel_on_chain_reaches_the_workflow(pipe: Pipeline) -> None:
    adapter(pipe).default = Script([(0, Q), (600, R)])
    job_id = pipe.submit()
    await pipe.wait_started(job_id)
    pipe.ledger.request_cancel(job_id)
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == JobState.CANCELLED
    assert pipe.ledger.usage_records(job_id) == [], "a job cancelled in the queue never ran and has no usage"
    assert pipe.ledger.settlement(job_id) is None or pipe.ledger.settlement(job_id).charged == 0  # type: ignore[union-attr]


async def test_rejected_submission_fails_once_with_the_schedulers_reason(pipe: Pipeline) -> None:
    job_id = pipe.submit()
    adapter(pipe).reject[job_id] = "Invalid account or account/partition combination specified"
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == F
    assert "Invalid account" in results[job_id].message
    assert adapter(pipe).submits == 1, "a permanent rejection is not retried"
    assert pipe.audit_events("job_submission_failed", job_id)


class NoAccountAdapter(MemoryAdapter):
    """A scheduler that cannot be reached for lookups, for a tenant whose account is refused before anything is
    sent to it (``TenantAccountError``)."""

    finds: int = 0

    async def submit(self, request: SubmitRequest, **kwargs: Any) -> SubmitResult:
        self.submits += 1
        raise TenantAccountError(
            f"tenant {request.job.tenant} has no cluster account: hpc.tenants.pool is empty"
        )

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        self.finds += 1
        raise SchedulerUnavailable("slurm_load_jobs error: Unable to contact slurm controller")


async def test_a_tenant_account_refusal_fails_the_job_at_once_and_looks_for_no_job(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A job refused for its tenant's account created nothing: it fails with the reason on chain, without the
    lookup for a job an attempt might have made (which, with the scheduler unreachable, retried for ever)."""
    no_account = NoAccountAdapter()
    async with running_pipeline(client, make_config(tmp_path), key_path, no_account, task_queue) as p:
        job_id = p.submit()
        results = await p.run_until_done([job_id], timeout=60)
        assert results[job_id].state == F
        assert "has no cluster account" in results[job_id].message
        assert no_account.submits == 1, "a tenant account refusal is not retried"
        assert no_account.finds == 0
        assert p.audit_events("job_submission_failed", job_id)


async def test_crash_after_scheduler_accepted_adopts_the_job(pipe: Pipeline) -> None:
    job_id = pipe.submit()
    adapter(pipe).crash_after_submit.add(job_id)
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == C
    assert len(adapter(pipe).jobs) == 1, "exactly one scheduler job for the chain job"
    assert adapter(pipe).submits == 2
    assert pipe.audit_events("state_recovered", job_id)


async def test_status_queries_are_batched_across_jobs(pipe: Pipeline) -> None:
    adapter(pipe).default = Script([(0, Q), (0.5, R), (3.0, C)], exit_code=0)
    job_ids = [pipe.submit() for _ in range(12)]
    await pipe.run_until_done(job_ids)
    polls_per_job_if_unbatched = 3.0 / 0.2
    # One query per poll interval for all jobs; unbatched would be ~12 x 15 = 180.
    assert adapter(pipe).status_queries < polls_per_job_if_unbatched * 3


async def test_malformed_job_is_rejected_and_others_go_on(pipe: Pipeline) -> None:
    bad = pipe.submit(resources={"nodes": -4}, name="x; rm -rf /")
    hostile = pipe.submit(environment={"LD_PRELOAD": "/tmp/evil.so"})
    good = pipe.submit()
    results = await pipe.run_until_done([bad, hostile, good])
    assert results[good].state == C
    for job_id in (bad, hostile):
        assert results[job_id].state == F
        assert "invalid job" in pipe.ledger.job(job_id).status_message  # type: ignore[union-attr]
        assert pipe.audit_events("job_validation_failed", job_id)
    assert "nodes" in pipe.ledger.job(bad).status_message  # type: ignore[union-attr]


async def test_unknown_template_is_a_validation_error(pipe: Pipeline) -> None:
    job_id = pipe.submit(template_id="no-such-template")
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == F
    assert "template" in results[job_id].message
    assert adapter(pipe).submits == 0


async def test_partition_bounds_are_checked_before_submission(pipe: Pipeline) -> None:
    too_many = pipe.submit(partition="long", resources={"nodes": 3})
    no_such = pipe.submit(partition="gpu-xl")
    results = await pipe.run_until_done([too_many, no_such])
    assert "allows 2" in results[too_many].message
    assert "does not exist" in results[no_such].message
    assert adapter(pipe).submits == 0


async def test_a_job_without_a_partition_runs_in_its_offerings_partition(pipe: Pipeline) -> None:
    # The cluster lists debug first; an offering priced for "long" must not have its jobs run (and billed) there.
    pipe.ledger.add_queue(
        PricedQueue(
            offering_id="offering-long",
            cluster_id=pipe.cluster_id,
            partition="long",
            pricing=Pricing(node_hour=Decimal("50"), minimum_charge=Decimal("0.01")),
            max_duration_seconds=7 * 86400,
        )
    )
    on_long = pipe.submit(offering_id="offering-long")
    on_default = pipe.submit()
    results = await pipe.run_until_done([on_long, on_default])
    assert results[on_long].state == C and results[on_default].state == C
    assert adapter(pipe).partitions[on_long] == "long"
    assert adapter(pipe).partitions[on_default] == "debug"


async def test_a_template_for_whole_nodes_reaches_the_scheduler_as_exclusive(pipe: Pipeline) -> None:
    gpu = pipe.submit(
        template_id="gpu-compute",
        template_parameters={"command": "nvidia-smi"},
        resources={"gpus_per_node": 1},
    )
    script = pipe.submit()
    results = await pipe.run_until_done([gpu, script])
    assert results[gpu].state == C, results[gpu].message
    assert results[script].state == C
    assert adapter(pipe).exclusive == {gpu: True, script: False}


async def test_scheduler_outage_is_not_a_state_change(pipe: Pipeline) -> None:
    adapter(pipe).default = Script([(0, Q), (0.2, R), (3.0, C)], exit_code=0)
    job_id = pipe.submit()
    await pipe.wait_started(job_id)
    await asyncio.sleep(0.5)
    adapter(pipe).unavailable = True
    await asyncio.sleep(2.0)
    assert pipe.ledger.job(job_id).state in (Q, R)  # type: ignore[union-attr]
    adapter(pipe).unavailable = False
    results = await pipe.run_until_done([job_id])
    assert results[job_id].state == C


async def test_vanished_job_fails_with_a_reason_never_completes(pipe: Pipeline, tmp_path: Path) -> None:
    adapter(pipe).default = Script([(0, Q), (0.2, R), (600, C)])
    job_id = pipe.submit()
    await pipe.wait_started(job_id)
    await asyncio.sleep(1.0)
    adapter(pipe).jobs.clear()  # the scheduler lost it (and its accounting)
    results = await pipe.run_until_done([job_id], timeout=200)
    assert results[job_id].state == F
    assert "vanished" in results[job_id].message


async def test_queue_full_waits_and_never_drops(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = make_config(
        tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"max_concurrent_jobs": 2}}
    )
    scheduler = MemoryAdapter(default=Script([(0, Q), (0.2, R), (1.5, C)], exit_code=0))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        job_ids = [p.submit() for _ in range(5)]
        stats = await p.poller.poll_once()
        assert len(stats.started) == 2 and stats.waiting == 3
        assert p.audit_events("job_queue_full")
        results = await p.run_until_done(job_ids)
        assert {r.state for r in results.values()} == {C}
        assert len(scheduler.jobs) == 5


async def test_switched_off_takes_no_new_jobs_but_running_ones_finish_and_cancels_flow(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    scheduler = MemoryAdapter(default=Script([(0, Q), (0.2, R), (2.0, C)], exit_code=0))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        running = [p.submit(), p.submit()]
        scheduler.scripts[running[1]] = Script([(0, Q), (0.2, R), (600, C)])  # runs until cancelled
        assert len((await p.poller.poll_once()).started) == 2
        for _ in range(300):
            if p.ledger.job(running[1]).state == R:  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the job to cancel never ran")

        off = config.model_copy(update={"hpc": config.hpc.model_copy(update={"enabled": False})})
        poller = ChainPoller(
            client, p.ledger, off, p.deps.audit, task_queue=task_queue, settings=job_settings(off)
        )
        waiting = p.submit()
        p.ledger.request_cancel(running[1])
        stats = await poller.poll_once()
        assert stats.started == [] and stats.paused == 1
        assert stats.cancelled == [running[1]]

        p.poller = poller  # from here on only the switched-off poller runs
        results = await p.run_until_done(running)
        assert results[running[0]].state == C
        assert results[running[1]].state == JobState.CANCELLED
        assert (await poller.poll_once()).paused == 1
        assert p.ledger.job(waiting).state == JobState.PENDING  # type: ignore[union-attr]
        assert waiting not in {job.workflow_id for job in scheduler.jobs.values()}
        assert len(scheduler.jobs) == 2 and scheduler.cancels, (
            "the running job was cancelled in the scheduler"
        )


async def test_search_attributes_follow_the_job(pipe: Pipeline) -> None:
    adapter(pipe).default = Script([(0, Q), (0.2, R), (1.0, C)], exit_code=0)
    job_id = pipe.submit()
    result = (await pipe.run_until_done([job_id]))[job_id]
    query = f"WorkflowId = '{job_id}' AND VeJobState = 'completed' AND VeClusterId = '{pipe.cluster_id}'"
    for _ in range(50):  # visibility is eventually consistent
        found = [wf async for wf in pipe.client.list_workflows(query)]
        if found:
            break
        await asyncio.sleep(0.2)
    assert [wf.id for wf in found] == [job_id]
    attrs = {pair.key.name: pair.value for pair in found[0].typed_search_attributes}
    assert attrs["VeSchedulerJobId"] == result.scheduler_job_id
    assert attrs["VeTenant"] == TENANT and attrs["VeTemplate"] == "script"


async def start_with_settings(
    pipe: Pipeline, job_id: str, update: dict[str, Any]
) -> WorkflowHandle[Any, Any]:
    """Start the workflow of the chain job ``job_id`` directly, with the worker's job settings changed by ``update``
    (as the poller would start it, with its search attributes)."""
    spec = JobSpec.model_validate(pipe.ledger.job(job_id).raw_spec)  # type: ignore[union-attr]
    settings = job_settings(pipe.config).model_copy(update=update)
    inp = JobWorkflowInput(job=spec, cluster_id=pipe.cluster_id, provider=spec.provider, settings=settings)
    return await pipe.client.start_workflow(
        "HPCJobWorkflow",
        inp,
        id=job_id,
        task_queue=pipe.task_queue,
        search_attributes=initial_search_attributes(inp),
    )


async def test_long_job_continues_as_new_and_keeps_its_usage_sequence(pipe: Pipeline, key_path: Path) -> None:
    """History stays bounded: the workflow continues as new and carries state (sequence, cumulative usage)."""
    adapter(pipe).default = Script([(0, Q), (0.2, R), (9.0, C)], exit_code=0)
    job_id = pipe.submit()
    handle = await start_with_settings(
        pipe, job_id, {"report_interval_seconds": 0.5, "continue_as_new_after_events": 40}
    )
    result = await pipe.handle(job_id).result()
    assert result.state == C
    runs = 0
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_execution_continued_as_new_event_attributes"):
            runs += 1
    desc = await handle.describe()
    assert desc.run_id != handle.first_execution_run_id, "the job finished in a later run"
    records = pipe.ledger.usage_records(job_id)
    assert len(records) >= 6, (
        "a record about every round of its monitor (each second here) over 9 s of running"
    )
    check_usage(pipe, job_id, key_path)
    assert adapter(pipe).submits == 1, "continue-as-new never resubmits"


async def test_history_grows_by_about_six_events_per_report_cycle(pipe: Pipeline) -> None:
    """Invariant 3: a 24 h job with 5-minute reports stays near 1,900 events without continue-as-new.

    The same 6 s job runs twice: once with no periodic report (the fixed cost of a job), once with a report every
    0.5 s; the difference per extra record is the cost of one report cycle. Its monitor rounds every 0.3 s, less
    often than twice a report interval, so the job sends its own records.
    """
    adapter(pipe).default = Script([(0, Q), (0.2, R), (6.0, C)], exit_code=0)

    async def run(report_interval: float) -> tuple[int, int]:
        job_id = pipe.submit()
        update = {"report_interval_seconds": report_interval, "poll_interval_seconds": 0.3}
        handle = await start_with_settings(pipe, job_id, update)
        await pipe.handle(job_id).result()
        events = [e async for e in handle.fetch_history_events()]
        return len(events), len(pipe.ledger.usage_records(job_id))

    (fixed, one), (events, records) = await asyncio.gather(run(3600), run(0.5))
    assert one == 1 and records >= 6
    per_cycle = (events - fixed) / (records - 1)
    # A report cycle is the timer firing, one workflow task, the local activity's marker and the next timer (~6
    # events) where the job sends its own records; where its monitor sends them, 4 (the next test).
    assert per_cycle <= 8, (
        f"{events} events for {records} records; {fixed} for a job without periodic reports"
    )
    assert fixed + 288 * per_cycle < 2200, "a 24 h job at 5-minute reports"


async def test_a_report_period_adds_at_most_four_events_when_the_monitor_sends_the_records(
    pipe: Pipeline,
) -> None:
    """The cluster monitor's round sends a running job's period records and signals each one: the job's history
    grows by the signal and one workflow task per period (4 events), with no timer and no activity of its own.

    A job reports every second for 12 s: from the first record its monitor signals to the last, its history grows
    by at most 4 events per record (anything else the job did meanwhile, a timer firing, counts too).
    """
    adapter(pipe).default = Script([(0, Q), (0.2, R), (12.0, C)], exit_code=0)
    job_id = pipe.submit()
    handle = await start_with_settings(pipe, job_id, {"report_interval_seconds": 1.0})
    await pipe.handle(job_id).result()
    events = [e async for e in handle.fetch_history_events()]
    signalled = [
        n
        for n, e in enumerate(events)
        if e.workflow_execution_signaled_event_attributes.signal_name == "period_recorded"
    ]
    records = len(pipe.ledger.usage_records(job_id))
    # Every period record is the monitor's, the last record the final one.
    assert len(signalled) >= 6 and len(signalled) >= records - 3, (len(signalled), records)
    per_period = (signalled[-1] - signalled[0]) / (len(signalled) - 1)
    assert per_period <= 4, [e.event_type for e in events[signalled[0] : signalled[-1]]]
    fixed = len(events) - (signalled[-1] - signalled[0])
    assert fixed + 288 * per_period < 1300, "a 24 h job at 5-minute reports"


async def test_every_report_period_of_a_run_costs_at_most_four_events_the_first_too(pipe: Pipeline) -> None:
    """From its first period on, a running job's period records come from its cluster monitor's round (the job
    registers for them when it reports running), so every period costs its history the signal and a workflow task:
    4 events. Before, a run's first record was the job's own (its timer, a workflow task, a patch marker and its
    upsert, the local activity's marker, the next timer: 8 events), 4.4 a period on average over 10 periods.

    The same 12 s job runs twice, once without period records (the fixed cost of a job), once with one a second;
    the difference per period record is what a period costs, as ``benchmarks/monitor.py --events`` counts it."""
    adapter(pipe).default = Script([(0, Q), (1.0, R), (12.0, C)], exit_code=0)

    async def run(report_interval: float) -> tuple[list[Any], int]:
        job_id = pipe.submit()
        handle = await start_with_settings(pipe, job_id, {"report_interval_seconds": report_interval})
        assert (await pipe.handle(job_id).result()).state == C
        events = [e async for e in handle.fetch_history_events()]
        return events, len(pipe.ledger.usage_records(job_id))

    (fixed, one), (events, records) = await asyncio.gather(run(3600), run(1.0))
    assert one == 1 and records >= 6, records
    signalled = [
        e for e in events if e.workflow_execution_signaled_event_attributes.signal_name == "period_recorded"
    ]
    assert len(signalled) == records - 1, "every period record (all but the final one) is the monitor's"
    per_period = (len(events) - len(fixed)) / (records - 1)
    assert per_period <= 4, f"{len(events)} events for {records} records; {len(fixed)} without period records"


async def test_the_safety_net_check_moves_with_the_monitors_records_instead_of_firing(pipe: Pipeline) -> None:
    """A served job's safety-net check (``max_watch_seconds`` without news from its monitor) never fires while the
    monitor's records arrive: the workflow task of a record that finds the check about to fire moves its timer
    (a cancel and a start, 2 events), where the timer fired and started again (its firing, a workflow task and
    the new timer, 5 events: once an hour, a quarter of an event a period at 5-minute reports).

    Here the check is every 6 s, a record every second for 16 s."""
    adapter(pipe).default = Script([(0, Q), (0.5, R), (16.0, C)], exit_code=0)
    job_id = pipe.submit()
    handle = await start_with_settings(
        pipe, job_id, {"report_interval_seconds": 1.0, "max_watch_seconds": 6.0}
    )
    assert (await pipe.handle(job_id).result()).state == C
    events = [e async for e in handle.fetch_history_events()]
    signalled = [
        n
        for n, e in enumerate(events)
        if e.workflow_execution_signaled_event_attributes.signal_name == "period_recorded"
    ]
    assert len(signalled) >= 10, len(signalled)
    served = events[signalled[0] : signalled[-1]]
    fired = [e.event_id for e in served if e.HasField("timer_fired_event_attributes")]
    moved = [e.event_id for e in served if e.HasField("timer_canceled_event_attributes")]
    assert fired == [] and moved, f"check fired at {fired}, moved at {moved}"
    others = [
        e.event_type
        for e in served
        if not e.HasField("workflow_execution_signaled_event_attributes")
        and not e.HasField("workflow_task_scheduled_event_attributes")
        and not e.HasField("workflow_task_started_event_attributes")
        and not e.HasField("workflow_task_completed_event_attributes")
    ]
    # Each move: a cancel and a start; the run's first also records its patch marker and the upsert that goes with it.
    assert len(others) <= 2 * len(moved) + 2, others


async def test_a_short_job_costs_at_most_thirty_history_events(pipe: Pipeline) -> None:
    """A job that runs for a few seconds, from start to settlement, in at most 30 history events (60 before):
    routing, its lifecycle reports and its final record are local activities, one marker each, and the submission
    reports it queued. What it reports is what it did before: each transition once, one signed final record, the
    settlement."""
    adapter(pipe).default = Script([(0, Q), (0.3, R), (3.0, C)], exit_code=0)
    job_id = pipe.submit()
    handle = await start_with_settings(pipe, job_id, {"report_interval_seconds": 3600})
    result = await pipe.handle(job_id).result()
    events = [e async for e in handle.fetch_history_events()]
    assert result.state == C and pipe.states_of(job_id) == [Q, R, C]
    assert len(events) <= 30, f"{len(events)} events from start to settlement"
    lifecycle = [e["details"]["event"] for e in pipe.audit_events("job_lifecycle_event", job_id=job_id)]
    assert lifecycle == ["submitted", "started", "completed"]
    assert len(pipe.audit_events("status_reported", job_id=job_id)) == 3
    records = pipe.ledger.usage_records(job_id)
    assert [r.is_final for r in records] == [True] and result.final_record_id == records[0].record_id
    assert pipe.ledger.settlement(job_id) is not None and adapter(pipe).submits == 1
    described = await handle.describe()
    attrs = {pair.key.name: pair.value for pair in described.typed_search_attributes}
    assert attrs["VeJobState"] == C.value and attrs["VeSchedulerJobId"] == result.scheduler_job_id


async def test_a_slow_submit_is_not_mistaken_for_a_dead_worker(pipe: Pipeline) -> None:
    """sbatch over a slow SSH link can take longer than the submit's heartbeat timeout (10 s here): the activity
    heartbeats while it waits, so it is not retried (a retry would be harmless but doubles scheduler load)."""
    adapter(pipe).submit_delay = 12.0
    job_id = pipe.submit()
    results = await pipe.run_until_done([job_id], timeout=120)
    assert results[job_id].state == C
    assert adapter(pipe).submits == 1


@pytest.mark.parametrize("by_monitor", [False, True], ids=["watch activity", "cluster monitor"])
async def test_the_configured_heartbeat_timeout_reaches_every_activity(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, by_monitor: bool
) -> None:
    """``hpc.job_service.activity_heartbeat_timeout`` is what Temporal waits for before it gives an attempt up:
    submit and usage reports get it, the watch activity (or the cluster monitor's rounds) at least four poll
    intervals."""
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "job_service": {"activity_heartbeat_timeout": "7s", "cluster_monitor": by_monitor},
        },
    )
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        job_id = p.submit()
        results = await p.run_until_done([job_id])
        history = await p.handle(job_id).fetch_history()
        monitor = (
            await p.client.get_workflow_handle(monitor_workflow_id(task_queue)).fetch_history()
            if by_monitor
            else None
        )
    assert results[job_id].state == C
    timeouts = {
        e.activity_task_scheduled_event_attributes.activity_type.name: (
            e.activity_task_scheduled_event_attributes.heartbeat_timeout.ToTimedelta().total_seconds()
        )
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    }
    poll = config.hpc.scheduler_poll_interval.total_seconds()
    assert timeouts["submit_job"] == 7, timeouts
    # The final record is a local activity on the workflow's own worker (a local activity has no heartbeat); as an
    # activity (on another cluster's queue, or after its local attempts) it gets the timeout too
    # (tests/test_job_lifecycle.py, a busy chain).
    assert "report_usage" not in timeouts, timeouts
    if monitor is None:
        assert timeouts["watch_job"] == max(7, 4 * poll), timeouts
        return
    rounds = {
        e.activity_task_scheduled_event_attributes.heartbeat_timeout.ToTimedelta().total_seconds()
        for e in monitor.events
        if e.HasField("activity_task_scheduled_event_attributes")
    }
    assert rounds == {max(7, 4 * poll)}, rounds
