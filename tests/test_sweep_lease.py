"""Several pollers of one cluster, one sweep: only the poller holding the cluster's intake lease lists the
scheduler and cancels what no workflow names (``workers/sweeper.py``), so the scheduler's load does not grow with
the number of pollers and a duplicate is cancelled and audited once.

The scheduler is the in-memory one, which lists its jobs like ``squeue`` does for the sweep (``swept_jobs``) and
counts the listings; the SLURM listing itself is tested on the real cluster in ``tests/test_sweep.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from activities.audit import read_events
from activities.schedulers.base import ListedJob
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script, _Job
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.messages import CancelRequest, JobStatusView
from virtengine_hpc.states import JobState
from workers.intake_lease import IntakeLease
from workers.metrics import WorkerMetrics
from workers.poller import ChainPoller
from workers.sweeper import ENDED_MARGIN, JobSweep
from workers.wiring import job_settings
from workers.worker import _sweep


@dataclass
class ListingScheduler(MemoryAdapter):
    """The in-memory scheduler, listing its live jobs with the workflow each belongs to (one call per listing)."""

    listings: int = 0

    async def swept_jobs(self) -> list[ListedJob]:
        self.listings += 1
        out = []
        for jid, job in self.jobs.items():
            state, _ = self._state(job)
            out.append(ListedJob(scheduler_job_id=jid, workflow_id=job.workflow_id, final=state.final))
        return out


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    scheduler = ListingScheduler(default=Script([(0, JobState.QUEUED), (0.2, JobState.RUNNING)]))
    async with running_pipeline(client, config, key_path, scheduler, task_queue) as p:
        yield p


def poller(p: Pipeline, holder: str) -> ChainPoller:
    """A poller of the pipeline's cluster, as another process (another lease holder) runs it."""
    return ChainPoller(
        p.client,
        p.ledger,
        p.config,
        p.deps.audit,
        task_queue=p.task_queue,
        settings=job_settings(p.config),
        lease=IntakeLease(p.client, p.cluster_id, term=p.config.hpc.job_service.intake_lease, holder=holder),
    )


async def named_job(p: Pipeline, job_id: str, within: float = 30) -> str:
    deadline = time.monotonic() + within
    while True:
        await p.poller.poll_once()
        try:
            view = await p.handle(job_id).query("status", result_type=JobStatusView)
            if view.scheduler_job_id is not None and view.state == JobState.RUNNING:
                return view.scheduler_job_id
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{job_id} named no running job within {within:.0f} s"
        await asyncio.sleep(0.2)


async def test_of_two_pollers_only_the_lease_holder_sweeps_and_a_duplicate_is_cancelled_once(
    pipe: Pipeline,
) -> None:
    """Two poller processes serve the cluster (a standby, or an old and a new release during an upgrade). A late
    duplicate of a running job's submission is listed, cancelled and audited once per round, by the poller that
    holds the intake lease; the other lists nothing. (Before, every poller swept: the scheduler was listed once
    per poller per interval and overlapping rounds cancelled and audited the duplicate twice.)"""
    scheduler = pipe.adapter
    assert isinstance(scheduler, ListingScheduler)
    job_id = pipe.submit()
    own = await named_job(pipe, job_id)
    late = "9999"  # a killed attempt's sbatch that the controller completed after the retry's check
    scheduler.jobs[late] = _Job(job_id, scheduler.clock(), scheduler.default)
    first, second = pipe.poller, poller(pipe, "another-poller-process")
    await first.poll_once()  # it holds the cluster's intake lease (it started the job)
    await second.poll_once()  # finds it taken: stands by
    sweeps = [
        _sweep(pipe.client, pipe.ledger, scheduler, pipe.config, pipe.deps.audit, p, WorkerMetrics())
        for p in (first, second)
    ]

    rounds = await asyncio.gather(*(s.sweep_once() for s in sweeps))

    assert scheduler.listings == 1, "the cluster was listed once, whatever the number of pollers"
    assert [r.standby for r in rounds] == [False, True]
    assert rounds[0].duplicates == [late]
    audited = [
        e for e in pipe.audit_events("duplicate_job_cancelled", job_id) if e["details"]["found_by"] == "sweep"
    ]
    assert [e["details"]["scheduler_job_id"] for e in audited] == [late], "cancelled and audited once"
    assert scheduler.cancels == [late]
    await pipe.handle(job_id).execute_update(
        "request_cancel", CancelRequest(reason="test over"), result_type=JobStatusView
    )
    results = await pipe.run_until_done([job_id])
    assert results[job_id].scheduler_job_id == own, "the workflow's own job was left to it"


@dataclass
class EndedWindowScheduler(ListingScheduler):
    """Records how far back each round asks for the tenants' accounts' jobs that ended."""

    asked: list[int] | None = None
    ended: list[ListedJob] | None = None

    async def swept_ended(self, seconds: int) -> list[ListedJob]:
        assert self.asked is not None
        self.asked.append(seconds)
        return list(self.ended or [])


async def test_a_pollers_first_round_reads_ended_jobs_back_to_the_last_round_kept_at_most_sweep_lookback(
    pipe: Pipeline,
) -> None:
    """A poller's first round reads the jobs that ended since the last round this host's pollers made (kept in
    the state directory), so that what ran while no poller swept is found; never further back than
    ``sweep_lookback``, and that far when no round is kept. Later rounds read since the round before (plus the
    margin for accounting's lag)."""
    job_service = pipe.config.hpc.job_service.model_copy(update={"sweep_lookback": timedelta(hours=1)})
    config = pipe.config.model_copy(
        update={"hpc": pipe.config.hpc.model_copy(update={"job_service": job_service})}
    )
    scheduler = EndedWindowScheduler(asked=[])
    now = [1_800_000_000.0]

    def poller_sweep() -> JobSweep:
        return JobSweep(pipe.client, pipe.ledger, scheduler, config, pipe.deps.audit, clock=lambda: now[0])

    margin = ENDED_MARGIN + 1
    await poller_sweep().sweep_once()  # nothing kept: sweep_lookback back
    first = poller_sweep()
    now[0] += 600
    await first.sweep_once()  # restarted 600 s later: back to the round kept
    now[0] += 60
    await first.sweep_once()  # its next round: since its first
    now[0] += 7200
    await poller_sweep().sweep_once()  # restarted after two hours: no further than sweep_lookback

    assert scheduler.asked == [3600 + margin, 600 + margin, 60 + margin, 3600 + margin]


class FlippingLease:
    """A lease this poller holds or not, as the test says."""

    def __init__(self) -> None:
        self.held = True

    async def refresh(self) -> bool:
        return self.held


async def test_a_poller_holding_the_lease_again_does_not_report_what_the_holder_meanwhile_reported(
    pipe: Pipeline,
) -> None:
    """Poller B sweeps, loses the cluster's lease to poller A of the same host, and holds it again: a tenant's job
    that ended meanwhile was read and audited by A. B's next round reads back over that time too, and leaves the
    job out: the audit log shows A's record (before, B reported it a second time, counted twice)."""
    scheduler = EndedWindowScheduler(asked=[])
    now = [time.time()]
    lease_b = FlippingLease()

    def poller_sweep(lease: FlippingLease | None) -> JobSweep:
        return JobSweep(
            pipe.client, pipe.ledger, scheduler, pipe.config, pipe.deps.audit, lease=lease,  # type: ignore[arg-type]
            clock=lambda: now[0],
        )  # fmt: skip

    b = poller_sweep(lease_b)
    await b.sweep_once()
    lease_b.held = False
    now[0] += 60
    assert (await b.sweep_once()).standby
    free = ListedJob(
        scheduler_job_id="4711", user="vehpc-t1", final=True, elapsed_seconds=20,
        submitted_at=datetime.fromtimestamp(now[0] - 40, UTC),
    )  # fmt: skip
    scheduler.ended = [free]
    assert (await poller_sweep(None).sweep_once()).ran == ["4711"]  # poller A, holding the lease
    lease_b.held = True
    now[0] += 60

    assert (await b.sweep_once()).ran == [], "A audited it already"
    records = [
        e
        for e in read_events(pipe.config.hpc.audit.log_path)
        if e["details"].get("scheduler_job_id") == "4711"
    ]
    assert len(records) == 1, records
