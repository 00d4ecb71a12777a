"""Group commit: many concurrent callers of a worker process share one call to a slow party.

Every batcher of a worker process is one of these: the adapters' lookups by workflow id (``Coalescer``), the
status queries of the jobs that still watch from their own activity (``StatusBatcher``), usage records to the
chain (``UsageBatcher``), node metadata to the ledger (``MetadataBatcher``) and registrations with a cluster's
monitor (``activities/monitor.py``). Callers hand an item and wait; one sender task, started by the first caller,
commits whatever waits, at most ``max_batch`` items a call, and while a call is in flight the callers that arrive
wait for the next one. So one caller alone pays one call and a thousand callers pay a few.

What every batcher gets from here, the same way:

* a failed call fails every caller of its batch with the call's error, and no caller of another batch;
* a caller that gives up (its activity cancelled) cancels only its own wait: the call the others wait for goes on,
  and an item whose every caller has gone before its batch leaves is not sent;
* ``linger``: a batch leaves once its oldest item has waited that long for others, or at once when full;
* ``interval``: calls start at least that far apart (the status batcher's poll interval);
* ``overlap``: a batch leaves without waiting for the call before it to end (usage records);
* ``dedupe``: callers of equal items share one slot of the batch (lookups, job ids);
* ``stop_unwanted``: a call whose callers have all gone is cancelled (lookups nobody needs any more).

Nothing here is durable: a caller whose process dies never had an answer, and its activity is retried.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

Commit = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]
"""Sends a batch; returns one outcome per item, in order: its answer, or the error that only its caller gets."""


@dataclass(eq=False)
class _Slot(Generic[T, R]):
    item: T
    since: float
    """When its first caller handed it in (loop time)."""
    callers: list[asyncio.Future[R]] = field(default_factory=list)

    @property
    def wanted(self) -> bool:
        return any(not caller.done() for caller in self.callers)

    def settle(self, outcome: R | BaseException) -> None:
        for caller in self.callers:
            if caller.done():
                continue
            if isinstance(outcome, BaseException):
                caller.set_exception(outcome)
            else:
                caller.set_result(outcome)


class GroupCommit(Generic[T, R]):
    """One per batcher and event loop. ``batches`` counts the calls started."""

    def __init__(
        self,
        commit: Commit[T, R],
        *,
        max_batch: int | None = None,
        linger: float = 0.0,
        interval: float = 0.0,
        overlap: bool = False,
        dedupe: bool = False,
        stop_unwanted: bool = False,
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._commit = commit
        self._max_batch = max_batch
        self._linger = max(0.0, linger)
        self._interval = max(0.0, interval)
        self._overlap = overlap
        self._dedupe = dedupe
        self._stop_unwanted = stop_unwanted
        self._waiting: dict[Hashable, _Slot[T, R]] = {}
        self._sender: asyncio.Task[None] | None = None
        self._full: asyncio.Future[None] | None = None  # the lingering sender waits on it (its own loop's)
        self._in_flight: list[tuple[asyncio.Future[Sequence[R | BaseException]], list[_Slot[T, R]]]] = []
        self._overlapping: set[asyncio.Task[None]] = set()
        self._last_start = -math.inf
        self.batches = 0

    async def submit(self, item: T) -> R:
        """``item``'s outcome from the next batch that carries it."""
        caller: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        key: Hashable = item if self._dedupe else caller
        self._waiting.setdefault(key, _Slot(item, asyncio.get_running_loop().time())).callers.append(caller)
        if self._full is not None and not self._full.done() and self._is_full():
            self._full.set_result(None)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        try:
            return await caller
        except asyncio.CancelledError:
            self._abandon()
            raise

    def _abandon(self) -> None:
        if self._stop_unwanted:
            for call, batch in self._in_flight:
                if not any(slot.wanted for slot in batch):
                    call.cancel()

    async def _send(self) -> None:
        while self._waiting:
            await self._lingering()
            await self._paced()
            batch = self._take()
            if not batch:
                continue
            self._last_start = asyncio.get_running_loop().time()
            self.batches += 1
            if self._overlap:
                task = asyncio.create_task(self._call(batch))
                self._overlapping.add(task)
                task.add_done_callback(self._overlapping.discard)
            else:
                await self._call(batch)

    async def _lingering(self) -> None:
        """Wait until the oldest waiting item has waited ``linger``, or a full batch waits."""
        loop = asyncio.get_running_loop()
        while self._linger > 0 and self._waiting and not self._is_full():
            left = next(iter(self._waiting.values())).since + self._linger - loop.time()
            if left <= 0:
                return
            self._full = loop.create_future()
            try:
                await asyncio.wait({self._full}, timeout=left)
            finally:
                self._full = None

    def _is_full(self) -> bool:
        return self._max_batch is not None and len(self._waiting) >= self._max_batch

    async def _paced(self) -> None:
        wait = self._last_start + self._interval - asyncio.get_running_loop().time()
        if wait > 0:
            await asyncio.sleep(wait)

    def _take(self) -> list[_Slot[T, R]]:
        """The next batch, in the order items arrived; items nobody waits for any more are dropped."""
        batch: list[_Slot[T, R]] = []
        while self._waiting and (self._max_batch is None or len(batch) < self._max_batch):
            room = len(self._waiting) if self._max_batch is None else self._max_batch - len(batch)
            for key in list(islice(self._waiting, room)):
                slot = self._waiting.pop(key)
                if slot.wanted:
                    batch.append(slot)
        return batch

    async def _call(self, batch: list[_Slot[T, R]]) -> None:
        call = asyncio.ensure_future(self._commit([slot.item for slot in batch]))
        entry = (call, batch)
        self._in_flight.append(entry)
        try:
            await asyncio.wait({call})
        finally:
            self._in_flight.remove(entry)
        if call.cancelled():  # every caller of this batch gave up
            for slot in batch:
                for caller in slot.callers:
                    caller.cancel()
            return
        error = call.exception()
        if error is not None:
            for slot in batch:
                slot.settle(error)
            if not isinstance(error, Exception):
                raise error
            return
        for slot, outcome in zip(batch, call.result(), strict=True):
            slot.settle(outcome)
