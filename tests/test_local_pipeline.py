"""Every job outcome end to end on the embedded default: chain poller, workflow, local executor running real
processes, signed usage, settlement (what ``make demo`` shows, asserted)."""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.audit import read_events, verify_log
from activities.schedulers.local import LocalAdapter
from tests.conftest import make_config
from tests.local_support import TENANT_POOL, reachable_dir, running_as_root
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.config import Secrets
from virtengine_hpc.models import Allocation, Resources
from virtengine_hpc.signing import Signer, write_private_key
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics, verify_record

# A fixed amount of work; bash's `times` then reports the CPU the job really used, to compare with the records.
BURN = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done\ntimes > cpu_times.txt\n"


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "local": {"max_walltime": "10s", "kill_wait": "1s", "job_poll_interval": "200ms"},
        },
    )
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_every_outcome_on_the_local_executor(pipe: Pipeline, key_path: Path) -> None:
    jobs = {
        "success": pipe.submit(script=BURN),
        "failure": pipe.submit(script="echo oops >&2\nexit 3\n"),
        "walltime": pipe.submit(script="sleep 120\n"),
        "cancelled": pipe.submit(script="sleep 120\n"),
        "rejected": pipe.submit(decide=False),
        # More cores than any host has: refused at submission, never run on fewer and billed for all of them.
        "too_big": pipe.submit(
            resources={"cpus_per_task": 1024}, walltime_seconds=60, max_price="1000", script="touch ran\n"
        ),
    }
    await pipe.wait_started(jobs["cancelled"])
    for _ in range(100):
        if pipe.ledger.job(jobs["cancelled"]).state == JobState.RUNNING:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the job to cancel never ran: a cancel while queued would prove less")
    pipe.ledger.request_cancel(jobs["cancelled"])
    results = await pipe.run_until_done(list(jobs.values()), timeout=120)

    state = {label: results[job_id].state for label, job_id in jobs.items()}
    assert state == {
        "success": JobState.COMPLETED,
        "failure": JobState.FAILED,
        "walltime": JobState.TIMEOUT,
        "cancelled": JobState.CANCELLED,
        "rejected": JobState.FAILED,
        "too_big": JobState.FAILED,
    }
    assert (
        "the local executor cannot provide 1024 cores per node (this host has"
        in results[jobs["too_big"]].message
    )
    assert pipe.audit_events("job_submission_failed", jobs["too_big"]) and not pipe.ledger.usage_records(
        jobs["too_big"]
    )
    assert pipe.ledger.job(jobs["failure"]).exit_code == 3  # type: ignore[union-attr]
    assert "walltime" in results[jobs["walltime"]].message
    assert "routing_rejected" in results[jobs["rejected"]].message

    public = Signer.from_file(key_path).public_key
    for label in ("success", "failure", "walltime", "cancelled"):
        records = pipe.ledger.usage_records(jobs[label])
        assert [r.sequence for r in records] == list(range(1, len(records) + 1))
        assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
        assert all(verify_record(r, public) for r in records)
        asked = Resources.model_validate(pipe.ledger.job(jobs[label]).raw_spec.get("resources", {}))  # type: ignore[union-attr]
        for r in records:  # format 2: priced on what the job asked for, and no period shorter than its claim
            assert (r.version, r.allocation) == (2, Allocation.of(asked)), r
            assert r.basis is not None and r.basis["cpu_core_seconds"] == "allocated"
            period = Decimal(str((r.period_end - r.period_start).total_seconds()))
            assert r.metrics.wall_clock_seconds <= period, (label, r.sequence, r.metrics, period)
        settlement = pipe.ledger.settlement(jobs[label])
        assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    burned = sum_metrics([r.metrics for r in pipe.ledger.usage_records(jobs["success"])])
    own = _bash_times(pipe, results[jobs["success"]].scheduler_job_id)
    used = burned.cpu_time_seconds or Decimal(0)
    assert abs(used - own) <= max(Decimal("0.1"), own * Decimal("0.15")), (burned, own)
    assert burned.wall_clock_seconds >= own * Decimal("0.9")
    for label in ("rejected", "too_big"):
        refund = pipe.ledger.settlement(jobs[label])
        assert refund is not None and refund.charged == 0 and refund.refunded == refund.escrow
    assert pipe.ledger.balance(TENANT) > Decimal("100000") - Decimal("500")


HOSTILE = r"""
attempt() { name=$1; shift; if "$@" >/dev/null 2>&1; then echo "$name: done"; else echo "$name: denied"; fi; }
printf '{"state": "completed", "native_state": "COMPLETED", "exit_code": 0, "usage": {}}' > forged.json
attempt read-worker-environ cat "/proc/$WORKER_PID/environ"
attempt read-provider-key cat "$PROVIDER_KEY"
attempt write-ledger sh -c 'printf x >> "$1"' sh "$LEDGER"
attempt write-audit-log sh -c 'printf x >> "$1"' sh "$AUDIT_LOG"
attempt forge-status cp forged.json "$(dirname "$VIRTENGINE_JOB_DIR")/status.json"
attempt kill-supervisor kill -KILL "$PPID"
sleep 3
i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done
times > cpu_times.txt
"""


@pytest.mark.skipif(not running_as_root(), reason="jobs run as tenant accounts only under a root worker")
async def test_a_hostile_job_cannot_touch_the_provider_and_is_billed_what_it_used(
    client: Client, tmp_path: Path, task_queue: str
) -> None:
    # Key, ledger and audit log where any account may look: only their own modes and owners protect them.
    provider = reachable_dir("provider")
    key = provider / "provider.key"
    write_private_key(key)
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "audit": {"log_path": str(provider / "audit.log")},
            "local": {"max_walltime": "30s", "kill_wait": "1s", "job_poll_interval": "200ms"},
        },
    )
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key, adapter, task_queue) as pipe:
        env = {
            "WORKER_PID": str(os.getpid()),
            "PROVIDER_KEY": str(key),
            "LEDGER": str(config.ledger_path),
            "AUDIT_LOG": str(config.hpc.audit.log_path),
        }
        job_id = pipe.submit(script=HOSTILE, environment=env)
        result = (await pipe.run_until_done([job_id], timeout=120))[job_id]

    assert result.state == JobState.COMPLETED, result.message
    stdout = (adapter.job_dir(str(result.scheduler_job_id)) / "stdout").read_text()
    attempts = ["read-worker-environ", "read-provider-key", "write-ledger", "write-audit-log", "forge-status"]
    assert stdout.splitlines() == [f"{name}: denied" for name in [*attempts, "kill-supervisor"]]
    job = pipe.ledger.job(job_id)
    assert job is not None and job.state == JobState.COMPLETED and job.exit_code == 0
    records = pipe.ledger.usage_records(job_id)
    assert [r.is_final for r in records].count(True) == 1
    assert all(verify_record(r, Signer.from_file(key).public_key) for r in records)
    # The records carry the supervisor's reading (the forged file said 0), over the whole run.
    used = sum_metrics([r.metrics for r in records])
    own = _bash_times(pipe, result.scheduler_job_id)
    assert abs((used.cpu_time_seconds or Decimal(0)) - own) <= max(Decimal("0.1"), own * Decimal("0.15"))
    assert used.wall_clock_seconds >= 3
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged > 0
    assert settlement.charged + settlement.refunded == settlement.escrow
    assert verify_log(config.hpc.audit.log_path).ok
    owner = pwd.getpwuid(adapter.work_dir(str(result.scheduler_job_id)).stat().st_uid).pw_name
    assert owner in TENANT_POOL


@pytest.mark.skipif(not running_as_root(), reason="jobs run as tenant accounts only under a root worker")
@pytest.mark.parametrize(
    ("tenants", "reason"),
    [
        (
            {"pool": [], "accounts": {"virtengine1tenant0bob": "vehpc-t3"}},
            f"tenant {TENANT} has no cluster account: hpc.tenants.accounts does not name it and "
            "hpc.tenants.pool is empty",
        ),
        (
            {"pool": [], "accounts": {TENANT: "vehpc-nosuch"}},
            f"tenant {TENANT}'s account vehpc-nosuch does not exist",
        ),
    ],
)
async def test_a_job_without_an_unprivileged_account_is_refused_and_refunded(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, tenants: dict[str, Any], reason: str
) -> None:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "tenants": tenants})
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as pipe:
        job_id = pipe.submit(script="echo ran > ran.txt\n")
        result = (await pipe.run_until_done([job_id], timeout=60))[job_id]
    assert result.state == JobState.FAILED
    assert reason in result.message
    assert not (config.local_state_dir / "jobs").exists() or not any(
        (config.local_state_dir / "jobs").iterdir()
    )
    refund = pipe.ledger.settlement(job_id)
    assert refund is not None and refund.charged == 0 and refund.refunded == refund.escrow
    [failed] = [
        e for e in read_events(config.hpc.audit.log_path) if e["event_type"] == "job_submission_failed"
    ]
    assert failed["job_id"] == job_id and reason in failed["error_msg"]
    assert failed["details"]["code"] == "tenant_account_missing"


def test_a_worker_refuses_to_run_local_jobs_without_the_opt_in(
    temporal_env: WorkflowEnvironment, tmp_path: Path, key_path: Path
) -> None:
    config = make_config(
        tmp_path,
        hpc={"local": {"allow_unisolated": False}},
        temporal={"address": temporal_env.client.service_client.config.target_host},
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "PROVIDER_SIGNING_KEY_PATH": str(key_path)}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "virtengine-hpc"), "-c", str(path), "worker", "run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "error: cluster local-cluster uses the local executor, which is no multi-tenant sandbox"
        in done.stderr
    )
    assert "hpc.local.allow_unisolated: true" in done.stderr
    assert "Traceback" not in done.stderr
    assert not config.local_state_dir.exists(), "no job directory, no supervisor: nothing ran"


def _bash_times(pipe: Pipeline, scheduler_job_id: str | None) -> Decimal:
    """User + system CPU of the shell as its own `times` reported it (first line: 0m1.234s 0m0.010s)."""
    work_dir = pipe.config.local_state_dir / "jobs" / str(scheduler_job_id) / "work"
    first = (work_dir / "cpu_times.txt").read_text().splitlines()[0].split()
    total = Decimal(0)
    for part in first:
        minutes, seconds = part.rstrip("s").split("m")
        total += Decimal(minutes) * 60 + Decimal(seconds)
    return total
