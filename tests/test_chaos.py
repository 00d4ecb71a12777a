"""Faults under load, in CI: the small version of ``benchmarks/chaos.py``.

Real processes: a Temporal dev server on a SQLite file, the production worker and poller, the LocalLedger, jobs
on the local executor (every outcome: completed, failed, timeout, cancelled by the tenant) and one on the local
SLURM cluster. While they run, the worker is SIGKILLed once and the ledger is made unwritable for longer than its
busy timeout (another process holds SQLite's write lock), so every chain write in that window fails with
``ChainUnavailable`` and must be retried. Then the nine invariants of ``benchmarks/chaos.py`` must hold: the
right terminal state for every job, exactly one scheduler job and one execution per job, gapless unique usage
sequences, one final record, records that add up to the scheduler's final accounting, a settlement that prices
the records, valid signatures, an intact audit chain, and no failed workflow task.

Also here: the regression test for what the first chaos run found (a usage report waiting on a busy ledger did
not heartbeat, so Temporal cancelled and retried it while its write still waited in a thread).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SubmitRequest, SubmitResult
from benchmarks.chaos import ChaosRun, LedgerLock, Plan, TemporalServer
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.local_support import reachable_dir
from tests.memory_adapter import MemoryAdapter
from tests.pipeline_harness import TENANT, running_pipeline, setup_ledger
from virtengine_hpc.config import Secrets
from virtengine_hpc.errors import ChainUnavailable, SchedulerUnavailable
from virtengine_hpc.messages import UsageInput
from virtengine_hpc.models import JobSpec, UsageMetrics
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from workers.wiring import build_worker_deps


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.timeout(420)
async def test_jobs_of_every_outcome_survive_a_worker_kill_and_a_ledger_outage() -> None:
    plan = Plan(
        slurm=sc.cluster(),
        slurm_jobs={"complete": 1},
        local_jobs={"complete": 2, "fail": 1, "timeout": 1, "cancel": 1},
        kills=1,
        kill_window=(4.0, 8.0),
        temporal_restart_at=None,
        slurmctld_outage_at=None,
        ledger_outage_at=12.0,
        ledger_outage=35.0,  # longer than the ledger's 30 s busy timeout: writes fail, not just wait
        # The tenant's cancellation goes through the ledger, which the outage blocks for 35 s: the local walltime
        # must outlast it, or the job to cancel times out first (seen in CI on a loaded machine at 30 s).
        local_walltime=90.0,
        seed=7,
        timeout=280.0,
    )
    # Local jobs run as tenant accounts: their state must be where those accounts can pass.
    outcome = await ChaosRun(reachable_dir("chaos"), plan).run()
    outcome.print()
    assert outcome.ok, "\n".join(f"{c.name}: {c.detail}" for c in outcome.checks if not c.ok)
    assert any("worker SIGKILLed" in line for line in outcome.faults)
    assert any("ledger write lock held" in line for line in outcome.faults)
    evidence = outcome.faults[-1]
    assert "2 worker starts" in evidence
    assert "0 attempts cancelled by Temporal" in evidence, evidence
    assert {row["cluster"] for row in outcome.jobs} == {"local", "slurm"}


def test_an_existing_ledger_opens_while_another_process_holds_its_write_lock(tmp_path: Path) -> None:
    """Opening took the write lock to create the schema even when it existed, so a worker restarted during a
    ledger outage could not start until it ended (found by the chaos benchmark)."""
    path = tmp_path / "ledger.db"
    LocalLedger(path).fund(TENANT, 5)
    lock = LedgerLock(path)
    lock.hold(30.0)
    try:
        started = time.monotonic()
        reopened = LocalLedger(path, busy_timeout=3)
        assert time.monotonic() - started < 1
        assert reopened.balance(TENANT) == 5, "reads go on during the outage"
        with pytest.raises(ChainUnavailable):
            reopened.fund(TENANT, 1)
    finally:
        lock.release()
    assert LocalLedger(path).fund(TENANT, 1) == 6


def start_worker(config_path: Path, key_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """The production ``virtengine-hpc worker run --poller`` process, its output in ``log_path``."""
    with open(log_path, "wb") as out:
        return subprocess.Popen(
            [
                str(Path(sys.executable).parent / "virtengine-hpc"),
                "-c",
                str(config_path),
                "worker",
                "run",
                "--poller",
            ],
            env={**os.environ, "PROVIDER_SIGNING_KEY_PATH": str(key_path)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_worker_started_while_the_ledger_is_busy_waits_for_it(
    temporal_env: WorkflowEnvironment, tmp_path: Path, key_path: Path
) -> None:
    """Opening the ledger writes its schema; a worker started during a ledger outage longer than the busy timeout
    exited (found by the chaos benchmark). It must wait the outage out, then serve."""
    config = make_config(
        tmp_path,
        temporal={
            "address": temporal_env.client.service_client.config.target_host,
            "task_queue": f"busy-{uuid.uuid4().hex[:8]}",
        },
    )
    ledger = setup_ledger(config, Signer.from_file(key_path))
    job_id = ledger.submit_job(
        {
            "job_id": f"JOB-busy-{uuid.uuid4().hex[:8]}",
            "tenant": TENANT,
            "provider": config.provider.address,
            "offering_id": "offering-standard",
            "script": "echo hello\n",
            "walltime_seconds": 600,
            "max_price": "100",
        }
    )
    ledger.create_decision(job_id, config.hpc.cluster_id)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    lock = LedgerLock(config.ledger_path)
    lock.hold(40.0)  # longer than the ledger's 30 s busy timeout
    log_path = tmp_path / "worker.log"
    worker = start_worker(path, key_path, log_path)
    try:
        await asyncio.sleep(36)
        assert worker.poll() is None, "the worker gave up: " + log_path.read_text()[-2000:]
        lock.release()
        deadline = time.monotonic() + 90
        while (job := ledger.job(job_id)) is None or not job.state.final:
            assert time.monotonic() < deadline, f"not done: {job}"
            assert worker.poll() is None, log_path.read_text()[-2000:]
            await asyncio.sleep(0.5)
        assert job.state == JobState.COMPLETED
        assert "trying again" in log_path.read_text()
    finally:
        lock.release()
        worker.terminate()
        worker.wait(timeout=30)


@pytest.mark.timeout(180)
async def test_a_worker_started_while_temporal_is_down_waits_for_it(tmp_path: Path, key_path: Path) -> None:
    """A worker (re)started while the Temporal server was down exited at once (chaos benchmark: the server
    restart caught a worker restart); it must wait for the server, then serve."""
    server = TemporalServer(tmp_path)
    config = make_config(tmp_path, temporal={"address": server.address, "task_queue": "down"})
    ledger = setup_ledger(config, Signer.from_file(key_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    log_path = tmp_path / "worker.log"
    worker = start_worker(path, key_path, log_path)
    try:
        await asyncio.sleep(4)
        assert worker.poll() is None, "the worker gave up: " + log_path.read_text()[-2000:]
        await asyncio.to_thread(server.start)
        job_id = ledger.submit_job(
            {
                "job_id": f"JOB-down-{uuid.uuid4().hex[:8]}",
                "tenant": TENANT,
                "provider": config.provider.address,
                "offering_id": "offering-standard",
                "script": "echo hello\n",
                "walltime_seconds": 600,
                "max_price": "100",
            }
        )
        ledger.create_decision(job_id, config.hpc.cluster_id)
        deadline = time.monotonic() + 90
        while (job := ledger.job(job_id)) is None or not job.state.final:
            assert time.monotonic() < deadline, f"not done: {job}"
            assert worker.poll() is None, log_path.read_text()[-2000:]
            await asyncio.sleep(0.5)
        assert job.state == JobState.COMPLETED
        assert "cannot connect to Temporal" in log_path.read_text() and "trying again" in log_path.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        server.kill()


class AnswersLost(MemoryAdapter):
    """The scheduler takes the job but no attempt ever hears back: what an overloaded server's lost heartbeats
    (submit timed out four times) looked like in the load benchmark."""

    async def submit(self, request: SubmitRequest, **_: Any) -> SubmitResult:
        await super().submit(request)
        raise SchedulerUnavailable("the answer was lost")


async def test_a_job_whose_submit_answers_were_all_lost_is_adopted_not_failed(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """The load benchmark found jobs failed on chain ("submission failed: activity Heartbeat timeout") while
    they ran on the executor: every submit attempt had created or adopted the job, none was heard. The workflow
    now looks the job up before failing it, and adopts it."""
    adapter = AnswersLost()
    config = make_config(tmp_path, hpc={"retry": {"max_retries": 2, "initial_backoff": "100ms"}})
    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        lost = pipe.submit(name="lost")
        rejected = pipe.submit(name="rejected")
        adapter.reject[rejected] = "invalid account"
        results = await pipe.run_until_done([lost, rejected], timeout=60)
    assert results[lost].state == JobState.COMPLETED, results[lost].message
    assert len(adapter.jobs) == 1, "one scheduler job"
    assert adapter.submits == 3 + 1, "three attempts for the lost one, one for the refused one"
    recovered = pipe.audit_events("state_recovered", lost)
    assert recovered and "every submit attempt failed" in recovered[-1]["details"]["why"]
    assert pipe.ledger.usage_records(lost), "it was watched and billed"
    # A refusal creates nothing: no lookup, the job fails with the scheduler's reason.
    assert results[rejected].state == JobState.FAILED and "invalid account" in results[rejected].message
    assert not pipe.audit_events("state_recovered", rejected)


async def test_a_usage_report_heartbeats_while_the_ledger_is_busy(tmp_path: Path, key_path: Path) -> None:
    """The report's chain write waits on the busy ledger; it must keep heartbeating meanwhile, or Temporal
    times the attempt out after 10 s (the short-activity heartbeat timeout) and retries it."""
    config = make_config(tmp_path)
    ledger = setup_ledger(config, Signer.from_file(key_path))
    raw = {
        "job_id": "JOB-busy",
        "tenant": TENANT,
        "provider": config.provider.address,
        "offering_id": "offering-standard",
        "script": "true\n",
        "max_price": "10",
    }
    job_id = ledger.submit_job(raw)
    adapter = MemoryAdapter()
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=ledger,
        adapters={config.hpc.cluster_id: adapter},
    )
    job = JobSpec.model_validate(raw)
    submitted = await adapter.submit(SubmitRequest(workflow_id=job_id, job=job, body="true\n"))
    await asyncio.sleep(0.5)  # running, with some usage
    beats: list[float] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *_: beats.append(asyncio.get_running_loop().time())
    lock = LedgerLock(config.ledger_path)
    lock.hold(5.0)
    started = asyncio.get_running_loop().time()
    try:
        out = await env.run(
            deps.activities.report_usage,
            UsageInput(
                job_id=job.job_id,
                tenant=job.tenant,
                provider=job.provider,
                cluster_id=config.hpc.cluster_id,
                scheduler_job_id=submitted.scheduler_job_id,
                sequence=1,
                period_start=datetime.now(UTC),
                previous_cumulative=UsageMetrics(),
                job_state=JobState.RUNNING,
            ),
        )
    finally:
        lock.release()
        await deps.close()
    waited = asyncio.get_running_loop().time() - started
    assert waited >= 4, "the write waited for the lock"
    assert out.record_id == f"{config.hpc.cluster_id}/{job_id}/1"
    assert len([t for t in beats if t - started < waited]) >= 2, f"heartbeats while waiting: {beats}"
    assert [r.sequence for r in ledger.usage_records(job_id)] == [1]
