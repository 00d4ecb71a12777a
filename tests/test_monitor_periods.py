"""Period usage records sent by the cluster monitor's round: exactly once, whatever overlaps it.

A running job whose monitor sends its period records is told each one by signal and keeps no report timer. These
tests hold a round's record or its signal at the moment where two attempts, or a round and the job's end, overlap,
on a real Temporal dev server with the real ledger (it refuses a gap, a repeat or a record after the final one) and
the in-memory scheduler. The monitor's own rounds can be paused, and a round run by hand as attempt 1 or 2 of the
same activity (``ActivityEnvironment``), as Temporal runs a retry while a timed-out attempt still runs.
What a user would notice: one record per sequence on chain, periods that follow each other without a gap, the
final record last, the job settled, the job's count of records equal to the chain's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, Interceptor, OutboundInterceptor, SignalWorkflowInput
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Replayer, Worker

from activities.audit import read_events
from activities.chain.local_ledger import LocalLedger
from activities.monitor import MonitorActivities
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import OFFERING, TENANT, setup_ledger
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import (
    JobRef,
    JobResult,
    JobStatusView,
    JobWorkflowInput,
    PeriodDue,
    PollInput,
    PollOutput,
    monitor_workflow_id,
)
from virtengine_hpc.models import JobSpec, UsageRecord, spec_digest
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import record_id
from workers.wiring import WorkerDeps, build_worker_deps, job_settings
from workers.worker import job_activities
from workflows.cluster_monitor import ClusterMonitorWorkflow
from workflows.hpc_job import HPCJobWorkflow, initial_search_attributes


class HeldChain:
    """The ledger as the provider reaches it, able to hold the first submission of one record until released."""

    def __init__(self, ledger: LocalLedger) -> None:
        self._ledger = ledger
        self.hold: str | None = None
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    async def submit_usage(self, records: list[UsageRecord]) -> Any:
        if self.hold is not None and any(r.record_id == self.hold for r in records):
            self.hold = None
            self.held.set()
            await self.release.wait()
        return await self._ledger.submit_usage(records)


class HeldSignals(Interceptor):
    """A client whose ``period_recorded`` signals wait until released (a round slow to tell the job)."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        hold = self

        class _Out(OutboundInterceptor):
            async def signal_workflow(self, input: SignalWorkflowInput) -> None:
                if input.signal == "period_recorded":
                    hold.held.set()
                    await hold.release.wait()
                await super().signal_workflow(input)

        return _Out(next)


class Rounds:
    """The monitor's ``poll_cluster`` activity, which a test can pause (its rounds then do nothing)."""

    def __init__(self, monitor: MonitorActivities) -> None:
        self.monitor = monitor
        self.auto = True
        self.running = 0

    @activity.defn(name="poll_cluster")
    async def poll_cluster(self, request: PollInput) -> PollOutput:
        if not self.auto:
            return PollOutput()
        self.running += 1
        try:
            return await MonitorActivities.poll_cluster(self.monitor, request)
        finally:
            self.running -= 1

    async def pause(self) -> None:
        self.auto = False
        while self.running:
            await asyncio.sleep(0.05)


@dataclasses.dataclass
class Setup:
    config: Config
    ledger: LocalLedger
    chain: HeldChain
    client: Client
    deps: WorkerDeps
    adapter: MemoryAdapter
    rounds: Rounds
    task_queue: str

    async def start(self, **settings: Any) -> str:
        """A job that runs until the test ends it; its workflow started as the poller would."""
        raw = {
            "job_id": f"JOB-{uuid.uuid4().hex[:10]}",
            "tenant": TENANT,
            "provider": self.config.provider.address,
            "offering_id": OFFERING,
            "script": "#!/bin/bash\nsleep 600\n",
            "walltime_seconds": 3600,
            "max_price": "100",
        }
        job_id = self.ledger.submit_job(raw)
        self.ledger.create_decision(job_id, self.config.hpc.cluster_id)
        spec = JobSpec.model_validate(raw)
        inp = JobWorkflowInput(
            job=JobRef.of(spec, spec_digest(raw)),
            cluster_id=self.config.hpc.cluster_id,
            provider=spec.provider,
            settings=job_settings(self.config).model_copy(update=settings),
        )
        await self.client.start_workflow(
            "HPCJobWorkflow",
            inp,
            id=job_id,
            task_queue=self.task_queue,
            search_attributes=initial_search_attributes(inp),
        )
        return job_id

    async def status(self, job_id: str) -> JobStatusView:
        return await self.client.get_workflow_handle(job_id).query("status", result_type=JobStatusView)

    async def served(self, job_id: str) -> None:
        """Until the monitor has sent one of the job's period records and the job holds every record on chain."""
        await until(lambda: signals(self, job_id), lambda n: n >= 1)
        await self.caught_up(job_id)

    async def caught_up(self, job_id: str) -> int:
        """Until the job counts as many records as the chain holds; that count."""
        await until(
            lambda: self.status(job_id),
            lambda s: s.usage_records == len(self.ledger.usage_records(job_id)),
        )
        return len(self.ledger.usage_records(job_id))

    async def period_due(self, job_id: str) -> None:
        """Until the job says its next period record is due."""

        async def ask() -> PeriodDue:
            return await self.client.get_workflow_handle(job_id).query("period_due", result_type=PeriodDue)

        await until(ask, lambda d: d.due_at is not None and d.due_at <= datetime.now(UTC))

    async def round_by_hand(self, attempt: int, client: Client | None = None) -> PollOutput:
        """One round of the cluster's monitor, run here as the given attempt of its activity."""
        env = ActivityEnvironment(client or self.client)
        env.info = dataclasses.replace(
            env.info,
            activity_type="poll_cluster",
            workflow_id=monitor_workflow_id(self.task_queue),
            attempt=attempt,
        )
        request = PollInput(cluster_id=self.config.hpc.cluster_id, vanished_grace_seconds=2.0)
        out: PollOutput = await env.run(MonitorActivities.poll_cluster, self.deps.activities.monitor, request)
        return out

    def end(self, job_id: str) -> None:
        """The scheduler ends the job (cancelled on the cluster)."""
        job = next(j for j in self.adapter.jobs.values() if j.workflow_id == job_id)
        job.cancelled_at = self.adapter.clock()

    async def result(self, job_id: str) -> JobResult:
        async with asyncio.timeout(90):
            return await self.client.get_workflow_handle(job_id, result_type=JobResult).result()


async def until(ask: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await ask()
        if ok(got):
            return got
        assert time.monotonic() < deadline, f"still {got!r}"
        await asyncio.sleep(0.1)


async def signals(s: Setup, job_id: str, name: str = "period_recorded") -> int:
    events = [e async for e in s.client.get_workflow_handle(job_id).fetch_history_events()]
    return sum(
        1
        for e in events
        if e.HasField("workflow_execution_signaled_event_attributes")
        and e.workflow_execution_signaled_event_attributes.signal_name == name
    )


def assert_whole(ledger: LocalLedger, job_id: str) -> list[UsageRecord]:
    """Sequences 1..n, each period starting where the one before ended, the final record last, the job settled."""
    records = sorted(ledger.usage_records(job_id), key=lambda r: r.sequence)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    for earlier, later in itertools.pairwise(records):
        assert later.period_start == earlier.period_end, (earlier.record_id, later.record_id)
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True]
    assert ledger.settlement(job_id) is not None
    return records


@pytest.fixture
async def setup(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Setup]:
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"p-{uuid.uuid4().hex[:8]}",
            "usage_reporting": {"report_interval": "1s"},
            "job_service": {"cluster_monitor": True},
        },
    )
    ledger = setup_ledger(config, Signer.from_file(key_path))
    chain = HeldChain(ledger)
    adapter = MemoryAdapter(default=Script([(0, JobState.QUEUED), (0.3, JobState.RUNNING)]))
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=chain,  # type: ignore[arg-type]
        adapters={config.hpc.cluster_id: adapter},
    )
    rounds = Rounds(deps.activities.monitor)
    activities = [
        rounds.poll_cluster if a.__name__ == "poll_cluster" else a for a in job_activities(deps.activities)
    ]
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[HPCJobWorkflow, ClusterMonitorWorkflow],
        activities=activities,
    ):
        yield Setup(config, ledger, chain, client, deps, adapter, rounds, task_queue)
    await deps.close()


async def test_a_running_job_records_the_monitors_period_records_from_its_signals(setup: Setup) -> None:
    """Every period record of a running job comes from its monitor's rounds, one signal each, the first too."""
    s = setup
    job_id = await s.start()
    await until(lambda: signals(s, job_id), lambda n: n >= 3)
    s.end(job_id)
    result = await s.result(job_id)
    records = assert_whole(s.ledger, job_id)
    assert result.state == JobState.CANCELLED and result.usage_records == len(records)
    # Every record but the final one is signalled by the monitor.
    assert await signals(s, job_id) >= len(records) - 1 >= 3


async def test_a_retried_round_and_its_timed_out_attempt_send_one_record(setup: Setup) -> None:
    """Attempt 1 of a round (timed out, still running) has signed its reading and is slow to send it; attempt 2
    finds nothing on chain, sends its own and tells the job; attempt 1's record then arrives: the chain calls it a
    duplicate, attempt 1 tells the job the stored one, and the job counts it once."""
    s = setup
    job_id = await s.start()
    await s.served(job_id)
    await s.rounds.pause()
    n = await s.caught_up(job_id) + 1
    rid = record_id(s.config.hpc.cluster_id, job_id, n)
    await s.period_due(job_id)
    before = await signals(s, job_id)

    s.chain.hold = rid
    zombie = asyncio.create_task(s.round_by_hand(attempt=1))
    await s.chain.held.wait()
    retry = await s.round_by_hand(attempt=2)
    assert retry.reported == 1
    stored = s.ledger.usage_record(rid)
    assert stored is not None and not stored.is_final
    s.chain.release.set()
    assert (await zombie).reported == 1  # it signalled the stored record, not its own reading
    assert s.ledger.usage_record(rid) == stored
    await until(lambda: signals(s, job_id), lambda k: k == before + 2)
    assert (await s.status(job_id)).usage_records == n
    reported = [e for e in read_events(s.config.hpc.audit.log_path) if e["event_type"] == "usage_reported"]
    duplicates = [e for e in reported if e["details"]["record_id"] == rid]
    assert [e["details"]["duplicate"] for e in duplicates] == [False, True]

    s.rounds.auto = True
    await until(lambda: s.status(job_id), lambda st: st.usage_records >= n + 1)
    s.end(job_id)
    result = await s.result(job_id)
    records = assert_whole(s.ledger, job_id)
    assert result.usage_records == len(records)
    assert records[n - 1] == stored


@pytest.mark.parametrize("first", ["period record", "final record"])
async def test_the_final_record_follows_a_period_record_whatever_reaches_the_chain_first(
    setup: Setup, first: str
) -> None:
    """A round took the job's reading while it ran; before the job hears of that record the job ends and sends its
    final record. Either the round's record reached the chain first (its signal comes after the job ended): the
    final record follows it under the next sequence; or the final record did: the round's record is a duplicate
    of it, nothing follows it and the job is not told of it."""
    s = setup
    held_signals = HeldSignals()
    slow = Client(
        s.client.service_client,
        namespace=s.client.namespace,
        data_converter=pydantic_data_converter,
        interceptors=[held_signals],
    )
    job_id = await s.start()
    await s.served(job_id)
    await s.rounds.pause()
    n = await s.caught_up(job_id) + 1
    rid = record_id(s.config.hpc.cluster_id, job_id, n)
    await s.period_due(job_id)

    if first == "final record":
        s.chain.hold = rid
    zombie = asyncio.create_task(s.round_by_hand(attempt=1, client=slow))
    await (s.chain.held if first == "final record" else held_signals.held).wait()
    s.end(job_id)
    s.rounds.auto = True
    result = await s.result(job_id)
    s.chain.release.set()
    held_signals.release.set()
    out = await zombie

    records = assert_whole(s.ledger, job_id)
    assert result.state == JobState.CANCELLED and result.usage_records == len(records)
    if first == "period record":
        assert len(records) == n + 1 and not records[n - 1].is_final and records[n].is_final
    else:
        assert len(records) == n and records[n - 1].is_final
    assert out.reported == 0  # the job was told nothing: it had ended, or the record was its final one


@pytest.mark.parametrize("runs", ["one run", "continued as new"])
async def test_a_job_whose_monitor_sends_nothing_reports_itself_without_a_gap(
    setup: Setup, runs: str
) -> None:
    """The monitor's rounds stop serving (paused: as a monitor stuck in a failing round): once the job has heard
    nothing for max_watch_seconds it sends its own period records, from where the monitor's last one ended; when
    the rounds come back, the monitor sends them again. A job whose history fills up every few records does the
    same in each of its runs (a run continued from another has heard nothing from the monitor yet)."""
    s = setup
    bound = {"continue_as_new_after_events": 60} if runs == "continued as new" else {}
    job_id = await s.start(max_watch_seconds=3.0, **bound)
    await s.served(job_id)
    await s.rounds.pause()
    paused_at = len(s.ledger.usage_records(job_id))
    await until(lambda: s.status(job_id), lambda st: st.usage_records >= paused_at + 2)
    heard = await signals(s, job_id)
    s.rounds.auto = True
    await until(lambda: signals(s, job_id), lambda k: k >= heard + 2)
    s.end(job_id)
    result = await s.result(job_id)
    records = assert_whole(s.ledger, job_id)
    assert result.usage_records == len(records)


async def test_a_job_whose_reading_breaks_leaves_the_round_to_the_others(setup: Setup) -> None:
    """One job's reading fails with an error outside the domain's (an adapter or chain fault the activities do not
    map): the round goes on, sends the other job's record and tells it; the broken job is served again once its
    reading works, and both settle whole."""
    s = setup
    broken, other = await s.start(), await s.start()
    await s.served(broken)
    await s.served(other)
    await s.rounds.pause()
    await s.caught_up(broken)
    n = await s.caught_up(other)
    await s.period_due(broken)
    await s.period_due(other)
    scheduler_id = next(jid for jid, j in s.adapter.jobs.items() if j.workflow_id == broken)
    reading = s.adapter.usage

    async def usage(scheduler_job_id: str) -> Any:
        if scheduler_job_id == scheduler_id:
            raise RuntimeError("the reading of this one job broke")
        return await reading(scheduler_job_id)

    s.adapter.usage = usage  # type: ignore[method-assign]
    out = await s.round_by_hand(attempt=1)  # raised the broken job's error before: no record for anyone
    assert out.reported == 1
    assert await s.caught_up(other) == n + 1

    heard = await signals(s, broken)
    s.adapter.usage = reading  # type: ignore[method-assign]
    s.rounds.auto = True
    await until(lambda: signals(s, broken), lambda k: k > heard)
    s.end(broken)
    s.end(other)
    for job_id in (broken, other):
        result = await s.result(job_id)
        assert result.usage_records == len(assert_whole(s.ledger, job_id))


async def replays(s: Setup, workflow_id: str) -> None:
    """The workflow's history, as recorded, replays on this code (every command it issues sits behind a patch)."""
    history = await s.client.get_workflow_handle(workflow_id).fetch_history()
    replayer = Replayer(
        workflows=[HPCJobWorkflow, ClusterMonitorWorkflow], data_converter=pydantic_data_converter
    )
    assert (await replayer.replay_workflow(history, raise_on_replay_failure=True)).replay_failure is None


async def test_a_served_job_and_its_monitor_replay_after_it_fell_back_and_was_served_again(
    setup: Setup,
) -> None:
    """Histories recorded with the monitor sending the records, with the job sending its own while the monitor was
    silent, and with the monitor back, replay: mid-run and once settled."""
    s = setup
    job_id = await s.start(max_watch_seconds=3.0)
    await until(lambda: signals(s, job_id), lambda n: n >= 3)
    await replays(s, job_id)
    await s.rounds.pause()
    paused_at = len(s.ledger.usage_records(job_id))
    await until(lambda: s.status(job_id), lambda st: st.usage_records >= paused_at + 2)
    await replays(s, job_id)
    heard = await signals(s, job_id)
    s.rounds.auto = True
    await until(lambda: signals(s, job_id), lambda k: k >= heard + 2)
    s.end(job_id)
    result = await s.result(job_id)
    assert result.usage_records == len(assert_whole(s.ledger, job_id))
    await replays(s, job_id)
    await replays(s, monitor_workflow_id(s.task_queue))


@pytest.mark.parametrize("how", ["terminate", "cancel"])
async def test_an_operator_stopping_the_monitor_leaves_no_gap(setup: Setup, how: str) -> None:
    """Terminate or Cancel on the monitor workflow (Web UI, CLI): the job sends its own records once it has heard
    nothing for max_watch_seconds, which registers it again and starts a monitor that serves it."""
    s = setup
    job_id = await s.start(max_watch_seconds=3.0)
    await until(lambda: signals(s, job_id), lambda n: n >= 2)
    monitor = s.client.get_workflow_handle(monitor_workflow_id(s.task_queue))
    await (monitor.terminate("operator") if how == "terminate" else monitor.cancel())
    at = len(s.ledger.usage_records(job_id))
    await until(lambda: s.status(job_id), lambda st: st.usage_records >= at + 2)
    heard = await signals(s, job_id)
    await until(lambda: signals(s, job_id), lambda k: k >= heard + 2)
    s.end(job_id)
    result = await s.result(job_id)
    assert result.usage_records == len(assert_whole(s.ledger, job_id))
    await replays(s, job_id)


@pytest.mark.parametrize("signals_reapplied", [True, False])
async def test_a_reset_to_before_the_monitors_first_record_goes_on_from_the_chain(
    setup: Setup, signals_reapplied: bool
) -> None:
    """Reset on a served job to the workflow task before the monitor's first record (signals reapplied, the
    default, or excluded): the reset run's records go on from the chain's, none twice, none missing."""
    s = setup
    job_id = await s.start()
    await until(lambda: signals(s, job_id), lambda n: n >= 3)
    handle = s.client.get_workflow_handle(job_id)
    tasks: list[int] = []
    async for e in handle.fetch_history_events():
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            tasks.append(e.event_id)
        if e.workflow_execution_signaled_event_attributes.signal_name == "period_recorded":
            break
    excluded = [] if signals_reapplied else [ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_SIGNAL]
    await s.client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=s.client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=job_id, run_id=(await handle.describe()).run_id),
            reason="operator",
            workflow_task_finish_event_id=tasks[-1],
            request_id=str(uuid.uuid4()),
            reset_reapply_exclude_types=excluded,
        )
    )
    at = len(s.ledger.usage_records(job_id))
    await until(lambda: s.status(job_id), lambda st: st.usage_records >= at + 2)
    s.end(job_id)
    result = await s.result(job_id)
    assert result.usage_records == len(assert_whole(s.ledger, job_id))
