"""A long job on Temporal's time-skipping test server, end to end: what ``tests/test_long_job.py`` checks in the
suite (a few days) and ``benchmarks/long_job.py`` runs for a month.

The job runs with the real activities, ledger and signer and the in-memory scheduler. It waits on timers (its next
report) and on its cluster monitor's signals, and the monitor waits on a timer between its polls, so the test
server skips the time between them. The monitor's poll and the usage reports used here first read the test
server's clock; the activities, the ledger and the scheduler read that same clock, so a 30-day job takes 30 days
on every clock that matters and a few minutes of real time.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

import activities.jobs
from activities.jobs import JobActivities
from activities.monitor import MonitorActivities
from tests.conftest import binary, make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import OFFERING, TENANT, setup_ledger
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import (
    JobRef,
    JobResult,
    JobSettings,
    JobWorkflowInput,
    PollInput,
    PollOutput,
    UsageInput,
    UsageOutput,
    monitor_workflow_id,
)
from virtengine_hpc.models import JobSpec, UsageRecord, spec_digest
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics, verify_record
from workers.wiring import build_worker_deps, job_settings
from workers.worker import job_activities
from workflows.cluster_monitor import ClusterMonitorWorkflow
from workflows.hpc_job import SEARCH_ATTRIBUTES, HPCJobWorkflow, initial_search_attributes

DAY = 86400
TEMPORAL_HISTORY_WARNING = 10_240
# A run ends at the first check past its bound (one watch cycle, 6 events, later) or, the last one, with the
# job's closing activities (final usage record, terminal status).
RUN_MARGIN = 30


class SkippedClock:
    """The test server's clock: real time plus whatever the test server has skipped."""

    def __init__(self, env: WorkflowEnvironment) -> None:
        self.env = env
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def seconds(self) -> float:
        return self.now().timestamp()

    async def advance_to(self, when: datetime) -> None:
        delta = (when - self.now()).total_seconds()
        if delta > 0:
            await self.env.sleep(delta)
        self.offset = (await self.env.get_current_time()) - datetime.now(UTC)


def skipped_datetime(clock: SkippedClock) -> type[datetime]:
    """``datetime`` whose ``now()`` reads ``clock``: what the activities module sees in these tests."""

    class Skipped(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            now = clock.now()
            return now.astimezone(tz) if tz is not None else now.replace(tzinfo=None)

    return Skipped


@contextlib.asynccontextmanager
async def skipping_server() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server, with the job workflow's search attributes."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=binary("temporal-test-server"), data_converter=pydantic_data_converter
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={key.name: int(key.indexed_value_type) for key in SEARCH_ATTRIBUTES},
        )
    )
    try:
        yield env
    finally:
        await env.shutdown()


@dataclass
class LongJob:
    """One job run to its end on the time-skipping server, and what it left behind."""

    result: JobResult
    runs: list[WorkflowHistory]
    records: list[UsageRecord]
    started: datetime
    ended: datetime
    settings: JobSettings
    config: Config
    adapter: MemoryAdapter
    ledger: Any


async def run_long_job(
    env: WorkflowEnvironment,
    tmp_path: Path,
    key_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    days: float,
    job_service: dict[str, Any] | None = None,
) -> LongJob:
    clock = SkippedClock(env)
    await clock.advance_to(clock.now())
    monkeypatch.setattr(activities.jobs, "datetime", skipped_datetime(clock))
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"long-{uuid.uuid4().hex[:6]}",
            # The monitor asks the scheduler hourly: a month of 5-minute rounds would only slow the test down.
            "local": {"job_poll_interval": "1h"},
            "usage_reporting": {"report_interval": "5m"},
            # The job waits on its cluster monitor's signals and its own timers, which the test server skips; the
            # default watch path holds a heartbeating activity that polls in real time, and the test server skips
            # no time while an activity is outstanding, so a month would take a month.
            "job_service": {"cluster_monitor": True, **(job_service or {})},
        },
    )
    runtime = int(days * DAY)
    ledger = setup_ledger(
        config, Signer.from_file(key_path), max_runtime_seconds=runtime + DAY, clock=clock.now
    )
    ledger.fund(TENANT, Decimal("10000000"))
    adapter = MemoryAdapter(
        default=Script([(0, JobState.RUNNING), (runtime, JobState.COMPLETED)], exit_code=0),
        clock=clock.seconds,
        wall=clock.now,
    )
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=ledger,
        adapters={config.hpc.cluster_id: adapter},
    )
    acts = deps.activities

    @activity.defn(name="poll_cluster")
    async def poll_cluster(request: PollInput) -> PollOutput:
        await clock.advance_to(clock.now())
        return await MonitorActivities.poll_cluster(acts.monitor, request)

    @activity.defn(name="report_usage")
    async def report_usage(request: UsageInput) -> UsageOutput:
        await clock.advance_to(clock.now())
        return await JobActivities.report_usage(acts, request)

    on_skipped_clock = {"poll_cluster": poll_cluster, "report_usage": report_usage}

    job_id = ledger.submit_job(
        {
            "job_id": f"JOB-{uuid.uuid4().hex[:10]}",
            "tenant": TENANT,
            "provider": config.provider.address,
            "offering_id": OFFERING,
            "script": "#!/bin/bash\nsleep 30d\n",
            "walltime_seconds": runtime + 3600,
            "max_price": "1000000",
        }
    )
    ledger.create_decision(job_id, config.hpc.cluster_id)
    raw = ledger.job(job_id).raw_spec  # type: ignore[union-attr]
    spec = JobSpec.model_validate(raw)
    settings = job_settings(config)
    inp = JobWorkflowInput(
        job=JobRef.of(spec, spec_digest(raw)),
        cluster_id=config.hpc.cluster_id,
        provider=spec.provider,
        settings=settings,
    )
    queue = f"tq-{uuid.uuid4().hex[:12]}"
    activities_here = [on_skipped_clock.get(a.__name__, a) for a in job_activities(acts)]
    try:
        async with Worker(
            env.client,
            task_queue=queue,
            workflows=[HPCJobWorkflow, ClusterMonitorWorkflow],
            activities=activities_here,
        ):
            handle: WorkflowHandle[Any, JobResult] = await env.client.start_workflow(
                HPCJobWorkflow.run,
                inp,
                id=job_id,
                task_queue=queue,
                search_attributes=initial_search_attributes(inp),
            )
            result = await wait_result(handle)
            runs = await histories_of_every_run(env.client, job_id, handle.first_execution_run_id or "")
    finally:
        # The cluster's monitor would outlive the test with a round no worker takes, and the test server skips no
        # time while an activity is outstanding: the next test on this server would wait in real time.
        with contextlib.suppress(RPCError):
            await env.client.get_workflow_handle(monitor_workflow_id(queue)).terminate("test over")
        await deps.close()
    job = adapter.jobs[result.scheduler_job_id or ""]
    started = datetime.fromtimestamp(job.submitted, UTC)
    return LongJob(
        result=result,
        runs=runs,
        records=ledger.usage_records(job_id),
        started=started,
        ended=started + timedelta(seconds=runtime),
        settings=settings,
        config=config,
        adapter=adapter,
        ledger=ledger,
    )


async def wait_result(handle: WorkflowHandle[Any, JobResult]) -> JobResult:
    """The job's result. Only while a handle of the time-skipping client awaits a result may the test server skip
    time; it ends a long poll for the result after about 20 s without an answer: ask again."""
    while True:
        try:
            return await handle.result()
        except RuntimeError as err:
            if "No completion event found" not in str(err):
                raise


async def histories_of_every_run(
    client: Client, workflow_id: str, first_run_id: str
) -> list[WorkflowHistory]:
    """Each run's history, first to last, following the continue-as-new chain."""
    runs: list[WorkflowHistory] = []
    run_id: str | None = first_run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        runs.append(history)
        run_id = None
        for event in history.events:
            if event.HasField("workflow_execution_continued_as_new_event_attributes"):
                run_id = event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return runs


def check_gapless_usage(job: LongJob, key_path: Path) -> None:
    records = job.records
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True]
    public = Signer.from_file(key_path).public_key
    assert all(verify_record(r, public) for r in records)
    for earlier, later in itertools.pairwise(records):
        assert later.period_start == earlier.period_end, f"gap before record {later.sequence}"
    # (to well under a second: the in-memory scheduler reads its clock and the wall clock one after the other, a
    # few milliseconds apart on a quiet machine and tens of them on a loaded one, and rounds run times to the
    # millisecond; no period is shorter than the run time its record claims)
    ends_at = abs(records[-1].period_end - job.ended)
    assert ends_at < timedelta(seconds=1), "the last period ends when the scheduler says the job ended"
    total = sum_metrics([r.metrics for r in records])
    running = Decimal(int((job.ended - job.started).total_seconds()))
    assert total.wall_clock_seconds == running, "the records add up to the job's whole run"
    assert total.cpu_core_seconds == running, "one core asked for, priced for the whole run"
    assert total.cpu_time_seconds == 2 * running, "the CPU time the scheduler measured, shown beside it"
    settlement = job.ledger.settlement(job.result.job_id)
    assert settlement is not None, "the chain settled the job on its final accounting"
    assert settlement.charged + settlement.refunded == settlement.escrow
    assert job.result.final_record_id == records[-1].record_id


async def check_runs_replay(runs: list[WorkflowHistory]) -> None:
    replayer = Replayer(workflows=[HPCJobWorkflow], data_converter=pydantic_data_converter)
    replayed = 0
    async with replayer.workflow_replay_iterator(_iter(runs)) as results:
        async for result in results:
            assert result.replay_failure is None, f"run {result.history.run_id} does not replay"
            replayed += 1
    assert replayed == len(runs)


async def _iter(runs: list[WorkflowHistory]) -> AsyncIterator[WorkflowHistory]:
    for history in runs:
        yield history
