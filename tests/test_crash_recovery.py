"""Crash recovery from workflow replay: SIGKILL real worker processes while real local jobs run.

Promise (invariants 2 and 6 in docs/architecture.md): a new worker finishes every job; exactly one scheduler job per chain job;
usage sequences gapless and unique; one ``is_final`` record per job; the ledger's settlement is right.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.schedulers.local import LocalAdapter
from tests.conftest import REPO, make_config
from tests.local_support import shared_dir
from tests.pipeline_harness import running_pipeline
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics, verify_record

BURN = 'end=$((SECONDS+{s})); while [ "$SECONDS" -lt "$end" ]; do :; done\n'


class WorkerProcess:
    def __init__(self, config_path: Path, task_queue: str, key_path: Path, log: Path) -> None:
        self.args = [sys.executable, "-m", "tests.crash_worker", str(config_path), task_queue]
        self.env = dict(os.environ, PROVIDER_SIGNING_KEY_PATH=str(key_path))
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.args, *extra], cwd=REPO, env=self.env, stdout=out, stderr=out)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    made: list[WorkerProcess] = []
    yield made
    for worker in made:
        worker.stop()


def _config(tmp_path: Path, env: WorkflowEnvironment) -> tuple[Config, Path]:
    config = make_config(
        tmp_path,
        hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}", "usage_reporting": {"report_interval": "1500ms"}},
        temporal={"address": env.client.service_client.config.target_host},
    )
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    return config, path


def _check_job(p, job_id: str, key_path: Path) -> None:  # type: ignore[no-untyped-def]
    records = p.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1)), "gapless, unique sequences"
    assert sum(r.is_final for r in records) == 1 and records[-1].is_final
    public = Signer.from_file(key_path).public_key
    assert all(verify_record(r, public) for r in records)
    settlement = p.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    assert sum_metrics([r.metrics for r in records]).wall_clock_seconds > 0


async def test_sigkill_worker_while_jobs_run_then_a_new_worker_finishes_them(
    temporal_env: WorkflowEnvironment,
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    worker_factory: list[WorkerProcess],
) -> None:
    config, config_path = _config(tmp_path, temporal_env)
    first = WorkerProcess(config_path, task_queue, key_path, tmp_path / "worker1.log")
    worker_factory.append(first)
    # The pipeline's in-process worker listens on another queue; the poller starts workflows on task_queue.
    # The workers' secrets: the adoption marker key derives from the provider's key, as in their processes.
    local = LocalAdapter.from_config(
        config, Secrets(provider_signing_key_path=key_path), config.hpc.cluster_id
    )
    async with running_pipeline(client, config, key_path, local, f"{task_queue}-unused") as p:
        p.poller.task_queue = task_queue
        first.start()
        jobs = [p.submit(script=BURN.format(s=6), name=f"burn{i}") for i in range(3)]
        jobs.append(p.submit(script="sleep 2\nexit 4\n", name="fails"))
        for job_id in jobs:
            await p.wait_started(job_id)
        for _ in range(100):
            if all(p.ledger.job(j).state == JobState.RUNNING for j in jobs[:3]):  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the burners never ran: the worker would be killed before any job runs")
        await asyncio.sleep(2.0)  # some usage records have been sent
        first.kill()
        await asyncio.sleep(1.0)
        second = WorkerProcess(config_path, task_queue, key_path, tmp_path / "worker2.log")
        worker_factory.append(second)
        second.start()
        results = await p.run_until_done(jobs, timeout=180)
        assert [results[j].state for j in jobs] == [JobState.COMPLETED] * 3 + [JobState.FAILED]
        for job_id in jobs:
            assert await local.find(job_id) is not None
            _check_job(p, job_id, key_path)
        # One execution per chain job: each local job directory ran its script exactly once.
        assert len(list((config.local_state_dir / "jobs").iterdir())) == len(jobs)


async def test_sigkill_between_scheduler_accept_and_activity_completion_submits_once(
    temporal_env: WorkflowEnvironment,
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    worker_factory: list[WorkerProcess],
) -> None:
    config, config_path = _config(tmp_path, temporal_env)
    # The workers' secrets: the adoption marker key derives from the provider's key, as in their processes.
    local = LocalAdapter.from_config(
        config, Secrets(provider_signing_key_path=key_path), config.hpc.cluster_id
    )
    async with running_pipeline(client, config, key_path, local, f"{task_queue}-unused") as p:
        p.poller.task_queue = task_queue
        marker = shared_dir() / "ran.log"  # the job, running as a tenant account, writes it
        job_id = p.submit(script=f"echo ran >> {marker}\nsleep 1\n", name="once")
        crashing = WorkerProcess(config_path, task_queue, key_path, tmp_path / "crash.log")
        worker_factory.append(crashing)
        crashing.start("--crash-after-submit", job_id)
        await p.wait_started(job_id)
        assert crashing.proc is not None
        await asyncio.to_thread(crashing.proc.wait, 60)
        assert crashing.proc.returncode == -signal.SIGKILL, "the worker died inside the submit activity"
        healthy = WorkerProcess(config_path, task_queue, key_path, tmp_path / "healthy.log")
        worker_factory.append(healthy)
        healthy.start()
        results = await p.run_until_done([job_id], timeout=120)
        assert results[job_id].state == JobState.COMPLETED
        assert marker.read_text() == "ran\n", "the job ran exactly once"
        assert len(list((config.local_state_dir / "jobs").iterdir())) == 1
        recovered = p.audit_events("state_recovered", job_id)
        assert recovered and recovered[0]["details"]["scheduler_job_id"] == results[job_id].scheduler_job_id
        _check_job(p, job_id, key_path)
