"""The ``local`` adapter against real processes: outcomes, limits, cancel, crash safety, usage, hostile input.

Nothing here is mocked: every job is a real bash script under a real detached supervisor. The crash tests
SIGKILL real submitting processes (a separate Python process running the adapter) at chosen and at random
moments.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest

from activities.schedulers import local as local_module
from activities.schedulers import local_supervisor as sup
from activities.schedulers.base import NativeStatus, RefusedAdoption, SubmitRequest
from activities.schedulers.local import JOB_PATH, LocalAdapter, scheduler_job_id
from activities.schedulers.registry import adapter_class
from activities.tenant_accounts import AssignmentStore, TenantAccounts
from tests.local_support import (
    JOB_PYTHON,
    TENANT_POOL,
    reachable_dir,
    running_as_root,
    shared_dir,
    tenant_accounts,
)
from virtengine_hpc.config import LocalSchedulerConfig
from virtengine_hpc.errors import ConfigError, JobNotFound, SchedulerError, SubmissionRejected
from virtengine_hpc.markers import MarkerKey
from virtengine_hpc.metering import GB, meter
from virtengine_hpc.models import JobSpec, Resources
from virtengine_hpc.signing import write_private_key
from virtengine_hpc.states import FINAL_STATES, JobState
from virtengine_hpc.tenancy import TenantAccountError, TenantRules

REPO = Path(__file__).resolve().parents[1]
#: The account ``tenant1``'s jobs run as when the tests run as root (``tenant_accounts``).
TENANT_ACCOUNT = "vehpc-t1"
pytestmark = pytest.mark.timeout(120)


def spec(job_id: str, body: str, **fields: Any) -> JobSpec:
    fields.setdefault("tenant", "tenant1")
    return JobSpec(job_id=job_id, provider="provider1", offering_id="offer-1", script=body, **fields)


def request(workflow_id: str, body: str, **fields: Any) -> SubmitRequest:
    return SubmitRequest(workflow_id=workflow_id, job=spec(workflow_id, body, **fields), body=body)


async def wait_for(
    adapter: LocalAdapter, job_id: str, states: frozenset[JobState] | set[JobState], timeout: float = 30.0
) -> NativeStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = (await adapter.status_batch([job_id]))[job_id]
        if status.state in states:
            return status
        if time.monotonic() > deadline:
            pytest.fail(f"{job_id} still {status.state} ({status.reason}) after {timeout:g}s")
        await asyncio.sleep(0.05)


async def wait_final(adapter: LocalAdapter, job_id: str, timeout: float = 30.0) -> NativeStatus:
    return await wait_for(adapter, job_id, FINAL_STATES, timeout)


def wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().endswith("\n")):
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear")
        time.sleep(0.02)
    return path.read_text()


def gone(pid: int) -> bool:
    """The process is gone (or a zombie nobody reaped yet: it runs nothing any more)."""
    stat = sup.read_stat(pid)
    return stat is None or stat.state == "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def supervisor_pid(adapter: LocalAdapter, job_id: str) -> int:
    deadline = time.monotonic() + 10
    while (status := sup.read_json(adapter.job_dir(job_id) / sup.STATUS)) is None:
        assert time.monotonic() < deadline, "the supervisor wrote no status"
        time.sleep(0.02)
    return int(status["supervisor_pid"])


def stop_everything(state_dir: Path) -> None:
    """Kill what a failing test left running, so it cannot disturb the next tests."""
    for status_file in state_dir.glob("jobs/*/status.json"):
        status = sup.read_json(status_file) or {}
        if status.get("state") in sup.FINAL_STATES:
            continue
        if sup.is_same_process(status.get("supervisor_pid"), status.get("supervisor_start_ticks")):
            os.kill(status["supervisor_pid"], signal.SIGKILL)
        sup.kill_orphaned_group(status.get("job_pid"), status.get("job_start_ticks"))


@pytest.fixture
def make_adapter() -> Iterator[Callable[..., LocalAdapter]]:
    state_dir = reachable_dir("local") / "state"

    def make(**config: Any) -> LocalAdapter:
        config.setdefault("kill_wait", "1s")
        config.setdefault("allow_unisolated", True)
        return LocalAdapter(LocalSchedulerConfig(**config), state_dir, "test-cluster", tenant_accounts())

    yield make
    stop_everything(state_dir)


@pytest.fixture
def shared() -> Path:
    """A directory the test and its jobs (running as tenant accounts) can both write to."""
    return shared_dir()


def test_registered_by_name() -> None:
    assert adapter_class("local") is LocalAdapter


def test_a_worker_that_cannot_switch_users_refuses_tenant_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not root, the worker could only run jobs as itself: that takes hpc.tenants.isolation: none, said outright."""
    config = LocalSchedulerConfig(allow_unisolated=True)
    isolated = TenantAccounts(TenantRules(fixed={"tenant1": "vehpc-t1"}), None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a worker running as an ordinary account
    with pytest.raises(
        ConfigError, match=r"not root, so the local executor cannot run jobs as the tenants"
    ) as no:
        LocalAdapter(config, tmp_path / "state", "test-cluster", isolated)
    assert "set hpc.tenants.isolation: none to run every job as" in str(no.value)
    assert not (tmp_path / "state").exists()
    LocalAdapter(
        config, tmp_path / "state", "test-cluster", TenantAccounts(TenantRules(isolated=False), None)
    )


def test_the_local_executor_does_not_start_without_the_opt_in(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"opts in with hpc\.local\.allow_unisolated: true") as refused:
        LocalAdapter(LocalSchedulerConfig(), tmp_path / "state", "test-cluster")
    assert "cluster test-cluster uses the local executor, which is no multi-tenant sandbox" in str(
        refused.value
    )
    assert not (tmp_path / "state").exists(), "a refused executor leaves nothing behind"


# ---- outcomes ----------------------------------------------------------------------------------------------
async def test_script_runs_to_completion_with_its_output(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    body = 'echo "hello from $VIRTENGINE_JOB_ID"\necho oops >&2\n'
    result = await adapter.submit(request("wf-ok", body))
    assert not result.adopted
    assert result.scheduler_job_id == scheduler_job_id("wf-ok")

    status = await wait_final(adapter, result.scheduler_job_id)
    assert (status.state, status.exit_code, status.reason) == (JobState.COMPLETED, 0, "")
    assert status.start_time is not None and status.end_time is not None
    assert status.start_time <= status.end_time

    jobdir = adapter.job_dir(result.scheduler_job_id)
    assert (jobdir / "stdout").read_text() == "hello from wf-ok\n"
    assert (jobdir / "stderr").read_text() == "oops\n"
    assert (jobdir / "job.sh").read_text() == "#!/bin/bash\n" + body
    # The job's account owns its script and work directory; the rest (what the billing reads) is the worker's.
    me, account = os.geteuid(), (TENANT_ACCOUNT if running_as_root() else None)
    owner = pwd.getpwnam(account).pw_uid if account else me
    modes = {
        name: (path.stat().st_uid, path.stat().st_mode & 0o7777)
        for name, path in [
            ("dir", jobdir),
            ("job.sh", jobdir / "job.sh"),
            ("work", jobdir / "work"),
            ("tmp", jobdir / "work" / "tmp"),
            ("stdout", jobdir / "stdout"),
            ("status", jobdir / "status.json"),
            ("meta", jobdir / "meta.json"),
            ("supervisor.log", jobdir / "supervisor.log"),
        ]
    }
    assert modes == {
        "dir": (me, 0o711),
        "job.sh": (owner, 0o500),
        "work": (owner, 0o700),
        "tmp": (owner, 0o700),
        "stdout": (me, 0o600),
        "status": (me, 0o600),
        "meta": (me, 0o600),
        "supervisor.log": (me, 0o600),
    }

    usage = await adapter.usage(result.scheduler_job_id)
    assert usage.final and usage.reading.wall_clock_seconds > 0
    assert usage.reading.network_bytes_in is None and usage.reading.energy_joules is None
    assert await adapter.find("wf-ok") == result.scheduler_job_id
    assert await adapter.find("wf-never-submitted") is None


async def test_nonzero_exit_is_failed_with_its_code(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    job_id = (await adapter.submit(request("wf-exit3", "echo partial\nexit 3\n"))).scheduler_job_id
    status = await wait_final(adapter, job_id)
    assert (status.state, status.exit_code, status.reason) == (JobState.FAILED, 3, "exit code 3")


async def test_killed_by_a_signal_is_failed_naming_it(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    job_id = (await adapter.submit(request("wf-sigkill", "kill -KILL $$\n"))).scheduler_job_id
    status = await wait_final(adapter, job_id)
    assert status.state == JobState.FAILED
    assert status.exit_code == 128 + signal.SIGKILL
    assert "killed by signal SIGKILL" in status.reason and "OOM" in status.reason


async def test_missing_working_directory_fails_clearly(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter()
    missing = str(shared / "no-such-dir")
    job_id = (await adapter.submit(request("wf-nowd", "true\n", working_directory=missing))).scheduler_job_id
    status = await wait_final(adapter, job_id)
    assert status.state == JobState.FAILED
    assert missing in status.reason and "does not exist" in status.reason


async def test_walltime_exceeded_is_timeout_even_when_sigterm_is_ignored(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    adapter = make_adapter(max_walltime="1s", kill_wait="1s")
    # The trap makes bash and its sleep ignore SIGTERM, so only the SIGKILL after kill_wait ends it.
    body = "trap '' TERM\necho $$ > leader.pid\nsleep 300\n"
    job_id = (await adapter.submit(request("wf-walltime", body))).scheduler_job_id
    status = await wait_final(adapter, job_id, timeout=20)
    assert status.state == JobState.TIMEOUT
    assert "walltime of 1s exceeded" in status.reason
    assert status.start_time is not None and status.end_time is not None
    elapsed = (status.end_time - status.start_time).total_seconds()
    assert 1.9 <= elapsed < 6, elapsed  # walltime 1 s + kill_wait 1 s
    leader = int((adapter.work_dir(job_id) / "leader.pid").read_text())
    assert wait_gone(leader)
    usage = await adapter.usage(job_id)
    assert usage.final and 1.9 <= usage.reading.wall_clock_seconds < 6


# ---- cancel ------------------------------------------------------------------------------------------------
async def test_cancel_running_job_kills_all_of_its_processes(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    adapter = make_adapter()
    body = (
        "sleep 300 &\necho $! > background.pid\n"
        # Leaves the process group and double-forks: a daemon. The supervisor (a subreaper) still catches it.
        "( setsid sleep 300 & echo $! > daemon.pid )\n"
        "echo $$ > leader.pid\nwait\n"
    )
    job_id = (await adapter.submit(request("wf-cancel-running", body))).scheduler_job_id
    await wait_for(adapter, job_id, {JobState.RUNNING})
    workdir = adapter.work_dir(job_id)
    pids = [int(wait_file(workdir / name)) for name in ("leader.pid", "background.pid", "daemon.pid")]

    await adapter.cancel(job_id)
    status = await wait_final(adapter, job_id, timeout=10)
    assert status.state == JobState.CANCELLED
    assert status.reason == "cancelled on request"
    assert all(wait_gone(pid) for pid in pids), [sup.read_stat(p) for p in pids]
    await adapter.cancel(job_id)  # cancelling again is a no-op


async def test_cancel_queued_job_never_runs_it(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter(max_parallel_jobs=1)
    first = (await adapter.submit(request("wf-slot-holder", "sleep 300\n"))).scheduler_job_id
    await wait_for(adapter, first, {JobState.RUNNING})
    ran = shared / "queued-job-ran"
    second = (await adapter.submit(request("wf-queued", f"touch {ran}\n"))).scheduler_job_id
    await asyncio.sleep(0.6)  # several slot polls: it must still be waiting
    assert (await adapter.status_batch([second]))[second].state == JobState.QUEUED

    await adapter.cancel(second)
    status = await wait_final(adapter, second, timeout=10)
    assert status.state == JobState.CANCELLED
    assert "before it started" in status.reason
    assert status.start_time is None
    assert not ran.exists()
    usage = await adapter.usage(second)
    assert usage.final and usage.reading.wall_clock_seconds == 0
    await adapter.cancel(first)
    assert (await wait_final(adapter, first, timeout=10)).state == JobState.CANCELLED


async def test_max_parallel_jobs_queues_until_a_slot_frees(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter(max_parallel_jobs=1)
    first = (await adapter.submit(request("wf-first", "sleep 1\n"))).scheduler_job_id
    await wait_for(adapter, first, {JobState.RUNNING})
    second = (await adapter.submit(request("wf-second", "true\n"))).scheduler_job_id
    assert (await adapter.status_batch([second]))[second].state == JobState.QUEUED
    done = await adapter.status_batch([first, second])
    assert done[first].state == JobState.RUNNING
    a = await wait_final(adapter, first)
    b = await wait_final(adapter, second)
    assert a.state == b.state == JobState.COMPLETED
    assert a.end_time is not None and b.start_time is not None and b.start_time >= a.end_time


async def test_cancel_after_the_end_is_a_no_op(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    job_id = (await adapter.submit(request("wf-done", "true\n"))).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    await adapter.cancel(job_id)
    status = (await adapter.status_batch([job_id]))[job_id]
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0)
    with pytest.raises(JobNotFound):
        await adapter.cancel(scheduler_job_id("wf-unknown"))


async def test_unknown_and_malformed_ids_are_not_found(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    known = (await adapter.submit(request("wf-known", "true\n"))).scheduler_job_id
    ids = [known, scheduler_job_id("wf-unknown"), "../../../etc", "12345", "local-" + "0" * 20]
    statuses = await adapter.status_batch(ids)
    assert statuses[known].found
    assert [statuses[i].found for i in ids[1:]] == [False] * 4
    with pytest.raises(JobNotFound):
        await adapter.usage("../../../etc")


# ---- crash safety ------------------------------------------------------------------------------------------
SUBMITTER = r"""
import asyncio, os, signal, sys
from pathlib import Path
from activities.schedulers.base import SubmitRequest
from activities.schedulers.local import LocalAdapter
from tests.local_support import tenant_accounts
from virtengine_hpc.config import LocalSchedulerConfig
from virtengine_hpc.models import JobSpec

state, runs, crash, *workflow_ids = sys.argv[1:]
adapter = LocalAdapter(LocalSchedulerConfig(allow_unisolated=True), Path(state), "test-cluster", tenant_accounts())

def die(*_args):
    os.kill(os.getpid(), signal.SIGKILL)

if crash == "before_spawn":  # job directory written and locked, supervisor not started yet
    adapter._spawn_supervisor = die
elif crash == "after_spawn":  # supervisor spawned, the submitter has not written the started marker
    adapter._commit = die

async def main():
    for wf in workflow_ids:
        body = 'echo "$VIRTENGINE_WORKFLOW_ID" >> "$RUNS"\nsleep 0.2\n'
        job = JobSpec(job_id=wf, tenant="tenant1", provider="provider1", offering_id="offer-1", script=body,
                      environment={"RUNS": runs})
        await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body=body))
        print(wf, flush=True)
    if crash == "after_return":  # submit returned, the activity never reported it
        die()

asyncio.run(main())
"""


def start_submitter(
    state_dir: Path, runs: Path, crash: str, workflow_ids: list[str]
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SUBMITTER, str(state_dir), str(runs), crash, *workflow_ids],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )


RUNS_BODY = 'echo "$VIRTENGINE_WORKFLOW_ID" >> "$RUNS"\nsleep 0.2\n'


def runs_request(workflow_id: str, runs: Path) -> SubmitRequest:
    """The request the submitter child sends: a retried activity sends the very same input."""
    return request(workflow_id, RUNS_BODY, environment={"RUNS": str(runs)})


def runs_of(runs: Path) -> list[str]:
    return runs.read_text().split() if runs.exists() else []


@pytest.mark.parametrize("crash", ["before_spawn", "after_spawn", "after_return"])
async def test_exactly_once_when_the_submitter_is_killed(
    make_adapter: Callable[..., LocalAdapter], shared: Path, crash: str
) -> None:
    adapter = make_adapter()
    runs = shared / "runs"
    wf = f"wf-crash-{crash.replace('_', '-')}"
    child = start_submitter(adapter.state_dir, runs, crash, [wf])
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL

    # The retried submit (the next activity attempt) adopts what the dead one started, or starts it if nothing
    # ran.
    retry = await adapter.submit(runs_request(wf, runs))
    assert retry.adopted == (crash != "before_spawn")
    assert (await wait_final(adapter, retry.scheduler_job_id)).state == JobState.COMPLETED
    assert (await adapter.submit(runs_request(wf, runs))).adopted
    assert runs_of(runs) == [wf]


async def test_exactly_once_when_the_submitter_dies_at_random_moments(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter()
    rng = random.Random(20261130)
    runs = shared / "runs"
    all_ids: list[str] = []
    for round_ in range(3):
        ids = [f"wf-random-{round_}-{n}" for n in range(6)]
        all_ids += ids
        child = start_submitter(adapter.state_dir, runs, "none", ids)
        assert child.stdout is not None
        child.stdout.readline()  # one submit done: the next ones are in flight
        time.sleep(rng.uniform(0, 0.08))
        child.kill()
        child.communicate(timeout=30)
        for wf in ids:  # every workflow retries its submit
            await adapter.submit(runs_request(wf, runs))
    statuses = [await wait_final(adapter, scheduler_job_id(wf)) for wf in all_ids]
    assert all(s.state == JobState.COMPLETED for s in statuses)
    assert sorted(runs_of(runs)) == sorted(all_ids)


async def test_a_second_supervisor_for_a_taken_job_refuses_to_run(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    """The last line of defence: even if a supervisor were spawned twice, the marker stops the second."""
    adapter = make_adapter()
    runs = shared / "runs"
    job_id = (await adapter.submit(runs_request("wf-twice", runs))).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    jobdir = adapter.job_dir(job_id)
    fd = os.open(jobdir / "lock", os.O_RDWR)
    try:
        second = subprocess.run(
            [sys.executable, "-I", "-S", sup.__file__, "--lock-fd", str(fd), str(jobdir)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(fd)
    assert second.returncode == 3
    assert "not running it twice" in second.stderr
    time.sleep(0.5)
    assert runs_of(runs) == ["wf-twice"]
    assert (await adapter.status_batch([job_id]))[job_id].state == JobState.COMPLETED


async def test_concurrent_submits_of_one_workflow_start_one_job(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter, other = make_adapter(), make_adapter()
    runs = shared / "runs"
    body = 'echo run >> "$RUNS"\n'
    req = SubmitRequest(
        workflow_id="wf-race", job=spec("wf-race", body, environment={"RUNS": str(runs)}), body=body
    )
    results = await asyncio.gather(*(a.submit(req) for a in [adapter, other] * 4))
    assert sorted(r.adopted for r in results) == [False] + [True] * 7
    assert len({r.scheduler_job_id for r in results}) == 1
    await wait_final(adapter, results[0].scheduler_job_id)
    assert runs_of(runs) == ["run"]


async def test_a_killed_supervisor_is_reported_failed_not_completed(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    adapter = make_adapter()
    job_id = (await adapter.submit(request("wf-lost", "echo $$ > leader.pid\nsleep 300\n"))).scheduler_job_id
    await wait_for(adapter, job_id, {JobState.RUNNING})
    leader = int(wait_file(adapter.work_dir(job_id) / "leader.pid"))
    os.kill(supervisor_pid(adapter, job_id), signal.SIGKILL)

    status = await wait_final(adapter, job_id, timeout=10)
    assert status.state == JobState.FAILED
    assert status.native_state == "SUPERVISOR_LOST"
    assert "supervisor died" in status.reason
    assert wait_gone(leader), "the orphaned job kept running"
    # The verdict is recorded: a fresh adapter (a restarted worker) sees the same, and never "completed".
    fresh = make_adapter()
    assert (await fresh.status_batch([job_id]))[job_id].state == JobState.FAILED
    assert (await fresh.usage(job_id)).final
    await fresh.cancel(job_id)  # ended: a no-op


async def test_a_killed_queued_supervisor_is_reported_failed_and_never_runs(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter(max_parallel_jobs=1)
    holder = (await adapter.submit(request("wf-holder", "sleep 300\n"))).scheduler_job_id
    await wait_for(adapter, holder, {JobState.RUNNING})
    ran = shared / "ran"
    queued = (await adapter.submit(request("wf-lost-queued", f"touch {ran}\n"))).scheduler_job_id
    await wait_for(adapter, queued, {JobState.QUEUED})
    os.kill(supervisor_pid(adapter, queued), signal.SIGKILL)
    status = await wait_final(adapter, queued, timeout=10)
    assert (status.state, status.native_state) == (JobState.FAILED, "SUPERVISOR_LOST")
    await adapter.cancel(holder)
    await wait_final(adapter, holder, timeout=10)
    assert not ran.exists()


# ---- usage -------------------------------------------------------------------------------------------------
BURNER = """
import sys, time
memory = bytearray(int(sys.argv[1]) * 1024 * 1024)
for i in range(0, len(memory), 4096):
    memory[i] = 1
while time.process_time() < float(sys.argv[2]):
    pass
print(time.process_time())
"""


async def test_usage_follows_real_cpu_and_memory_and_never_goes_back(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter()
    burner = shared / "burn.py"
    burner.write_text(BURNER)
    body = '"$PY" "$BURN" 96 1.5 > cpu1 &\n"$PY" "$BURN" 16 1.0 > cpu2\nwait\n'
    env = {"PY": JOB_PYTHON, "BURN": str(burner)}
    resources = Resources(tasks_per_node=2, storage_gb=10)
    job_id = (
        await adapter.submit(request("wf-burn", body, environment=env, resources=resources))
    ).scheduler_job_id

    readings = []
    while True:
        usage = await adapter.usage(job_id)
        readings.append(usage)
        if usage.final:
            break
        await asyncio.sleep(0.2)
    final = readings[-1].reading
    running = [r.reading for r in readings[:-1] if (r.reading.cpu_time_seconds or 0) > 0]
    assert len(running) >= 2, "usage must be measured while the job runs, not only at the end"
    for name in ("wall_clock_seconds", "cpu_time_seconds", "memory_byte_seconds", "taken_at"):
        values = [getattr(r.reading, name) for r in readings if getattr(r.reading, name) is not None]
        assert values == sorted(values), f"{name} went backwards: {values}"
    peaks = [r.reading.memory_bytes_max or 0 for r in readings]
    assert peaks == sorted(peaks)

    workdir = adapter.work_dir(job_id)
    real_cpu = float((workdir / "cpu1").read_text()) + float((workdir / "cpu2").read_text())
    measured = float(final.cpu_time_seconds or 0)
    print(f"measured {measured:.3f} s of CPU, the burners report {real_cpu:.3f} s")
    assert abs(measured - real_cpu) / real_cpu < 0.15, (measured, real_cpu)
    assert final.memory_bytes_max is not None and final.memory_bytes_max >= 96 * 2**20
    assert final.memory_byte_seconds is not None and final.memory_byte_seconds > 0
    # The reading describes the moment the supervisor clocked: the job's start plus its run time.
    status = await wait_final(adapter, job_id)
    assert status.start_time is not None and status.end_time is not None
    assert final.taken_at is not None and abs((final.taken_at - status.end_time).total_seconds()) < 0.001

    # Billed: the allocation held for the run time; shown: what was used.
    metered = meter(final, resources)
    wall = metered.metrics.wall_clock_seconds
    assert metered.metrics.cpu_core_seconds == 2 * wall
    assert metered.metrics.node_hours == (wall / 3600).quantize(Decimal("0.000001"))
    assert metered.metrics.gpu_seconds == 0
    assert metered.metrics.storage_gb_hours == (10 * wall / 3600).quantize(Decimal("0.000001"))
    assert metered.metrics.cpu_time_seconds == (final.cpu_time_seconds or 0).quantize(Decimal("0.000001"))
    assert (
        metered.basis["cpu_core_seconds"] == "allocated" and metered.basis["cpu_time_seconds"] == "measured"
    )


HOLDER = """
import sys, time
memory = bytearray(int(sys.argv[1]))
for i in range(0, len(memory), 4096):
    memory[i] = 1
time.sleep(float(sys.argv[2]))
"""


async def test_memory_is_measured_in_gb_of_ten_to_the_nine_bytes(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    """A job holding ~400 MB for a few seconds used ~0.4 GB x seconds: GB, not GiB (which read 7 % low)."""
    adapter = make_adapter()
    holder = shared / "hold.py"
    holder.write_text(HOLDER)
    held, seconds = 400_000_000, 4.0
    env = {"PY": JOB_PYTHON, "HOLD": str(holder)}
    resources = Resources(memory_mb_per_node=382)  # 382 MiB = 400.56 MB asked for, and priced
    req = request("wf-hold", f'"$PY" "$HOLD" {held} {seconds}\n', environment=env, resources=resources)
    job_id = (await adapter.submit(req)).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    reading = (await adapter.usage(job_id)).reading
    metered = meter(reading, resources)

    peak = reading.memory_bytes_max or 0
    assert held <= peak < held + 40_000_000, peak  # the array plus the interpreter
    used = metered.metrics.memory_used_gb_seconds
    assert used is not None
    # At most the peak held for the whole run; at least the array held for the time it slept.
    assert Decimal(held) / GB * Decimal(seconds) * Decimal("0.95") <= used
    assert used <= Decimal(peak) / GB * reading.wall_clock_seconds
    # Billed: the 400.56 MB asked for, in GB of 10^9 bytes, for the run time.
    wall = reading.wall_clock_seconds
    assert metered.metrics.memory_gb_seconds == (Decimal(382 * 2**20) / GB * wall).quantize(
        Decimal("0.000001")
    )
    print(
        f"held {held / 1e9:.3f} GB for {seconds:g} s: measured {used} GB-s, billed {metered.metrics.memory_gb_seconds}"
    )


@pytest.mark.parametrize(
    ("resources", "why"),
    [
        (Resources(nodes=2), "2 nodes (it runs every job on this one host)"),
        (Resources(tasks_per_node=2, cpus_per_task=1024), "2048 cores per node (this host has"),
        (Resources(gpus_per_node=1), "1 GPUs per node (this host has 0)"),
        (Resources(memory_mb_per_node=64 * 1024 * 1024), "67108864 MiB of memory per node (this host has"),
    ],
)
async def test_what_this_host_cannot_provide_is_refused_before_anything_runs(
    make_adapter: Callable[..., LocalAdapter], resources: Resources, why: str
) -> None:
    adapter = make_adapter(gpus=0)
    with pytest.raises(SubmissionRejected) as refused:
        await adapter.submit(request("wf-too-big", "touch ran\n", resources=resources))
    assert f"the local executor cannot provide {why}" in str(refused.value)
    assert "refused, not billed" in str(refused.value) and not refused.value.transient
    assert await adapter.find("wf-too-big") is None
    assert not (adapter.state_dir / "jobs" / scheduler_job_id("wf-too-big")).exists()
    # A host with GPUs (hpc.local.gpus) runs a job that asks for them.
    if resources.gpus_per_node:
        with_gpus = make_adapter(gpus=2)
        job_id = (await with_gpus.submit(request("wf-gpu", "true\n", resources=resources))).scheduler_job_id
        assert (await wait_final(with_gpus, job_id)).state == JobState.COMPLETED


# ---- the job's account against the provider and the other tenants -------------------------------------------
HOSTILE = r"""
attempt() { name=$1; shift; if "$@" >/dev/null 2>&1; then echo "$name: done"; else echo "$name: denied"; fi; }
control=$(dirname "$VIRTENGINE_JOB_DIR")
printf '{"state": "completed", "native_state": "COMPLETED", "exit_code": 0, "usage": {}}' > forged.json
attempt read-worker-environ cat "/proc/$WORKER_PID/environ"
attempt read-supervisor-environ cat "/proc/$PPID/environ"
attempt read-provider-key cat "$PROVIDER_KEY"
attempt write-status cp forged.json "$control/status.json"
attempt replace-status mv forged.json "$control/status.json"
attempt write-meta cp /dev/null "$control/meta.json"
attempt read-other-output cat "$OTHER_JOB_DIR/stdout"
attempt read-other-files cat "$OTHER_JOB_DIR/work/secret.txt"
attempt list-jobs ls "$(dirname "$control")"
attempt kill-supervisor kill -KILL "$PPID"
echo done > attempts-done
sleep 1
i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done
times > times.txt
"""
ATTEMPTS = [
    "read-worker-environ",
    "read-supervisor-environ",
    "read-provider-key",
    "write-status",
    "replace-status",
    "write-meta",
    "read-other-output",
    "read-other-files",
    "list-jobs",
    "kill-supervisor",
]


def bash_times(path: Path) -> Decimal:
    """User + system CPU of a shell as its own ``times`` reported it (first line: 0m1.234s 0m0.010s)."""
    total = Decimal(0)
    for part in path.read_text().splitlines()[0].split():
        minutes, seconds = part.rstrip("s").split("m")
        total += Decimal(minutes) * 60 + Decimal(seconds)
    return total


@pytest.mark.skipif(not running_as_root(), reason="jobs run as tenant accounts only under a root worker")
async def test_a_hostile_job_reaches_neither_the_provider_nor_another_tenant_and_pays_what_it_used(
    make_adapter: Callable[..., LocalAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JWT_TOKEN", "worker-secret-token")
    keys = reachable_dir("keys")  # only the key file's own mode and owner protect it
    key = keys / "provider.key"
    write_private_key(key)
    adapter = make_adapter()
    other = (
        await adapter.submit(
            request(
                "wf-victim", "echo secret-of-tenant2\necho secret-of-tenant2 > secret.txt\n", tenant="tenant2"
            )
        )
    ).scheduler_job_id
    assert (await wait_final(adapter, other)).state == JobState.COMPLETED
    env = {
        "WORKER_PID": str(os.getpid()),
        "PROVIDER_KEY": str(key),
        "OTHER_JOB_DIR": str(adapter.job_dir(other)),
    }
    job_id = (await adapter.submit(request("wf-attacker", HOSTILE, environment=env))).scheduler_job_id

    wait_file(adapter.work_dir(job_id) / "attempts-done")
    assert (await adapter.status_batch([job_id]))[job_id].state == JobState.RUNNING, (
        "the forged status counts"
    )
    status = await wait_final(adapter, job_id)
    stdout = (adapter.job_dir(job_id) / "stdout").read_text()
    assert stdout.splitlines() == [f"{name}: denied" for name in ATTEMPTS]
    assert (status.state, status.exit_code) == (JobState.COMPLETED, 0)
    # Billed from the supervisor's own reading: the CPU the job burned after its attempts, as bash counted it.
    usage = await adapter.usage(job_id)
    assert usage.final and usage.reading.cpu_time_seconds is not None and usage.reading.wall_clock_seconds > 1
    own = bash_times(adapter.work_dir(job_id) / "times.txt")
    assert abs(usage.reading.cpu_time_seconds - own) <= max(Decimal("0.1"), own * Decimal("0.15")), own
    assert (adapter.work_dir(other) / "secret.txt").read_text() == "secret-of-tenant2\n"
    owners = {pwd.getpwuid(adapter.work_dir(j).stat().st_uid).pw_name for j in (job_id, other)}
    assert owners == {"vehpc-t1", "vehpc-t2"}, "two tenants, two accounts"


async def test_a_job_runs_under_limits_sized_from_what_it_asked_for(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    adapter = make_adapter()
    resources = Resources(tasks_per_node=2, memory_mb_per_node=64, storage_gb=3)
    body = (
        "ulimit -v; ulimit -t; ulimit -f; ulimit -c; ulimit -u\n"
        f'{JOB_PYTHON} -c "bytearray(256 * 2**20)" 2>/dev/null && echo allocated || echo refused\n'
    )
    req = request("wf-limits", body, resources=resources, walltime_seconds=600)
    job_id = (await adapter.submit(req)).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    lines = (adapter.job_dir(job_id) / "stdout").read_text().splitlines()
    nproc = str(max(4096, 64 * 2)) if running_as_root() else lines[4]  # the worker's own account: not limited
    # 2 x 64 MiB of address space (in KiB), 600 s x 2 cores of CPU, 3 GB per file (in KiB), no core files.
    assert lines == [str(2 * 64 * 1024), "1200", str(3 * 10**9 // 1024), "0", nproc, "refused"]


async def test_the_process_limit_of_an_account_leaves_room_for_a_tenant_s_parallel_jobs(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    """The kernel counts a process limit over every process of the account: all of a tenant's jobs share it."""
    adapter = make_adapter()
    body = (
        "for i in $(seq 150); do sleep 4 & done 2>/dev/null\n"
        'echo "$(jobs -p | wc -l) started"; kill $(jobs -p) 2>/dev/null; wait\n'
    )
    ids = [(await adapter.submit(request(f"wf-many-{n}", body))).scheduler_job_id for n in range(2)]
    for job_id in ids:
        assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
        assert (adapter.job_dir(job_id) / "stdout").read_text() == "150 started\n"


# ---- what a tenant cannot do -------------------------------------------------------------------------------
async def test_hostile_strings_never_reach_a_shell(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    adapter = make_adapter()
    pwned = shared / "pwned"
    pwned.mkdir(mode=0o1777)
    pwned.chmod(0o1777)  # the job could write here: it must not
    hostile = {
        "DOLLAR": f"$(touch {pwned}/dollar)",
        "BACKTICK": f"`touch {pwned}/backtick`",
        "SEMI": f"x; touch {pwned}/semi",
        "AND": f"x && touch {pwned}/and | cat",
        "QUOTES": f"'\"; touch {pwned}/quotes; echo \"'",
    }
    body = "".join(f'printf "%s\\n" "${name}"\n' for name in hostile)
    job_id = (await adapter.submit(request("wf-hostile", body, environment=hostile))).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    assert (adapter.job_dir(job_id) / "stdout").read_text().splitlines() == list(hostile.values())
    assert list(pwned.iterdir()) == []
    # Names and paths a shell could misread never get this far.
    for bad in (
        {"name": "x;touch"},
        {"working_directory": "/tmp/$(touch)"},
        {"environment": {"BASH_ENV": "/tmp/x"}},
        {"environment": {"A;B": "1"}},
    ):
        with pytest.raises(pydantic.ValidationError):
            spec("wf-bad", "true", **bad)
    with pytest.raises(pydantic.ValidationError):
        SubmitRequest(workflow_id="wf;rm -rf", job=spec("wf-bad", "true"), body="true")


async def test_job_environment_is_clean_and_describes_the_allocation(
    make_adapter: Callable[..., LocalAdapter], shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JWT_TOKEN", "worker-secret-token")
    monkeypatch.setattr(local_module, "host_cpus", lambda: 6)  # a 6-core host, whatever this one has
    adapter = make_adapter()
    workdir = shared / "workdir"
    workdir.mkdir()
    # 3 tasks of 2 cores fit 6 cores; on a 4-core host the same job is refused, never run on 4 and billed for 6.
    resources = Resources(tasks_per_node=3, cpus_per_task=2)
    monkeypatch.setattr(local_module, "host_cpus", lambda: 4)
    with pytest.raises(SubmissionRejected, match="cannot provide 6 cores per node \\(this host has 4\\)"):
        await adapter.submit(request("wf-env", "true\n", resources=resources))
    monkeypatch.setattr(local_module, "host_cpus", lambda: 6)
    req = request(
        "wf-env",
        "pwd\nenv\n",
        resources=resources,
        working_directory=str(workdir),
        environment={"MY_SETTING": "on"},
    )
    job_id = (await adapter.submit(req)).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    lines = (adapter.job_dir(job_id) / "stdout").read_text().splitlines()
    assert lines[0] == str(workdir)
    env = dict(line.split("=", 1) for line in lines[1:] if "=" in line)
    assert "worker-secret-token" not in "\n".join(lines)
    assert env["PATH"] == JOB_PATH
    assert env["MY_SETTING"] == "on"
    assert env["VIRTENGINE_JOB_ID"] == "wf-env"
    assert env["VIRTENGINE_SCHEDULER_JOB_ID"] == job_id
    assert env["SLURM_NTASKS"] == env["VIRTENGINE_NTASKS"] == "3"
    assert env["SLURM_NNODES"] == "1" and env["SLURM_CPUS_PER_TASK"] == "2"
    assert env["VIRTENGINE_WALLTIME_SECONDS"] == "3600"
    assert env["HOME"] == str(workdir)
    assert "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env


async def test_a_script_near_the_size_limit_runs_whole(make_adapter: Callable[..., LocalAdapter]) -> None:
    adapter = make_adapter()
    filler = "# " + "x" * 1000 + "\n"
    body = filler * 1000 + "echo end-of-a-long-script\n"  # ~1 MB, just under the model's limit
    job_id = (await adapter.submit(request("wf-big", body))).scheduler_job_id
    assert (await wait_final(adapter, job_id)).state == JobState.COMPLETED
    assert (adapter.job_dir(job_id) / "stdout").read_text() == "end-of-a-long-script\n"


async def test_a_restarted_worker_finds_its_jobs(make_adapter: Callable[..., LocalAdapter]) -> None:
    first = make_adapter()
    job_id = (await first.submit(request("wf-restart", "sleep 0.3\n"))).scheduler_job_id
    await first.close()
    second = make_adapter()
    assert await second.find("wf-restart") == job_id
    assert (await wait_final(second, job_id)).state == JobState.COMPLETED


async def test_a_lookalike_job_directory_is_set_aside_never_adopted(
    make_adapter: Callable[..., LocalAdapter], tmp_path: Path
) -> None:
    """Someone who can write the state directory (a tenant on a host without isolation) plants a launched job
    under the id a future workflow will use (the id is a hash of the workflow id). Made without the provider's marker key, it is never adopted."""
    adapter = make_adapter()
    refused: list[RefusedAdoption] = []
    adapter.on_refused_adoption(refused.append)
    forger = LocalAdapter(
        LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True),
        adapter.state_dir,
        "test-cluster",
        tenant_accounts(),
        markers=MarkerKey(b"f" * 32, source="x"),
    )
    planted = await forger.submit(request("wf-victim", "echo the look-alike ran\nsleep 1\n"))
    assert planted.scheduler_job_id == scheduler_job_id("wf-victim")
    assert await adapter.find("wf-victim") is None
    own = await adapter.submit(request("wf-victim", "echo the victim ran\n"))
    assert own.scheduler_job_id == planted.scheduler_job_id and not own.adopted
    assert (await wait_final(adapter, own.scheduler_job_id)).state == JobState.COMPLETED
    assert (adapter.job_dir(own.scheduler_job_id) / "stdout").read_text() == "the victim ran\n"
    assert await adapter.find("wf-victim") == own.scheduler_job_id
    assert [r.scheduler_job_id for r in refused] == [planted.scheduler_job_id] * 2, "find, then submit"
    assert "no valid marker" in refused[0].reason
    aside = list((adapter.state_dir / "tmp").glob(f"{planted.scheduler_job_id}.lookalike-*"))
    assert len(aside) == 1, "the look-alike is kept aside for the operator"


async def test_a_running_lookalikes_supervisor_keeps_writing_into_the_directory_it_holds(
    make_adapter: Callable[..., LocalAdapter],
) -> None:
    """A look-alike whose supervisor already runs when the adapter sets its directory aside: the supervisor
    goes on sampling and then records its end. Written by path, those statuses landed in the directory the adapter
    had just made for the workflow's own job: the victim's completed job showed the look-alike's failure and its
    usage. Every write goes through the directory the supervisor holds, so they stay with the look-alike."""
    adapter = make_adapter()
    forger = LocalAdapter(
        LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True),
        adapter.state_dir,
        "test-cluster",
        tenant_accounts(),
        markers=MarkerKey(b"f" * 32, source="x"),
    )
    planted = await forger.submit(request("wf-victim", "sleep 2\nexit 3\n"))
    await wait_for(forger, planted.scheduler_job_id, {JobState.RUNNING})
    lookalike_supervisor = supervisor_pid(forger, planted.scheduler_job_id)
    own = await adapter.submit(request("wf-victim", "echo the victim ran\n"))
    assert not own.adopted
    assert (await wait_final(adapter, own.scheduler_job_id)).state == JobState.COMPLETED
    victim_supervisor = supervisor_pid(adapter, own.scheduler_job_id)
    assert wait_gone(lookalike_supervisor), "the look-alike ends (exit 3) after 2 s"
    status = sup.read_json(adapter.job_dir(own.scheduler_job_id) / sup.STATUS) or {}
    assert (status["supervisor_pid"], status["state"], status["exit_code"]) == (
        victim_supervisor,
        "completed",
        0,
    )
    assert (await adapter.status_batch([own.scheduler_job_id]))[
        own.scheduler_job_id
    ].state == JobState.COMPLETED
    (aside,) = (adapter.state_dir / "tmp").glob(f"{planted.scheduler_job_id}.lookalike-*")
    lookalike = sup.read_json(aside / sup.STATUS) or {}
    assert (lookalike["supervisor_pid"], lookalike["state"], lookalike["exit_code"]) == (
        lookalike_supervisor,
        "failed",
        3,
    ), "the look-alike's end is recorded where it was set aside"


async def test_a_queued_lookalike_set_aside_never_runs_the_new_jobs_script(
    make_adapter: Callable[..., LocalAdapter], shared: Path
) -> None:
    """A look-alike waiting for a slot when it is set aside: bash opens the script by path, so once it got its
    slot it ran the script the adapter had just written under that path, the victim's, a second time. It now
    sees its directory is no longer under the path and records its job failed, in its own directory."""
    adapter = make_adapter(max_parallel_jobs=1)
    forger = LocalAdapter(
        LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True, max_parallel_jobs=1),
        adapter.state_dir,
        "test-cluster",
        tenant_accounts(),
        markers=MarkerKey(b"f" * 32, source="x"),
    )
    gate = shared / "gate"
    blocker = await adapter.submit(request("wf-blocker", f"while [ ! -e {gate} ]; do sleep 0.05; done\n"))
    await wait_for(adapter, blocker.scheduler_job_id, {JobState.RUNNING})
    planted = await forger.submit(request("wf-victim", "echo the look-alike ran\n"))
    supervisor_pid(forger, planted.scheduler_job_id)  # queued behind the blocker
    own = await adapter.submit(request("wf-victim", f"echo the victim ran >> {shared}/ran\n"))
    assert not own.adopted
    gate.touch()
    assert (await wait_final(adapter, own.scheduler_job_id)).state == JobState.COMPLETED
    (aside,) = (adapter.state_dir / "tmp").glob(f"{planted.scheduler_job_id}.lookalike-*")
    deadline = time.monotonic() + 30
    while ((lookalike := sup.read_json(aside / sup.STATUS) or {}).get("state")) not in sup.FINAL_STATES:
        assert time.monotonic() < deadline, lookalike
        await asyncio.sleep(0.05)
    assert (
        lookalike["state"] == "failed"
        and "moved or replaced before the script started" in lookalike["reason"]
    )
    assert (shared / "ran").read_text() == "the victim ran\n", "the victim's script ran once"
    assert not (aside / sup.STDOUT).exists(), "the look-alike's own script never ran either"


def test_a_lookalikes_supervisor_that_starts_after_it_was_set_aside_leaves_the_new_job_alone(
    tmp_path: Path,
) -> None:
    """The look-alike's supervisor can start late (a loaded host): by then the adapter has moved its directory
    aside and made the workflow's own job under the same path. Claiming that path would mark the victim's job as
    taken (its submit adopted a job that never ran: seen in CI); the late supervisor checks that the directory is
    still the one whose lock it was handed, and leaves."""
    jobdir = tmp_path / "local-0123456789abcdef0123"
    jobdir.mkdir()
    (jobdir / sup.META).write_text('{"workflow_id": "wf-forged"}')
    lock_fd = os.open(jobdir / sup.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.rename(jobdir, tmp_path / "set-aside")
        jobdir.mkdir()
        (jobdir / sup.META).write_text('{"workflow_id": "wf-victim"}')
        (jobdir / sup.LOCK).touch()
        late = subprocess.run(
            [sys.executable, "-I", "-S", sup.__file__, "--lock-fd", str(lock_fd), str(jobdir)],
            pass_fds=(lock_fd,),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(lock_fd)
    assert late.returncode == 2, late
    assert "moved or replaced" in late.stderr + late.stdout
    assert not (jobdir / sup.STARTED).exists(), "the victim's job is not marked as taken"
    assert sorted(p.name for p in jobdir.iterdir()) == [sup.LOCK, sup.META]


@pytest.mark.skipif(not running_as_root(), reason="pool accounts need a root worker")
async def test_a_pool_account_with_job_directories_here_is_never_handed_to_a_new_tenant(
    make_adapter: Callable[..., LocalAdapter], tmp_path: Path
) -> None:
    """Worker A's assignments file gave tenant X the pool's account, and X's job ran as it: its directory, with
    X's outputs in its work/, is kept. Worker B keeps a file of its own (lost and recreated, or another host's):
    its pool shows the account free. Before handing it out, B asks its job registry, as the SLURM and MOAB
    adapters ask the cluster, and refuses the new tenant Z rather than give it X's uid and X's files."""
    account = TENANT_POOL[-1]
    state_dir = make_adapter().state_dir

    def worker(db: str) -> LocalAdapter:
        tenants = TenantAccounts(TenantRules(pool=(account,)), AssignmentStore(tmp_path / db))
        config = LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True)
        return LocalAdapter(config, state_dir, "test-cluster", tenants)

    worker_a, worker_b = worker("a.db"), worker("b.db")
    x = await worker_a.submit(request("wf-pool-x", "id -un > out\n", tenant="tenantx"))
    assert (await wait_final(worker_a, x.scheduler_job_id)).state == JobState.COMPLETED
    assert (worker_a.work_dir(x.scheduler_job_id) / "out").read_text() == f"{account}\n"
    with pytest.raises(TenantAccountError, match=r"accounts of hpc\.tenants\.pool are taken") as refused:
        await worker_b.submit(request("wf-pool-z", "id -un\n", tenant="tenantz"))
    assert f"held back, not handed to a new tenant: {account}: 1 local job directories" in str(refused.value)
    assert await worker_b.find("wf-pool-z") is None
    assert AssignmentStore(tmp_path / "b.db").all() == {}, "nothing recorded for the new tenant"
    assert await worker_b.accounts_in_use([account, TENANT_POOL[0]]) == {
        account: f"1 local job directories in {state_dir / 'jobs'} (0 not ended), which hold its files"
    }


@pytest.mark.skipif(not running_as_root(), reason="pool accounts need a root worker")
async def test_an_accounts_job_directories_are_removed_as_the_account_once_its_jobs_ended(
    make_adapter: Callable[..., LocalAdapter], tmp_path: Path, shared: Path
) -> None:
    """``tenants release --clean`` on the local executor: the account's job directories go (what its jobs wrote
    removed as the account, read-only directories too), refused while one of its jobs runs; then the pool hands
    the account to a new tenant."""
    account = TENANT_POOL[-1]
    state_dir = make_adapter().state_dir
    tenants = TenantAccounts(TenantRules(pool=(account,)), AssignmentStore(tmp_path / "a.db"))
    adapter = LocalAdapter(
        LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True), state_dir, "c", tenants
    )
    gate = shared / "gate"
    body = f"mkdir -p keep/deep && echo x > keep/deep/f && chmod 500 keep/deep keep\nwhile [ ! -e {gate} ]; do sleep 0.05; done\n"
    x = await adapter.submit(request("wf-clean-x", body, tenant="tenantx"))
    await wait_for(adapter, x.scheduler_job_id, {JobState.RUNNING})
    assert await adapter.account_files(account) == [x.scheduler_job_id]
    with pytest.raises(SchedulerError, match="local jobs that have not ended"):
        await adapter.remove_account_files(account)
    gate.touch()
    assert (await wait_final(adapter, x.scheduler_job_id)).state == JobState.COMPLETED
    await adapter.remove_account_files(account)
    assert not adapter.job_dir(x.scheduler_job_id).exists()
    assert await adapter.account_files(account) == [] and await adapter.accounts_in_use([account]) == {}
    tenants.store.release("tenantx")  # type: ignore[union-attr]
    z = await adapter.submit(request("wf-clean-z", "id -un\n", tenant="tenantz"))
    assert (await wait_final(adapter, z.scheduler_job_id)).state == JobState.COMPLETED
    assert (adapter.job_dir(z.scheduler_job_id) / "stdout").read_text() == f"{account}\n"


@pytest.mark.skipif(not running_as_root(), reason="pool accounts need a root worker")
async def test_clean_empties_a_work_directory_its_tenant_made_unreadable_as_the_account(
    make_adapter: Callable[..., LocalAdapter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's last job can chmod 0 its own ``work/`` on its way out. ``--clean`` gives it its owner's bits back
    before ``find`` reads it, so the account empties it, as it does any other: the worker's own removal (the
    rest of the job directory) finds nothing of the tenant's left in it. It skipped ``work/`` itself, and the
    tenant's files were left to a worker that can remove them only as root."""
    account = TENANT_POOL[-1]
    state_dir = make_adapter().state_dir
    tenants = TenantAccounts(TenantRules(pool=(account,)), AssignmentStore(tmp_path / "a.db"))
    adapter = LocalAdapter(
        LocalSchedulerConfig(kill_wait="1s", allow_unisolated=True), state_dir, "c", tenants
    )
    x = await adapter.submit(
        request("wf-clean-chmod0", "mkdir keep && echo x > keep/f && chmod 0 .\n", tenant="tx")
    )
    assert (await wait_final(adapter, x.scheduler_job_id)).state == JobState.COMPLETED
    work = adapter.work_dir(x.scheduler_job_id)
    assert work.stat().st_mode & 0o777 == 0, "the job left its work directory mode 0"
    left_to_the_worker: list[list[str]] = []
    rmtree = local_module.shutil.rmtree

    def worker_removal(path: Path) -> None:
        left_to_the_worker.append(sorted(p.name for p in (Path(path) / sup.WORK).iterdir()))
        rmtree(path)

    monkeypatch.setattr(local_module.shutil, "rmtree", worker_removal)
    await adapter.remove_account_files(account)
    assert left_to_the_worker == [[]], "work/ emptied as the account before the worker removes the rest"
    assert not adapter.job_dir(x.scheduler_job_id).exists()
    assert await adapter.account_files(account) == [] and await adapter.accounts_in_use([account]) == {}


def test_supervisors_of_old_jobs_sample_less_often() -> None:
    """At 1,000 running jobs, a /proc scan and a status write per job per second took both cores of the
    benchmark machine (benchmarks/load.py); young jobs keep one sample a second, old ones one per 10 s."""
    from activities.schedulers.local_supervisor import MAX_SAMPLE_INTERVAL, sample_interval

    assert sample_interval(0) == sample_interval(30) == 1.0
    assert sample_interval(60) == 2.0
    assert sample_interval(3600) == MAX_SAMPLE_INTERVAL == 10.0
    intervals = [sample_interval(t) for t in range(0, 1000, 7)]
    assert intervals == sorted(intervals), "never denser as the job ages"
