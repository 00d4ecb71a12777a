"""``virtengine-hpc usage reconcile`` on real SLURM jobs of every outcome: the records the pipeline signed, against
``sacct``, metric by metric (what a provider runs before a dispute).

Jobs go through the whole pipeline (ledger, poller, workflow, SLURM adapter over the cli and ssh transports,
slurmctld); then the command runs as an operator would run it, against the same config file. A record changed behind
the provider's back is a difference it reports, with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Config
from virtengine_hpc.messages import JobResult
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics

pytestmark = pytest.mark.slurm
# Unique per test process: the cleanup cancels this run's jobs by name prefix, never a concurrent run's.
SCOPE = f"recon{uuid.uuid4().hex[:6]}-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


def pipeline_config(
    tmp_path: Path, env: dict[str, Any], *, transport: str = "cli", **slurm: Any
) -> tuple[Config, SlurmAdapter]:
    """A cluster of its own over ``transport``, the test tenants' accounts, fast polls and 2 s usage periods, and its
    adapter; ``slurm`` adds keys to the SLURM section."""
    hpc: dict[str, Any] = {
        "scheduler_type": "slurm",
        "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
        "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
        "usage_reporting": {"report_interval": "2s"},
        "slurm": sc.slurm_section(env, transport, **slurm),
        "tenants": sc.tenants_section(env),
    }
    config = make_config(tmp_path, hpc=hpc)
    return config, SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)


def sacct_runs(env: dict[str, Any], slurm_id: str) -> list[dict[str, str]]:
    """Slurm's own accounting of the job, one row per run (a requeued job ran more than once), oldest first."""
    fields = ("JobIDRaw", "State", "ElapsedRaw", "AllocTRES", "Start", "End")
    out = sc.slurm_command(
        env, ["sacct", "--duplicates", "-X", "-P", "-n", "-j", slurm_id, "-o", ",".join(fields)]
    )
    rows = [line.split("|") for line in out.splitlines() if line.split("|")[0] == slurm_id]
    return [dict(zip(fields, row, strict=True)) for row in rows]


def sacct_elapsed(env: dict[str, Any], slurm_id: str) -> int:
    """The seconds Slurm clocked for the job, every run added up."""
    return sum(int(run["ElapsedRaw"]) for run in sacct_runs(env, slurm_id))


async def act_when_running(
    pipe: Any, steps: dict[str, list[tuple[float, Callable[[str], Any]]]], timeout: float = 600
) -> dict[str, str]:
    """Drive the poller and run each job's steps (seconds since the chain first showed it running, what to do with
    its Slurm job id) in turn; the jobs' Slurm ids."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while any(steps.values()):
        assert time.monotonic() < deadline, {j: pipe.ledger.job(j) for j, left in steps.items() if left}
        await pipe.poller.poll_once()
        for job_id, left in steps.items():
            if job_id not in seen and getattr(pipe.ledger.job(job_id), "state", None) == JobState.RUNNING:
                seen[job_id] = time.monotonic()
            while left and job_id in seen and time.monotonic() - seen[job_id] >= left[0][0]:
                left.pop(0)[1](str(pipe.ledger.job(job_id).scheduler_job_id))
        await asyncio.sleep(0.3)
    return {job_id: str(pipe.ledger.job(job_id).scheduler_job_id) for job_id in steps}


#: What each outcome's job runs: a requeued job's second run (``SLURM_RESTART_COUNT`` 1) ends after 3 s.
REQUEUED_SCRIPT = (
    '#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then sleep 3; exit 0; fi\nsleep 300\n'
)
OUTCOMES: dict[str, tuple[str, dict[str, Any]]] = {
    "completed": (
        "#!/bin/bash\nsrun bash -c 'dd if=/dev/zero of=blob bs=1M count=8 status=none; rm -f blob; sleep 4'\n",
        {},
    ),
    "failed": ("#!/bin/bash\nexit 3\n", {}),  # at once: Start = End, 0 s in sacct
    "cancelled": ("#!/bin/bash\nsleep 300\n", {}),
    "timeout": ("#!/bin/bash\nsleep 300\n", {"walltime_seconds": 60}),
    "suspended": ("#!/bin/bash\nfor i in $(seq 20); do sleep 1; done\n", {}),
    "requeued": (REQUEUED_SCRIPT, {}),
}
ENDS = {
    "completed": JobState.COMPLETED,
    "failed": JobState.FAILED,
    "cancelled": JobState.CANCELLED,
    "timeout": JobState.TIMEOUT,
    "suspended": JobState.COMPLETED,
    "requeued": JobState.COMPLETED,
}


@dataclass
class OutcomesRun:
    """The jobs of every outcome one pipeline ran over one transport, and what it left on its chain."""

    transport: str
    config: Config
    pipe: Pipeline
    jobs: dict[str, str]  # outcome -> chain job id
    never_ran: str
    results: dict[str, JobResult]
    requeued: str  # the requeued job's Slurm id


async def run_every_outcome(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any], transport: str
) -> OutcomesRun:
    """A pipeline of its own over ``transport`` (its own cluster id, ledger and task queue) runs a job of every
    outcome, and one held and cancelled while pending, to their ends."""
    tmp_path.mkdir()
    config, adapter = pipeline_config(tmp_path, env, transport=transport)

    def submit(label: str) -> str:
        script, spec = OUTCOMES[label]
        spec = {"resources": {"memory_mb_per_node": 256}, **spec}
        return pipe.submit(job_id=sc.workflow_id(SCOPE.rstrip("-")), script=script, **spec)

    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        # Held (it never starts), then cancelled while pending: no record, and nothing to bill.
        adapter.hold = True
        never_ran = pipe.submit(job_id=sc.workflow_id(SCOPE.rstrip("-")), script="#!/bin/bash\nsleep 300\n")
        for _ in range(300):
            await pipe.poller.poll_once()
            if getattr(pipe.ledger.job(never_ran), "scheduler_job_id", None):
                break
            await asyncio.sleep(0.3)
        adapter.hold = False
        pipe.ledger.request_cancel(never_ran)
        jobs = {label: submit(label) for label in OUTCOMES}
        # Each job is acted on the seconds it has been seen running (the node runs two at a time, in any order).
        ids = await act_when_running(
            pipe,
            {
                jobs["cancelled"]: [(2, lambda _: pipe.ledger.request_cancel(jobs["cancelled"]))],
                jobs["suspended"]: [  # suspended 6 s: none of this is run time, on any transport
                    (3, lambda sid: sc.slurm_command(env, ["scontrol", "suspend", sid])),
                    (9, lambda sid: sc.slurm_command(env, ["scontrol", "resume", sid])),
                ],
                # the first run holds its allocation for a while, and reports it
                jobs["requeued"]: [(8, lambda sid: sc.slurm_command(env, ["scontrol", "requeue", sid]))],
            },
        )
        results = await pipe.run_until_done([never_ran, *jobs.values()], timeout=600)
    return OutcomesRun(transport, config, pipe, jobs, never_ran, results, ids[jobs["requeued"]])


@pytest.mark.timeout(
    900
)  # a requeued job waits out Slurm's hold (cred_expire + 1 s: 121 s by default, 31 s here)
async def test_reconcile_agrees_with_sacct_for_jobs_of_every_outcome(
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    env: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Jobs that completed, failed at once (exit 3), were cancelled while running and while pending, timed out,
    were suspended and resumed (``scontrol suspend``/``resume``), and were requeued while running (``scontrol
    requeue``: Slurm runs the job again under the same id, and plain ``sacct -j`` then shows the last run alone),
    over the cli and ssh transports (slurmrestd's run did not finish on a cluster loaded by another test run; its
    readings are tested in test_slurm_adapter.py and test_slurm_metering.py): the records add up to Slurm's own accounting of every run, and ``usage reconcile`` agrees.
    Both transports' pipelines run at the same time, each with its own cluster id, ledger and task queue, so
    their waits on Slurm (the requeue's hold, the walltime) overlap; each is checked on its own.
    A node failure is not produced here: the one node is shared by every test that runs."""
    async with asyncio.TaskGroup() as group:
        started = [
            group.create_task(run_every_outcome(client, tmp_path / t, key_path, f"{task_queue}-{t}", env, t))
            for t in ("cli", "ssh")
        ]
    for run in (task.result() for task in started):
        await check_every_outcome(run, env, capsys)
    await check_findings(started[0].result(), env, capsys)


def reconcile_cli(
    run: OutcomesRun, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Awaitable[tuple[int, str]]]:
    """``virtengine-hpc --config <run's config file> ...`` as an operator runs it: its exit code and output."""
    config_file = run.config.ledger_path.parent / f"provider-{run.transport}.json"
    config_file.write_text(run.config.model_dump_json(exclude_defaults=True))

    async def cli(*argv: str) -> tuple[int, str]:
        # The command runs its own event loop, as it does from a shell: off this test's loop.
        code = await asyncio.to_thread(cli_main, ["--config", str(config_file), *argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, out

    return cli


async def check_every_outcome(
    run: OutcomesRun, env: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every job ended as its outcome says, its records add up to sacct over all its runs, and ``usage reconcile``
    and ``usage verify`` agree."""
    pipe, jobs, results, config, transport = run.pipe, run.jobs, run.results, run.config, run.transport
    assert results[run.never_ran].state == JobState.CANCELLED and not pipe.ledger.usage_records(run.never_ran)
    assert {label: results[j].state for label, j in jobs.items()} == ENDS, {
        label: results[j].message for label, j in jobs.items()
    }
    assert JobState.SUSPENDED in pipe.states_of(jobs["suspended"])
    runs = sacct_runs(env, run.requeued)
    assert [r["State"] for r in runs] == ["REQUEUED", "COMPLETED"] and int(runs[0]["ElapsedRaw"]) >= 8, runs
    cli = reconcile_cli(run, capsys)

    figures = []
    for label, job_id in jobs.items():
        records = pipe.ledger.usage_records(job_id)
        assert records and records[-1].is_final, f"{label}: a job Slurm started has its final record"
        assert sum(1 for r in records if r.is_final) == 1
        # Independently of the command: the records add up to sacct's own figures, every run of the job.
        slurm_id = records[-1].scheduler_job_id
        elapsed = sacct_elapsed(env, slurm_id)
        total = sum_metrics([r.metrics for r in records])
        assert total.wall_clock_seconds == elapsed, (label, sacct_runs(env, slurm_id), total)
        assert total.cpu_core_seconds == elapsed  # one core, held for the run time (every run)
        assert total.memory_gb_seconds == (Decimal(256 * 2**20) / 10**9 * elapsed).quantize(
            Decimal("0.000001")
        )
        code, out = await cli("usage", "reconcile", "--job", job_id)
        assert code == 0, out
        assert out.startswith(f"OK    job {job_id}: {slurm_id} on {config.hpc.cluster_id}")
        assert "every metric within tolerance" in out
        lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("      ")}
        assert lines["wall_clock_seconds"][1:3] == [str(elapsed), str(elapsed)]
        assert lines["cpu_time_seconds"][-1] == "ok" and lines["disk_bytes_written"][-1] == "ok"
        figures.append(
            f"{transport:5} {label:10} {len(records):3} records  {total.wall_clock_seconds} s billed  "
            f"sacct {elapsed} s  cpu_time {lines['cpu_time_seconds'][1]} / {lines['cpu_time_seconds'][2]}"
        )
        # And the records keep the format's rules: periods that follow each other, allocation x run time.
        code, out = await cli("usage", "verify", "--job", job_id)
        assert code == 0, out

    # Slurm's accounting of the job cancelled while pending says 0 s, no start: it agrees with no records.
    code, out = await cli("usage", "reconcile", "--job", run.never_ran)
    held_id = pipe.ledger.job(run.never_ran).scheduler_job_id
    assert code == 0, out
    assert out.startswith(f"OK    job {run.never_ran}: {held_id} on {config.hpc.cluster_id} never ran"), out

    code, out = await cli("usage", "reconcile", "--since", "1h")
    assert code == 0 and out.rstrip().endswith(
        "7 jobs: 7 agree, 0 differ, 0 cannot be reconciled, 0 still running"
    ), out
    with capsys.disabled():  # the figures docs/usage-records.md gives, for a reader of the test's output
        print("\n" + "\n".join(figures))


async def check_findings(run: OutcomesRun, env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """What ``usage reconcile`` reports of records changed behind the provider's back (the command's own, the same
    whatever the transport): a changed figure, a record taken out of a sequence, a job with no record at all."""
    pipe, jobs, config = run.pipe, run.jobs, run.config
    cli = reconcile_cli(run, capsys)
    # A record changed behind the provider's back: five seconds more than Slurm clocked.
    done = pipe.ledger.usage_records(jobs["completed"])[-1]
    data = json.loads(done.model_dump_json())
    claimed = Decimal(data["metrics"]["wall_clock_seconds"]) + 5
    data["metrics"]["wall_clock_seconds"] = str(claimed)
    with sqlite3.connect(config.ledger_path) as db:
        db.execute(
            "UPDATE usage_records SET data = ? WHERE record_id = ?", (json.dumps(data), done.record_id)
        )
    code, out = await cli("usage", "reconcile", "--job", jobs["completed"])
    assert code == 1
    assert out.startswith(f"DIFF  job {jobs['completed']}") and "differs in wall_clock_seconds" in out
    wall = next(line.split() for line in out.splitlines() if line.strip().startswith("wall_clock_seconds"))
    assert wall[3:] == ["5", "1", "DIFF"]

    # A record taken out of a job's sequence is a finding, and so is a job Slurm ran with no record at all
    # (--since lists the jobs a scheduler held, not only those with records).
    with sqlite3.connect(config.ledger_path) as db:
        second = pipe.ledger.usage_records(jobs["timeout"])[1]
        db.execute("DELETE FROM usage_records WHERE record_id = ?", (second.record_id,))
        db.execute("DELETE FROM usage_records WHERE job_id = ?", (jobs["failed"],))
    code, out = await cli("usage", "reconcile", "--job", jobs["timeout"])
    assert code == 1 and out.startswith(f"DIFF  job {jobs['timeout']}") and "sequence gap: missing 2" in out
    code, out = await cli("usage", "reconcile", "--since", "1h")
    failed_id = run.results[jobs["failed"]].scheduler_job_id or ""
    ran = sacct_elapsed(env, failed_id)  # 0 s, or 1 s when the second ticked over
    assert code == 1
    assert (
        f"DIFF  job {jobs['failed']}: {failed_id} on {config.hpc.cluster_id} ran ({ran} s) but the chain holds "
        "no usage record of it"
    ) in out, out
    assert out.rstrip().endswith("7 jobs: 4 agree, 3 differ, 0 cannot be reconciled, 0 still running"), out


@pytest.mark.timeout(
    600
)  # Slurm holds a requeued job back (BeginTime) for cred_expire + 1 s before it runs again
async def test_a_job_that_requeues_and_renames_itself_is_billed_for_every_run(
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    env: dict[str, Any],
) -> None:
    """A tenant's job requeues itself (its owner may) and, in its second run, renames itself and changes its
    comment (``scontrol update``): its first run held the allocation all the same and is billed. Before, an earlier
    run counted only under the latest run's name and comment: the records billed the second run alone."""
    config, adapter = pipeline_config(tmp_path, env)
    script = (
        '#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then\n'
        "  scontrol update JobId=$SLURM_JOB_ID JobName=renamed Comment=mine\n  sleep 3\n  exit 0\nfi\n"
        "sleep 8\nscontrol requeue $SLURM_JOB_ID\nsleep 300\n"
    )
    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        job_id = pipe.submit(
            job_id=sc.workflow_id(SCOPE.rstrip("-")), script=script, resources={"memory_mb_per_node": 256}
        )
        results = await pipe.run_until_done([job_id], timeout=400)
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    slurm_id = pipe.ledger.job(job_id).scheduler_job_id
    runs = sc.slurm_command(
        env,
        ["sacct", "--duplicates", "-X", "-P", "-n", "-j", slurm_id, "-o", "State,ElapsedRaw,JobName,User"],
    ).split()
    fields = [run.split("|") for run in runs]
    assert [f[0] for f in fields] == ["REQUEUED", "COMPLETED"] and fields[1][2] == "renamed", runs
    assert fields[0][3] == fields[1][3] == sc.account_of(env), runs
    elapsed = [int(f[1]) for f in fields]
    records = pipe.ledger.usage_records(job_id)
    total = sum_metrics([r.metrics for r in records])
    assert total.wall_clock_seconds == sum(elapsed) and elapsed[0] >= 8, (runs, total)
    assert total.cpu_core_seconds == sum(elapsed)


@pytest.mark.timeout(300)
async def test_a_job_cancelled_as_it_is_requeued_settles_on_the_run_it_had(
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    env: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An operator requeues a running job and cancels it at once (before slurmdbd records its pending run):
    accounting's last word about it stays REQUEUED. It ends cancelled, billed for the run it had, and reconciles.
    Before, its final record waited for accounting for ever and the chain showed it running."""
    config, adapter = pipeline_config(tmp_path, env, accounting_grace="5s")
    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        job_id = pipe.submit(
            job_id=sc.workflow_id(SCOPE.rstrip("-")),
            script="sleep 300\n",
            resources={"memory_mb_per_node": 256},
        )
        for _ in range(300):
            await pipe.poller.poll_once()
            if getattr(pipe.ledger.job(job_id), "state", None) == JobState.RUNNING:
                break
            await asyncio.sleep(0.3)
        await asyncio.sleep(3)
        slurm_id = pipe.ledger.job(job_id).scheduler_job_id
        sc.slurm_command(env, ["bash", "-c", f"scontrol requeue {slurm_id}; scancel {slurm_id}"])
        results = await pipe.run_until_done([job_id], timeout=200)
    assert results[job_id].state == JobState.CANCELLED, results[job_id].message
    runs = sc.slurm_command(
        env, ["sacct", "--duplicates", "-X", "-P", "-n", "-j", slurm_id, "-o", "State,ElapsedRaw"]
    ).split()
    records = pipe.ledger.usage_records(job_id)
    total = sum_metrics([r.metrics for r in records])
    assert total.wall_clock_seconds == sum(int(run.split("|")[1]) for run in runs) >= 3, (runs, total)
    assert sum(1 for r in records if r.is_final) == 1 and records[-1].is_final
    assert pipe.ledger.settlement(job_id) is not None
    print("accounting:", runs)  # REQUEUED alone when the cancel beat slurmdbd, else REQUEUED then CANCELLED

    config_file = tmp_path / "provider.json"
    config_file.write_text(config.model_dump_json(exclude_defaults=True))
    capsys.readouterr()
    code = await asyncio.to_thread(
        cli_main, ["--config", str(config_file), "usage", "reconcile", "--job", job_id]
    )
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, out + err
