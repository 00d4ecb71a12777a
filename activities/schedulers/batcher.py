"""Coalesces status requests of all watching activities into one scheduler query per poll interval.

invariant 4 in docs/architecture.md: with 1,000 active jobs on a cluster a worker asks the scheduler once per interval, not 1,000
times. Every ``watch`` activity of a worker registers the jobs it follows here and awaits the next round; one task
per adapter runs ``status_batch`` over the union of the ids at most once per interval and hands each waiter its
job's status (or the error, which is not a state change).
"""

from __future__ import annotations

import logging

from activities.group_commit import GroupCommit
from activities.schedulers.base import NativeStatus, SchedulerAdapter
from virtengine_hpc.errors import SchedulerError, SchedulerUnavailable

log = logging.getLogger(__name__)


class StatusBatcher:
    """One per (worker, cluster adapter). ``queries`` counts scheduler queries, for metrics and benchmarks.

    A round is a ``GroupCommit`` of job ids, paced by the interval: a job registered while a query is in flight is
    asked about in the next one."""

    def __init__(self, adapter: SchedulerAdapter, interval_seconds: float) -> None:
        self.adapter = adapter
        self.interval = max(0.05, interval_seconds)
        self._rounds: GroupCommit[str, NativeStatus] = GroupCommit(
            self._query, interval=self.interval, dedupe=True
        )
        self.queries = 0
        self.failures = 0

    async def status(self, scheduler_job_id: str) -> NativeStatus:
        """The job's status from the next batched query (waits at most about one interval)."""
        return await self._rounds.submit(scheduler_job_id)

    async def _query(self, job_ids: list[str]) -> list[NativeStatus]:
        ids = sorted(job_ids)
        self.queries += 1
        try:
            result = await self.adapter.status_batch(ids)
        except SchedulerError:
            self.failures += 1
            raise
        except Exception as exc:  # an adapter bug must not leave waiters hanging
            self.failures += 1
            log.exception("status query failed")
            raise SchedulerUnavailable(f"status query failed: {exc}") from exc
        return [
            result.get(job_id)
            or NativeStatus(scheduler_job_id=job_id, found=False, reason="not in the answer")
            for job_id in job_ids
        ]
