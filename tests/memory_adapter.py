"""A small in-memory scheduler for workflow tests (the third level of scheduler testing).

The real adapters are tested against real schedulers (local processes, SLURM); this one lets workflow tests script
a job's life precisely: each job follows a list of (seconds after submit, state) steps, usage grows linearly while
it runs, and counters record every call so tests can assert batching and exactly-once submission.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from activities.schedulers.base import Accounting, NativeStatus, SchedulerAdapter, SubmitRequest, SubmitResult
from virtengine_hpc.errors import JobNotFound, SchedulerUnavailable, SubmissionRejected
from virtengine_hpc.metering import Reading
from virtengine_hpc.states import JobState


@dataclass
class Script:
    steps: list[tuple[float, JobState]]
    exit_code: int | None = None
    reason: str = ""
    started_at: float | None = None
    """Seconds after submit when the scheduler started a job that no poll can see running (it ends at that very
    moment: ``[(0, QUEUED), (1, FAILED)]`` with ``started_at=1`` is a job that exited at once)."""


@dataclass
class _Job:
    workflow_id: str
    submitted: float
    script: Script
    cancelled_at: float | None = None
    submitted_wall: datetime = field(default_factory=lambda: datetime.now(UTC))

    def run_start(self, elapsed: float) -> datetime | None:
        """When the current run started, as a scheduler reports it: a requeued job's start moves, a resumed one's
        does not."""
        start: float | None = None
        previous = JobState.QUEUED
        for at, step in self.script.steps:
            if elapsed < at:
                break
            if step == JobState.RUNNING and previous != JobState.SUSPENDED and previous != JobState.RUNNING:
                start = at
            previous = step
        unseen = self.script.started_at
        if start is None and unseen is not None and elapsed >= unseen:
            start = unseen
        return None if start is None else self.submitted_wall + timedelta(seconds=start)


@dataclass
class MemoryAdapter(SchedulerAdapter):
    scripts: dict[str, Script] = field(default_factory=dict)
    default: Script = field(
        default_factory=lambda: Script(
            [(0.0, JobState.QUEUED), (0.3, JobState.RUNNING), (1.0, JobState.COMPLETED)], exit_code=0
        )
    )
    reject: dict[str, str] = field(default_factory=dict)
    unavailable: bool = False
    jobs: dict[str, _Job] = field(default_factory=dict)
    submits: int = 0
    status_queries: int = 0
    cancels: list[str] = field(default_factory=list)
    crash_after_submit: set[str] = field(default_factory=set)
    lose_submit_answers: set[str] = field(default_factory=set)  # every submit answer lost (the job exists)
    vanished: set[str] = field(default_factory=set)  # workflow ids whose job left the queue and accounting
    submit_delay: float = 0.0
    partitions: dict[str, str | None] = field(default_factory=dict)  # workflow id -> partition it was sent to
    walltimes: dict[str, int] = field(default_factory=dict)  # workflow id -> walltime it was submitted with
    exclusive: dict[str, bool] = field(default_factory=dict)  # workflow id -> asked for whole nodes
    # Seconds on the scheduler's clock, and the wall-clock time it corresponds to (a time-skipping test moves
    # both with the test server's clock).
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))

    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        self.submits += 1
        if self.submit_delay:
            await asyncio.sleep(self.submit_delay)
        existing = await self.find(request.workflow_id)
        if existing is not None and request.workflow_id in self.lose_submit_answers:
            raise SchedulerUnavailable("connection lost after the scheduler accepted the job")
        if existing is not None:
            return SubmitResult(scheduler_job_id=existing, adopted=True)
        if request.workflow_id in self.reject:
            raise SubmissionRejected(self.reject[request.workflow_id])
        if self.unavailable:
            raise SchedulerUnavailable("Socket timed out on send/recv operation")
        job_id = str(1000 + len(self.jobs))
        script = self.scripts.get(request.workflow_id, self.default)
        self.jobs[job_id] = _Job(request.workflow_id, self.clock(), script, submitted_wall=self.wall())
        self.partitions[request.workflow_id] = request.partition
        self.walltimes[request.workflow_id] = request.job.walltime_seconds
        self.exclusive[request.workflow_id] = request.exclusive
        if request.workflow_id in self.crash_after_submit | self.lose_submit_answers:
            self.crash_after_submit.discard(request.workflow_id)
            raise SchedulerUnavailable("connection lost after the scheduler accepted the job")
        if on_submitted is not None:
            on_submitted(job_id)
        return SubmitResult(scheduler_job_id=job_id)

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        return next((jid for jid, job in self.jobs.items() if job.workflow_id == workflow_id), None)

    def _state(self, job: _Job) -> tuple[JobState, float | None]:
        elapsed = self.clock() - job.submitted
        state = JobState.QUEUED
        started: float | None = None
        for at, step in job.script.steps:
            if elapsed >= at:
                state = step
                if step == JobState.RUNNING and started is None:
                    started = job.submitted + at
        unseen = job.script.started_at
        if started is None and unseen is not None and elapsed >= unseen:
            started = job.submitted + unseen
        if job.cancelled_at is not None and not state.final:
            return JobState.CANCELLED, started
        return state, started

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        self.status_queries += 1
        if self.unavailable:
            raise SchedulerUnavailable("slurm_load_jobs error: Unable to contact slurm controller")
        out = {}
        for jid in scheduler_job_ids:
            job = self._job(jid)
            if job is None:
                out[jid] = NativeStatus(scheduler_job_id=jid, found=False)
                continue
            state, _ = self._state(job)
            out[jid] = NativeStatus(
                scheduler_job_id=jid,
                state=state,
                native_state=state.value.upper(),
                reason=job.script.reason,
                exit_code=job.script.exit_code if state.final else None,
                start_time=job.run_start(self.clock() - job.submitted),
            )
        return out

    async def cancel(self, scheduler_job_id: str) -> None:
        self.cancels.append(scheduler_job_id)
        job = self.jobs.get(scheduler_job_id)
        if job is not None and job.cancelled_at is None:
            job.cancelled_at = self.clock()

    def _job(self, scheduler_job_id: str) -> _Job | None:
        job = self.jobs.get(scheduler_job_id)
        return None if job is None or job.workflow_id in self.vanished else job

    async def usage(self, scheduler_job_id: str) -> Accounting:
        job = self._job(scheduler_job_id)
        if job is None:
            raise JobNotFound(f"job {scheduler_job_id} not found")
        state, started = self._state(job)
        if started is None:
            return Accounting(scheduler_job_id=scheduler_job_id, final=state.final)
        now, wall = (
            self.clock(),
            self.wall(),
        )  # read together: the reading's time is exact to a few microseconds
        end = now
        if state.final:
            ends = [job.submitted + at for at, s in job.script.steps if s.final]
            if job.cancelled_at is not None:
                ends.append(job.cancelled_at)
            end = min(ends) if ends else end
        seconds = Decimal(str(round(max(0.0, end - started), 3)))
        at = wall - timedelta(seconds=now - end)  # the moment the reading describes, on the wall clock
        return Accounting(
            scheduler_job_id=scheduler_job_id,
            final=state.final,
            reading=Reading(wall_clock_seconds=seconds, cpu_time_seconds=seconds * 2, taken_at=at),
            end_time=at if state.final else None,
        )
