"""Every metric Slurm's accounting has reaches the usage records: the adapter's readings of each shape of ``sacct`` and
``sstat`` output (``tests/golden/slurm/metering``: captured on the local cluster, and composed for sites with
energy, GPU and interconnect accounting), metered by the one metering function.

The adapter runs for real on top of a backend that answers with those outputs, parsed by the real parsers from
the exact field lists the adapter asks Slurm for: what is under test is everything from Slurm's bytes to a record's
metrics. The same path against the live cluster is in ``test_slurm_adapter.py`` and ``test_slurm_pipeline.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm import parsers as p
from activities.schedulers.slurm.backends import ClusterInfo, SlurmBackend
from activities.schedulers.slurm.base import Backoff
from activities.schedulers.slurm.script import SubmitPlan
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import SlurmConfig
from virtengine_hpc.metering import Reading, meter
from virtengine_hpc.models import Allocation, Resources

GOLDEN = Path(__file__).parent / "golden" / "slurm" / "metering"
MiB = 1024 * 1024


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


class GoldenBackend(SlurmBackend):
    """Answers the adapter's usage questions with golden output: the controller holds ``queued`` (running
    jobs), accounting holds what ``sacct`` printed, ``sstat`` what it printed."""

    description = "golden output"

    def __init__(
        self,
        sacct: str,
        sstat: str = "",
        queued: Sequence[p.QueueJob] = (),
        rest: dict | None = None,
        clock: datetime | None = None,
    ) -> None:
        """``rest``: accounting as slurmdbd's REST answers it instead of ``sacct`` (a ``GET .../job/{id}`` body);
        ``clock``: the controller's clock, as slurmrestd's ``/diag`` tells it."""
        super().__init__()
        self.sacct, self.sstat, self.queued, self.rest = sacct, sstat, list(queued), rest
        self.clock = clock

    async def controller_clock(self) -> datetime | None:
        return self.clock

    async def cluster_info(self) -> ClusterInfo:
        return ClusterInfo(cluster_name="localcluster")

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        raise AssertionError("not submitted")

    async def queue(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        return [job for job in self.queued if job.job_id in job_ids]

    async def queue_by_names(self, names: Sequence[str]) -> list[p.QueueJob]:
        return []

    async def accounting(self, job_ids: Sequence[str], *, steps: bool) -> list[p.AcctJob]:
        jobs = p.parse_sacct(self.sacct) if self.rest is None else p.parse_rest_db_jobs(self.rest)
        return [job for job in jobs if job.job_id in job_ids]

    async def accounting_by_names(self, names: Sequence[str]) -> list[p.AcctJob]:
        return []

    async def live_steps(self, job_id: str) -> list[p.LiveStep] | None:
        return [step for step in p.parse_sstat(self.sstat)]

    async def cancel(self, job_ids: Sequence[str]) -> None:
        raise AssertionError("not cancelled")

    async def node_busy(self, node: str) -> bool:
        return False


def adapter(backend: GoldenBackend) -> SlurmAdapter:
    return SlurmAdapter(
        backend,
        cluster_id="golden",
        config=SlurmConfig(cluster_name="localcluster"),
        backoff=Backoff(max_retries=0),
        tenants=TenantAccounts.shared(),
        verify_cluster=False,
    )


def running(
    job_id: str, elapsed: int, alloc: str, start: datetime = datetime(2026, 12, 1, tzinfo=UTC)
) -> p.QueueJob:
    return p.QueueJob(
        job_id=job_id,
        state="RUNNING",
        start_time=start,
        elapsed_seconds=elapsed,
        alloc_tres=p.parse_tres(alloc, usage=False),
    )


# ---- what the local cluster has: CPU, memory, disk; no energy plugin -------------------------------------------


async def test_a_finished_jobs_disk_bytes_and_cpu_come_from_its_steps() -> None:
    usage = await adapter(GoldenBackend(golden("sacct_io_and_exit3.txt"))).usage("8")
    assert usage.final
    reading = usage.reading
    assert reading.wall_clock_seconds == 4
    assert reading.cpu_time_seconds == Decimal("0.711")  # .batch 0.014 + .0 0.697 s
    assert reading.memory_bytes_max == 4075520
    assert (reading.disk_bytes_read, reading.disk_bytes_written) == (8253 + 50360385, 1 + 50331649)
    assert reading.energy_joules is None, "energy=0 with no energy plugin is 'not measured', never 0 J"
    assert reading.network_bytes_in is None and reading.network_bytes_out is None
    assert reading.allocated.memory_bytes == 256 * MiB and reading.allocated.cpus == 1
    assert reading.taken_at == usage.end_time == datetime.fromtimestamp(1796147398, UTC)

    metered = meter(reading, Resources(memory_mb_per_node=256))
    m = metered.metrics
    assert (m.disk_bytes_read, m.disk_bytes_written) == (50368638, 50331650)
    assert m.memory_gb_seconds == Decimal("1.073742")  # 268435456 B / 10^9 x 4 s
    assert m.cpu_core_seconds == 4 and m.cpu_time_seconds == Decimal("0.711")
    assert metered.basis["disk_bytes_read"] == "measured" and "energy_joules" not in metered.basis


async def test_a_job_that_failed_at_once_started_and_ran_for_no_time() -> None:
    """``exit 3`` at once: Start = End, 0 s, but an allocation. The job ran: its status says when it started
    (so the workflow sends its final record), and it is metered at 0 s."""
    slurm = adapter(GoldenBackend(golden("sacct_io_and_exit3.txt")))
    status = (await slurm.status_batch(["9"]))["9"]
    started = datetime.fromtimestamp(1796147397, UTC)
    assert (status.state.value, status.exit_code, status.start_time) == ("failed", 3, started)
    usage = await slurm.usage("9")
    assert usage.final and usage.start_time == started and usage.reading.wall_clock_seconds == 0
    assert meter(usage.reading, Resources()).metrics.cpu_core_seconds == 0


async def test_a_running_jobs_disk_bytes_come_from_sstat() -> None:
    backend = GoldenBackend("", golden("sstat_io_running.txt"), [running("8", 3, "cpu=1,mem=256M,node=1")])
    usage = await adapter(backend).usage("8")
    assert not usage.final
    reading = usage.reading
    assert (reading.wall_clock_seconds, reading.disk_bytes_read) == (3, 8253 + 50360385)
    assert reading.disk_bytes_written == 1 + 50331649 and reading.memory_bytes_max == 4075520
    assert reading.allocated.memory_bytes == 256 * MiB


# ---- a requeued job: every run is billed -------------------------------------------------------------------------

#: Job 2552 ran 12 s, was requeued, and ran 6 s more (``sacct_requeued.txt``, ``slurmdb_job_requeued.json``).
REQUEUED_FIRST_START = datetime.fromtimestamp(1796159247, UTC)
REQUEUED_CPU = Decimal("0.002") + Decimal("0.623") + Decimal("0.041") + Decimal("0.700")


@pytest.mark.parametrize("source", ["sacct", "slurmrestd"])
async def test_a_requeued_jobs_final_reading_adds_up_every_run(source: str) -> None:
    """Plain ``sacct -j`` shows the last run alone (6 s): the job held its allocation for 18 s."""
    if source == "sacct":
        backend = GoldenBackend(golden("sacct_requeued.txt"))
    else:
        backend = GoldenBackend("", rest=json.loads(golden("slurmdb_job_requeued.json")))
    usage = await adapter(backend).usage("2552")
    reading = usage.reading
    assert usage.final and reading.wall_clock_seconds == 12 + 6
    assert usage.start_time == REQUEUED_FIRST_START and usage.end_time == datetime.fromtimestamp(
        1796159400, UTC
    )
    assert reading.cpu_time_seconds is not None
    assert abs(reading.cpu_time_seconds - REQUEUED_CPU) < Decimal("0.002")  # REST: microseconds, sacct: ms
    assert reading.memory_bytes_max == 4075520
    assert reading.disk_bytes_read == 8313 + 14785 + 8313 + 7809 and reading.disk_bytes_written == 4
    assert meter(reading, Resources(memory_mb_per_node=256)).metrics.cpu_core_seconds == 18
    status = (await adapter(backend).status_batch(["2552"]))["2552"]
    assert (status.state.value, status.start_time) == ("completed", datetime.fromtimestamp(1796159394, UTC))


async def test_a_requeued_job_running_again_is_read_with_its_earlier_run() -> None:
    """Run 2 has run 3 s; accounting holds run 1 (12 s) and nothing of run 2's steps yet."""
    run_one = "\n".join(golden("sacct_requeued.txt").splitlines()[:3]) + "\n"
    second_start = datetime.fromtimestamp(1796159394, UTC)
    slurm = adapter(
        GoldenBackend(run_one, queued=[running("2552", 3, "cpu=1,mem=256M,node=1", second_start)])
    )
    reading = (await slurm.usage("2552")).reading
    assert reading.wall_clock_seconds == 12 + 3
    assert reading.cpu_time_seconds == Decimal("0.625")
    # Run 2 a moment later, its step .0 now in sstat: run 1 still counts once, never twice.
    slurm.backend.queued = [running("2552", 5, "cpu=1,mem=256M,node=1", second_start)]
    slurm.backend.sstat = "2552.0|303104|cpu=00:00:00.5,energy=0,fs/disk=7809,mem=303104|energy=0,fs/disk=1\n"
    later = (await slurm.usage("2552")).reading
    assert later.wall_clock_seconds == 12 + 5
    assert later.disk_bytes_read == 8313 + 14785 + 7809


def renamed(line: str) -> str:
    """A run of job 2552 whose owner changed its name and comment (``scontrol update JobName=… Comment=…``)."""
    return line.replace("|metering-requeue|wf:metering-requeue", "|renamed|other")


async def test_a_requeued_job_its_owner_renamed_is_billed_for_every_run() -> None:
    """The job's owner may rename its own job and change its comment in a later run: its earlier run held the
    allocation all the same and is billed (before, a different name or comment dropped it: 6 s billed of 18)."""
    lines = golden("sacct_requeued.txt").splitlines()
    lines[3] = renamed(lines[3])
    usage = await adapter(GoldenBackend("\n".join(lines) + "\n")).usage("2552")
    assert usage.final and usage.reading.wall_clock_seconds == 12 + 6
    assert meter(usage.reading, Resources(memory_mb_per_node=256)).metrics.cpu_core_seconds == 18


async def test_a_requeued_job_renamed_while_running_again_is_read_with_its_earlier_run() -> None:
    """Renamed at the start of run 2: while run 2 runs, run 1 still counts (else every period record would be 0
    until run 2 had run longer than run 1, the reading being below what the records already billed)."""
    lines = golden("sacct_requeued.txt").splitlines()
    second = renamed(lines[3]).replace("|COMPLETED|", "|RUNNING|")
    second_start = datetime.fromtimestamp(1796159394, UTC)
    slurm = adapter(
        GoldenBackend(
            "\n".join([*lines[:3], second]) + "\n",
            queued=[running("2552", 3, "cpu=1,mem=256M,node=1", second_start)],
        )
    )
    assert (await slurm.usage("2552")).reading.wall_clock_seconds == 12 + 3


async def test_a_job_cancelled_as_it_was_requeued_is_final_with_the_runs_accounting_holds() -> None:
    """Requeued, then cancelled within the second (before slurmdbd recorded its pending run): accounting's last
    word is REQUEUED for ever (seen on Slurm 22.05). Once the controller says it ended, ``accounting_grace`` ago, its
    final accounting is the run accounting holds; before, its final record waited for ever and the job never
    settled (the chain showed it running)."""
    run_one = "\n".join(golden("sacct_requeued.txt").splitlines()[:3]) + "\n"
    cancelled = p.QueueJob(
        job_id="2552",
        state="CANCELLED",
        start_time=None,
        end_time=datetime.now(UTC) - timedelta(minutes=2),
        alloc_tres=p.parse_tres("cpu=1,mem=256M,node=1", usage=False),
    )
    usage = await adapter(GoldenBackend(run_one, queued=[cancelled])).usage("2552")
    assert usage.final and usage.reading.wall_clock_seconds == 12
    assert usage.start_time == REQUEUED_FIRST_START
    # The controller has forgotten it (MinJobAge): it is not "queued" again for ever, it ended.
    slurm = adapter(GoldenBackend(run_one))
    status = (await slurm.status_batch(["2552"]))["2552"]
    assert status.state.value == "cancelled" and "requeued, then removed" in status.reason
    assert (await slurm.usage("2552")).final


async def test_a_job_requeued_after_it_ended_is_read_with_the_run_it_had() -> None:
    """Its owner requeued job 30477 after it had completed (6 s): Slurm rewrote that run's record (REQUEUED, no
    start, 0 s) and held the job to run again; the rerun was cancelled while pending. The run held its allocation
    for as long as its batch step ran: 6 s, not 0 (before, a job billed 6 s no longer reconciled with its
    accounting, and one whose requeue came before its final reading was billed less than its records already
    claimed)."""
    usage = await adapter(GoldenBackend(golden("sacct_requeued_after_it_ended.txt"))).usage("30477")
    assert usage.final and usage.reading.wall_clock_seconds == 6
    assert meter(usage.reading, Resources(memory_mb_per_node=256)).metrics.cpu_core_seconds == 6
    # The other shape Slurm rewrites it to (seen in tests/test_sweep.py): its start kept, its end moved to the
    # requeue, 3 s after the run ended (9 s): still the 6 s the run held its allocation, never the 9.
    lines = golden("sacct_requeued_after_it_ended.txt").splitlines()
    lines[0] = (
        lines[0]
        .replace("|REQUEUED|0:0|0|", "|REQUEUED|0:0|9|")
        .replace("|None|1796186726|", "|1796186717|1796186726|")
    )
    usage = await adapter(GoldenBackend("\n".join(lines) + "\n")).usage("30477")
    assert usage.final and usage.reading.wall_clock_seconds == 6


async def test_a_job_requeued_a_moment_ago_is_not_taken_for_ended() -> None:
    """The same accounting while the controller holds the job pending again: it runs again, nothing is final."""
    run_one = "\n".join(golden("sacct_requeued.txt").splitlines()[:3]) + "\n"
    pending = p.QueueJob(job_id="2552", state="PENDING", reason="BeginTime")
    slurm = adapter(GoldenBackend(run_one, queued=[pending]))
    assert not (await slurm.usage("2552")).final
    assert (await slurm.status_batch(["2552"]))["2552"].state.value == "queued"


# ---- slurmrestd: no run time of its own; suspended time is not run time ------------------------------------------


def rest_job(state: str, start: datetime, suspend: datetime | None, before_suspend: int) -> p.QueueJob:
    """A job as ``GET /slurm/v0.0.38/jobs`` gives it (the captured running job, its times changed)."""
    body = json.loads((GOLDEN.parent / "rest_job_get_pending_or_running.json").read_text())
    raw = body["jobs"][0]
    raw.update(
        job_state=state,
        start_time=int(start.timestamp()),
        end_time=int((start + timedelta(hours=1)).timestamp()),  # its time limit, in the future
        suspend_time=int(suspend.timestamp()) if suspend else 0,
        pre_sus_time=before_suspend,
        tres_alloc_str="cpu=1,mem=256M,node=1,billing=1",
    )
    body["jobs"] = [raw]
    (job,) = p.parse_rest_jobs(body)
    return job


async def test_slurmrestd_does_not_bill_the_time_a_job_was_suspended() -> None:
    """Ran 40 s, suspended 60 s ago and still suspended: it has run 40 s, as squeue's TimeUsed says (before:
    now - start, 100 s, and the high-water mark kept it to the final record)."""
    now = datetime.now(UTC)
    job = rest_job("SUSPENDED", now - timedelta(seconds=100), now - timedelta(seconds=60), 40)
    usage = await adapter(GoldenBackend("", queued=[job])).usage(job.job_id)
    assert usage.reading.wall_clock_seconds == 40


async def test_slurmrestd_does_not_bill_the_time_a_resumed_job_was_suspended() -> None:
    """Ran 40 s, was suspended 40 s, resumed 20 s ago: it has run 60 s (before: 100 s)."""
    now = datetime.now(UTC)
    job = rest_job("RUNNING", now - timedelta(seconds=100), now - timedelta(seconds=20), 40)
    usage = await adapter(GoldenBackend("", queued=[job])).usage(job.job_id)
    assert 60 <= usage.reading.wall_clock_seconds <= 61  # a second may tick between now and the reading


async def test_slurmrestd_reads_a_job_never_suspended_from_its_start() -> None:
    now = datetime.now(UTC)
    job = rest_job("RUNNING", now - timedelta(seconds=30), None, 0)
    usage = await adapter(GoldenBackend("", queued=[job])).usage(job.job_id)
    assert 30 <= usage.reading.wall_clock_seconds <= 31


async def test_slurmrestd_counts_run_time_on_the_controllers_clock_not_the_workers() -> None:
    """The worker's clock is 60 s ahead of the controller's: a job that has run 30 s by the controller's clock (its
    start is on that clock) has run 30 s, not 90 (before: every running reading billed the skew, and the final
    record, which cannot be negative, never took it back)."""
    controller_now = datetime.now(UTC) - timedelta(seconds=60)
    job = rest_job("RUNNING", controller_now - timedelta(seconds=30), None, 0)
    usage = await adapter(GoldenBackend("", queued=[job], clock=controller_now)).usage(job.job_id)
    assert usage.reading.wall_clock_seconds == 30
    # Resumed 10 s ago after a suspension (its suspend_time is then the resume): 40 s before it, 10 s since.
    resumed = rest_job(
        "RUNNING", controller_now - timedelta(seconds=80), controller_now - timedelta(seconds=10), 40
    )
    usage = await adapter(GoldenBackend("", queued=[resumed], clock=controller_now)).usage(resumed.job_id)
    assert usage.reading.wall_clock_seconds == 50


# ---- sites with energy, GPU and interconnect accounting (composed shapes) ----------------------------------------


async def test_energy_gpus_and_interconnect_of_a_finished_job_reach_its_metrics() -> None:
    usage = await adapter(GoldenBackend(golden("sacct_site_gpu_energy_ofed.txt"))).usage("731")
    reading = usage.reading
    assert usage.final and reading.wall_clock_seconds == 600
    assert reading.allocated.model_dump() == {
        "nodes": 2,
        "cpus": 64,
        "gpus": 4,
        "memory_bytes": 512000 * MiB,
        "storage_gb": None,
    }
    assert reading.energy_joules == 1803000, "the job's ConsumedEnergyRaw: steps overlap, their sum would not"
    assert reading.network_bytes_in == 4096 + 64424509440
    assert reading.network_bytes_out == 8192 + 64424509440
    assert reading.disk_bytes_read == 10485760 + 21474836480
    assert reading.disk_bytes_written == 2097152 + 4294967296
    assert reading.cpu_time_seconds == Decimal("14380.5")  # 2.1 + 0 + 3:59:38.4
    assert reading.memory_bytes_max == 34359738368

    asked = Resources(nodes=2, tasks_per_node=32, memory_mb_per_node=256000, gpus_per_node=2, storage_gb=100)
    metered = meter(reading, asked)
    m = metered.metrics
    assert metered.allocation == Allocation(
        nodes=2, cpus=64, gpus=4, memory_bytes=512000 * MiB, storage_gb=100
    )
    assert (m.gpu_seconds, m.node_hours, m.cpu_core_seconds) == (2400, Decimal("0.333333"), 38400)
    assert m.memory_gb_seconds == Decimal("322122.547200")  # 536870912000 B / 10^9 x 600 s
    assert m.storage_gb_hours == Decimal("16.666667")  # Slurm allocates no storage: the request stands
    assert (m.energy_joules, m.network_bytes_in) == (Decimal(1803000), 64424513536)
    assert {metered.basis[k] for k in ("energy_joules", "network_bytes_out", "cpu_time_seconds")} == {
        "measured"
    }


async def test_only_typed_gpus_are_counted_and_a_zero_energy_reading_is_no_reading() -> None:
    usage = await adapter(GoldenBackend(golden("sacct_site_gpu_energy_ofed.txt"))).usage("732")
    assert usage.reading.allocated.gpus == 2  # gres/gpu:v100=2, with no untyped gres/gpu
    assert usage.reading.energy_joules is None
    metered = meter(usage.reading, Resources(tasks_per_node=8, memory_mb_per_node=64000, gpus_per_node=2))
    assert metered.metrics.gpu_seconds == 240


async def test_a_running_jobs_energy_gpus_and_interconnect_come_from_sstat() -> None:
    alloc = "billing=64,cpu=64,gres/gpu:a100=4,gres/gpu=4,mem=512000M,node=2"
    backend = GoldenBackend("", golden("sstat_site_gpu_energy_ofed.txt"), [running("731", 200, alloc)])
    reading = (await adapter(backend).usage("731")).reading
    assert reading.wall_clock_seconds == 200 and reading.allocated.gpus == 4
    assert reading.energy_joules == 601000  # the extern step's: it spans the job on every node
    assert reading.network_bytes_in == 4096 + 21474836480 and reading.network_bytes_out == 8192 + 21474836480
    assert reading.cpu_time_seconds == 1 + 4792  # 00:00:01 + 01:19:52
    # The final reading that follows is higher in every measured quantity: records are never negative.
    final = (await adapter(GoldenBackend(golden("sacct_site_gpu_energy_ofed.txt"))).usage("731")).reading
    for name in Reading.model_fields:
        value = getattr(reading, name)
        if isinstance(value, int | Decimal):
            assert getattr(final, name) >= value, name
