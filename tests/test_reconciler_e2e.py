"""No job left behind, end to end: an operator terminates the workflow of a running job (``temporal workflow
terminate``, the Web UI's Terminate), and the poller's reconciler, running as in production, closes the job on
chain with its process (or Slurm job) stopped, its usage records complete and its escrow settled.

The local executor runs the job as a real process; the second test runs it on the real SLURM cluster. Both print
how long the job stayed open on chain after the terminate (the reconciler's bound: ``reconcile_interval`` plus one
recovery run; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from activities.schedulers import local_supervisor as sup
from activities.schedulers.local import LocalAdapter
from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import JobResult
from virtengine_hpc.states import JobState

INTERVAL = 1.0


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "job_service": {"reconcile_interval": f"{INTERVAL}s"},
            "local": {"kill_wait": "1s", "job_poll_interval": "200ms"},
        },
    )
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def eventually(check: object, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        await asyncio.sleep(0.1)


@dataclass
class Closed:
    terminated_at: datetime
    after: float  # seconds from the terminate to a final state on chain
    result: JobResult


async def terminate_and_reconcile(pipe: Pipeline, job_id: str) -> Closed:
    """Terminate the job's workflow right after a reconcile round (the longest wait for the next one), with the
    poller running as in production, and wait for the job to be final on chain."""
    ledger = pipe.ledger
    stop = asyncio.Event()
    poller = asyncio.create_task(pipe.poller.run(stop))  # polls and reconciles as in production
    reconciler = pipe.poller.reconciler
    try:
        await eventually(lambda: reconciler.rounds >= 1, "a first reconcile round")
        terminated_at, terminated_wall = time.monotonic(), datetime.now(UTC)
        await pipe.handle(job_id).terminate("operator pressed Terminate")
        await eventually(lambda: ledger.job(job_id).state.final, "a final chain state", timeout=120)  # type: ignore[union-attr]
        closed_after = time.monotonic() - terminated_at
        result = await pipe.handle(job_id).result()
    finally:
        stop.set()
        await poller
    return Closed(terminated_wall, closed_after, result)


def report_bound(pipe: Pipeline, job_id: str, closed: Closed) -> None:
    [found] = pipe.audit_events("job_reconciled", job_id)
    found_at = datetime.fromisoformat(found["timestamp"])
    final_at = pipe.ledger.history(job_id)[-1].at
    terminated = closed.terminated_at
    print(
        f"\nreconciler bound ({type(pipe.adapter).__name__}, reconcile_interval "
        f"{pipe.config.hpc.job_service.reconcile_interval.total_seconds():.0f} s): job final on chain "
        f"{closed.after:.1f} s after the terminate; found after {(found_at - terminated).total_seconds():.1f} s, "
        f"recovery run {(final_at - found_at).total_seconds():.1f} s"
    )


def gone(pid: int) -> bool:
    stat = sup.read_stat(pid)
    return stat is None or stat.state == "Z"


async def test_a_terminated_workflow_s_job_is_closed_on_chain_by_the_reconciler_and_its_process_stopped(
    pipe: Pipeline, client: Client
) -> None:
    job_id = pipe.submit(script="echo $$ > leader.pid\nsleep 300\n", walltime_seconds=600)
    await pipe.wait_started(job_id)
    ledger = pipe.ledger
    await eventually(lambda: ledger.job(job_id).state == JobState.RUNNING, "running")  # type: ignore[union-attr]
    await eventually(lambda: len(ledger.usage_records(job_id)) >= 1, "a first usage record", timeout=30)
    chain_job = ledger.job(job_id)
    assert chain_job is not None and chain_job.scheduler_job_id is not None
    adapter = pipe.adapter
    assert isinstance(adapter, LocalAdapter)
    pid_file = adapter.work_dir(chain_job.scheduler_job_id) / "leader.pid"
    await eventually(pid_file.exists, "the job's pid file")
    leader = int(pid_file.read_text())

    closed = await terminate_and_reconcile(pipe, job_id)
    result = closed.result
    job = ledger.job(job_id)
    assert job is not None and job.state == JobState.CANCELLED
    assert "reconciler" in job.status_message and "TERMINATED" in job.status_message
    assert isinstance(result, JobResult) and result.state == JobState.CANCELLED
    await eventually(lambda: gone(leader), "the job's process gone", timeout=30)
    records = ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
    settlement = ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    [found] = pipe.audit_events("job_reconciled", job_id)
    assert found["details"]["closed_status"] == "TERMINATED" and found["details"]["chain_state"] == "running"
    described = await client.get_workflow_handle(job_id).describe()
    assert described.status == WorkflowExecutionStatus.COMPLETED
    report_bound(pipe, job_id, closed)


@pytest.fixture
async def slurm_pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> AsyncIterator[Pipeline]:
    env = sc.cluster()
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"reconcile_interval": f"{INTERVAL}s", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "10s"},
            "slurm": sc.slurm_section(env, "cli"),
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    try:
        async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
            yield p
    finally:
        sc.cancel_test_jobs(env, SLURM_SCOPE)
        sc.remove_outputs(env, SLURM_SCOPE)


SLURM_SCOPE = "recon-"


@pytest.mark.slurm
async def test_a_terminated_workflow_s_slurm_job_is_cancelled_and_closed_on_chain_by_the_reconciler(
    slurm_pipe: Pipeline,
) -> None:
    env: dict[str, Any] = sc.cluster()
    pipe = slurm_pipe
    job_id = pipe.submit(
        job_id=sc.workflow_id(SLURM_SCOPE.rstrip("-")),
        script="#!/bin/bash\nsleep 300\n",
        resources={"memory_mb_per_node": 256},
    )
    await pipe.wait_started(job_id)
    for _ in range(600):
        await pipe.poller.poll_once()
        if pipe.ledger.job(job_id).state == JobState.RUNNING:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.2)
    chain_job = pipe.ledger.job(job_id)
    assert chain_job is not None and chain_job.state == JobState.RUNNING and chain_job.scheduler_job_id
    slurm_id = chain_job.scheduler_job_id

    closed = await terminate_and_reconcile(pipe, job_id)
    result = closed.result

    assert result.state == JobState.CANCELLED
    job = pipe.ledger.job(job_id)
    assert job is not None and job.state == JobState.CANCELLED and "reconciler" in job.status_message
    line = sc.slurm_command(env, ["sacct", "-X", "-P", "-n", "-j", slurm_id, "-o", "State"])
    assert line.strip().startswith("CANCELLED"), f"Slurm says {line!r}"
    records = pipe.ledger.usage_records(job_id)
    assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
    assert pipe.ledger.settlement(job_id) is not None
    report_bound(pipe, job_id, closed)
