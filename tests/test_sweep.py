"""The sweep for scheduler jobs no workflow names, on the real SLURM cluster (``workers/sweeper.py``).

The late ``sbatch`` of a killed submit attempt, landing after the retry's duplicate check, is played by the
adapter's own submission call (``_submit_new``, what every attempt's ``sbatch`` is) for a workflow whose submit
has finished: one sweep, one scheduler listing, cancels it and audits it, and the workflow's own job is left
alone (the workflow then closes it as usual). The same late job after the workflow has closed and settled is cancelled as unowned; one whose workflow
the chain does not know (another provider's, another test run's) is left alone; with ``unowned_jobs: report``
nothing is cancelled.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.audit import read_events
from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.config import Config
from virtengine_hpc.messages import CancelRequest, JobStatusView
from virtengine_hpc.states import JobState
from workers.metrics import WorkerMetrics
from workers.sweeper import JobSweep
from workers.wiring import task_queue as queue_of
from workers.worker import WorkerProcess

pytestmark = pytest.mark.slurm
SCOPE = "sweep-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


def slurm_config(tmp_path: Path, env: dict[str, Any], **job_service: Any) -> Config:
    return make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s", **job_service},
            "usage_reporting": {"report_interval": "1h"},
            "slurm": sc.slurm_section(env, "cli"),
            "tenants": sc.tenants_section(env),
        },
    )


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> AsyncIterator[Pipeline]:
    config = slurm_config(tmp_path, env)
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def slurm(p: Pipeline) -> SlurmAdapter:
    assert isinstance(p.adapter, SlurmAdapter)
    return p.adapter


def sweep(p: Pipeline, env: dict[str, Any], config: Config | None = None) -> JobSweep:
    """A sweep as the poller process runs it: with an adapter of its own (its calls are the sweep's alone)."""
    config = config or p.config
    own = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    return JobSweep(p.client, p.ledger, own, config, p.deps.audit, metrics=WorkerMetrics())


def calls_of(s: JobSweep) -> dict[str, int]:
    assert isinstance(s.adapter, SlurmAdapter)
    return dict(s.adapter.backend.calls)


async def late_sbatch(p: Pipeline, workflow_id: str) -> str:
    """What a killed attempt's ``sbatch`` leaves when the controller completes it late: a job carrying the
    workflow's marker that no workflow was told about."""
    job = sc.spec(workflow_id, "#!/bin/bash\nsleep 300\n")
    return await slurm(p)._submit_new(SubmitRequest(workflow_id=workflow_id, job=job, body=job.script or ""))


async def named_job(p: Pipeline, job_id: str, timeout: float = 60) -> str:
    """The Slurm job the workflow names, once its submit has finished."""
    await p.wait_started(job_id)
    for _ in range(int(timeout / 0.3)):
        view = await p.handle(job_id).query("status", result_type=JobStatusView)
        if view.scheduler_job_id is not None:
            return view.scheduler_job_id
        await asyncio.sleep(0.3)
    raise AssertionError(f"{job_id} named no Slurm job within {timeout:.0f} s")


async def still_its_own(p: Pipeline, job_id: str, own: str) -> None:
    """After the sweep the workflow's own job is untouched, and the workflow closes it as usual (cancelled here:
    on a busy cluster the job may wait in the queue for a long time)."""
    status = (await slurm(p).status_batch([own]))[own]
    assert status.found and not status.state.final, f"the workflow's own job is untouched: {status}"
    await p.handle(job_id).execute_update(
        "request_cancel", CancelRequest(reason="test over"), result_type=JobStatusView
    )
    results = await p.run_until_done([job_id], timeout=120)
    assert results[job_id].scheduler_job_id == own
    assert results[job_id].state in (JobState.CANCELLED, JobState.COMPLETED), results[job_id].message
    assert p.ledger.settlement(job_id) is not None


def swept(p: Pipeline, event: str) -> list[dict[str, Any]]:
    return [
        e["details"]
        for e in read_events(p.config.hpc.audit.log_path)
        if e["event_type"] == event and e["details"].get("found_by") == "sweep"
    ]


async def test_a_late_duplicate_is_cancelled_by_one_sweep_and_the_workflows_job_runs_on(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "dup"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    zombie = await late_sbatch(pipe, job_id)
    assert sorted(sc.controller_jobs_of(env, job_id)) == sorted([own, zombie])

    sweeper = sweep(pipe, env)
    await sweeper.adapter.status_batch([own])  # its first call checks the cluster (scontrol show config)
    before = calls_of(sweeper)
    stats = await sweeper.sweep_once()
    calls = {k: v - before.get(k, 0) for k, v in calls_of(sweeper).items() if v != before.get(k, 0)}

    assert stats.duplicates == [zombie] and stats.unowned == []
    assert calls == {"squeue": 1, "scancel": 1}, "one listing for the whole cluster, one cancel"
    assert (await sc.wait_final(slurm(pipe), zombie)).state == JobState.CANCELLED
    [audited] = swept(pipe, "duplicate_job_cancelled")
    assert audited["scheduler_job_id"] == zombie and audited["kept"] == own and audited["kind"] == "duplicate"
    await still_its_own(pipe, job_id, own)


async def test_a_late_job_of_a_settled_job_is_cancelled_as_unowned(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "closed"), script="#!/bin/bash\nsleep 300\n")
    await still_its_own(pipe, job_id, await named_job(pipe, job_id))  # closed and settled on chain
    zombie = await late_sbatch(pipe, job_id)
    stranger = await late_sbatch(pipe, sc.workflow_id(SCOPE + "unknown"))  # not on this chain: not ours

    stats = await sweep(pipe, env).sweep_once()

    assert stats.unowned == [zombie] and stats.duplicates == []
    assert (await sc.wait_final(slurm(pipe), zombie)).state == JobState.CANCELLED
    [audited] = swept(pipe, "unowned_job_cancelled")
    assert audited["scheduler_job_id"] == zombie and audited["kind"] == "unowned"
    still = (await slurm(pipe).status_batch([stranger]))[stranger]
    assert still.found and not still.state.final, "a job of a workflow the chain does not know is left alone"


async def test_report_only_leaves_the_job_running_and_audits_it(
    pipe: Pipeline, env: dict[str, Any], tmp_path: Path
) -> None:
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "report"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    zombie = await late_sbatch(pipe, job_id)
    reporting = pipe.config.model_copy(
        update={
            "hpc": pipe.config.hpc.model_copy(
                update={
                    "job_service": pipe.config.hpc.job_service.model_copy(update={"unowned_jobs": "report"})
                }
            )
        }
    )

    stats = await sweep(pipe, env, reporting).sweep_once()

    assert stats.duplicates == [zombie]
    [audited] = swept(pipe, "unowned_job_found")
    assert audited["scheduler_job_id"] == zombie and audited["kept"] == own
    status = (await slurm(pipe).status_batch([zombie]))[zombie]
    assert status.found and not status.state.final, "reported, not cancelled"
    await slurm(pipe).cancel(zombie)


async def test_the_poller_process_sweeps_its_cluster(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> None:
    """The production wiring: a worker run with its poller (``worker run --poller``) sweeps each cluster it
    serves every ``sweep_interval``, with no one calling the sweep by hand."""
    config = slurm_config(tmp_path, env, sweep_interval="1s")
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, f"{task_queue}-unused") as p:
        p.poller.task_queue = queue_of(config)
        process = WorkerProcess(
            config,
            sc.secrets(env, key_path),
            with_poller=True,
            chain=p.ledger,
            adapters={config.hpc.cluster_id: adapter},
            client=client,
        )
        await process.start()
        try:
            job_id = p.submit(job_id=sc.workflow_id(SCOPE + "process"), script="#!/bin/bash\nsleep 60\n")
            own = await named_job(p, job_id)
            zombie = await late_sbatch(p, job_id)
            assert (await sc.wait_final(adapter, zombie, timeout=60)).state == JobState.CANCELLED
            audits = swept(p, "duplicate_job_cancelled")
            assert len(audits) == 1, audits
            [audited] = audits
            assert audited["scheduler_job_id"] == zombie and audited["kept"] == own
            assert [s.cluster_id for s in process.sweeps] == [config.hpc.cluster_id]
            await still_its_own(p, job_id, own)
        finally:
            await process.stop()
