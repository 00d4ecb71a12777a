"""The whole provider pipeline on the real SLURM cluster: chain (LocalLedger) -> poller -> HPCJobWorkflow on a real
Temporal dev server -> the real SlurmAdapter (local CLI, and slurmrestd) -> slurmctld, and signed usage back to the
chain.

What a provider would notice: the states the chain went through, the exit code, the usage records (signed, gapless,
one final, adding up to exactly what Slurm's accounting says), the settlement, and one Slurm job per chain job.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics, verify_record

pytestmark = pytest.mark.slurm
SCOPE = "pipe-"
Q, R, C, F, X = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


def pipeline_config(tmp_path: Path, env: dict[str, Any], transport: str = "cli") -> Any:
    return make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "2s"},
            "slurm": sc.slurm_section(env, transport),
            "tenants": sc.tenants_section(env),
        },
    )


@pytest.fixture(params=["cli", "rest"])
async def pipe(
    request: pytest.FixtureRequest,
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    env: dict[str, Any],
) -> AsyncIterator[Pipeline]:
    config = pipeline_config(tmp_path, env, request.param)
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def submit(p: Pipeline, script: str, **spec: Any) -> str:
    spec.setdefault("resources", {"memory_mb_per_node": 256})
    return p.submit(job_id=sc.workflow_id(SCOPE.rstrip("-")), script=script, **spec)


async def wait_chain_state(p: Pipeline, job_id: str, state: JobState, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await p.poller.poll_once()
        job = p.ledger.job(job_id)
        if job is not None and job.state == state:
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"{job_id} never reached {state} on chain: {p.ledger.job(job_id)}")


def check_usage(p: Pipeline, env: dict[str, Any], job_id: str, key_path: Path) -> None:
    """Signed, gapless, one final record; they add up to the settlement and to Slurm's own accounting."""
    records = p.ledger.usage_records(job_id)
    assert records, "a job that ran has usage records"
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True]
    public = Signer.from_file(key_path).public_key
    assert all(verify_record(r, public) for r in records)
    settlement = p.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    total = sum_metrics([r.metrics for r in records])
    slurm_id = records[-1].scheduler_job_id
    line = sc.slurm_command(env, ["sacct", "-X", "-P", "-n", "-j", slurm_id, "-o", "JobIDRaw,ElapsedRaw"])
    elapsed = next(int(x.split("|")[1]) for x in line.splitlines() if x.split("|")[0] == slurm_id)
    readings = [(r.sequence, r.job_state.value, str(r.metrics.wall_clock_seconds)) for r in records]
    assert total.wall_clock_seconds == elapsed, (
        f"records {readings} must add up to sacct's {elapsed} s, exactly"
    )
    gib = Decimal(256 * 1024 * 1024) / Decimal(10**9)
    assert total.memory_gb_seconds == (gib * elapsed).quantize(Decimal("0.000001"))


async def test_jobs_complete_fail_and_cancel_through_the_pipeline(
    pipe: Pipeline, env: dict[str, Any], key_path: Path
) -> None:
    done = submit(pipe, "#!/bin/bash\necho hello from slurm\nsleep 5\n")
    failed = submit(pipe, "#!/bin/bash\necho about to fail >&2\nsleep 1\nexit 3\n")
    cancelled = submit(pipe, "#!/bin/bash\nsleep 300\n")
    await wait_chain_state(pipe, cancelled, R)
    await asyncio.sleep(2)  # let it run a moment, so it has usage to settle
    pipe.ledger.request_cancel(cancelled)
    results = await pipe.run_until_done([done, failed, cancelled], timeout=180)

    assert results[done].state == C, results[done]
    assert pipe.states_of(done) == [Q, R, C]
    assert (results[done].exit_code or 0) == 0
    check_usage(pipe, env, done, key_path)
    output = sc.job_output(env, done, results[done].scheduler_job_id or "")
    assert output.strip() == "hello from slurm"

    assert results[failed].state == F
    assert results[failed].exit_code == 3
    ledger_job = pipe.ledger.job(failed)
    assert ledger_job is not None and ledger_job.exit_code == 3 and "exit code 3" in ledger_job.status_message
    check_usage(pipe, env, failed, key_path)

    assert results[cancelled].state == X
    assert pipe.states_of(cancelled)[-1] == X and F not in pipe.states_of(cancelled)
    check_usage(pipe, env, cancelled, key_path)
    assert pipe.audit_events("job_cancelled", cancelled)

    for job_id in (done, failed, cancelled):
        assert await sc.wait_in_accounting(env, job_id) == [results[job_id].scheduler_job_id], (
            "exactly one Slurm job per chain job"
        )


async def test_jobs_that_exit_at_once_start_and_settle_on_one_final_record(
    pipe: Pipeline, env: dict[str, Any], key_path: Path
) -> None:
    """``exit 3`` at once: Slurm starts the job and ends it within its one-second clock (Start = End), so a poll
    may see it queued, then failed. Every time, the chain sees it start (the ``started`` callback) and fail, and it
    settles on exactly one final record."""
    jobs = [submit(pipe, "#!/bin/bash\nexit 3\n") for _ in range(4)]
    results = await pipe.run_until_done(jobs, timeout=240)
    for job_id in jobs:
        assert (results[job_id].state, results[job_id].exit_code) == (F, 3), results[job_id]
        assert pipe.states_of(job_id) == [Q, R, F]
        events = [e["details"]["event"] for e in pipe.audit_events("job_lifecycle_event", job_id)]
        assert events.count("started") == 1 and events[-1] == "failed", events
        check_usage(pipe, env, job_id, key_path)
        assert results[job_id].final_record_id == pipe.ledger.usage_records(job_id)[-1].record_id


async def test_a_comment_the_job_owner_edits_does_not_change_the_storage_charged(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """The job's comment is the owner's to edit (``scontrol update JobId=N Comment=...``): the storage billed
    comes from the job the provider accepted, 50 GB for as long as the job ran, never from what the comment says
    afterwards."""
    job_id = submit(pipe, "#!/bin/bash\nsleep 8\n", resources={"memory_mb_per_node": 256, "storage_gb": 50})
    await wait_chain_state(pipe, job_id, R)
    slurm_id = pipe.ledger.job(job_id).scheduler_job_id  # type: ignore[union-attr]
    assert slurm_id
    comment = sc.slurm_command(env, ["squeue", "-h", "-j", slurm_id, "-o", "%k"]).strip()
    forged = re.sub(r"storage_gb=\d+", "storage_gb=0", comment) if "storage_gb=" in comment else comment
    if forged == comment:
        forged = f"{comment};storage_gb=0"
    sc.slurm_command(env, ["scontrol", "update", f"JobId={slurm_id}", f"Comment={forged}"])
    assert sc.slurm_command(env, ["squeue", "-h", "-j", slurm_id, "-o", "%k"]).strip() == forged

    [result] = (await pipe.run_until_done([job_id], timeout=120)).values()
    assert result.state == C, result.message
    total = sum_metrics([r.metrics for r in pipe.ledger.usage_records(job_id)])
    assert total.wall_clock_seconds >= 8
    expected = Decimal(50) * total.wall_clock_seconds / 3600
    assert abs(total.storage_gb_hours - expected) < Decimal("0.00001"), (total.storage_gb_hours, expected)
