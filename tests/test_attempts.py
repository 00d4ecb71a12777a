"""Activity attempts never overlap in effect: a cancelled or timed-out attempt stops its call, and what an attempt
did reaches its retry through heartbeat details (``activities/attempts.py``).

Scheduler commands are real: a cancelled attempt's ``sbatch`` (hanging on a controller that never answers) and
its command over SSH (the cluster's sshd) must be gone once the cancellation is through.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.attempts import LOST_ATTEMPTS, Attempt, AttemptProgress, heartbeating
from activities.audit import read_events
from activities.chain.client import UsageSubmitResult
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import Accounting, SubmitRequest
from activities.schedulers.slurm.transports import LocalRunner, SSHRunner
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import TENANT, running_pipeline, setup_ledger
from virtengine_hpc.config import Secrets
from virtengine_hpc.errors import ChainError, ChainUnavailable
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.messages import (
    JobStatusView,
    SubmitInput,
    SubmitOutput,
    UsageInput,
    WatchInput,
    monitor_workflow_id,
)
from virtengine_hpc.metering import meter
from virtengine_hpc.models import JobSpec, Resources, UsageMetrics, UsageRecord
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sign_record, sum_metrics
from workers.wiring import build_worker_deps


def metered(final: Accounting, resources: Resources) -> UsageMetrics:
    """The scheduler's final reading as the records meter it (the one metering path)."""
    return meter(final.reading, resources).metrics


def asked(pipe: Any, job_id: str) -> Resources:
    """What the job asked for, as the tenant submitted it on the ledger."""
    return Resources.model_validate(pipe.ledger.job(job_id).raw_spec.get("resources") or {})


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line or environment mentions ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(proc.info["cmdline"] or [])
            if marker in line or any(marker in v for v in proc.environ().values()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


async def gone_when(condition: Any, within: float = 10.0) -> bool:
    """Whether ``condition()`` becomes true soon (a killed process disappears once its parent has reaped it)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def gone(marker: str) -> bool:
    """Whether every process mentioning ``marker`` has exited."""
    return await gone_when(lambda: not processes_with(marker))


async def started(marker: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not processes_with(marker):
        assert time.monotonic() < deadline, f"no process with {marker!r} started"
        await asyncio.sleep(0.1)


async def run_and_cancel(env: ActivityEnvironment, fn: Any, marker: str, *args: Any) -> None:
    """Run an activity, cancel it once the process ``marker`` runs, and expect the cancellation back."""
    task = asyncio.create_task(env.run(fn, *args))
    await started(marker)
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancelled_attempt_cancels_the_call_it_waits_for() -> None:
    """The wrapped call (here a stand-in for a chain write) sees the cancellation and the attempt waits until it
    has wound down; before, it went on running beside the attempt's retry."""
    events: list[str] = []

    async def call() -> None:
        try:
            events.append("started")
            await asyncio.sleep(300)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # cleanup that the attempt must wait for
            events.append("cleaned up")
            raise

    @activity.defn(name="waits")
    async def waits() -> None:
        await heartbeating(call())

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, activity_type="waits")
    before = LOST_ATTEMPTS[("waits", "cancelled")]
    task = asyncio.create_task(env.run(waits))
    while not events:
        await asyncio.sleep(0.01)
    env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["started", "cleaned up"]
    assert LOST_ATTEMPTS[("waits", "cancelled")] == before + 1


@pytest.fixture
def silent_controller(tmp_path: Path) -> Iterator[Path]:
    """A copy of the cluster's slurm.conf whose controller port accepts connections and never answers: Slurm
    commands hang there as they do on an overloaded controller (``MessageTimeout`` raised so they hang long)."""
    env = sc.cluster()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    conf_dir = tmp_path / f"silent-{port}"
    conf_dir.mkdir()
    source = Path(env["slurm_conf"])
    for extra in source.parent.glob("*.conf"):
        if extra.name != "slurm.conf":
            shutil.copy(extra, conf_dir / extra.name)
    lines = [
        f"SlurmctldPort={port}" if line.startswith("SlurmctldPort=") else line
        for line in source.read_text().splitlines()
        if not line.startswith("MessageTimeout=")
    ]
    (conf_dir / "slurm.conf").write_text("\n".join([*lines, "MessageTimeout=120", ""]))
    try:
        yield conf_dir / "slurm.conf"
    finally:
        listener.close()


@pytest.mark.slurm
async def test_a_cancelled_submit_attempt_kills_its_sbatch(
    silent_controller: Path, tmp_path: Path, key_path: Path
) -> None:
    """The submit activity's ``sbatch`` hangs on a controller that does not answer; Temporal cancels the attempt
    (a heartbeat timeout the worker hears of): the ``sbatch`` process is killed, not left to submit the job
    behind the retry's back."""
    env = sc.cluster()
    adapter = sc.adapter(env, "cli", slurm_conf=str(silent_controller))
    adapter._verify_cluster = False  # straight to sbatch: the cluster check would hang the same way
    config = make_config(tmp_path)
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={config.hpc.cluster_id: adapter}
    )
    wf = sc.workflow_id("attempts-silent")
    marker = str(silent_controller)

    def sbatches() -> list[psutil.Process]:
        return [p for p in processes_with(marker) if p.info["cmdline"][:1] == ["sbatch"]]

    activity_env = ActivityEnvironment()
    request = SubmitInput(
        workflow_id=wf, job=sc.on_chain(config, sc.spec(wf, "true\n")), cluster_id=config.hpc.cluster_id
    )
    try:
        task = asyncio.create_task(activity_env.run(deps.activities.submit_job, request))
        deadline = time.monotonic() + 20
        while not sbatches():  # a first attempt submits without looking the job up first
            assert time.monotonic() < deadline and not task.done(), "sbatch never started"
            await asyncio.sleep(0.1)
        activity_env.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await gone_when(lambda: not sbatches()), "the cancelled attempt's sbatch is still running"
    finally:
        await (
            deps.close()
        )  # also stops the lookup the cancelled submit left running (the controller is silent)
        for proc in processes_with(marker):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert not processes_with(marker), "closing the adapter stopped its background lookup"


@pytest.mark.slurm
async def test_a_cancelled_attempt_kills_its_command_over_ssh() -> None:
    """Over SSH the command runs on the login node: cancelling the attempt kills it there too."""
    env = sc.cluster()
    runner = SSHRunner(
        host=env["ssh_host"],
        port=env["ssh_port"],
        user=env["ssh_user"],
        key_path=Path(env["ssh_key_file"]),
        known_hosts=Path(env["ssh_known_hosts"]),
        timeout=300,
    )
    seconds = str(2000 + int(time.time() * 1000) % 7000)  # a sleep no one else runs
    marker = f"sleep {seconds}"

    @activity.defn(name="remote")
    async def remote() -> None:
        await heartbeating(runner.run(["sleep", seconds], timeout=300))

    try:
        await run_and_cancel(ActivityEnvironment(), remote, marker)
        assert await gone(marker), "the remote command outlived its attempt"
    finally:
        await runner.close()


async def test_a_cancelled_attempt_kills_its_local_command(tmp_path: Path) -> None:
    """The same for any command of the local runner: the process and what it started are gone."""
    runner = LocalRunner()
    marker = str(tmp_path / "child-marker")

    @activity.defn(name="local")
    async def local() -> None:
        # A command that started a child of its own: both must go.
        await heartbeating(
            runner.run(["bash", "-c", f"(exec -a {marker}-child sleep 300) & wait"], timeout=600)
        )

    try:
        await run_and_cancel(ActivityEnvironment(), local, f"{marker}-child")
        assert await gone(marker)
    finally:
        await runner.close()


# ---- submission: heartbeated job ids, first attempts, duplicates of racing attempts -----------------------------


def controller_states(env: dict[str, Any], workflow: str) -> dict[str, str]:
    """Every job the controller holds under a name claiming the workflow, with its state (any user)."""
    out = sc.slurm_command(env, ["squeue", "-h", "-t", "all", "-o", "%A|%T|%j"])
    rows = [line.split("|", 2) for line in out.splitlines() if line.count("|") >= 2]
    return {job_id: state for job_id, state, name in rows if claimed_workflow(name) == workflow}


@pytest.mark.slurm
@pytest.mark.parametrize("transport", sc.TRANSPORTS)
async def test_two_attempts_racing_on_two_processes_leave_one_slurm_job(
    tmp_path: Path, key_path: Path, transport: str
) -> None:
    """A timed-out attempt still submitting while its retry runs on another worker: both pass their lookups
    before either job exists and both run ``sbatch``. Each checks after its own submission; the oldest job is
    kept by both, the other is cancelled and audited, and both attempts answer with the kept job, so whichever
    answer Temporal takes, the workflow names the one live job."""
    env = sc.cluster()
    wf = sc.workflow_id("attempts-race")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = {}
    for attempt in (1, 2):
        home = tmp_path / f"worker-{attempt}"
        home.mkdir()
        procs[attempt] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.racing_submit",
                wf,
                str(attempt),
                str(barrier),
                str(home / "audit.log"),
                str(key_path),
                transport,
            ],
            cwd=sc.REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        answers = {}
        for attempt, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            answers[attempt] = SubmitOutput.model_validate_json(out.strip().splitlines()[-1])
        states = controller_states(env, wf)
        assert len(states) == 2, f"both attempts submitted: {states}"
        kept, duplicate = sorted(states, key=int)
        assert {a.scheduler_job_id for a in answers.values()} == {kept}, answers
        assert states == {kept: "PENDING", duplicate: "CANCELLED"}
        live = [job for job, state in states.items() if state != "CANCELLED"]
        assert live == [kept], "exactly one live Slurm job, the one both answers name"
        events = [
            e
            for attempt in procs
            for e in read_events(tmp_path / f"worker-{attempt}" / "audit.log")
            if e["event_type"] == "duplicate_job_cancelled"
        ]
        assert events, "the cancelled duplicate is audited"
        assert {(e["details"]["scheduler_job_id"], e["details"]["kept"]) for e in events} == {
            (duplicate, kept)
        }
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        sc.cancel_test_jobs(env, "attempts-race")


@pytest.mark.slurm
async def test_a_first_attempt_submits_at_once_and_a_retry_adopts_its_heartbeated_job(
    tmp_path: Path, key_path: Path
) -> None:
    """Attempt 1 cannot find a job nobody made: it runs ``sbatch`` without the ~90 ms accounting lookup and
    heartbeats the job id at once. No retry can have started while it ran alone (within half its heartbeat
    timeout), so it asks nothing else either: one ``sbatch``, nothing more. Its retry (the answer lost) reads the
    id from the heartbeat details and adopts it: no lookup, no second ``sbatch``."""
    env = sc.cluster()
    adapter = sc.adapter(env, "cli", hold=True)
    config = make_config(tmp_path)
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={config.hpc.cluster_id: adapter}
    )
    wf = sc.workflow_id("attempts-heartbeat")
    request = SubmitInput(
        workflow_id=wf, job=sc.on_chain(config, sc.spec(wf, "echo never\n")), cluster_id=config.hpc.cluster_id
    )
    beats: list[Any] = []
    try:
        await adapter._ready()  # the one-time cluster check is not part of a submission
        before = adapter.calls
        first = ActivityEnvironment()
        first.info = dataclasses.replace(
            first.info,
            started_time=datetime.now(UTC),
            heartbeat_timeout=timedelta(seconds=10),
            start_to_close_timeout=timedelta(seconds=300),
        )
        first.on_heartbeat = lambda *details: beats.append(details)
        submitted = await first.run(deps.activities.submit_job, request)
        used = Counter(adapter.calls) - Counter(before)
        assert used == {"sbatch": 1}, "no lookup before the submit and no check after it"
        progress = [d[0] for d in beats if d]
        assert progress and progress[0].scheduler_job_id == submitted.scheduler_job_id, "heartbeated at once"

        before = adapter.calls
        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(
            retry.info, attempt=2, heartbeat_details=[progress[-1].model_dump(mode="json")]
        )
        adopted = await retry.run(deps.activities.submit_job, request)
        used = Counter(adapter.calls) - Counter(before)
        assert adopted == SubmitOutput(scheduler_job_id=submitted.scheduler_job_id, adopted=True)
        assert used == {"squeue": 1}, "adopted without a lookup or a second sbatch"
        assert list(controller_states(env, wf)) == [submitted.scheduler_job_id]
        recovered = [
            e for e in read_events(config.hpc.audit.log_path) if e["event_type"] == "state_recovered"
        ]
        assert "heartbeated" in recovered[-1]["details"]["why"]
    finally:
        await deps.close()
        sc.cancel_test_jobs(env, "attempts-heartbeat")


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("started_ago", "worker_lag"), [(60, 0), (12, 20)], ids=["on-time-clock", "lagging-clock"]
)
async def test_a_first_attempt_past_its_window_checks_and_yields_to_its_retrys_job(
    tmp_path: Path, key_path: Path, started_ago: int, worker_lag: int
) -> None:
    """A zombie attempt 1 (it started ``started_ago`` seconds ago on the server's clock and Temporal gave it up after
    its 10 s heartbeat timeout) submits after its retry already did: its job is the newer one, so its check cancels
    it and it answers with the retry's job. Skipping the check is only for an attempt that still runs alone. With
    ``worker_lag`` the worker's clock is that far behind the server's (a VM resumed before its clock was stepped):
    the attempt's start lies in the worker's future, which only a lagging clock shows, so it checks as well."""
    env = sc.cluster()
    adapter = sc.adapter(env, "cli", hold=True)
    config = make_config(tmp_path)
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={config.hpc.cluster_id: adapter}
    )
    wf = sc.workflow_id("attempts-zombie")
    job = sc.on_chain(config, sc.spec(wf, "echo never\n"))
    request = SubmitInput(workflow_id=wf, job=job, cluster_id=config.hpc.cluster_id)
    try:
        retrys = await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body="echo never\n"))
        zombie = ActivityEnvironment()
        zombie.info = dataclasses.replace(
            zombie.info,
            started_time=datetime.now(UTC) + timedelta(seconds=worker_lag - started_ago),
            heartbeat_timeout=timedelta(seconds=10),
            start_to_close_timeout=timedelta(seconds=300),
        )
        answer = await zombie.run(deps.activities.submit_job, request)
        assert answer == SubmitOutput(scheduler_job_id=retrys.scheduler_job_id, adopted=True)
        states = controller_states(env, wf)
        assert len(states) == 2 and states.pop(retrys.scheduler_job_id) == "PENDING"
        assert list(states.values()) == ["CANCELLED"], "the zombie's own job was cancelled"
    finally:
        await deps.close()
        sc.cancel_test_jobs(env, "attempts-zombie")


@pytest.mark.slurm
async def test_attempt_one_after_an_operators_reset_of_a_paused_submit_looks_first(
    tmp_path: Path, key_path: Path
) -> None:
    """``temporal activity pause`` cancels a running submit attempt (its ``sbatch`` may already have made the job)
    and ``temporal activity reset`` then starts the activity over as attempt 1, without heartbeat details if the
    paused attempt had recorded none (checked on the dev server: attempt 1, empty details, its
    ``current_attempt_scheduled_time`` later than the activity's ``scheduled_time``). That attempt is not the
    first: it looks the job up and adopts it instead of submitting a second one without a lookup or check."""
    env = sc.cluster()
    adapter = sc.adapter(env, "cli", hold=True)
    config = make_config(tmp_path)
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={config.hpc.cluster_id: adapter}
    )
    wf = sc.workflow_id("attempts-reset")
    job = sc.on_chain(config, sc.spec(wf, "echo never\n"))
    request = SubmitInput(workflow_id=wf, job=job, cluster_id=config.hpc.cluster_id)
    try:
        paused = await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body="echo never\n"))
        now = datetime.now(UTC)
        after_reset = ActivityEnvironment()
        after_reset.info = dataclasses.replace(
            after_reset.info,
            attempt=1,
            scheduled_time=now - timedelta(seconds=40),
            current_attempt_scheduled_time=now,
            started_time=now,
            heartbeat_timeout=timedelta(seconds=30),
            start_to_close_timeout=timedelta(seconds=300),
        )
        answer = await after_reset.run(deps.activities.submit_job, request)
        assert answer == SubmitOutput(scheduler_job_id=paused.scheduler_job_id, adopted=True)
        assert list(controller_states(env, wf)) == [paused.scheduler_job_id], "no second Slurm job"
    finally:
        await deps.close()
        sc.cancel_test_jobs(env, "attempts-reset")


def test_only_a_first_attempt_runs_alone_and_only_for_half_its_shortest_timeout() -> None:
    """The window in which no retry can have started: the attempt's start (server clock) plus half of its
    shortest timeout; none for a retry, for a first attempt resumed from details, or without any timeout."""
    start = datetime(2026, 12, 1, 21, 0, tzinfo=UTC)
    timeouts = (timedelta(seconds=10), timedelta(seconds=300))
    first = Attempt(1, "submit_job", AttemptProgress(), started=start, timeouts=timeouts)
    assert first.alone_until == start + timedelta(seconds=5)
    assert Attempt(2, "submit_job", AttemptProgress(), started=start, timeouts=timeouts).alone_until is None
    resumed = AttemptProgress(scheduler_job_id="42")
    assert Attempt(1, "submit_job", resumed, started=start, timeouts=timeouts).alone_until is None
    assert (
        Attempt(1, "submit_job", AttemptProgress(), started=start, timeouts=(None, None)).alone_until is None
    )
    rescheduled = Attempt(
        1, "submit_job", AttemptProgress(), started=start, timeouts=timeouts, rescheduled=True
    )
    assert rescheduled.alone_until is None and not rescheduled.first, (
        "attempt 1 again after an operator's reset"
    )
    ahead = datetime.now(UTC) + timedelta(seconds=8)
    assert (
        Attempt(1, "submit_job", AttemptProgress(), started=ahead, timeouts=timeouts).alone_until is None
    ), "a start in this worker's future: its clock lags the server's, no window"


# ---- usage: the signed record is heartbeated, re-sent, and on "duplicate" the stored one is carried ---------------


class LostAnswerChain:
    """The LocalLedger behind a connection that loses the answer to a job's first usage record once (the ledger
    stored it), and whose reads trail its writes by ``lag`` seconds, as a chain's query nodes see a transaction
    only once it is in a block while a second submission of it is already refused as a duplicate."""

    def __init__(self, ledger: LocalLedger, lag: float = 1.5) -> None:
        self.ledger = ledger
        self.lag = lag
        self.lost: list[str] = []
        self.duplicates: list[str] = []
        self._written: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        result = await self.ledger.submit_usage(records)
        now = time.monotonic()
        self._written.update((rid, now) for rid in result.accepted)
        self.duplicates += result.duplicates
        firsts = [r.record_id for r in records if r.sequence == 1 and r.record_id in result.accepted]
        if firsts and not self.lost:
            self.lost += firsts
            raise ChainUnavailable("connection reset after the ledger stored the records; the answer is lost")
        return result

    async def get_usage_record(self, record_id: str) -> UsageRecord | None:
        if time.monotonic() - self._written.get(record_id, -1e9) < self.lag:
            return None  # not in a block yet
        return await self.ledger.get_usage_record(record_id)


@pytest.mark.parametrize("by_monitor", [False, True], ids=["watch activity", "cluster monitor"])
async def test_a_usage_retry_after_a_lost_answer_carries_the_stored_record(
    client: Any, tmp_path: Path, key_path: Path, task_queue: str, by_monitor: bool
) -> None:
    """The chain took record 1 but the attempt never heard so; the retry does not see it yet and the chain
    refuses a second record 1 as a duplicate. The retry must carry forward what the chain holds, not a new
    reading of its own: then the records add up, to the last digit, to the scheduler's final accounting, and
    the chain accepts the accounting and settles. (Before: the retry carried its own, later reading, the next
    records were differences from it, the sum fell short by the gap and the ledger refused the accounting.)

    On the cluster monitor's path, for a job whose monitor rounds less often than twice a report interval (it
    sends its own period records), the report is a local activity, retried within one workflow task whose clock
    stands still: the next report is still due on the job's schedule, not as late as the retries took (it came
    after the job had ended, and the job had one period record instead of two)."""
    adapter = MemoryAdapter(
        default=Script(
            [(0.0, JobState.QUEUED), (0.2, JobState.RUNNING), (6.0, JobState.COMPLETED)], exit_code=0
        )
    )
    chains: list[LostAnswerChain] = []

    def lossy(ledger: LocalLedger) -> LostAnswerChain:
        chains.append(LostAnswerChain(ledger))
        return chains[-1]

    hpc: dict[str, Any] = {"job_service": {"cluster_monitor": by_monitor}}
    if by_monitor:
        hpc["local"] = {"job_poll_interval": "1500ms"}  # the job's report interval is 2 s: it sends its own
    config = make_config(tmp_path, hpc=hpc)
    async with running_pipeline(client, config, key_path, adapter, task_queue, chain=lossy) as pipe:
        job_id = pipe.submit()
        results = await pipe.run_until_done([job_id], timeout=90)
        scheduler_job_id = results[job_id].scheduler_job_id
        assert scheduler_job_id is not None
        final = await adapter.usage(scheduler_job_id)
    chain = chains[0]
    assert chain.lost == [f"{config.hpc.cluster_id}/{job_id}/1"], "the first record's answer was lost"
    assert chain.duplicates, "a retry sent record 1 again and the chain refused it as a duplicate"
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1)) and len(records) >= 3
    assert sum_metrics([r.metrics for r in records]) == metered(final, asked(pipe, job_id))
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow


class RefusingChain:
    """The LocalLedger behind a connection that refuses a job's second record for good, ``times`` times (a
    non-transient chain error: the report's attempts end at once)."""

    def __init__(self, ledger: LocalLedger, times: int = 2) -> None:
        self.ledger = ledger
        self.left = times
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        if self.left and any(r.sequence == 2 for r in records):
            self.left -= 1
            self.refused += 1
            raise ChainError("the chain refused the batch")
        return await self.ledger.submit_usage(records)


@pytest.mark.parametrize("monitor", [False, True], ids=["watch", "monitor"])
async def test_a_period_report_that_failed_for_good_leaves_no_gap(
    client: Any, tmp_path: Path, key_path: Path, task_queue: str, monitor: bool
) -> None:
    """Record 2 is refused for good, twice: the next record covers that period too and starts where record 1
    ended. Before, on the watch path, it started when the report failed (a 2 s gap that ``usage verify`` fails the
    job for, though the gap was billed) and ended past its own reading."""
    adapter = MemoryAdapter(
        default=Script(
            [(0.0, JobState.QUEUED), (0.2, JobState.RUNNING), (9.0, JobState.COMPLETED)], exit_code=0
        )
    )
    chains: list[RefusingChain] = []

    def refusing(ledger: LocalLedger) -> RefusingChain:
        chains.append(RefusingChain(ledger))
        return chains[-1]

    config = make_config(tmp_path, hpc={"job_service": {"cluster_monitor": monitor}})
    async with running_pipeline(client, config, key_path, adapter, task_queue, chain=refusing) as pipe:
        job_id = pipe.submit()
        results = await pipe.run_until_done([job_id], timeout=90)
        scheduler_job_id = results[job_id].scheduler_job_id
        assert scheduler_job_id is not None
        final = await adapter.usage(scheduler_job_id)
    assert chains[0].refused == 2, "record 2 was refused twice"
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1)) and len(records) >= 3
    assert [(a.period_end, a.sequence + 1) for a in records[:-1]] == [
        (b.period_start, b.sequence) for b in records[1:]
    ], "each record starts where the one before ended"
    assert sum_metrics([r.metrics for r in records]) == metered(final, asked(pipe, job_id))
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow


class CountingUsage(MemoryAdapter):
    """The in-memory scheduler, counting usage readings."""

    readings: int = 0

    async def usage(self, scheduler_job_id: str) -> Any:
        self.readings += 1
        return await super().usage(scheduler_job_id)


async def activity_setup(
    tmp_path: Path, key_path: Path, adapter: MemoryAdapter
) -> tuple[Any, Any, JobSpec, str]:
    """A ledger with one job, worker dependencies around it, and the job running on ``adapter``."""
    config = make_config(tmp_path)
    ledger = setup_ledger(config, Signer.from_file(key_path))
    raw = {
        "job_id": f"JOB-{time.monotonic_ns() % 10**9}",
        "tenant": TENANT,
        "provider": config.provider.address,
        "offering_id": "offering-standard",
        "script": "true\n",
        "max_price": "10",
    }
    job_id = ledger.submit_job(raw)
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=ledger,
        adapters={config.hpc.cluster_id: adapter},
    )
    job = JobSpec.model_validate(raw)
    submitted = await adapter.submit(SubmitRequest(workflow_id=job_id, job=job, body="true\n"))
    return ledger, deps, job, submitted.scheduler_job_id


async def test_a_usage_retry_sends_the_record_its_predecessor_signed(tmp_path: Path, key_path: Path) -> None:
    """Attempt 1 signed record 1, heartbeated it and was lost before the chain heard of it. Attempt 2 sends
    that very record (same reading, same signature), not a new reading of the scheduler."""
    adapter = CountingUsage()
    ledger, deps, job, scheduler_job_id = await activity_setup(tmp_path, key_path, adapter)
    request = UsageInput(
        job_id=job.job_id,
        tenant=job.tenant,
        provider=job.provider,
        cluster_id=deps.config.hpc.cluster_id,
        scheduler_job_id=scheduler_job_id,
        sequence=1,
        period_start=datetime.now(UTC),
        previous_cumulative=UsageMetrics(),
        job_state=JobState.RUNNING,
    )
    try:
        await asyncio.sleep(0.5)  # running, with some usage
        beats: list[Any] = []
        first = ActivityEnvironment()
        first.on_heartbeat = lambda *details: beats.append(details)
        signed: list[UsageRecord] = []

        async def lost(records: list[UsageRecord]) -> UsageSubmitResult:
            signed.extend(records)
            raise ChainUnavailable("the connection dropped before the chain read the request")

        deps.activities.usage_batcher.chain = SimpleNamespace(submit_usage=lost)
        with pytest.raises(ApplicationError):
            await first.run(deps.activities.report_usage, request)
        deps.activities.usage_batcher.chain = ledger
        heartbeated = [d[0].usage_record for d in beats if d and d[0].usage_record is not None]
        assert heartbeated == signed, "the record was heartbeated before it was sent"

        await asyncio.sleep(0.3)  # the job used more meanwhile: a new reading would differ
        readings = adapter.readings
        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(
            retry.info, attempt=2, heartbeat_details=[beats[-1][0].model_dump(mode="json")]
        )
        out = await retry.run(deps.activities.report_usage, request)
        assert adapter.readings == readings, "no new reading"
        assert ledger.usage_records(job.job_id) == signed, "the chain holds the record attempt 1 signed"
        assert out.cumulative == signed[0].metrics
    finally:
        await deps.close()


async def test_a_usage_retry_that_meets_a_duplicate_carries_the_stored_record(
    tmp_path: Path, key_path: Path
) -> None:
    """A retry without its predecessor's record (its heartbeat never arrived) signs a new reading; the chain
    already holds record 1 (the predecessor's write landed late) and answers "duplicate": the stored record is
    what the activity returns and carries forward, not the retry's own reading."""
    adapter = MemoryAdapter()
    ledger, deps, job, scheduler_job_id = await activity_setup(tmp_path, key_path, adapter)
    cluster_id = deps.config.hpc.cluster_id
    request = UsageInput(
        job_id=job.job_id,
        tenant=job.tenant,
        provider=job.provider,
        cluster_id=cluster_id,
        scheduler_job_id=scheduler_job_id,
        sequence=1,
        period_start=datetime.now(UTC),
        previous_cumulative=UsageMetrics(),
        job_state=JobState.RUNNING,
    )
    try:
        await asyncio.sleep(0.5)
        first = await ActivityEnvironment().run(deps.activities.report_usage, request)
        stored = ledger.usage_record(first.record_id)
        assert stored is not None
        await asyncio.sleep(0.3)
        real_lookup = deps.activities.chain.get_usage_record
        lookups: list[str] = []

        async def not_yet_visible(record_id: str) -> UsageRecord | None:
            lookups.append(record_id)
            return None if len(lookups) == 1 else await real_lookup(record_id)

        deps.activities.chain = SimpleNamespace(get_usage_record=not_yet_visible)
        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(retry.info, attempt=2)
        out = await retry.run(deps.activities.report_usage, request)
        assert lookups == [first.record_id, first.record_id], "looked up, sent, refused, read back"
        assert out.cumulative == stored.metrics == first.cumulative, "the stored record is carried forward"
        assert ledger.usage_records(job.job_id) == [stored]
        reported = [
            e for e in read_events(deps.config.hpc.audit.log_path) if e["event_type"] == "usage_reported"
        ]
        assert [e["details"]["duplicate"] for e in reported] == [False, True]
    finally:
        await deps.close()


# ---- watch: a vanished job's grace period survives retries ---------------------------------------------------


async def test_a_retried_watch_resumes_the_vanished_jobs_grace_from_its_heartbeat(
    tmp_path: Path, key_path: Path
) -> None:
    """The scheduler stopped finding the job during attempt 1, which heartbeated since when; attempt 1 was then
    lost. Attempt 2 goes on from that moment: once the grace period has run out since the job first went missing
    it reports the job vanished. (Before: every retry restarted the grace period from its own start, so a watch
    retried often enough never gave up on a vanished job.)"""
    adapter = MemoryAdapter()
    config = make_config(tmp_path)
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=setup_ledger(config, Signer.from_file(key_path)),
        adapters={config.hpc.cluster_id: adapter},
    )
    request = WatchInput(
        job_id="JOB-vanishing",
        cluster_id=config.hpc.cluster_id,
        scheduler_job_id="4711",  # the scheduler knows no such job
        last_state=JobState.RUNNING,
        return_by=datetime.now(UTC) + timedelta(minutes=5),
        poll_interval_seconds=0.2,
        vanished_grace_seconds=2.0,
    )
    try:
        beats: list[Any] = []
        first = ActivityEnvironment()
        first.on_heartbeat = lambda *details: beats.append(details[0] if details else None)
        task = asyncio.create_task(first.run(deps.activities.watch_job, request))
        while not [b for b in beats if b is not None and b.missing_since is not None]:
            await asyncio.sleep(0.05)
        first.cancel()  # the attempt is lost before the grace period ran out
        with pytest.raises(asyncio.CancelledError):
            await task
        progress = [b for b in beats if b is not None][-1]
        went_missing = progress.missing_since
        assert progress.found is False and progress.last_state == JobState.RUNNING
        while datetime.now(UTC) - went_missing < timedelta(seconds=request.vanished_grace_seconds):
            await asyncio.sleep(0.1)

        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(
            retry.info, attempt=2, heartbeat_details=[progress.model_dump(mode="json")]
        )
        out = await retry.run(deps.activities.watch_job, request)
        assert out.changed and not out.status.found
        assert out.missing_since == went_missing, "the grace period ran from when the job first went missing"
    finally:
        await deps.close()


# ---- a watch's report survives the watch's lost attempt ------------------------------------------------------


class StallingChain:
    """The LocalLedger behind a worker that stalls (its event loop blocked, as under heavy load) right after the
    chain stored the first period record of a job: the watch attempt that sent it misses its heartbeat timeout,
    and its answer, naming the record, is lost."""

    def __init__(self, ledger: LocalLedger, stall: float = 25.0) -> None:
        self.ledger = ledger
        self.stall = stall
        self.stalled: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        result = await self.ledger.submit_usage(records)
        first = [r.record_id for r in records if r.sequence == 1 and not r.is_final]
        if first and not self.stalled:
            self.stalled += first
            time.sleep(self.stall)  # the whole worker stalls: no heartbeat leaves it
        return result


@pytest.mark.parametrize(
    "path",
    ["watch activity", "cluster monitor", "monitor's round"],
    ids=["watch activity", "cluster monitor", "round"],
)
async def test_a_report_sent_by_a_lost_watch_attempt_is_not_reused_by_the_final_record(
    client: Any, tmp_path: Path, key_path: Path, task_queue: str, path: str
) -> None:
    """Found by the load benchmark (13 of 600 jobs parked): a watch attempt sent period record 1 and lost its
    attempt to a heartbeat timeout before answering; the job ended meanwhile, so the retried watch answered
    "completed" without a record, and the final record reused sequence 1. The chain answered "duplicate", the
    stored record was not final, and the ledger refused the accounting. Now the retried watch names the record
    its predecessor sent, and the final record is record 2.

    On the cluster monitor's path a job whose monitor rounds less often than twice a report interval sends its own
    period records, each a local activity: the stall loses the workflow task that ran it, and the task's retry runs
    the report again, which meets the stored record 1 and carries it. Where the monitor's round sends them (from
    the first period on), the stall loses the round's attempt, and its retry finds the job ended."""
    adapter = MemoryAdapter(
        default=Script(
            [(0.0, JobState.QUEUED), (0.2, JobState.RUNNING), (5.0, JobState.COMPLETED)], exit_code=0
        )
    )
    chains: list[StallingChain] = []

    def stalling(ledger: LocalLedger) -> StallingChain:
        chains.append(StallingChain(ledger))
        return chains[-1]

    by_monitor = path != "watch activity"
    hpc: dict[str, Any] = {"job_service": {"cluster_monitor": by_monitor}}
    if path == "cluster monitor":
        hpc["local"] = {"job_poll_interval": "1500ms"}  # the job's report interval is 2 s: it sends its own
    config = make_config(tmp_path, hpc=hpc)
    async with running_pipeline(client, config, key_path, adapter, task_queue, chain=stalling) as pipe:
        job_id = pipe.submit()
        results = await pipe.run_until_done([job_id], timeout=150)
        scheduler_job_id = results[job_id].scheduler_job_id
        assert scheduler_job_id is not None
        final = await adapter.usage(scheduler_job_id)
        history = await pipe.handle(job_id).fetch_history()
        if path == "monitor's round":  # (the round's attempt was lost)
            history = await pipe.client.get_workflow_handle(monitor_workflow_id(task_queue)).fetch_history()
    assert chains[0].stalled == [f"{config.hpc.cluster_id}/{job_id}/1"]
    if path == "cluster monitor":
        lost = [e for e in history.events if e.HasField("workflow_task_timed_out_event_attributes")]
        assert lost, "the workflow task that ran the report was lost"
    else:
        retried = [
            e.activity_task_started_event_attributes.last_failure.message
            for e in history.events
            if e.HasField("activity_task_started_event_attributes")
            and e.activity_task_started_event_attributes.attempt > 1
        ]
        assert any("Heartbeat timeout" in m for m in retried), f"the attempt that sent it was lost: {retried}"
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [(r.sequence, r.is_final) for r in records] == [(1, False), (2, True)]
    assert sum_metrics([r.metrics for r in records]) == metered(final, asked(pipe, job_id))
    assert results[job_id].final_record_id == records[-1].record_id
    assert pipe.ledger.settlement(job_id) is not None


async def test_a_retried_watch_names_the_report_its_predecessor_sent(tmp_path: Path, key_path: Path) -> None:
    """Whatever a retried watch answers, it names the period record an earlier attempt sent: the one in its
    heartbeat details (sent again, the chain keeps the first), or else the one the chain holds."""
    adapter = MemoryAdapter(default=Script([(0.0, JobState.RUNNING), (0.5, JobState.COMPLETED)], exit_code=0))
    ledger, deps, job, scheduler_job_id = await activity_setup(tmp_path, key_path, adapter)
    cluster_id = deps.config.hpc.cluster_id
    report = UsageInput(
        job_id=job.job_id,
        tenant=job.tenant,
        provider=job.provider,
        cluster_id=cluster_id,
        scheduler_job_id=scheduler_job_id,
        sequence=1,
        period_start=datetime.now(UTC),
        previous_cumulative=UsageMetrics(),
        job_state=JobState.RUNNING,
    )
    watch = WatchInput(
        job_id=job.job_id,
        cluster_id=cluster_id,
        scheduler_job_id=scheduler_job_id,
        last_state=JobState.RUNNING,
        return_by=datetime.now(UTC) + timedelta(minutes=5),
        poll_interval_seconds=0.1,
        report=report,
    )
    try:
        sent = await ActivityEnvironment().run(
            deps.activities.report_usage, report
        )  # the lost attempt's send
        stored = ledger.usage_record(sent.record_id)
        assert stored is not None
        await asyncio.sleep(0.6)  # the job ends meanwhile
        for details in ([AttemptProgress(usage_record=stored).model_dump(mode="json")], []):
            retry = ActivityEnvironment()
            retry.info = dataclasses.replace(retry.info, attempt=2, heartbeat_details=details)
            out = await retry.run(deps.activities.watch_job, watch)
            assert out.changed and out.status.state == JobState.COMPLETED
            named = sent.model_copy(update={"answered_at": None})  # (the activity's own answer has its time)
            assert out.usage == named, "the answer names the record already on chain"
        assert ledger.usage_records(job.job_id) == [stored]
    finally:
        await deps.close()


async def test_a_final_report_whose_sequence_holds_a_period_record_follows_it(
    tmp_path: Path, key_path: Path
) -> None:
    """Should the final report still meet a period record under its sequence (the lost watch's write landed
    after the retry looked), that record stands and the final record follows it as the next sequence; the
    accounting names it and the chain settles."""
    adapter = MemoryAdapter(default=Script([(0.0, JobState.RUNNING), (0.5, JobState.COMPLETED)], exit_code=0))
    ledger, deps, job, scheduler_job_id = await activity_setup(tmp_path, key_path, adapter)
    request = UsageInput(
        job_id=job.job_id,
        tenant=job.tenant,
        provider=job.provider,
        cluster_id=deps.config.hpc.cluster_id,
        scheduler_job_id=scheduler_job_id,
        sequence=1,
        period_start=datetime.now(UTC),
        previous_cumulative=UsageMetrics(),
        job_state=JobState.RUNNING,
    )
    try:
        await asyncio.sleep(0.2)
        await ActivityEnvironment().run(deps.activities.report_usage, request)  # the period record
        await asyncio.sleep(0.5)
        final_request = request.model_copy(
            update={"is_final": True, "report_accounting": True, "job_state": JobState.COMPLETED}
        )
        out = await ActivityEnvironment().run(deps.activities.report_usage, final_request)
        records = ledger.usage_records(job.job_id)
        assert [(r.sequence, r.is_final) for r in records] == [(1, False), (2, True)]
        assert out.record_id == records[-1].record_id and out.charged is not None
        final = await adapter.usage(scheduler_job_id)
        assert out.cumulative == sum_metrics([r.metrics for r in records]) == metered(final, job.resources)
    finally:
        await deps.close()


class LateWriteChain:
    """The LocalLedger, where the period record of a lost watch attempt lands late: just before the job's final
    record, under the same sequence (the retried watch had looked for it and found nothing yet)."""

    def __init__(self, ledger: LocalLedger, signer: Signer) -> None:
        self.ledger = ledger
        self.signer = signer
        self.landed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        for record in records:
            if record.is_final and not self.landed:
                period = record.model_copy(update={"is_final": False, "job_state": JobState.RUNNING})
                await self.ledger.submit_usage([sign_record(period, self.signer)])
                self.landed.append(record.record_id)
        return await self.ledger.submit_usage(records)


async def test_a_final_record_that_follows_a_period_record_is_counted(
    client: Any, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """The final report finds a period record under its sequence and follows it with the next one; the workflow
    counts both: the job's result and status name as many records as the chain holds (before, one short: the
    workflow advanced its sequence by one whatever record the report ended on)."""
    adapter = MemoryAdapter(
        default=Script(
            [(0.0, JobState.QUEUED), (0.2, JobState.RUNNING), (1.0, JobState.COMPLETED)], exit_code=0
        )
    )
    chains: list[LateWriteChain] = []

    def late(ledger: LocalLedger) -> LateWriteChain:
        chains.append(LateWriteChain(ledger, Signer.from_file(key_path)))
        return chains[-1]

    config = make_config(tmp_path, hpc={"usage_reporting": {"report_interval": "1h"}})
    async with running_pipeline(client, config, key_path, adapter, task_queue, chain=late) as pipe:
        job_id = pipe.submit()
        results = await pipe.run_until_done([job_id], timeout=90)
        status = await pipe.handle(job_id).query("status", result_type=JobStatusView)
    assert chains[0].landed == [f"{config.hpc.cluster_id}/{job_id}/1"]
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [(r.sequence, r.is_final) for r in records] == [(1, False), (2, True)]
    assert results[job_id].final_record_id == records[-1].record_id
    assert results[job_id].usage_records == 2
    assert status.usage_records == 2
    assert pipe.ledger.settlement(job_id) is not None
