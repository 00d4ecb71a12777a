"""Coalesces the usage records of a worker's concurrent ``report_usage`` activities into batched chain calls.

Each usage activity signs one record and hands it here; the batcher sends what arrived within ``linger_seconds``
(or as soon as ``batch_size`` records are waiting) in one ``submit_usage`` call, so N records that are due
together cost ceil(N / batch_size) chain transactions instead of N (``hpc.usage_reporting.batch_size``). Like the
status batcher (``activities/schedulers/batcher.py``) it lives per worker and holds nothing durable: a record
waiting here when the worker dies was never acknowledged, its activity is retried, and the retry adopts the
record if the chain had already taken it (record ids are deterministic).

A chain refusal of a whole batch for one bad record (a sequence gap, a bad signature) must not fail the other
jobs' records: a batch refused with a permanent error is split and each record is sent alone, so only the bad
one's activity fails. A transient error (chain busy) fails every waiter; their activities retry per the
workflow's policy (``retry_on_failure``).
"""

from __future__ import annotations

import asyncio
import logging

from activities.chain.client import ChainClient, UsageSubmitResult
from virtengine_hpc.errors import HPCError
from virtengine_hpc.models import UsageRecord

log = logging.getLogger(__name__)

_Item = tuple[UsageRecord, "asyncio.Future[UsageSubmitResult]"]


class UsageBatcher:
    """One per worker. ``calls`` counts ``submit_usage`` calls and ``records`` the records they carried."""

    def __init__(self, chain: ChainClient, batch_size: int, linger_seconds: float = 0.02) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.chain = chain
        self.batch_size = batch_size
        self.linger = max(0.0, linger_seconds)
        self._pending: list[_Item] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0
        self.records = 0

    async def submit(self, record: UsageRecord) -> UsageSubmitResult:
        """Send ``record`` with the next batch; the result names only this record (accepted or duplicate)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[UsageSubmitResult] = loop.create_future()
        self._pending.append((record, future))
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.batch_size):
            task = asyncio.create_task(self._send(pending[start : start + self.batch_size]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Item]) -> None:
        records = [record for record, _ in batch]
        self.calls += 1
        self.records += len(records)
        try:
            result = await self.chain.submit_usage(records)
        except HPCError as exc:
            if len(batch) > 1 and not exc.transient:
                log.info("usage batch of %d refused (%s); sending its records one by one", len(batch), exc)
                await asyncio.gather(*(self._send([item]) for item in batch))
                return
            self._fail(batch, exc)
            return
        except Exception as exc:  # a client bug must not leave waiters hanging
            log.exception("usage submission failed")
            self._fail(batch, exc)
            return
        accepted, duplicates = set(result.accepted), set(result.duplicates)
        for record, future in batch:
            rid = record.record_id
            if not future.done():
                future.set_result(
                    UsageSubmitResult(
                        accepted=[rid] if rid in accepted else [],
                        duplicates=[rid] if rid in duplicates else [],
                    )
                )

    @staticmethod
    def _fail(batch: list[_Item], exc: BaseException) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)
