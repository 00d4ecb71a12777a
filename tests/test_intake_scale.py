"""An intake that keeps up and holds its limits (``workers/poller.py``, ``workers/intake_lease.py``).

Real dev server and LocalLedger, the real poller; its workflows start on a task queue no worker polls, so they stay
open and hold their slot. Running workflows are counted with ``describe`` (strongly consistent), not with the
visibility store the poller itself reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from activities.chain.client import StatusReport
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from tests.poller_support import idle_queue, start_idle, terminate_all, visibility_shows
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, CancelRequest
from virtengine_hpc.states import JobState
from workers import poller as poller_module
from workers.intake_lease import SETTLE_SECONDS, IntakeLease, lease_id
from workers.metrics import WorkerMetrics
from workers.poller import CANCEL_BATCH, ChainPoller, PollStats
from workers.wiring import job_settings


def pipeline_config(tmp_path: Path, max_concurrent_jobs: int) -> Any:
    return make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "job_service": {"max_concurrent_jobs": max_concurrent_jobs, "job_poll_interval": "1s"},
        },
    )


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    async with running_pipeline(
        client, pipeline_config(tmp_path, 5), key_path, MemoryAdapter(), task_queue
    ) as p:
        yield p


def make_poller(pipe: Pipeline, client: Any, queue: str, holder: str, **lease: Any) -> ChainPoller:
    return ChainPoller(
        cast(Client, client),
        pipe.ledger,
        pipe.config,
        pipe.deps.audit,
        task_queue=queue,
        settings=job_settings(pipe.config),
        lease=IntakeLease(
            cast(Client, client),
            pipe.cluster_id,
            term=pipe.config.hpc.job_service.intake_lease,
            holder=holder,
            **lease,
        ),
    )


async def running(client: Client, job_ids: list[str]) -> list[str]:
    """The jobs whose workflow runs now, asked of each workflow itself."""
    out = []
    for job_id in job_ids:
        try:
            desc = await client.get_workflow_handle(job_id).describe()
        except RPCError:
            continue
        if desc.status == WorkflowExecutionStatus.RUNNING:
            out.append(job_id)
    return out


async def test_two_pollers_together_never_run_more_than_max_concurrent_jobs(
    pipe: Pipeline, client: Client
) -> None:
    """Both pollers poll at the same moments, each seeing the same free slots in visibility: without a lease both
    would fill them (10 running for a limit of 5). With it the bound is exact: one poller starts, the other
    stands by, and the jobs beyond the limit wait on chain."""
    queue = idle_queue()
    jobs = [pipe.submit() for _ in range(12)]
    a = make_poller(pipe, client, queue, holder="poller-a")
    b = make_poller(pipe, client, queue, holder="poller-b")
    try:
        for _ in range(4):
            rounds = await asyncio.gather(a.take_jobs(), b.take_jobs())
            assert len(await running(client, jobs)) <= 5
            assert sorted(r.standby for r in rounds) == [False, True], "one poller holds the intake"
        assert len(await running(client, jobs)) == 5, "the free slots were filled"
        waiting = [r.waiting for r in rounds if not r.standby]
        assert waiting == [7], "the rest wait on chain, none is dropped"
    finally:
        await terminate_all(client, jobs)


async def test_a_poller_takes_over_the_intake_when_the_holder_stops(pipe: Pipeline, client: Client) -> None:
    """The holder stops renewing (its process died): the other poller takes the first term it did not take, and
    waits a moment into it before starting anything, so the holder's last starts have reached visibility."""
    now = [1_900_000_000.0]
    term = timedelta(seconds=30)
    a = IntakeLease(client, pipe.cluster_id, term=term, holder="a", clock=lambda: now[0])
    b = IntakeLease(client, pipe.cluster_id, term=term, holder="b", clock=lambda: now[0])
    first = int(now[0] // 30)
    try:
        assert await a.refresh() and not await b.refresh()
        now[0] = (first + 1) * 30 + 1  # a never refreshed again: the next term is free
        assert not await b.refresh(), "another poller held the term before: b waits the settle time"
        now[0] = (first + 1) * 30 + SETTLE_SECONDS
        assert b.valid() and not a.valid()
    finally:
        await terminate_all(client, [lease_id(pipe.cluster_id, t) for t in (first, first + 1)])


async def test_two_loops_taking_the_term_at_once_both_wait_the_settle_time(
    pipe: Pipeline, client: Client
) -> None:
    """The poller's loops (intake, cancellations, renewal) refresh one lease side by side. At a takeover, the one
    whose start of the term's workflow lost (already started, by this process) held the term at once, while the
    winner was still asking who held the term before: for that moment ``valid()`` said the new holder could start
    jobs without the settle time. Here the winner's question is held up until the other has answered."""
    now = [1_900_000_000.0]
    term = timedelta(seconds=30)
    first = int(now[0] // 30)
    slow = _SlowDescribe(client, lease_id(pipe.cluster_id, first))
    a = IntakeLease(client, pipe.cluster_id, term=term, holder="a", clock=lambda: now[0])
    b = IntakeLease(cast(Client, slow), pipe.cluster_id, term=term, holder="b", clock=lambda: now[0])
    try:
        assert await a.refresh(), "a holds the first term, then dies"
        now[0] = (first + 1) * 30 + 1
        answers = await asyncio.gather(b.refresh(), slow.after_release(b.refresh()))
        assert answers == [False, False], "both wait the settle time"
        now[0] = (first + 1) * 30 + SETTLE_SECONDS
        assert b.valid()
    finally:
        await terminate_all(client, [lease_id(pipe.cluster_id, t) for t in (first, first + 1)])


class _SlowDescribe:
    """The real client; the first describe of workflow ``slow_id`` waits until a second caller has had its answer."""

    def __init__(self, client: Client, slow_id: str) -> None:
        self.client = client
        self.slow_id = slow_id
        self.started = asyncio.Event()  # a lease workflow was started through this client
        self.released = asyncio.Event()
        self.held_up = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start_workflow(self, *args: Any, **kwargs: Any) -> Any:
        handle = await self.client.start_workflow(*args, **kwargs)
        self.started.set()
        return handle

    def get_workflow_handle(self, workflow_id: str, **kwargs: Any) -> Any:
        handle = self.client.get_workflow_handle(workflow_id, **kwargs)
        if workflow_id != self.slow_id or self.held_up:
            return handle
        self.held_up = True
        return _HeldDescribe(handle, self.released)

    async def after_release(self, refresh: Any) -> bool:
        """Run the second ``refresh`` once the first has started its term's workflow, then let the first go on."""
        await self.started.wait()
        try:
            return bool(await refresh)
        finally:
            self.released.set()


class _HeldDescribe:
    def __init__(self, handle: Any, released: asyncio.Event) -> None:
        self.handle = handle
        self.released = released

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    async def describe(self) -> Any:
        await self.released.wait()
        return await self.handle.describe()


class GatedStarts:
    """The real client, with every job workflow start held at a gate until the test opens it."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.gate = asyncio.Event()
        self.waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start_workflow(self, workflow: Any, *args: Any, **kwargs: Any) -> Any:
        if workflow == JOB_WORKFLOW_NAME and "start_signal" not in kwargs:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await self.client.start_workflow(workflow, *args, **kwargs)


async def signalled(client: Client, job_id: str, name: str) -> bool:
    async for event in client.get_workflow_handle(job_id).fetch_history_events():
        if event.workflow_execution_signaled_event_attributes.signal_name == name:
            return True
    return False


async def test_a_tenant_cancel_is_forwarded_while_thousands_of_starts_wait(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """2,000 pending jobs, their starts held up (a slow Temporal); meanwhile a tenant cancels a job whose workflow
    runs. The cancel reaches that workflow while the starts still wait: cancellations have a loop of their own."""
    config = pipeline_config(tmp_path, 5000)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        cancelled = pipe.submit()
        await start_idle(pipe, cancelled, queue)
        pipe.ledger.fund(TENANT, 2000)
        for _ in range(2000):
            pipe.submit(decide=False, max_price="1")
        gated = GatedStarts(client)
        poller = make_poller(pipe, gated, queue, holder="poller")
        stop = asyncio.Event()
        task = asyncio.create_task(poller.run(stop))
        try:
            for _ in range(300):
                if gated.waiting >= poller.start_concurrency:
                    break
                await asyncio.sleep(0.1)
            assert gated.waiting == poller.start_concurrency, "the start round is under way, held at the gate"
            pipe.ledger.request_cancel(cancelled)
            for _ in range(300):
                if await signalled(client, cancelled, "cancel"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the tenant's cancel never reached the job's workflow")
            assert not gated.gate.is_set() and gated.waiting == poller.start_concurrency
            assert await running(client, [cancelled]) == [cancelled]
        finally:
            stop.set()
            task.cancel()  # the held starts are dropped, not let through into 2,000 idle workflows
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await terminate_all(client, [cancelled, *poller._recent])


async def test_a_full_queue_reports_every_waiting_job_and_the_starts_it_made(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """1,200 pending jobs, a limit of 5: the round starts 5 and reads no page past the first once the slots are full,
    yet ``job_queue_full`` and the gauge ``virtengine_hpc_chain_pending_jobs`` say all 1,195 others wait (the pages
    not read are counted on chain, not listed), and ``running`` includes the 5 just started."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund(TENANT, 1200)
        jobs = [pipe.submit(decide=False, max_price="1") for _ in range(1200)]
        poller = make_poller(pipe, client, queue, holder="poller")
        poller.metrics = WorkerMetrics()
        try:
            stats = await poller.take_jobs()
            assert len(stats.started) == 5
            full = pipe.audit_events("job_queue_full")
            assert full[-1]["details"] == {"waiting": 1195, "running": 5, "max_concurrent_jobs": 5}
            gauge = poller.metrics.registry.get_sample_value(
                "virtengine_hpc_chain_pending_jobs", {"cluster": pipe.cluster_id}
            )
            assert gauge == 1195
        finally:
            await terminate_all(client, jobs[:10])


async def cancel_signals(client: Client, job_id: str) -> int:
    count = 0
    async for event in client.get_workflow_handle(job_id).fetch_history_events():
        count += event.workflow_execution_signaled_event_attributes.signal_name == "cancel"
    return count


async def test_two_pollers_forwarding_one_tenant_cancel_audit_it_once(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """Two pollers, one holding the intake lease. A pending job with no workflow is started with the cancel in it
    (signal-with-start) by the holder alone, so the cancel is audited once (``job_cancelled`` "cancelled before
    it started") and signalled once: the standby poller forwards nothing while the holder lives."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        job = pipe.submit(decide=False)
        pipe.ledger.request_cancel(job)
        a = make_poller(pipe, client, queue, holder="poller-a")
        b = make_poller(pipe, client, queue, holder="poller-b")
        try:
            assert await a.lease.refresh() and not await b.lease.refresh(), "a holds the intake lease"
            forwarded = await asyncio.gather(a.forward_cancellations(), b.forward_cancellations())
            assert [stats.cancelled for stats in forwarded] == [[job], []]
            assert [stats.standby for stats in forwarded] == [False, True]
            assert (await b.forward_cancellations()).cancelled == [], "b leaves it to the holder"
            assert (await a.forward_cancellations()).cancelled == [], "forwarded once"
            assert await cancel_signals(client, job) == 1
            assert len(pipe.audit_events("job_cancelled", job)) == 1
        finally:
            await terminate_all(client, [job])


async def test_two_fresh_pollers_forwarding_one_cancel_at_once_audit_it_once(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """Both pollers have just started (neither has asked for the lease yet) and forward the same cancel at the same
    moment: they race for the lease, one wins and starts the job with the cancel in it, once."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        job = pipe.submit(decide=False)
        pipe.ledger.request_cancel(job)
        a = make_poller(pipe, client, queue, holder="poller-a")
        b = make_poller(pipe, client, queue, holder="poller-b")
        try:
            forwarded = await asyncio.gather(a.forward_cancellations(), b.forward_cancellations())
            assert sorted(len(stats.cancelled) for stats in forwarded) == [0, 1]
            assert await cancel_signals(client, job) == 1
            assert len(pipe.audit_events("job_cancelled", job)) == 1
        finally:
            await terminate_all(client, [job] + [lease_id(pipe.cluster_id, t) for t in lease_terms(a)])


def lease_terms(poller: ChainPoller) -> list[int]:
    now = int(time.time() // poller.lease.term)
    return [now - 1, now, now + 1]


async def test_the_pollers_of_two_clusters_audit_the_cancel_of_a_job_for_no_cluster_once(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A job that names no cluster is offered to every cluster of its provider, so each cluster's lease holder
    forwards its cancel. Only the one whose start made the run audits it; the other's signal-with-start signals
    that run."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        job = pipe.submit(decide=False, offering_id="offering-of-no-cluster")
        pipe.ledger.request_cancel(job)
        other = f"c-{uuid.uuid4().hex[:8]}"
        a = make_poller(pipe, client, queue, holder="poller-a")
        b = ChainPoller(
            client,
            pipe.ledger,
            config.model_copy(update={"hpc": config.hpc.model_copy(update={"cluster_id": other})}),
            pipe.deps.audit,
            task_queue=queue,
            settings=job_settings(pipe.config),
            lease=IntakeLease(client, other, term=config.hpc.job_service.intake_lease, holder="poller-b"),
        )
        try:
            assert await a.lease.refresh() and await b.lease.refresh(), "each holds its own cluster's lease"
            forwarded = await asyncio.gather(a.forward_cancellations(), b.forward_cancellations())
            assert [stats.cancelled for stats in forwarded] == [[job], [job]]
            assert len(pipe.audit_events("job_cancelled", job)) == 1
        finally:
            terms = lease_terms(a)
            await terminate_all(
                client, [job] + [lease_id(c, t) for t in terms for c in (pipe.cluster_id, other)]
            )


async def test_a_standby_poller_forwards_a_cancel_the_holder_left_for_a_whole_term(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """The holder died after taking its terms: until they run out the standby poller cannot take the lease, but a
    cancel still waiting after a whole term is forwarded by it (a running job is billed while it waits)."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        job = pipe.submit()
        await start_idle(pipe, job, queue)
        pipe.ledger.request_cancel(job)
        a = make_poller(pipe, client, queue, holder="poller-a")
        now = [0.0]
        b = make_poller(pipe, client, queue, holder="poller-b")
        b.clock = lambda: now[0]
        try:
            assert await a.lease.refresh(), "a holds the lease, then dies"
            assert (await b.forward_cancellations()).cancelled == []
            now[0] = b.lease.term - 1
            assert (await b.forward_cancellations()).cancelled == []
            now[0] = b.lease.term
            stats = await b.forward_cancellations()
            assert stats.standby and stats.cancelled == [job]
            assert await cancel_signals(client, job) == 1
        finally:
            await terminate_all(client, [job])


async def test_a_standby_poller_leaves_the_pending_jobs_of_a_long_flood_to_the_busy_holder(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """The holder lives but a flood of cancels outlasts a term: the standby poller forwards what has waited that
    long, and the cancel of a pending job without a workflow is the holder's to start. The standby signals it and
    stops there; it looked up every such job on Temporal and on chain, every round, for nothing, while the holder
    was at its busiest."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund("mallory", 40)
        flood = [pipe.submit(decide=False, max_price="1", tenant="mallory") for _ in range(30)]
        for job_id in flood:
            pipe.ledger.request_cancel(job_id)
        a = make_poller(pipe, client, queue, holder="poller-a")
        b = make_poller(pipe, client, queue, holder="poller-b")
        reads = _CountingReads(pipe.ledger)
        b.chain = cast(Any, reads)
        now = [0.0]
        b.clock = lambda: now[0]
        try:
            assert await a.lease.refresh(), "a holds the lease, busy with the flood"
            assert (await b.forward_cancellations()).cancelled == []
            now[0] = b.lease.term
            stats = await b.forward_cancellations()
            assert stats.standby and stats.cancelled == []
            assert reads.job_reads == 0, "the standby read the chain for jobs the holder starts"
            assert pipe.audit_events("job_cancelled") == []
            assert sorted((await a.forward_cancellations()).cancelled) == sorted(flood)
        finally:
            await terminate_all(client, flood)


class _CountingReads:
    """The ledger, counting ``get_job`` calls and the size of each answer of ``cancel_requested_jobs``."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.job_reads = 0
        self.cancel_reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def get_job(self, job_id: str) -> Any:
        self.job_reads += 1
        return await self.ledger.get_job(job_id)

    async def cancel_requested_jobs(self, *args: Any, **kwargs: Any) -> list[str]:
        listed: list[str] = await self.ledger.cancel_requested_jobs(*args, **kwargs)
        self.cancel_reads.append(len(listed))
        return listed


async def test_a_flood_of_cancels_does_not_delay_another_tenants_cancel(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A tenant submits 300 jobs beyond the limit (pending, no workflow) and cancels them all, then its own running
    job; then another tenant cancels a job whose workflow was just started. ``cancel_concurrency`` at once, the
    cancels of jobs that run come first and the rest in turns by tenant: both cancels are among the first forwarded,
    not behind the whole flood (whose every cancel costs a lookup, a start and an audit record). Every cancel of the
    flood is forwarded too, in the same round."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund("mallory", 400)
        flood = [pipe.submit(decide=False, max_price="1", tenant="mallory") for _ in range(300)]
        own = pipe.submit(tenant="mallory")
        await start_idle(pipe, own, queue)
        await pipe.ledger.report_status(StatusReport(job_id=own, state=JobState.RUNNING))
        for job_id in [*flood, own]:
            pipe.ledger.request_cancel(job_id)
        victim = pipe.submit()
        await start_idle(pipe, victim, queue)  # not reported yet: pending on chain, like the flood
        pipe.ledger.request_cancel(victim)
        order: list[str] = []
        poller = make_poller(pipe, RecordingCalls(client, order), queue, holder="poller")
        try:
            stats = await poller.forward_cancellations()
            assert sorted(stats.cancelled) == sorted([victim, own, *flood])
            first = [op for op in order if op.startswith("signal ")][: poller.cancel_concurrency]
            assert {f"signal {own}", f"signal {victim}"} <= set(first), first
            assert await cancel_signals(client, victim) == 1
        finally:
            await terminate_all(client, [victim, own, *flood])


async def test_jobs_cancelled_before_they_started_take_no_slot(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A tenant submits 20 jobs beyond the limit and cancels them: each gets its workflow started with the cancel
    in it, outside the intake. Such a workflow submits nothing and shows as cancelled from its start, so it takes
    no slot: a fresh job of another tenant starts in the next round, even while those workflows are still open (on
    a queue no worker polls here, so they stay open; with a worker they close within seconds, a flood of
    thousands within minutes)."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund("mallory", 20)
        flood = [pipe.submit(decide=False, max_price="1", tenant="mallory") for _ in range(20)]
        for job_id in flood:
            pipe.ledger.request_cancel(job_id)
        poller = make_poller(pipe, client, queue, holder="poller")
        try:
            assert sorted((await poller.forward_cancellations()).cancelled) == sorted(flood)
            await visibility_shows(client, dict.fromkeys(flood, WorkflowExecutionStatus.RUNNING))
            fresh = pipe.submit()
            stats = await poller.take_jobs()
            assert stats.started == [fresh] and stats.running == 0
            assert len(pipe.audit_events("job_cancelled")) == 20
        finally:
            await terminate_all(client, [*flood, *poller._recent])


async def test_a_cancel_requested_during_a_flood_of_cancels_is_not_left_behind_the_flood(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A tenant has cancelled 300 pending jobs (each a lookup, a start with the cancel in it and an audit record);
    while the poller forwards them, another tenant cancels its running job. The chain's list is read again every
    ``CANCEL_BATCH`` forwards, so that cancel comes next, not after the whole flood: it was not forwarded at all in
    that round (the list had been read once, at its start), at 10,000 cancels a wait of minutes while the job ran
    and was billed."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund("mallory", 400)
        flood = [pipe.submit(decide=False, max_price="1", tenant="mallory") for _ in range(300)]
        for job_id in flood:
            pipe.ledger.request_cancel(job_id)
        victim = pipe.submit()
        await start_idle(pipe, victim, queue)
        await pipe.ledger.report_status(StatusReport(job_id=victim, state=JobState.RUNNING))
        order = _CancelOnce(lambda: pipe.ledger.request_cancel(victim), after=20)
        poller = make_poller(pipe, RecordingCalls(client, order), queue, holder="poller")
        try:
            stats = await poller.forward_cancellations()
            assert sorted(stats.cancelled) == sorted([*flood, victim])
            signals = [op for op in order if op.startswith("signal ")]
            assert signals.index(f"signal {victim}") <= CANCEL_BATCH, "next after the batch in flight"
            assert await cancel_signals(client, victim) == 1
            assert len(pipe.audit_events("job_cancelled")) == 300
        finally:
            await terminate_all(client, [victim, *flood])


async def test_a_flood_of_cancels_is_read_a_page_at_a_time_and_every_cancel_is_forwarded(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop read the chain's whole list of cancel requests at each reading, again every ``CANCEL_BATCH``
    forwards: at 10,000 requests 10,000 ids per reading, some 150 readings a round. It now reads ``CANCEL_PAGE`` at a
    time (40 here, against 300 cancels of pending jobs): no reading returns more, every cancel is still forwarded in
    the round, another tenant's cancel requested in mid round still comes within the next batch, and the next round
    forwards nothing again."""
    monkeypatch.setattr(poller_module, "CANCEL_PAGE", 40)
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        queue = idle_queue()
        pipe.ledger.fund("mallory", 400)
        flood = [pipe.submit(decide=False, max_price="1", tenant="mallory") for _ in range(300)]
        for job_id in flood:
            pipe.ledger.request_cancel(job_id)
        victim = pipe.submit()
        await start_idle(pipe, victim, queue)
        await pipe.ledger.report_status(StatusReport(job_id=victim, state=JobState.RUNNING))
        order = _CancelOnce(lambda: pipe.ledger.request_cancel(victim), after=100)
        poller = make_poller(pipe, RecordingCalls(client, order), queue, holder="poller")
        reads = _CountingReads(pipe.ledger)
        poller.chain = cast(Any, reads)
        try:
            stats = await poller.forward_cancellations()
            assert sorted(stats.cancelled) == sorted([*flood, victim])
            assert max(reads.cancel_reads) == 40, reads.cancel_reads
            meanwhile = order[100 : order.index(f"signal {victim}")]
            assert sum(op.startswith("signal ") for op in meanwhile) <= CANCEL_BATCH, (
                "next after the batch in flight"
            )
            assert len(pipe.audit_events("job_cancelled")) == 300
            assert (await poller.forward_cancellations()).cancelled == [], "each forwarded once"
            assert await cancel_signals(client, victim) == 1
        finally:
            await terminate_all(client, [victim, *flood])


class _CancelOnce(list[str]):
    """The calls' order; once ``after`` calls were made, ``cancel`` (a tenant's cancel in mid round)."""

    def __init__(self, cancel: Any, after: int) -> None:
        super().__init__()
        self.cancel = cancel
        self.after = after

    def append(self, item: str) -> None:
        super().append(item)
        if len(self) == self.after:
            self.cancel()


class RecordingCalls:
    """The real client, recording the order of the signals and starts sent through it."""

    def __init__(self, client: Client, order: list[str]) -> None:
        self.client = client
        self.order = order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start_workflow(self, *args: Any, **kwargs: Any) -> Any:
        self.order.append(f"start {kwargs.get('id')}")
        return await self.client.start_workflow(*args, **kwargs)

    def get_workflow_handle(self, workflow_id: str, **kwargs: Any) -> Any:
        return _RecordingHandle(self.client.get_workflow_handle(workflow_id, **kwargs), self.order)


class _RecordingHandle:
    def __init__(self, handle: Any, order: list[str]) -> None:
        self.handle = handle
        self.order = order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    async def signal(self, *args: Any, **kwargs: Any) -> Any:
        self.order.append(f"signal {self.handle.id}")
        return await self.handle.signal(*args, **kwargs)


async def test_the_intake_leaves_a_job_its_tenant_cancelled_to_the_cancellation_loop(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """A tenant cancels a job still pending on chain. The two loops run side by side, and the intake's round may
    come first: it used to start the job as any other (a slot taken), and the job was submitted, ran and was billed
    before the cancellation loop's round signalled it (here it even completed: settled, 1 submit). The intake now
    leaves it to that loop, which starts its workflow with the cancel in it: nothing submitted, cancelled on chain,
    audited ``job_cancelled`` once."""
    config = pipeline_config(tmp_path, 5)
    adapter = MemoryAdapter()
    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        job = pipe.submit()
        pipe.ledger.request_cancel(job)
        taken = await pipe.poller.take_jobs()
        if (
            taken.started
        ):  # what it did before: let the run go on, as it did until the next cancellation round
            await pipe.handle(job).result()
        assert (await pipe.poller.forward_cancellations()).cancelled == [job]
        results = await pipe.run_until_done([job])
        assert results[job].state == JobState.CANCELLED
        assert pipe.states_of(job) == [JobState.CANCELLED]
        assert adapter.submits == 0
        assert len(pipe.audit_events("job_cancelled", job)) == 1
        assert taken.started == [] and taken.running == 0


async def test_a_start_with_the_cancel_in_it_knows_whether_it_made_the_run(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """Which poller audits a job cancelled before it started rests on Temporal's answer to signal-with-start
    (``started``), which the SDK keeps on the handle without a public accessor. An SDK that moved it would make
    every such start look made here (an audit record per cluster): this says so, on the real server."""
    config = pipeline_config(tmp_path, 5)
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as pipe:
        job = pipe.submit(decide=False)
        poller = make_poller(pipe, client, idle_queue(), holder="poller")
        chain_job = await pipe.ledger.get_job(job)
        assert chain_job is not None
        inp = await poller._accept(chain_job, PollStats())
        assert inp is not None
        try:
            made = await poller._start_workflow(inp, cancel=CancelRequest(reason="cancelled by the tenant"))
            again = await poller._start_workflow(inp, cancel=CancelRequest(reason="cancelled by the tenant"))
            assert (made, again) == (True, False)
        finally:
            await terminate_all(client, [job])
