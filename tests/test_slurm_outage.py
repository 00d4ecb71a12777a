"""slurmctld stopped mid-run: every transport reports the scheduler unavailable (never a state change), a submit
made meanwhile fails as transient and leaves no job behind, no running job is marked failed, and all finish once the
controller is back (restarted with ``temporal-dev/slurm-up.sh``, which leaves running daemons alone).

The controller is stopped through its pid file, as an operator would; it is always brought back, even if the test
fails. Other tests using the cluster at the same moment see ten seconds of "unavailable" and carry on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.errors import SchedulerUnavailable
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "outage-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


def _alive(pid: int) -> bool:
    """Running, not a zombie (zombies linger a moment under this machine's PID 1)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_slurmctld(env: dict[str, Any]) -> None:
    pid_file = Path(env["state_dir"]) / "run" / "slurm" / "slurmctld.pid"
    pid = int(pid_file.read_text().strip())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "slurmctld did not stop"


def start_slurmctld() -> None:
    subprocess.run(
        [str(sc.REPO / "temporal-dev" / "slurm-up.sh")], check=True, capture_output=True, timeout=180
    )


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "3s"},
            "slurm": sc.slurm_section(env, "cli"),
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_controller_outage_is_not_a_state_change(pipe: Pipeline, env: dict[str, Any]) -> None:
    job_id = pipe.submit(
        job_id=sc.workflow_id(SCOPE + "pipe"),
        script="#!/bin/bash\nsleep 14\necho survived\n",
        resources={"memory_mb_per_node": 256},
    )
    deadline = time.monotonic() + 90
    while (job := pipe.ledger.job(job_id)) is None or job.state != JobState.RUNNING:
        assert time.monotonic() < deadline, f"never ran: {job}"
        await pipe.poller.poll_once()
        await asyncio.sleep(0.3)
    slurm_id = job.scheduler_job_id
    assert slurm_id is not None
    adapters = {t: sc.adapter(env, t, max_retries=0) for t in sc.TRANSPORTS}
    for adapter in adapters.values():  # connected and checked before the outage
        assert (await adapter.status_batch([slurm_id]))[slurm_id].state == JobState.RUNNING
    wf = sc.workflow_id(SCOPE + "during")
    stop_slurmctld(env)
    try:
        # Slurm's commands themselves retry for a while before they give up: ask everything at once.
        answers = await asyncio.gather(
            *(adapter.status_batch([slurm_id]) for adapter in adapters.values()),
            adapters["cli"].submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n")),
            return_exceptions=True,
        )
        for name, answer in zip([*adapters, "submit"], answers, strict=True):
            assert isinstance(answer, SchedulerUnavailable), f"{name}: {answer!r}"
            assert answer.transient
        assert pipe.ledger.job(job_id).state == JobState.RUNNING  # type: ignore[union-attr]
    finally:
        start_slurmctld()
    results = await pipe.run_until_done([job_id], timeout=120)
    assert results[job_id].state == JobState.COMPLETED, results[job_id]
    assert JobState.FAILED not in pipe.states_of(job_id)
    assert sc.job_output(env, job_id, slurm_id).strip() == "survived"
    assert await adapters["cli"].find(wf) is None, "the submit that failed in the outage left no job behind"
    for adapter in adapters.values():
        assert (await adapter.status_batch([slurm_id]))[slurm_id].state == JobState.COMPLETED
        with contextlib.suppress(Exception):
            await adapter.close()
