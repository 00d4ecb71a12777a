"""The cluster monitor: one status query per poll interval for all of a cluster's jobs, whatever the worker count.

Two worker processes' worth of workers serve one cluster task queue, on a real Temporal dev server, with the
in-memory scheduler. What an operator would notice: the scheduler is asked by one monitor, one query at a time,
never by each job or each worker; a watched job holds no activity; jobs still go through every state and settle
when the monitor is reset, restarted with no memory, or continued as new.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker

from activities import monitor as monitor_activities
from activities.monitor import BUSY_RETRIES, MONITOR_PRIORITY, REGISTRATIONS_IN_FLIGHT, register
from activities.schedulers.base import NativeStatus
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import Pipeline, setup_ledger
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import (
    MONITOR_WORKFLOW_NAME,
    CancelRequest,
    JobRef,
    JobWorkflowInput,
    MonitorInput,
    MonitorSettings,
    WatchedSet,
    WatchEntry,
    WatchRegistration,
    monitor_workflow_id,
)
from virtengine_hpc.models import JobSpec, spec_digest
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.watch_batch import MONITOR_TAKES_BATCHES, WATCH_MANY
from workers.poller import ChainPoller
from workers.wiring import build_worker_deps, job_settings
from workers.worker import make_worker
from workflows.hpc_job import initial_search_attributes

Q, R, C = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED


@dataclass
class CountingAdapter(MemoryAdapter):
    """The in-memory scheduler, noting who asked each status query and how many were in flight at once."""

    askers: list[tuple[str, str]] = field(default_factory=list)
    asked: list[frozenset[str]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    breaks: int = 0
    """Queries still to fail with something no scheduler error is (as a bug in an adapter's parser would)."""

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        if self.breaks > 0:
            self.breaks -= 1
            raise ValueError("could not parse the scheduler's answer")
        ids = frozenset(scheduler_job_ids)
        info = activity.info()
        self.askers.append((info.activity_type, info.workflow_id or ""))
        self.asked.append(ids)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # a query takes a moment: overlapping askers would show
            return await super().status_batch(ids)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def two_workers(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> AsyncIterator[Pipeline]:
    """Two workers (as two worker processes would run them) on one cluster's task queue, one scheduler."""
    config = make_config(
        tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "job_service": {"cluster_monitor": True}}
    )
    adapter = CountingAdapter()
    ledger = setup_ledger(config, Signer.from_file(key_path))
    secrets = Secrets(provider_signing_key_path=key_path)
    cluster = {config.hpc.cluster_id: adapter}
    deps = [build_worker_deps(config, secrets, chain=ledger, adapters=cluster) for _ in range(2)]
    poller = ChainPoller(
        client, ledger, config, deps[0].audit, task_queue=task_queue, settings=job_settings(config)
    )
    # A client each, as two worker processes have (one client cannot run two workers of one task queue).
    other = await Client.connect(
        client.service_client.config.target_host,
        namespace=client.namespace,
        data_converter=pydantic_data_converter,
    )
    workers = [make_worker(c, d, queue=task_queue) for c, d in zip((client, other), deps, strict=True)]
    async with workers[0], workers[1]:
        yield Pipeline(config, ledger, client, deps[0], poller, task_queue, adapter)
    for d in deps:
        await d.close()


def counting(p: Pipeline) -> CountingAdapter:
    assert isinstance(p.adapter, CountingAdapter)
    return p.adapter


async def test_one_monitor_asks_the_scheduler_for_every_job_one_query_at_a_time(
    two_workers: Pipeline,
) -> None:
    p = two_workers
    counting(p).default = Script([(0, Q), (1.0, R), (4.0, C)], exit_code=0)
    job_ids = [p.submit() for _ in range(8)]
    results = await p.run_until_done(job_ids)
    assert {r.state for r in results.values()} == {C}
    for job_id in job_ids:
        assert p.states_of(job_id) == [Q, R, C]
    adapter = counting(p)
    monitor = monitor_workflow_id(p.task_queue)
    assert set(adapter.askers) == {("poll_cluster", monitor)}, "no job and no worker asks on its own"
    assert adapter.most_in_flight == 1
    # While all eight ran, each query asked about all of them at once.
    assert any(len(ids) == 8 for ids in adapter.asked)


async def test_a_watched_job_holds_no_activity_and_hears_its_start_by_signal(two_workers: Pipeline) -> None:
    p = two_workers
    counting(p).default = Script([(0, Q), (2.0, R), (600, C)])
    job_id = p.submit()
    await p.wait_started(job_id)
    await _wait_for_state(p, job_id, Q)
    desc = await p.handle(job_id).describe()
    assert list(desc.raw_description.pending_activities) == [], (
        "a queued job waits on a signal, not an activity"
    )
    await _wait_for_state(p, job_id, R)
    events = [e async for e in p.handle(job_id).fetch_history_events()]
    signals = [
        e.workflow_execution_signaled_event_attributes.signal_name
        for e in events
        if e.HasField("workflow_execution_signaled_event_attributes")
    ]
    assert signals == ["observe"]
    await p.handle(job_id).cancel()
    await p.handle(job_id).result()


async def test_a_monitor_that_forgot_everything_still_gets_every_job_to_its_end(
    two_workers: Pipeline,
) -> None:
    """The monitor's round is retried on a worker that knows nothing (its memory lost): jobs are told again at
    worst, and none misses a transition."""
    p = two_workers
    counting(p).default = Script([(0, Q), (1.0, R), (3.0, C)], exit_code=0)
    job_ids = [p.submit() for _ in range(4)]
    for job_id in job_ids:
        await p.wait_started(job_id)
    await _wait_for_state(p, job_ids[0], R)
    p.deps.activities.monitor._monitors.clear()
    results = await p.run_until_done(job_ids)
    assert {r.state for r in results.values()} == {C}
    for job_id in job_ids:
        assert p.states_of(job_id) == [Q, R, C]


async def test_a_job_whose_monitor_was_terminated_reaches_it_again(two_workers: Pipeline) -> None:
    """An operator terminates the monitor: the job's safety-net check registers it again, which starts a new
    monitor, and the job ends as the scheduler says."""
    p = two_workers
    counting(p).default = Script([(0, Q), (1.0, R), (3.0, C)], exit_code=0)
    job_id = p.submit()
    spec = JobSpec.model_validate(p.ledger.job(job_id).raw_spec)  # type: ignore[union-attr]
    settings = job_settings(p.config).model_copy(update={"max_watch_seconds": 2.0})
    inp = JobWorkflowInput(
        job=JobRef.of(spec, spec_digest(p.ledger.job(job_id).raw_spec)),  # type: ignore[union-attr]
        cluster_id=p.cluster_id,
        provider=spec.provider,
        settings=settings,
    )
    handle = await p.client.start_workflow(
        "HPCJobWorkflow",
        inp,
        id=job_id,
        task_queue=p.task_queue,
        search_attributes=initial_search_attributes(inp),
    )
    await _wait_for_state(p, job_id, Q)
    monitor = p.client.get_workflow_handle(monitor_workflow_id(p.task_queue))
    first_run = (await monitor.describe()).run_id
    await monitor.terminate("operator")
    result = await p.handle(job_id).result()
    assert result.state == C
    assert p.states_of(job_id) == [Q, R, C]
    assert (await monitor.describe()).run_id != first_run
    assert handle.id == job_id


async def test_jobs_go_on_across_the_monitors_continue_as_new(two_workers: Pipeline) -> None:
    """The monitor's history fills up while jobs run: its next run watches them on, and tells them when they end."""
    p = two_workers
    counting(p).default = Script([(0, Q), (1.0, R), (600, C)])
    monitor_id = monitor_workflow_id(p.task_queue)
    settings = MonitorSettings(
        cluster_id=p.cluster_id,
        task_queue=p.task_queue,
        poll_interval_seconds=0.3,
        vanished_grace_seconds=2.0,
        max_history_events=100,
    )
    monitor = await p.client.start_workflow(
        MONITOR_WORKFLOW_NAME, MonitorInput(settings=settings), id=monitor_id, task_queue=p.task_queue
    )
    job_ids = [p.submit() for _ in range(3)]
    for job_id in job_ids:
        await p.wait_started(job_id)
        await _wait_for_state(p, job_id, R)
    first = p.client.get_workflow_handle(monitor_id, run_id=monitor.first_execution_run_id)
    async with asyncio.timeout(60):
        while (await first.describe()).status != WorkflowExecutionStatus.CONTINUED_AS_NEW:
            await asyncio.sleep(0.5)
    for job_id in job_ids:
        await p.handle(job_id).signal("cancel", CancelRequest(reason="the tenant changed their mind"))
    results = await p.run_until_done(job_ids)
    assert {r.state for r in results.values()} == {JobState.CANCELLED}
    for job_id in job_ids:
        assert p.states_of(job_id) == [Q, R, JobState.CANCELLED]
    current = await p.client.get_workflow_handle(monitor_id).describe()
    assert current.run_id != monitor.first_execution_run_id


async def test_a_round_whose_query_breaks_is_a_failed_round_and_the_next_one_tells(
    two_workers: Pipeline,
) -> None:
    """An adapter error that is not a scheduler error fails the round as a scheduler error does: counted in the
    query failures, its message in the round's result (Web UI), the next round at the next interval. It used to
    fail the activity, which Temporal retried with a growing backoff while no job heard anything."""
    p = two_workers
    broken = counting(p)
    broken.breaks = 3
    broken.default = Script([(0, Q), (1.0, R), (3.0, C)], exit_code=0)
    job_id = p.submit()
    result = (await p.run_until_done([job_id]))[job_id]
    assert result.state == C and p.states_of(job_id) == [Q, R, C]
    history = await p.client.get_workflow_handle(monitor_workflow_id(p.task_queue)).fetch_history()
    errors = [
        json.loads(e.activity_task_completed_event_attributes.result.payloads[0].data).get("error")
        for e in history.events
        if e.HasField("activity_task_completed_event_attributes")
    ]
    assert "status query failed: could not parse the scheduler's answer" in errors
    retried = [
        e
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.attempt > 1
    ]
    assert not retried, "no round failed as an activity"
    assert broken.breaks == 0


async def _wait_for_state(p: Pipeline, job_id: str, state: JobState, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while True:
            await p.poller.poll_once()
            job = p.ledger.job(job_id)
            if job is not None and job.state == state:
                return
            await asyncio.sleep(0.2)


class _CrowdedServer:
    """The real client, counting the monitor starts (signal-with-start) in flight at once; the first ``busy`` of
    them answered as Temporal answers a workflow that many requests update at once."""

    def __init__(self, client: Client, busy: int = 0) -> None:
        self.client = client
        self.busy = busy
        self.in_flight = 0
        self.most_in_flight = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start_workflow(self, *args: Any, **kwargs: Any) -> Any:
        if self.busy > 0:
            self.busy -= 1
            raise RPCError("Workflow is busy.", RPCStatusCode.RESOURCE_EXHAUSTED, b"")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self.client.start_workflow(*args, **kwargs)
        finally:
            self.in_flight -= 1


def _registration(task_queue: str, n: int) -> WatchRegistration:
    return WatchRegistration(
        workflow_id=f"job-{n}",
        monitor=MonitorSettings(cluster_id="c1", task_queue=task_queue, poll_interval_seconds=2),
        entry=WatchEntry(scheduler_job_id=str(1000 + n), state=JobState.QUEUED),
    )


async def _watch_signals(client: Client, task_queue: str) -> list[str]:
    """The jobs the monitor of ``task_queue`` was told of, from its history (no worker runs it here)."""
    told = []
    async for event in client.get_workflow_handle(monitor_workflow_id(task_queue)).fetch_history_events():
        if event.HasField("workflow_execution_signaled_event_attributes"):
            payload = event.workflow_execution_signaled_event_attributes.input.payloads[0]
            told.append(json.loads(payload.data)["workflow_id"])
    return told


async def test_a_crowd_of_jobs_registers_with_its_monitor_a_few_at_a_time(
    client: Client, task_queue: str
) -> None:
    """10,000 jobs queued within minutes each registered with their cluster's one monitor workflow at once, and
    Temporal, which updates one workflow one request at a time, refused most as "Workflow is busy" (each refusal
    failed the job's report activity, retried with its chain report). 200 registrations sent together from one
    process: at most ``REGISTRATIONS_IN_FLIGHT`` leave it at once, and the monitor hears every one."""
    crowded = _CrowdedServer(client)
    try:
        await asyncio.gather(
            *(register(cast(Client, crowded), _registration(task_queue, n)) for n in range(200))
        )
        assert crowded.most_in_flight <= REGISTRATIONS_IN_FLIGHT
        assert sorted(await _watch_signals(client, task_queue)) == sorted(f"job-{n}" for n in range(200))
    finally:
        await client.get_workflow_handle(monitor_workflow_id(task_queue)).terminate("test over")


async def test_a_registration_refused_as_busy_is_sent_again(
    client: Client, task_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration Temporal refuses as busy is sent again after a backoff, instead of failing the job's
    report activity at once; one refused more often than ``BUSY_RETRIES`` still fails it (its retry goes on)."""
    monkeypatch.setattr(monitor_activities, "BUSY_BACKOFF_SECONDS", 0.01)
    try:
        await register(cast(Client, _CrowdedServer(client, busy=2)), _registration(task_queue, 1))
        assert await _watch_signals(client, task_queue) == ["job-1"]
        with pytest.raises(RPCError, match="busy"):
            await register(
                cast(Client, _CrowdedServer(client, busy=BUSY_RETRIES)), _registration(task_queue, 2)
            )
        assert await _watch_signals(client, task_queue) == ["job-1"]
    finally:
        await client.get_workflow_handle(monitor_workflow_id(task_queue)).terminate("test over")


async def _signals_of(client: Client, task_queue: str) -> list[tuple[str, int]]:
    """(signal name, registrations it carried) of every signal in the monitor's history (all its runs)."""
    signals = []
    async for event in client.get_workflow_handle(monitor_workflow_id(task_queue)).fetch_history_events():
        if event.HasField("workflow_execution_signaled_event_attributes"):
            attrs = event.workflow_execution_signaled_event_attributes
            data = json.loads(attrs.input.payloads[0].data)
            signals.append((attrs.signal_name, len(data["registrations"]) if "registrations" in data else 1))
    return signals


async def _watched(client: Client, task_queue: str) -> set[str]:
    answer = await client.get_workflow_handle(monitor_workflow_id(task_queue)).query(
        "watched", result_type=WatchedSet
    )
    return set(answer.entries)


async def test_registrations_waiting_in_a_worker_process_reach_the_monitor_in_a_few_signals(
    two_workers: Pipeline,
) -> None:
    """10,000 jobs sent the one monitor workflow one signal each, which Temporal applies one at a time (measured
    about 1.2 s each on a loaded dev server, 5 a second): jobs waited half an hour to be watched. Registrations that
    wait in a worker process while it sends leave together in one ``watch_many`` signal, once the monitor's run says
    it handles that: 200 sent together reach the running monitor in a few signals, and it watches every job."""
    p = two_workers
    settings = MonitorSettings(
        cluster_id=p.cluster_id, task_queue=p.task_queue, poll_interval_seconds=2, vanished_grace_seconds=600
    )

    def registration(n: int) -> WatchRegistration:
        entry = WatchEntry(scheduler_job_id=str(5000 + n), state=Q)
        return WatchRegistration(workflow_id=f"job-{n}", monitor=settings, entry=entry)

    try:
        await register(p.client, registration(0))  # starts the monitor
        async with asyncio.timeout(30):
            while not await _watched(p.client, p.task_queue):
                await asyncio.sleep(0.2)
        await asyncio.gather(*(register(p.client, registration(n)) for n in range(1, 201)))
        assert await _watched(p.client, p.task_queue) == {f"job-{n}" for n in range(201)}
        signals = await _signals_of(p.client, p.task_queue)
        assert sum(carried for _, carried in signals) == 201
        assert len(signals) <= 10, signals
        assert {name for name, _ in signals} == {"watch", WATCH_MANY}
    finally:
        await p.client.get_workflow_handle(monitor_workflow_id(p.task_queue)).terminate("test over")


@workflow.defn(name=MONITOR_WORKFLOW_NAME, sandboxed=False)
class OlderBuildsMonitor:
    """A monitor of a build before ``watch_many``: it knows the ``watch`` signal only (and says nothing in its
    memo). It keeps what it is told and never rounds."""

    def __init__(self) -> None:
        self.watched: dict[str, WatchEntry] = {}

    @workflow.signal(name="watch")
    def watch(self, registration: WatchRegistration) -> None:
        self.watched[registration.workflow_id] = registration.entry

    @workflow.query(name="watched")
    def query_watched(self) -> WatchedSet:
        return WatchedSet(entries=self.watched)

    @workflow.run
    async def run(self, inp: MonitorInput) -> int:
        await workflow.wait_condition(lambda: False)
        return 0


@workflow.defn(name=MONITOR_WORKFLOW_NAME, sandboxed=False)
class OlderBuildsRunWithAnInheritedMemo(OlderBuildsMonitor):
    """An older build's monitor run that continued a newer one (a rollback): the memo saying ``watch_many`` is
    handled came with continue-as-new, and names the run before it."""

    @workflow.run
    async def run(self, inp: MonitorInput) -> int:
        workflow.upsert_memo({MONITOR_TAKES_BATCHES: "the-run-before-this-one"})
        await workflow.wait_condition(lambda: False)
        return 0


@pytest.mark.parametrize("older", [OlderBuildsMonitor, OlderBuildsRunWithAnInheritedMemo])
async def test_an_older_builds_monitor_is_sent_the_one_signal_it_knows(
    client: Client, task_queue: str, older: type
) -> None:
    """During an upgrade a job of the new build may register with a monitor run of the old build, which has no
    ``watch_many`` handler (a signal it does not know would wait unhandled and be lost with the run): it is sent one
    ``watch`` per job, and it watches every one; also when the run carries a memo of the run before it."""
    async with Worker(client, task_queue=task_queue, workflows=[older]):
        try:
            await register(client, _registration(task_queue, 0))
            async with asyncio.timeout(30):
                while not await _watched(client, task_queue):
                    await asyncio.sleep(0.2)
            await asyncio.gather(*(register(client, _registration(task_queue, n)) for n in range(1, 51)))
            assert await _watched(client, task_queue) == {f"job-{n}" for n in range(51)}
            assert await _signals_of(client, task_queue) == [("watch", 1)] * 51
        finally:
            await client.get_workflow_handle(monitor_workflow_id(task_queue)).terminate("test over")


async def test_the_monitor_runs_ahead_of_the_jobs_on_their_task_queue(two_workers: Pipeline) -> None:
    """The monitor shares the cluster's task queue with every job: during a ramp of 10,000 jobs its next workflow
    task waited behind theirs for more than ten minutes, with no round and no job told of anything. A monitor
    started by a job's registration runs at Temporal priority key ``MONITOR_PRIORITY`` (its workflow tasks and
    rounds go before the jobs' tasks, at the default 3), and so does its next run after continue-as-new."""
    p = two_workers
    settings = MonitorSettings(
        cluster_id=p.cluster_id,
        task_queue=p.task_queue,
        poll_interval_seconds=0.3,
        vanished_grace_seconds=600,
        max_history_events=100,
    )
    entry = WatchEntry(scheduler_job_id="4242", state=Q)
    await register(p.client, WatchRegistration(workflow_id="job-x", monitor=settings, entry=entry))
    handle = p.client.get_workflow_handle(monitor_workflow_id(p.task_queue))
    try:
        first = await handle.describe()
        assert first.raw_description.workflow_execution_info.priority.priority_key == MONITOR_PRIORITY
        async with asyncio.timeout(60):
            while (later := await handle.describe()).run_id == first.run_id:
                await asyncio.sleep(0.5)
        assert later.raw_description.workflow_execution_info.priority.priority_key == MONITOR_PRIORITY
    finally:
        await handle.terminate("test over")
