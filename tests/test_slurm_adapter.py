"""The SLURM adapter against the real local cluster, for each transport: local CLI, CLI over SSH, slurmrestd.

Per transport, the jobs that must run (complete, fail, OOM, cancel while running, CPU burner, hostile environment)
are submitted together at the first test and awaited by each test, so one node with two CPUs gets through them in
a couple of waves. Jobs that must not run are held (``--hold``). One TIMEOUT test in all (``--time=1`` is Slurm's
minimum: it takes 1-2 minutes), marked slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from activities.schedulers.base import Accounting, NativeStatus, SubmitRequest, SubmitResult
from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm import adapter as adapter_module
from activities.schedulers.slurm import backends as backends_module
from activities.schedulers.slurm.script import SubmitPlan
from activities.schedulers.slurm.transports import SSHRunner
from tests import slurm_cluster as sc
from virtengine_hpc.errors import JobNotFound, SchedulerError, SchedulerUnavailable, SubmissionRejected
from virtengine_hpc.metering import meter
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm

BURN_SECONDS = 5
BURN = (
    "python3 - <<'EOF'\nimport time\nt = time.process_time()\n"
    f"while time.process_time() - t < {BURN_SECONDS}:\n    pass\nEOF\n"
)


SCOPE = "adapter-"  # this module's jobs: workflow ids slurmtest-adapter-*, cleaned up by that prefix only


def wid(label: str) -> str:
    return sc.workflow_id(SCOPE + label)


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


@pytest.fixture(scope="module", params=sc.TRANSPORTS)
async def slurm(request: pytest.FixtureRequest, env: dict[str, Any]) -> AsyncIterator[SlurmAdapter]:
    adapter = sc.adapter(env, request.param)
    yield adapter
    leftover = _started.pop(id(adapter), {})
    for task in leftover.values():
        task.cancel()
    await asyncio.gather(*leftover.values(), return_exceptions=True)
    await adapter.close()


@dataclass
class Outcome:
    workflow_id: str
    submitted: SubmitResult
    final: NativeStatus
    states: list[JobState] = field(default_factory=list)
    usage: Accounting | None = None
    live: list[Accounting] = field(default_factory=list)


async def run_job(
    adapter: SlurmAdapter,
    wf: str,
    job: JobSpec,
    *,
    on_running: Callable[[str], Awaitable[None]] | None = None,
    sample_usage: bool = False,
    timeout: float = 150,
    exclusive: bool = False,
) -> Outcome:
    submitted = await adapter.submit(
        SubmitRequest(workflow_id=wf, job=job, body=job.script or "", exclusive=exclusive)
    )
    job_id = submitted.scheduler_job_id
    states: list[JobState] = []
    live: list[Accounting] = []
    acted = False
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = (await adapter.status_batch([job_id]))[job_id]
        except SchedulerUnavailable:  # another test may have stopped slurmctld for a moment: poll again
            assert time.monotonic() < deadline, f"{wf}: scheduler unavailable for {timeout} s"
            await asyncio.sleep(1)
            continue
        assert status.found, status
        if not states or states[-1] != status.state:
            states.append(status.state)
        if status.state.final:
            break
        if status.state == JobState.RUNNING:
            if on_running is not None and not acted:
                acted = True
                await on_running(job_id)
            if sample_usage:
                live.append(await adapter.usage(job_id))
        assert time.monotonic() < deadline, f"{wf} not final after {timeout} s: {states}"
        await asyncio.sleep(0.5)
    usage = None
    while time.monotonic() < deadline:
        with contextlib.suppress(SchedulerUnavailable):
            usage = await adapter.usage(job_id)
            if usage.final:
                break
        await asyncio.sleep(1)
    return Outcome(wf, submitted, status, states, usage, live)


def _scenarios(env: dict[str, Any], adapter: SlurmAdapter) -> dict[str, asyncio.Task[Outcome]]:
    marker = f"/tmp/vehpc-pwned-{uuid.uuid4().hex[:8]}"
    hostile = {
        "SUBST": f"$(touch {marker})",
        "TICKS": f"`touch {marker}`",
        "SEMI": f"x; touch {marker}",
        "QUOTES": 'it\'s "quoted" \\ $HOME',
    }
    hostile_body = (
        "#!/bin/bash\n#SBATCH --partition=nosuchpartition\n#SBATCH --job-name=evil\n"
        'printf "%s\\n" "$SUBST" "$TICKS" "$SEMI" "$QUOTES" "$SLURM_JOB_NAME" "$SLURM_JOB_PARTITION"\n'
    )

    async def cancel(job_id: str) -> None:
        await asyncio.sleep(2)  # let it run a little: a job cancelled in its first second has no elapsed time
        await adapter.cancel(job_id)

    jobs: dict[str, tuple[str, Callable[[str], Awaitable[Outcome]]]] = {}

    def add(name: str, make: Callable[[str], Awaitable[Outcome]]) -> None:
        jobs[name] = (wid(name), make)

    add("complete", lambda wf: run_job(adapter, wf, sc.spec(wf, "echo done\n")))
    add("fail", lambda wf: run_job(adapter, wf, sc.spec(wf, "echo failing >&2\nexit 3\n")))
    add("running-cancel", lambda wf: run_job(adapter, wf, sc.spec(wf, "sleep 120\n"), on_running=cancel))
    add("burn", lambda wf: run_job(adapter, wf, sc.spec(wf, BURN), sample_usage=True))
    add("hostile", lambda wf: run_job(adapter, wf, sc.spec(wf, hostile_body, environment=hostile)))
    if env.get("memory_enforced"):
        oom = "python3 -c 'b = bytearray(400 * 1024 * 1024); import time; time.sleep(5)'\n"
        add("oom", lambda wf: run_job(adapter, wf, sc.spec(wf, oom, resources={"memory_mb_per_node": 100})))
    tasks = {name: asyncio.ensure_future(make(wf)) for name, (wf, make) in jobs.items()}
    tasks["hostile"].marker = marker  # type: ignore[attr-defined]
    return tasks


_started: dict[int, dict[str, asyncio.Task[Outcome]]] = {}


@pytest.fixture
async def outcomes(env: dict[str, Any], slurm: SlurmAdapter) -> dict[str, asyncio.Task[Outcome]]:
    """The running jobs of this transport, started once (at the first test that asks).

    An async fixture, so the tasks are created on the session's event loop whatever ran before it (a plain
    fixture has no running loop and only worked when an earlier test had left one set on the main thread)."""
    key = id(slurm)
    if key not in _started:
        _started[key] = _scenarios(env, slurm)
    return _started[key]


def transport(adapter: SlurmAdapter) -> str:
    return adapter.config.transport or "cli"


# ---- jobs that run -----------------------------------------------------------------------------------------------


async def test_completed_job_reports_its_end_and_exact_final_usage(
    env: dict[str, Any], slurm: SlurmAdapter, outcomes: dict[str, asyncio.Task[Outcome]]
) -> None:
    outcome = await outcomes["complete"]
    assert outcome.final.state == JobState.COMPLETED
    assert outcome.final.exit_code == 0
    assert outcome.states[-1] == JobState.COMPLETED and JobState.FAILED not in outcome.states
    assert outcome.usage is not None and outcome.usage.final
    reading = outcome.usage.reading
    assert reading.allocated.memory_bytes == 256 * 1024 * 1024 and reading.allocated.nodes == 1
    metrics = meter(reading, sc.spec(outcome.workflow_id, "x").resources).metrics
    wall = metrics.wall_clock_seconds
    # memory GB-s = allocation (256 MiB) x elapsed, exactly: a sub-GiB job is not floored to 0.
    assert metrics.memory_gb_seconds == (Decimal(256 * 1024 * 1024) / Decimal(10**9) * wall).quantize(
        Decimal("0.000001")
    )
    assert metrics.node_hours == (wall / 3600).quantize(Decimal("0.000001"))
    job_id = outcome.submitted.scheduler_job_id
    assert await slurm.find(outcome.workflow_id) == job_id
    again = await slurm.submit(
        SubmitRequest(
            workflow_id=outcome.workflow_id, job=sc.spec(outcome.workflow_id, "echo done\n"), body="x"
        )
    )
    assert again == SubmitResult(scheduler_job_id=job_id, adopted=True), (
        "a finished job is adopted, not redone"
    )
    assert await sc.wait_in_accounting(env, outcome.workflow_id) == [job_id]


async def test_failed_job_keeps_its_exit_code(outcomes: dict[str, asyncio.Task[Outcome]]) -> None:
    outcome = await outcomes["fail"]
    assert outcome.final.state == JobState.FAILED
    assert outcome.final.exit_code == 3
    assert "exit code 3" in outcome.final.reason
    assert outcome.usage is not None and outcome.usage.final


async def test_out_of_memory_job_fails_with_the_reason(
    env: dict[str, Any], outcomes: dict[str, asyncio.Task[Outcome]]
) -> None:
    if "oom" not in outcomes:
        pytest.skip("cgroup memory limits are not enforced on this cluster (memory_enforced: false)")
    outcome = await outcomes["oom"]
    assert outcome.final.state == JobState.FAILED
    assert outcome.final.native_state == "OUT_OF_MEMORY"
    assert "out of memory" in outcome.final.reason
    assert outcome.usage is not None and outcome.usage.final


async def test_job_cancelled_while_running(
    slurm: SlurmAdapter, outcomes: dict[str, asyncio.Task[Outcome]]
) -> None:
    outcome = await outcomes["running-cancel"]
    assert JobState.RUNNING in outcome.states
    assert outcome.final.state == JobState.CANCELLED
    assert outcome.final.reason.startswith("cancelled")
    assert outcome.usage is not None and outcome.usage.final and outcome.usage.reading.wall_clock_seconds > 0
    await slurm.cancel(outcome.submitted.scheduler_job_id)  # already ended: not an error


async def test_cpu_burner_usage_matches_sacct(
    env: dict[str, Any], slurm: SlurmAdapter, outcomes: dict[str, asyncio.Task[Outcome]]
) -> None:
    outcome = await outcomes["burn"]
    assert outcome.final.state == JobState.COMPLETED
    assert outcome.usage is not None and outcome.usage.final
    final = outcome.usage.reading
    job_id = outcome.submitted.scheduler_job_id
    line = sc.slurm_command(env, ["sacct", "-P", "-n", "-j", job_id, "-o", "JobIDRaw,TotalCPU,ElapsedRaw"])
    fields = next(row.split("|") for row in line.splitlines() if row.split("|")[0] == job_id)
    from activities.schedulers.slurm.parsers import parse_duration

    sacct_cpu, sacct_wall = parse_duration(fields[1]) or Decimal(0), Decimal(fields[2])
    final_cpu = final.cpu_time_seconds or Decimal(0)
    assert abs(final_cpu - sacct_cpu) <= Decimal("0.1") * sacct_cpu
    assert abs(final.wall_clock_seconds - sacct_wall) <= max(Decimal(1), Decimal("0.1") * sacct_wall)
    assert abs(final_cpu - BURN_SECONDS) <= Decimal("0.1") * BURN_SECONDS
    # Running readings climb and never pass the final one (so period records add up to it).
    readings = [a.reading for a in outcome.live]
    assert readings, "the burner was seen running"
    for earlier, later in itertools.pairwise(readings):
        assert later.wall_clock_seconds >= earlier.wall_clock_seconds
        assert (later.cpu_time_seconds or 0) >= (earlier.cpu_time_seconds or 0)
    assert all((r.cpu_time_seconds or 0) <= final_cpu for r in readings)
    # slurmrestd v0.0.38 has no sstat, and over SSH the provider's account may not read a tenant's running steps
    # (slurmd refuses an operator; asking as the tenant would take the tenant's word): CPU arrives with the final
    # accounting there (a reading while the job is COMPLETING may already have its ended step's, the final figure).
    if transport(slurm) == "cli":
        assert max(r.cpu_time_seconds or 0 for r in readings) > 0, "sstat saw the CPU being burnt"
    else:
        assert all(r.cpu_time_seconds in (0, final_cpu) for r in readings) and final_cpu > 0, readings


async def test_hostile_environment_stays_literal_and_tenant_directives_are_ignored(
    env: dict[str, Any], slurm: SlurmAdapter, outcomes: dict[str, asyncio.Task[Outcome]]
) -> None:
    task = outcomes["hostile"]
    outcome = await task
    marker = task.marker  # type: ignore[attr-defined]
    assert outcome.final.state == JobState.COMPLETED, outcome.final
    lines = sc.job_output(env, outcome.workflow_id, outcome.submitted.scheduler_job_id).splitlines()
    assert lines[:4] == [
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"x; touch {marker}",
        'it\'s "quoted" \\ $HOME',
    ]
    marked = slurm.job_name(slurm.owner(outcome.workflow_id, sc.ALICE))
    assert lines[4] == marked, "the tenant's #SBATCH --job-name was ignored"
    assert lines[5] == env["partition"], "the tenant's #SBATCH --partition was ignored"
    assert not Path(marker).exists(), "no hostile string reached a shell"


async def test_a_job_asking_for_whole_nodes_gets_every_cpu_of_its_node(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    cpus = os.cpu_count() or 1
    if cpus < 2:
        pytest.skip("the one-node cluster has a single CPU: an exclusive job would look like a shared one")
    body = 'echo "$SLURM_JOB_CPUS_PER_NODE"\n'  # what Slurm allocated on the node
    whole, shared = wid("whole"), wid("shared")
    outcomes = {
        wf: await run_job(slurm, wf, sc.spec(wf, body), exclusive=wf == whole) for wf in (whole, shared)
    }
    for outcome in outcomes.values():
        assert outcome.final.state == JobState.COMPLETED, outcome.final
    allocated = {
        wf: sc.job_output(env, wf, outcome.submitted.scheduler_job_id).strip()
        for wf, outcome in outcomes.items()
    }
    assert allocated == {whole: str(cpus), shared: "1"}


# ---- jobs that never run -----------------------------------------------------------------------------------------


async def test_rejected_submission_is_final_with_slurms_reason(slurm: SlurmAdapter) -> None:
    wf = wid("reject")
    before = sum(slurm.calls.get(k, 0) for k in ("sbatch", "job/submit"))
    with pytest.raises(SubmissionRejected) as caught:
        await slurm.submit(
            SubmitRequest(
                workflow_id=wf, job=sc.spec(wf, "true\n", partition="nosuchpartition"), body="true\n"
            )
        )
    assert "Invalid partition" in str(caught.value) or "invalid partition" in str(caught.value)
    assert not caught.value.transient
    assert sum(slurm.calls.get(k, 0) for k in ("sbatch", "job/submit")) == before + 1, "not retried"


async def test_pending_job_cancelled_and_retried_submit_adopts(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    held = sc.adapter(env, transport(slurm), hold=True)
    try:
        wf = wid("held")
        job = sc.spec(wf, "echo never\n")
        first = await held.submit(SubmitRequest(workflow_id=wf, job=job, body="echo never\n"))
        status = (await held.status_batch([first.scheduler_job_id]))[first.scheduler_job_id]
        assert status.state == JobState.QUEUED and status.reason == "pending: JobHeldUser"
        # The retried submit of the same workflow (its first answer lost) adopts: accounting does not know
        # the job yet (4-5 s lag), the controller does.
        retried = await held.submit(SubmitRequest(workflow_id=wf, job=job, body="echo never\n"))
        assert retried == SubmitResult(scheduler_job_id=first.scheduler_job_id, adopted=True)
        assert (await held.usage(first.scheduler_job_id)).reading.wall_clock_seconds == 0
        await held.cancel(first.scheduler_job_id)
        final = await sc.wait_final(held, first.scheduler_job_id, timeout=60)
        assert final.state == JobState.CANCELLED and final.start_time is None
        usage = await held.usage(first.scheduler_job_id)
        assert usage.final and usage.reading.wall_clock_seconds == 0
        await held.cancel(first.scheduler_job_id)  # again: not an error
    finally:
        await held.close()


async def test_ten_thousand_watched_jobs_are_one_status_query(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    """A cluster monitor asks about every watched job at once: at 10,000 jobs that is still one query of the
    controller (and, on the command line, one of accounting for the ids it does not hold), not one per 5,000."""
    held = sc.adapter(env, transport(slurm), hold=True)
    try:
        wf = wid("ten-thousand")
        job = sc.spec(wf, "echo never\n")
        real = (
            await held.submit(SubmitRequest(workflow_id=wf, job=job, body="echo never\n"))
        ).scheduler_job_id
        # Ids the controller has never handed out (its MaxJobId is 67,043,328 by default): found nowhere.
        made_up = [str(60_000_000 + n) for n in range(9_999)]
        before = held.calls
        statuses = await held.status_batch([real, *made_up])
        made = {kind: n - before.get(kind, 0) for kind, n in held.calls.items() if n != before.get(kind, 0)}
        assert statuses[real].state == JobState.QUEUED
        assert not any(statuses[i].found for i in made_up) and len(statuses) == 10_000
        if transport(slurm) == "rest":  # slurmrestd 22.05 reads accounting one job at a time
            assert made.get("jobs") == 1, made
        else:
            assert made == {"squeue": 1, "sacct": 1}, made
        await held.cancel(real)
    finally:
        await held.close()


async def test_job_that_can_never_start_fails_fast_and_is_cancelled(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    """A dependency on a cancelled job can never be satisfied: the job is failed now, not at job_timeout_default."""
    name = f"vehpc-{wid('never')}"
    # As the transport's own user: the adapter cancels its user's jobs (hpcuser may not cancel root's).
    as_user = [] if transport(slurm) == "cli" else ["runuser", "-u", env["job_user"], "--"]
    common = ["sbatch", "--parsable", "-J", name, "-o", "/dev/null", "--chdir=/tmp"]
    held = sc.slurm_command(env, [*as_user, *common, "--hold", "--wrap", "true"]).strip()
    sc.slurm_command(env, ["scancel", held])
    blocked = sc.slurm_command(
        env, [*as_user, *common, f"--dependency=afterok:{held}", "--wrap", "true"]
    ).strip()
    assert blocked.isdigit()
    status = await sc.wait_for(slurm, blocked, lambda s: s.state != JobState.QUEUED, timeout=30)
    assert status.state == JobState.FAILED
    assert "will never start: DependencyNeverSatisfied" in status.reason
    # ... and Slurm no longer holds it pending: it cannot start behind the workflow's back.
    cancelled = await sc.wait_for(slurm, blocked, lambda s: s.native_state == "CANCELLED", timeout=30)
    assert cancelled.state == JobState.CANCELLED


async def test_unknown_jobs_are_not_found_never_completed(slurm: SlurmAdapter) -> None:
    statuses = await slurm.status_batch(["999999", "12x", "999998"])
    assert {job_id: s.found for job_id, s in statuses.items()} == dict.fromkeys(
        ["999999", "12x", "999998"], False
    )
    with pytest.raises(JobNotFound):
        await slurm.usage("999999")
    with pytest.raises(JobNotFound):
        await slurm.cancel("1; touch /tmp/x")


class _LosesAnswers:
    """Backend wrapper: submits for real, then 'loses' the answer once (as a dropped connection would)."""

    def __init__(self, adapter: SlurmAdapter) -> None:
        self.real = adapter.backend.submit
        self.lost = 0
        adapter.backend.submit = self.submit  # type: ignore[method-assign]

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        job_id = await self.real(plan, account)
        if self.lost == 0:
            self.lost += 1
            raise SchedulerUnavailable(f"connection lost after the scheduler accepted job {job_id}")
        return job_id


async def test_lost_submit_answer_is_adopted_inside_the_adapter(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    adapter = sc.adapter(env, transport(slurm))
    try:
        loser = _LosesAnswers(adapter)
        wf = wid("lost")
        result = await adapter.submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n"))
        assert loser.lost == 1 and result.adopted
        # Concurrent submits of one workflow in one process: one lookup, one job.
        wf2 = wid("concurrent")
        request = SubmitRequest(workflow_id=wf2, job=sc.spec(wf2, "true\n"), body="true\n")
        results = await asyncio.gather(*(adapter.submit(request) for _ in range(3)))
        assert len({r.scheduler_job_id for r in results}) == 1
        assert sorted(r.adopted for r in results) == [False, True, True]
        for w, expected in ((wf, result.scheduler_job_id), (wf2, results[0].scheduler_job_id)):
            assert sc.controller_jobs_of(env, w) == [expected], "exactly one Slurm job"
            assert await sc.wait_in_accounting(env, w) == [expected], "and accounting agrees"
    finally:
        await adapter.close()


async def test_job_the_controller_forgot_is_found_in_accounting(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    """After MinJobAge (300 s) only accounting knows a job: simulate it by hiding the controller's answer."""
    adapter = sc.adapter(env, transport(slurm))
    try:
        wf = wid("forgot")
        submitted = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n")
        )
        assert await sc.wait_in_accounting(env, wf) == [submitted.scheduler_job_id]

        async def forgetful(names: Any) -> list[Any]:
            return []

        adapter.backend.queue_by_names = forgetful  # type: ignore[method-assign]
        assert await adapter.find(wf) == submitted.scheduler_job_id
        again = await adapter.submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n"))
        assert again == SubmitResult(scheduler_job_id=submitted.scheduler_job_id, adopted=True)
    finally:
        await adapter.close()


async def test_submitter_killed_after_sbatch_leaves_exactly_one_job(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """kill -9 between 'sbatch answered' and 'submit returned'; the retried submit adopts; one job in sacct."""
    wf = wid("sigkill")
    child = tmp_path / "submitter.py"
    child.write_text(
        "import asyncio, os, signal, sys\n"
        f"sys.path.insert(0, {str(sc.REPO)!r})\n"
        "from tests import slurm_cluster as sc\n"
        "from activities.schedulers.base import SubmitRequest\n"
        "async def main():\n"
        "    a = sc.adapter(sc.cluster(), 'cli')\n"
        "    real = a.backend.submit\n"
        "    async def submit_then_die(plan, account=None):\n"
        "        job_id = await real(plan, account)\n"
        "        print(job_id, flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    a.backend.submit = submit_then_die\n"
        f"    wf = {wf!r}\n"
        "    await a.submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, 'true\\n'), body='true\\n'))\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, str(child)], capture_output=True, text=True, timeout=60, cwd=sc.REPO
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    job_id = proc.stdout.strip()
    assert job_id.isdigit()
    adapter = sc.adapter(env, "cli")
    try:
        # Right after the crash accounting has not heard of the job (4-5 s lag): the controller's view adopts it.
        recovered = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n")
        )
        assert recovered == SubmitResult(scheduler_job_id=job_id, adopted=True)
        assert sc.controller_jobs_of(env, wf) == [job_id]
        assert await sc.wait_in_accounting(env, wf) == [job_id]
    finally:
        await adapter.close()


# ---- the transport itself ----------------------------------------------------------------------------------------


async def test_ssh_arguments_reach_the_command_verbatim(env: dict[str, Any]) -> None:
    marker = f"/tmp/vehpc-pwned-{uuid.uuid4().hex[:8]}"
    runner = SSHRunner(
        host=env["ssh_host"],
        port=env["ssh_port"],
        user=env["ssh_user"],
        key_path=Path(env["ssh_key_file"]),
        known_hosts=Path(env["ssh_known_hosts"]),
        timeout=20,
    )
    try:
        args = [f"$(touch {marker})", f"`touch {marker}`", f"a; touch {marker}", "it's", "*", "$HOME", "a b"]
        result = await runner.run(["printf", "%s\\n", *args], timeout=20)
        assert result.exit_code == 0
        assert result.stdout.splitlines() == args
        assert not Path(marker).exists()
        script = f"echo $(echo inner) ; echo {marker}\n"
        piped = await runner.run(["cat"], stdin=script, timeout=20)
        assert piped.stdout == script, "a script on stdin arrives byte for byte"
        # One connection serves every command (TCP_NODELAY: no 40 ms stall per command).
        started = time.monotonic()
        for _ in range(10):
            await runner.run(["true"], timeout=20)
        assert runner.connects == 1
        assert (time.monotonic() - started) / 10 < 0.2
    finally:
        await runner.close()


async def test_ssh_refuses_an_unknown_host_key(env: dict[str, Any], tmp_path: Path) -> None:
    from virtengine_hpc.errors import SecurityError

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    runner = SSHRunner(
        host=env["ssh_host"],
        port=env["ssh_port"],
        user=env["ssh_user"],
        key_path=Path(env["ssh_key_file"]),
        known_hosts=empty,
        timeout=10,
    )
    with pytest.raises(SecurityError, match="known_hosts"):
        await runner.run(["true"], timeout=10)
    await runner.close()


async def test_wrong_cluster_name_is_a_config_error(env: dict[str, Any]) -> None:
    from virtengine_hpc.errors import ConfigError

    adapter = sc.adapter(env, "cli", cluster_name="not-this-cluster")
    try:
        with pytest.raises(ConfigError, match="not-this-cluster"):
            await adapter.status_batch(["1"])
    finally:
        await adapter.close()


async def test_drain_and_resume_node_with_a_hostile_reason(env: dict[str, Any]) -> None:
    adapter = sc.adapter(env, "cli")
    node = env["node"]
    reason = f"maintenance $(touch /tmp/vehpc-pwned-drain) `id`; {uuid.uuid4().hex[:6]}"
    try:
        await adapter.drain_node(node, reason)
        try:
            shown = sc.slurm_command(env, ["scontrol", "show", "node", node])
            assert f"Reason={reason}" in shown
            assert "DRAIN" in shown
        finally:
            await adapter.resume_node(node)
        await adapter.resume_node(node)  # resuming a node that is not drained: nothing to do, no error
        assert "DRAIN" not in sc.slurm_command(env, ["scontrol", "show", "node", node])
        assert not Path("/tmp/vehpc-pwned-drain").exists()
        assert await adapter.node_busy(node) in (True, False)
        with pytest.raises(SchedulerError):
            await adapter.drain_node("node1; touch /tmp/x", "x")
        with pytest.raises(SchedulerError, match="Invalid node name"):
            await adapter.drain_node("nosuchnode", "x")
    finally:
        await adapter.close()


async def test_drain_over_ssh_as_an_unprivileged_user_is_refused_for_good(env: dict[str, Any]) -> None:
    # The provider's own account is a Slurm operator (it cancels tenants' jobs) and may drain; a tenant's may not.
    tenant = sc.tenant_accounts(env)[-1]
    adapter = sc.adapter(
        env,
        "ssh",
        tenants={"isolation": "none"},
        max_retries=0,
        ssh_user=tenant,
        ssh_key_path=str(Path(env["tenant_key_dir"]) / tenant),
    )
    try:
        with pytest.raises(SchedulerError) as caught:
            await adapter.drain_node(env["node"], "not allowed")
        assert not caught.value.transient and caught.value.command[:2] == ["scontrol", "update"]
        assert "DRAIN" not in sc.slurm_command(env, ["scontrol", "show", "node", env["node"]])
    finally:
        await adapter.close()


async def test_rest_with_a_bad_token_is_a_security_error_not_an_outage(env: dict[str, Any]) -> None:
    from pydantic import SecretStr

    from virtengine_hpc.config import Secrets
    from virtengine_hpc.errors import SecurityError

    bad = SlurmAdapter.from_config(
        sc.config(env, "rest"), Secrets(slurm_jwt_token=SecretStr("not.a.valid-token")), "slurm-test"
    )
    try:
        with pytest.raises(SecurityError, match="SLURM_JWT_TOKEN") as caught:
            await bad.status_batch(["1"])
        assert "not.a.valid-token" not in str(caught.value), "the token never appears in an error"
    finally:
        await bad.close()


async def test_rest_transport_cannot_drain_and_says_so(env: dict[str, Any]) -> None:
    adapter = sc.adapter(env, "rest")
    try:
        with pytest.raises(NotImplementedError, match="cli or ssh"):
            await adapter.drain_node(env["node"], "x")
        assert await adapter.node_busy(env["node"]) in (True, False)
    finally:
        await adapter.close()


# ---- TIMEOUT (slow: Slurm's shortest walltime is one minute) -----------------------------------------------------


@pytest.mark.slow
async def test_job_past_its_walltime_times_out(env: dict[str, Any]) -> None:
    adapter = sc.adapter(env, "cli")
    try:
        wf = wid("timeout")
        outcome = await run_job(adapter, wf, sc.spec(wf, "sleep 600\n", walltime_seconds=60), timeout=240)
        assert outcome.final.state == JobState.TIMEOUT
        assert "time limit" in outcome.final.reason
        assert outcome.usage is not None and outcome.usage.final
        assert outcome.usage.reading.wall_clock_seconds >= 60
    finally:
        await adapter.close()


async def test_a_suspended_jobs_run_time_excludes_its_suspension_on_every_transport(
    env: dict[str, Any],
) -> None:
    """An operator suspends a running job (``scontrol suspend``): its run time stops, on every transport, as the
    controller counts it (``squeue``'s TimeUsed). slurmrestd gives no run time: it was now - start, which billed
    the suspension (and the high-water mark kept it to the final record)."""
    adapters = {name: sc.adapter(env, name) for name in sc.TRANSPORTS}
    wf = wid("suspend")
    job_id = ""
    try:
        submitted = await adapters["cli"].submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "sleep 300\n"), body="sleep 300\n")
        )
        job_id = submitted.scheduler_job_id
        await sc.wait_for(adapters["cli"], job_id, lambda s: s.state == JobState.RUNNING, timeout=120)
        await asyncio.sleep(3)
        sc.slurm_command(env, ["scontrol", "suspend", job_id])
        await sc.wait_for(adapters["cli"], job_id, lambda s: s.state == JobState.SUSPENDED, timeout=30)
        await asyncio.sleep(6)  # suspended: none of this is run time
        seconds = sc.time_used(env, job_id)
        readings = {name: (await a.usage(job_id)).reading.wall_clock_seconds for name, a in adapters.items()}
        assert readings == dict.fromkeys(sc.TRANSPORTS, Decimal(seconds)), (seconds, readings)
        sc.slurm_command(env, ["scontrol", "resume", job_id])
        await asyncio.sleep(2)
        resumed = await adapters["rest"].usage(job_id)
        assert seconds + 1 <= resumed.reading.wall_clock_seconds <= seconds + 4, resumed.reading
    finally:
        if job_id:
            await adapters["cli"].cancel(job_id)
        for adapter in adapters.values():
            await adapter.close()


class _WorkerAhead(datetime):
    """The worker's clock a minute ahead of the controller's (what the adapter's module reads as ``datetime``)."""

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> datetime:  # type: ignore[override]
        return datetime.now(tz) + timedelta(seconds=60)


async def test_slurmrestd_counts_a_running_jobs_time_on_the_controllers_clock(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """slurmrestd gives no run time of a running job, so the adapter counts it from the job's start, which is on the
    controller's clock. With the worker's clock a minute ahead, every running reading billed that minute (and the
    final record, which cannot be negative, never took it back); it is now what ``squeue``'s TimeUsed says."""
    cli, rest = sc.adapter(env, "cli"), sc.adapter(env, "rest")
    monkeypatch.setattr(adapter_module, "datetime", _WorkerAhead)
    wf = wid("skew")
    job_id = ""
    try:
        submitted = await rest.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "sleep 8\n"), body="sleep 8\n")
        )
        job_id = submitted.scheduler_job_id
        await sc.wait_for(cli, job_id, lambda s: s.state == JobState.RUNNING, timeout=120)
        await asyncio.sleep(2)
        before = sc.time_used(env, job_id)
        running = await rest.usage(job_id)
        after = sc.time_used(env, job_id)
        assert not running.final
        assert before <= running.reading.wall_clock_seconds <= after, (before, running.reading, after)
        await sc.wait_final(cli, job_id)
        final = await sc.final_usage(rest, job_id)
        assert final.final and final.reading.wall_clock_seconds >= running.reading.wall_clock_seconds
    finally:
        if job_id:
            await cli.cancel(job_id)
        await cli.close()
        await rest.close()


_CLOCK_AHEAD = r"""
#include <stdlib.h>
#include <time.h>
time_t time(time_t *t) {  /* this host's clock SKEW seconds ahead, as Slurm's client commands read it */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    time_t ahead = now.tv_sec + atol(getenv("SKEW") ? getenv("SKEW") : "0");
    if (t) *t = ahead;
    return ahead;
}
"""


async def test_cli_counts_a_running_jobs_time_on_the_controllers_clock(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``squeue`` counts a running job's TimeUsed on the host it runs on, to that host's clock, from the job's start
    on the controller's: on the cli transport, the worker's. With the worker's clock a minute ahead, a job that had
    run a few seconds read 62 s, and the final record, which cannot be negative, never took it back (sacct: 25 s).
    The worker's clock is put ahead for Slurm's commands (a preloaded ``time``) and for the adapter's own."""
    shim = tmp_path / "ahead.so"
    (tmp_path / "ahead.c").write_text(_CLOCK_AHEAD)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "ahead.c")], check=True)
    cli = sc.adapter(env, "cli")
    wf = wid("cliskew")
    job_id = ""
    try:
        submitted = await cli.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "sleep 8\n"), body="sleep 8\n")
        )
        job_id = submitted.scheduler_job_id
        await sc.wait_for(cli, job_id, lambda s: s.state == JobState.RUNNING, timeout=120)
        await asyncio.sleep(2)
        runner = cli.backend.executors.own.runner  # type: ignore[attr-defined]
        plain = dict(runner.env)
        runner.env = {**plain, "LD_PRELOAD": str(shim), "SKEW": "60"}
        monkeypatch.setattr(backends_module, "datetime", _WorkerAhead)
        running = await cli.usage(job_id)
        runner.env = plain
        monkeypatch.undo()
        assert not running.final
        await sc.wait_final(cli, job_id)
        final = await sc.final_usage(cli, job_id)
        assert final.final
        assert running.reading.wall_clock_seconds <= final.reading.wall_clock_seconds, (
            running.reading,
            final.reading,
        )
    finally:
        if job_id:
            await cli.cancel(job_id)
        await cli.close()
