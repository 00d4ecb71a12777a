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
from activities.group_commit import GroupCommit
from virtengine_hpc.errors import HPCError
from virtengine_hpc.models import UsageRecord

log = logging.getLogger(__name__)


class UsageBatcher:
    """One per worker. ``calls`` counts ``submit_usage`` calls and ``records`` the records they carried.

    A ``GroupCommit`` whose batches overlap: a full batch leaves at once, even while the one before is in flight."""

    def __init__(self, chain: ChainClient, batch_size: int, linger_seconds: float = 0.02) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.chain = chain
        self.batch_size = batch_size
        self.linger = max(0.0, linger_seconds)
        self._sends: GroupCommit[UsageRecord, UsageSubmitResult] = GroupCommit(
            self._send, max_batch=batch_size, linger=self.linger, overlap=True
        )
        self.calls = 0
        self.records = 0

    async def submit(self, record: UsageRecord) -> UsageSubmitResult:
        """Send ``record`` with the next batch; the result names only this record (accepted or duplicate)."""
        return await self._sends.submit(record)

    async def _send(self, records: list[UsageRecord]) -> list[UsageSubmitResult | BaseException]:
        self.calls += 1
        self.records += len(records)
        try:
            result = await self.chain.submit_usage(records)
        except HPCError as exc:
            if len(records) > 1 and not exc.transient:
                log.info("usage batch of %d refused (%s); sending its records one by one", len(records), exc)
                alone = await asyncio.gather(*(self._send([r]) for r in records), return_exceptions=True)
                return [outcome if isinstance(outcome, BaseException) else outcome[0] for outcome in alone]
            raise
        except Exception:  # a client bug must not leave waiters hanging: every waiter gets it
            log.exception("usage submission failed")
            raise
        accepted, duplicates = set(result.accepted), set(result.duplicates)
        return [
            UsageSubmitResult(
                accepted=[r.record_id] if r.record_id in accepted else [],
                duplicates=[r.record_id] if r.record_id in duplicates else [],
            )
            for r in records
        ]
