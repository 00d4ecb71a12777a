"""Coalesces status requests of all watching activities into one scheduler query per poll interval.

invariant 4 in docs/architecture.md: with 1,000 active jobs on a cluster a worker asks the scheduler once per interval, not 1,000
times. Every ``watch`` activity of a worker registers the jobs it follows here and awaits the next round; one task
per adapter runs ``status_batch`` over the union of the ids at most once per interval and hands each waiter its
job's status (or the error, which is not a state change).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from activities.schedulers.base import NativeStatus, SchedulerAdapter
from virtengine_hpc.errors import SchedulerError, SchedulerUnavailable

log = logging.getLogger(__name__)


class StatusBatcher:
    """One per (worker, cluster adapter). ``queries`` counts scheduler queries, for metrics and benchmarks."""

    def __init__(self, adapter: SchedulerAdapter, interval_seconds: float) -> None:
        self.adapter = adapter
        self.interval = max(0.05, interval_seconds)
        self._watched: Counter[str] = Counter()
        self._round: asyncio.Future[dict[str, NativeStatus]] | None = None
        self._last_query = 0.0
        self._task: asyncio.Task[None] | None = None
        self.queries = 0
        self.failures = 0

    async def status(self, scheduler_job_id: str) -> NativeStatus:
        """The job's status from the next batched query (waits at most about one interval)."""
        self._watched[scheduler_job_id] += 1
        try:
            if self._round is None or self._round.done():
                self._round = asyncio.get_running_loop().create_future()
                self._task = asyncio.create_task(self._run_round(self._round))
            results = await asyncio.shield(self._round)
        finally:
            self._watched[scheduler_job_id] -= 1
            if self._watched[scheduler_job_id] <= 0:
                del self._watched[scheduler_job_id]
        status = results.get(scheduler_job_id)
        if status is None:
            # Registered after the round's query went out: not an answer about this job.
            return await self.status(scheduler_job_id)
        return status

    async def _run_round(self, future: asyncio.Future[dict[str, NativeStatus]]) -> None:
        wait = self._last_query + self.interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        ids = sorted(self._watched)
        self._last_query = time.monotonic()
        try:
            self.queries += 1
            result = await self.adapter.status_batch(ids) if ids else {}
        except SchedulerError as exc:
            self.failures += 1
            future.set_exception(exc)
            future.exception()  # marks it retrieved when every waiter has gone
            return
        except Exception as exc:  # an adapter bug must not leave waiters hanging
            self.failures += 1
            log.exception("status query failed")
            future.set_exception(SchedulerUnavailable(f"status query failed: {exc}"))
            future.exception()
            return
        for job_id in ids:
            if job_id not in result:
                result[job_id] = NativeStatus(
                    scheduler_job_id=job_id, found=False, reason="not in the answer"
                )
        future.set_result(result)
