"""The batchers of a worker process: group commit of lookups, status queries, usage records, node metadata and
monitor registrations.

Each batcher lets many concurrent callers share one call to a slow or rate-limited party (the scheduler, the
chain, the ledger, the monitor workflow). What every one of them must keep: callers waiting together share a
call, a call carries at most its batch size, a failed call fails every caller of that batch (and only those), a
caller that gives up does not stop the call the others wait for, and the status batcher asks at most once per
interval. Fakes stand in for the other party here; the real parties are in the adapter, monitor and node tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from temporalio.client import WorkflowExecutionStatus

from activities import monitor
from activities.chain.client import UsageSubmitResult
from activities.nodes import MetadataBatcher
from activities.schedulers.base import NativeStatus
from activities.schedulers.batch.base import Coalescer
from activities.schedulers.batcher import StatusBatcher
from activities.usage_batcher import UsageBatcher
from virtengine_hpc.errors import ChainError, SchedulerError, SchedulerUnavailable
from virtengine_hpc.messages import MonitorSettings, WatchEntry, WatchRegistration
from virtengine_hpc.models import UsageMetrics, UsageRecord
from virtengine_hpc.node.lifecycle import NodeBeat, NodeMetadataUpdate, NodeState
from virtengine_hpc.states import JobState
from virtengine_hpc.watch_batch import MAX_WATCH_BATCH, MONITOR_TAKES_BATCHES, WATCH_MANY, WatchBatch

T = TypeVar("T")
AT = datetime(2026, 1, 1, tzinfo=UTC)


class Gate:
    """A call that blocks until released, recording what it was called with."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.open = asyncio.Event()
        self.entered = asyncio.Event()

    async def passing(self, items: Iterable[Any]) -> None:
        self.calls.append(list(items))
        self.entered.set()
        await self.open.wait()


async def started(coroutine: Awaitable[T]) -> asyncio.Task[T]:
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(0)
    return task


async def all_started(*coroutines: Awaitable[T]) -> list[asyncio.Task[T]]:
    """Callers that arrive together (before any batch leaves)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    await asyncio.sleep(0)
    return tasks


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


# ---- Coalescer: lookups by key --------------------------------------------------------------------------------------


def answering(gate: Gate | None = None) -> Callable[[list[str]], Awaitable[dict[str, str]]]:
    async def fetch(keys: list[str]) -> dict[str, str]:
        if gate is not None:
            await gate.passing(keys)
        return {k: k.upper() for k in keys if not k.startswith("absent")}

    return fetch


async def test_coalescer_concurrent_lookups_share_one_query_and_a_key_left_out_is_none() -> None:
    asked: list[list[str]] = []

    async def fetch(keys: list[str]) -> dict[str, str]:
        asked.append(keys)
        return await answering()(keys)

    coalescer: Coalescer[str, str] = Coalescer(fetch)
    answers = await asyncio.gather(*(coalescer.get(k) for k in ["a", "b", "a", "absent"]))
    assert answers == ["A", "B", "A", None]
    assert asked == [["a", "b", "absent"]], "one query, each key once"
    assert coalescer.batches == 1


async def test_coalescer_lookups_arriving_during_a_query_share_the_next_one() -> None:
    gate = Gate()
    coalescer: Coalescer[str, str] = Coalescer(answering(gate))
    first = await started(coalescer.get("a"))
    await gate.entered.wait()
    later = [await started(coalescer.get(k)) for k in ("b", "c", "b")]
    gate.open.set()
    assert await first == "A"
    assert [await t for t in later] == ["B", "C", "B"]
    assert gate.calls == [["a"], ["b", "c"]]
    assert coalescer.batches == 2


async def test_coalescer_splits_at_its_batch_size() -> None:
    asked: list[list[str]] = []

    async def fetch(keys: list[str]) -> dict[str, str]:
        asked.append(keys)
        return {}

    coalescer: Coalescer[str, str] = Coalescer(fetch, max_batch=200)
    await asyncio.gather(*(coalescer.get(str(n)) for n in range(450)))
    assert [len(keys) for keys in asked] == [200, 200, 50]
    assert [k for keys in asked for k in keys] == [str(n) for n in range(450)], "in the order asked"


async def test_coalescer_a_failed_query_fails_every_caller_of_its_batch_only() -> None:
    gate = Gate()
    failing = {"x"}

    async def fetch(keys: list[str]) -> dict[str, str]:
        await gate.passing(keys)
        if failing & set(keys):
            raise SchedulerUnavailable("controller down")
        return {k: k.upper() for k in keys}

    coalescer: Coalescer[str, str] = Coalescer(fetch)
    first = await started(coalescer.get("x"))
    await gate.entered.wait()
    same_batch = await started(coalescer.get("y"))
    gate.open.set()
    with pytest.raises(SchedulerUnavailable):
        await first
    assert await same_batch == "Y", "the next batch is its own query"
    both = await asyncio.gather(coalescer.get("x"), coalescer.get("z"), return_exceptions=True)
    assert [type(r) for r in both] == [SchedulerUnavailable, SchedulerUnavailable]


async def test_coalescer_a_caller_that_gives_up_leaves_the_query_to_the_others() -> None:
    gate = Gate()
    coalescer: Coalescer[str, str] = Coalescer(answering(gate))
    quitter, stayer = await all_started(coalescer.get("a"), coalescer.get("b"))
    await gate.entered.wait()
    quitter.cancel()
    await settle()
    gate.open.set()
    assert await stayer == "B"
    assert quitter.cancelled()
    assert gate.calls == [["a", "b"]]


async def test_coalescer_a_query_nobody_waits_for_any_more_is_stopped() -> None:
    gate = Gate()
    stopped = asyncio.Event()

    async def fetch(keys: list[str]) -> dict[str, str]:
        try:
            return await answering(gate)(keys)
        except asyncio.CancelledError:
            stopped.set()
            raise

    coalescer: Coalescer[str, str] = Coalescer(fetch)
    callers = await all_started(coalescer.get("a"), coalescer.get("b"))
    await gate.entered.wait()
    for caller in callers:
        caller.cancel()
    await asyncio.wait_for(stopped.wait(), 30)
    gate.open.set()
    assert await coalescer.get("c") == "C"
    assert gate.calls == [["a", "b"], ["c"]]


# ---- StatusBatcher: one status query per interval ------------------------------------------------------------------


class StatusAdapter:
    """``status_batch`` of an adapter; ``fail`` raises instead, ``gate`` holds each query until opened."""

    name = "fake"

    def __init__(self, gate: Gate | None = None) -> None:
        self.gate = gate
        self.asked: list[list[str]] = []
        self.at: list[float] = []
        self.fail: BaseException | None = None

    async def status_batch(self, ids: Iterable[str]) -> dict[str, NativeStatus]:
        ids = list(ids)
        self.asked.append(ids)
        self.at.append(asyncio.get_running_loop().time())
        if self.gate is not None:
            await self.gate.passing(ids)
        if self.fail is not None:
            raise self.fail
        return {
            i: NativeStatus(scheduler_job_id=i, state=JobState.RUNNING, native_state="RUNNING")
            for i in ids
            if not i.startswith("gone")
        }


def status_batcher(adapter: StatusAdapter, interval: float = 0.05) -> StatusBatcher:
    return StatusBatcher(adapter, interval)  # type: ignore[arg-type]


async def test_status_watchers_share_one_query_and_a_job_not_in_the_answer_is_not_found() -> None:
    adapter = StatusAdapter()
    batcher = status_batcher(adapter)
    ids = [str(n) for n in range(50)] + ["gone-1", "7"]
    answers = await asyncio.gather(*(batcher.status(i) for i in ids))
    assert len(adapter.asked) == 1 and sorted(adapter.asked[0]) == sorted(set(ids))
    assert [a.scheduler_job_id for a in answers] == ids
    assert [a.found for a in answers].count(False) == 1 and answers[50].reason == "not in the answer"
    assert batcher.queries == 1 and batcher.failures == 0


async def test_status_queries_are_at_least_an_interval_apart() -> None:
    adapter = StatusAdapter()
    batcher = status_batcher(adapter, interval=0.2)
    for _ in range(3):
        await asyncio.gather(batcher.status("1"), batcher.status("2"))
    assert len(adapter.asked) == 3
    gaps = [b - a for a, b in zip(adapter.at, adapter.at[1:], strict=False)]
    assert all(gap >= 0.2 - 0.005 for gap in gaps), gaps


async def test_status_a_job_registered_during_a_query_is_answered_by_the_next_one() -> None:
    gate = Gate()
    adapter = StatusAdapter(gate)
    batcher = status_batcher(adapter)
    first = await started(batcher.status("1"))
    await gate.entered.wait()
    late = await started(batcher.status("2"))
    gate.open.set()
    assert (await first).found and (await late).found
    assert adapter.asked == [["1"], ["2"]]
    assert batcher.queries == 2


@pytest.mark.parametrize(
    ("error", "seen"),
    [(SchedulerUnavailable("slurmctld down"), SchedulerUnavailable), (SchedulerError("bad"), SchedulerError)],
)
async def test_status_a_failed_query_fails_every_watcher_and_counts_once(
    error: SchedulerError, seen: type[SchedulerError]
) -> None:
    adapter = StatusAdapter()
    adapter.fail = error
    batcher = status_batcher(adapter)
    results = await asyncio.gather(*(batcher.status(str(n)) for n in range(5)), return_exceptions=True)
    assert all(r is error for r in results)
    assert [type(r) for r in results] == [seen] * 5
    assert (batcher.queries, batcher.failures) == (1, 1)


async def test_status_an_adapter_bug_reaches_every_watcher_as_scheduler_unavailable() -> None:
    adapter = StatusAdapter()
    adapter.fail = KeyError("oops")
    batcher = status_batcher(adapter)
    results = await asyncio.gather(*(batcher.status(str(n)) for n in range(3)), return_exceptions=True)
    assert [type(r) for r in results] == [SchedulerUnavailable] * 3
    assert all("status query failed" in str(r) for r in results)
    assert batcher.failures == 1
    adapter.fail = None
    assert (await batcher.status("1")).found, "the next round asks again"


async def test_status_a_watcher_that_gives_up_leaves_the_query_to_the_others() -> None:
    gate = Gate()
    adapter = StatusAdapter(gate)
    batcher = status_batcher(adapter)
    quitter, stayer = await all_started(batcher.status("1"), batcher.status("2"))
    await gate.entered.wait()
    quitter.cancel()
    await settle()
    gate.open.set()
    assert (await stayer).scheduler_job_id == "2"
    assert quitter.cancelled()
    assert adapter.asked == [["1", "2"]]


# ---- UsageBatcher: usage records to the chain ----------------------------------------------------------------------


def usage_record(n: int) -> UsageRecord:
    return UsageRecord(
        record_id=f"c1/JOB-{n}/1",
        job_id=f"JOB-{n}",
        cluster_id="c1",
        scheduler_job_id="1",
        provider="provider",
        tenant="tenant",
        sequence=1,
        period_start=AT,
        period_end=AT,
        job_state=JobState.RUNNING,
        is_final=False,
        metrics=UsageMetrics(),
        created_at=AT,
        key_id="k",
    )


class UsageChain:
    def __init__(self, gate: Gate | None = None) -> None:
        self.gate = gate
        self.calls: list[list[str]] = []
        self.bad: set[str] = set()

    async def submit_usage(self, records: Sequence[UsageRecord]) -> UsageSubmitResult:
        ids = [r.record_id for r in records]
        self.calls.append(ids)
        if self.gate is not None:
            await self.gate.passing(ids)
        if self.bad & set(ids):
            raise ChainError("sequence gap")
        return UsageSubmitResult(accepted=ids)


def usage_batcher(chain: UsageChain, batch_size: int, linger: float = 0.02) -> UsageBatcher:
    return UsageBatcher(chain, batch_size, linger)  # type: ignore[arg-type]


async def test_usage_records_arriving_within_the_linger_share_a_call() -> None:
    chain = UsageChain()
    batcher = usage_batcher(chain, 10, linger=0.2)
    first = await started(batcher.submit(usage_record(1)))
    await asyncio.sleep(0.01)
    second = await started(batcher.submit(usage_record(2)))
    assert (await first).accepted == [usage_record(1).record_id]
    assert (await second).accepted == [usage_record(2).record_id]
    assert chain.calls == [[usage_record(1).record_id, usage_record(2).record_id]]
    assert (batcher.calls, batcher.records) == (1, 2)


async def test_usage_a_full_batch_leaves_at_once_even_while_the_one_before_is_in_flight() -> None:
    gate = Gate()
    chain = UsageChain(gate)
    batcher = usage_batcher(chain, 2, linger=30)
    ids = [usage_record(n).record_id for n in range(6)]
    waiters = [await started(batcher.submit(usage_record(n))) for n in range(5)]
    await settle()
    assert chain.calls == [ids[0:2], ids[2:4]], "two calls in flight at once, neither waits out the linger"
    gate.open.set()
    await asyncio.gather(*waiters[:4])
    await settle()
    assert not waiters[4].done(), "the fifth waits for its linger or a full batch"
    await batcher.submit(usage_record(5))
    assert (await waiters[4]).accepted == [ids[4]]
    assert chain.calls == [ids[0:2], ids[2:4], ids[4:6]]


async def test_usage_a_record_left_over_from_a_full_batch_waits_its_own_linger() -> None:
    chain = UsageChain()
    batcher = usage_batcher(chain, 2, linger=30)
    ids = [usage_record(n).record_id for n in range(4)]
    first, second, third = await all_started(*(batcher.submit(usage_record(n)) for n in range(3)))
    await asyncio.gather(first, second)
    await settle()
    assert chain.calls == [ids[0:2]] and not third.done(), "the third is not sent alone at once"
    await batcher.submit(usage_record(3))
    assert (await third).accepted == [ids[2]]
    assert chain.calls == [ids[0:2], ids[2:4]]


async def test_usage_a_waiter_that_gives_up_leaves_the_call_to_the_others() -> None:
    gate = Gate()
    chain = UsageChain(gate)
    batcher = usage_batcher(chain, 10, linger=0.01)
    quitter, stayer = await all_started(batcher.submit(usage_record(1)), batcher.submit(usage_record(2)))
    await gate.entered.wait()
    quitter.cancel()
    await settle()
    gate.open.set()
    assert (await stayer).accepted == [usage_record(2).record_id]
    assert quitter.cancelled()
    assert len(chain.calls) == 1


async def test_usage_a_refused_batch_is_sent_record_by_record_and_fails_only_the_bad_one() -> None:
    chain = UsageChain()
    chain.bad = {usage_record(1).record_id}
    batcher = usage_batcher(chain, 10)
    results = await asyncio.gather(
        *(batcher.submit(usage_record(n)) for n in range(3)), return_exceptions=True
    )
    assert isinstance(results[1], ChainError)
    assert [r.accepted for i, r in enumerate(results) if i != 1] == [  # type: ignore[union-attr]
        [usage_record(0).record_id],
        [usage_record(2).record_id],
    ]
    assert (batcher.calls, batcher.records) == (4, 6)


# ---- MetadataBatcher: node metadata to the ledger ------------------------------------------------------------------


def metadata(n: int) -> NodeMetadataUpdate:
    return NodeMetadataUpdate(
        update_id=f"u{n}",
        cluster_id="c1",
        node_id=f"node-{n}",
        state=NodeState.ACTIVE,
        at=AT,
        beat=NodeBeat.model_construct(),
    )


class MetadataLedger:
    """``record_metadata`` of the node ledger (called in a thread); ``fail`` raises, ``release`` holds a write."""

    def __init__(self, held: bool = False) -> None:
        self.writes: list[list[str]] = []
        self.fail: Exception | None = None
        self.release = asyncio.Event() if held else None
        self.entered = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def record_metadata(self, updates: Sequence[NodeMetadataUpdate]) -> int:
        self.writes.append([u.update_id for u in updates])
        self.loop.call_soon_threadsafe(self.entered.set)
        if self.release is not None:
            asyncio.run_coroutine_threadsafe(self.release.wait(), self.loop).result(timeout=30)
        if self.fail is not None:
            raise self.fail
        return len(updates)


def metadata_batcher(ledger: MetadataLedger, **kwargs: Any) -> MetadataBatcher:
    return MetadataBatcher(ledger, **kwargs)  # type: ignore[arg-type]


async def test_metadata_updates_within_a_window_share_one_write() -> None:
    ledger = MetadataLedger()
    batcher = metadata_batcher(ledger, window=0.05)
    await asyncio.gather(*(batcher.submit(metadata(n)) for n in range(30)))
    assert ledger.writes == [[f"u{n}" for n in range(30)]]
    assert batcher.batches == 1


async def test_metadata_a_write_carries_at_most_its_batch_size() -> None:
    ledger = MetadataLedger()
    batcher = metadata_batcher(ledger, window=0.05, max_batch=500)
    await asyncio.gather(*(batcher.submit(metadata(n)) for n in range(1200)))
    assert sorted(len(w) for w in ledger.writes) == [200, 500, 500]
    assert sorted(u for w in ledger.writes for u in w) == sorted(f"u{n}" for n in range(1200))
    assert batcher.batches == 3


async def test_metadata_a_failed_write_fails_every_waiter_and_is_not_counted() -> None:
    ledger = MetadataLedger()
    ledger.fail = ChainError("database is locked")
    batcher = metadata_batcher(ledger)
    results = await asyncio.gather(*(batcher.submit(metadata(n)) for n in range(4)), return_exceptions=True)
    assert all(r is ledger.fail for r in results)
    assert len(ledger.writes) == 1 and batcher.batches == 0
    ledger.fail = None
    await batcher.submit(metadata(9))
    assert batcher.batches == 1


async def test_metadata_a_waiter_that_gives_up_leaves_the_write_to_the_others() -> None:
    ledger = MetadataLedger(held=True)
    batcher = metadata_batcher(ledger, window=0.01)
    quitter, stayer = await all_started(batcher.submit(metadata(1)), batcher.submit(metadata(2)))
    await ledger.entered.wait()
    quitter.cancel()
    await settle()
    assert ledger.release is not None
    ledger.release.set()
    await stayer
    assert quitter.cancelled()
    assert ledger.writes == [["u1", "u2"]] and batcher.batches == 1


# ---- monitor registrations: one watch_many signal for those waiting -------------------------------------------------


def registration(n: int, task_queue: str) -> WatchRegistration:
    return WatchRegistration(
        workflow_id=f"job-{n}",
        monitor=MonitorSettings(cluster_id="c1", task_queue=task_queue, poll_interval_seconds=2),
        entry=WatchEntry(scheduler_job_id=str(1000 + n), state=JobState.QUEUED),
    )


class MonitorClient:
    """What ``register`` uses of a Temporal client, for a monitor whose run takes ``watch_many`` (``takes``).
    Every send (a batch, or a registration alone) passes ``gate``."""

    def __init__(self, takes: bool = True) -> None:
        self.takes = takes
        self.gate = Gate()
        self.gate.open.set()
        self.batches: list[list[str]] = []
        self.alone: list[str] = []
        self.fail: Exception | None = None

    def get_workflow_handle(self, workflow_id: str, run_id: str | None = None) -> Any:
        client = self

        class Described:
            status = WorkflowExecutionStatus.RUNNING
            run_id = "run-1"

            async def memo_value(self, key: str, default: Any, type_hint: Any = None) -> Any:
                assert key == MONITOR_TAKES_BATCHES
                return "run-1" if client.takes else default

        class Handle:
            async def describe(self) -> Described:
                return Described()

            async def signal(self, name: str, arg: Any) -> None:
                assert name == WATCH_MANY and run_id == "run-1"
                assert isinstance(arg, WatchBatch)
                ids = [r.workflow_id for r in arg.registrations]
                client.batches.append(ids)
                await client.gate.passing(ids)
                if client.fail is not None:
                    raise client.fail

        return Handle()

    async def start_workflow(self, *args: Any, start_signal_args: list[WatchRegistration], **kw: Any) -> None:
        self.alone.append(start_signal_args[0].workflow_id)
        await self.gate.passing(self.alone[-1:])


def register(client: MonitorClient, n: int, task_queue: str) -> Awaitable[None]:
    return monitor.register(client, registration(n, task_queue))  # type: ignore[arg-type]


async def holding_the_first(client: MonitorClient, task_queue: str) -> asyncio.Task[None]:
    """A registration alone, its send held: the ones after it wait."""
    client.gate.open.clear()
    first = await started(register(client, 0, task_queue))
    await client.gate.entered.wait()
    assert client.alone == ["job-0"], "a registration alone goes as before"
    return first


async def test_registrations_waiting_during_a_send_leave_together_in_batches_of_at_most_500() -> None:
    client = MonitorClient()
    first = await holding_the_first(client, "q-many")
    count = MAX_WATCH_BATCH + 100
    waiters = [await started(register(client, n, "q-many")) for n in range(1, count)]
    client.gate.open.set()
    await asyncio.gather(first, *waiters)
    assert client.alone == ["job-0"]
    assert [len(b) for b in client.batches] == [MAX_WATCH_BATCH, count - 1 - MAX_WATCH_BATCH]
    assert [j for b in client.batches for j in b] == [f"job-{n}" for n in range(1, count)]


async def test_a_monitor_that_does_not_take_batches_is_told_one_by_one() -> None:
    client = MonitorClient(takes=False)
    await asyncio.gather(*(register(client, n, "q-older") for n in range(20)))
    assert sorted(client.alone) == sorted(f"job-{n}" for n in range(20))
    assert client.batches == []


async def test_a_failed_batch_signal_fails_every_registration_of_that_batch_only() -> None:
    client = MonitorClient()
    first = await holding_the_first(client, "q-fail")
    others = [await started(register(client, n, "q-fail")) for n in range(1, 4)]
    client.fail = ValueError("payload too large")
    client.gate.open.set()
    await first
    results = await asyncio.gather(*others, return_exceptions=True)
    assert all(r is client.fail for r in results)
    assert client.batches == [["job-1", "job-2", "job-3"]]


async def test_a_registration_that_gives_up_is_not_sent_and_leaves_the_batch_to_the_others() -> None:
    client = MonitorClient()
    first = await holding_the_first(client, "q-cancel")
    waiting = [await started(register(client, n, "q-cancel")) for n in range(1, 4)]
    waiting[0].cancel()
    await settle()
    client.gate.open.set()
    await first
    await asyncio.gather(*waiting[1:])
    assert waiting[0].cancelled()
    assert client.batches == [["job-2", "job-3"]]


# ---- fixed on the way to one primitive ------------------------------------------------------------------------------


async def test_metadata_updates_arriving_during_a_write_are_written_without_waiting_for_another() -> None:
    """An update that arrived while a write was in flight waited, unwritten, for the next update to come."""
    ledger = MetadataLedger(held=True)
    batcher = metadata_batcher(ledger, window=0.01)
    first = await started(batcher.submit(metadata(1)))
    await ledger.entered.wait()
    second = await started(batcher.submit(metadata(2)))
    assert ledger.release is not None
    ledger.release.set()
    await first
    await asyncio.wait_for(second, 10)
    assert ledger.writes == [["u1"], ["u2"]]


async def test_metadata_the_caller_that_fills_a_batch_giving_up_leaves_the_write_to_the_others() -> None:
    """The caller that filled a batch ran its write itself: cancelling it left the others of the batch waiting."""
    ledger = MetadataLedger(held=True)
    batcher = metadata_batcher(ledger, window=30, max_batch=3)
    others = await all_started(batcher.submit(metadata(1)), batcher.submit(metadata(2)))
    filler = await started(batcher.submit(metadata(3)))
    await ledger.entered.wait()
    filler.cancel()
    await settle()
    assert ledger.release is not None
    ledger.release.set()
    await asyncio.wait_for(asyncio.gather(*others), 10)
    assert ledger.writes == [["u1", "u2", "u3"]] and batcher.batches == 1
