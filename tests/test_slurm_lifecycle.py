"""Walltime, suspension, requeue and Temporal's own Cancel on the real SLURM cluster.

What a provider would notice: a job the site suspends past its walltime slack (``scontrol suspend``) or requeues
(``scontrol requeue``) still completes, because walltime counts only the time the job ran (Slurm counts it the
same way); and the Web UI's Cancel (``WorkflowHandle.cancel``) cancels the Slurm job and ends the job on chain.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from tests.test_slurm_pipeline import wait_chain_state
from virtengine_hpc.messages import JobStatusView
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "life-"
R, S, C, X = JobState.RUNNING, JobState.SUSPENDED, JobState.COMPLETED, JobState.CANCELLED


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {
                "job_poll_interval": "500ms",
                "vanished_job_grace": "60s",
                "walltime_grace": "5s",
            },
            "usage_reporting": {"report_interval": "10s"},
            "slurm": sc.slurm_section(env, "cli"),
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def submit(p: Pipeline, script: str, **spec: Any) -> str:
    spec.setdefault("resources", {"memory_mb_per_node": 256})
    return p.submit(job_id=sc.workflow_id(SCOPE.rstrip("-")), script=script, **spec)


async def slurm_id(p: Pipeline, job_id: str) -> str:
    view = await p.handle(job_id).query("status", result_type=JobStatusView)
    assert view.scheduler_job_id is not None
    return view.scheduler_job_id


async def test_suspended_and_requeued_time_does_not_count_against_walltime(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    # Walltime 60 s (+5 s slack): the suspended job is on the cluster well past 65 s but runs less than 60 s. (A
    # job that really overruns is still stopped: tests/test_job_lifecycle.py; the local cluster has room for two.)
    suspended = submit(pipe, "#!/bin/bash\nsleep 45\necho done\n", walltime_seconds=60)
    # The requeued job runs until it is requeued (about 35 s), then 40 s: some 75 s of its walltime of 90 (both runs
    # count; the wait in the queue between them does not: Slurm holds a requeued job cred_expire + 1 s, 31 s on the
    # dev cluster and 121 s by default, so the job is on the cluster past 90 + 5 s either way). Its first run must
    # not end on its own before the requeue: Slurm requeues a batch job that has already ended too, after the chain
    # settled on that end (a first run of "sleep 40" did, on a loaded machine: settled completed, then held pending
    # to run again).
    requeued = submit(
        pipe,
        '#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then sleep 40; echo done; exit 0; fi\nsleep 300\n',
        walltime_seconds=90,
    )
    for job_id in (suspended, requeued):
        await wait_chain_state(pipe, job_id, R)
    await asyncio.sleep(10)
    sc.slurm_command(env, ["scontrol", "suspend", await slurm_id(pipe, suspended)])
    await asyncio.sleep(25)
    sc.slurm_command(env, ["scontrol", "requeue", await slurm_id(pipe, requeued)])
    await asyncio.sleep(40)  # suspended for 65 s in all: past walltime + slack since it started
    sc.slurm_command(env, ["scontrol", "resume", await slurm_id(pipe, suspended)])

    results = await pipe.run_until_done([suspended, requeued], timeout=240)

    assert results[suspended].state == C, results[suspended]
    assert S in pipe.states_of(suspended), "the chain saw the suspension"
    assert results[requeued].state == C, results[requeued]
    assert pipe.states_of(requeued).count(R) >= 2, "the chain saw it run again after the requeue"
    # Its runs' span on the cluster, the wait between them included, was past its walltime + slack (95 s).
    sid = results[requeued].scheduler_job_id or ""
    every_run = ["sacct", "--duplicates", "-X", "-P", "-n", "-j", sid, "-o", "Start,End"]
    spans = sc.slurm_command(env, every_run).split()
    assert len(spans) == 2 and int(spans[1].split("|")[1]) - int(spans[0].split("|")[0]) > 95, spans


async def test_temporal_cancel_cancels_the_slurm_job_and_ends_the_job_on_chain(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    job_id = submit(pipe, "#!/bin/bash\nsleep 300\n")
    await wait_chain_state(pipe, job_id, R)
    sid = await slurm_id(pipe, job_id)

    await pipe.handle(job_id).cancel()  # what the Web UI's Cancel button and `temporal workflow cancel` do

    results = await pipe.run_until_done([job_id], timeout=120)
    assert results[job_id].state == X
    line = sc.slurm_command(env, ["sacct", "-X", "-P", "-n", "-j", sid, "-o", "State"])
    assert line.strip().startswith("CANCELLED"), f"Slurm says {line!r}"
    records = pipe.ledger.usage_records(job_id)
    assert records and [r.is_final for r in records].count(True) == 1
    assert pipe.ledger.settlement(job_id) is not None
