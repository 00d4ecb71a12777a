"""An operator resets a running job's workflow (the Web UI's Reset, ``temporal workflow reset``): what the chain and
the scheduler show at the end. The scheduler is the MOAB adapter over SSH against the simulator (the batch
adapters' shared submission path: a first attempt submits without a lookup).

A reset run replays the history up to the chosen point and runs the rest again: with a point before the submit
finished, ``submit_job`` runs again as the first attempt of the new run while the job the earlier run submitted
still runs. The new run must take that job over (one Slurm job for the chain job, usage that adds up to Slurm's
accounting, settled), whatever the sweep does next.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client

from activities.schedulers.moab import MoabAdapter
from tests import moab_support as ms
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.config import Config
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.messages import JobStatusView
from virtengine_hpc.states import JobState


@pytest.fixture(scope="module")
def cluster() -> Iterator[ms.MoabCluster]:
    with ms.moab_cluster(walltime_cap=120.0, max_nodes=2) as c:
        yield c


def moab_config(tmp_path: Path, cluster: ms.MoabCluster) -> Config:
    return make_config(
        tmp_path,
        hpc={
            "scheduler_type": "moab",
            "cluster_id": f"moab-{uuid.uuid4().hex[:8]}",
            "job_service": {"vanished_job_grace": "3s"},
            "usage_reporting": {"report_interval": "2s"},
            "moab": cluster.moab_section("ssh", job_poll_interval="300ms", default_queue="debug"),
            "tenants": cluster.tenants_section(),
        },
    )


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, cluster: ms.MoabCluster
) -> AsyncIterator[Pipeline]:
    config = moab_config(tmp_path, cluster)
    adapter = MoabAdapter.from_config(config, ms.secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def live_jobs_of(cluster: ms.MoabCluster, job_id: str) -> list[str]:
    return [
        jid
        for jid, j in cluster.moab.jobs.items()
        if claimed_workflow(j.name) == job_id and j.state not in ("Completed", "Removed", "Vacated")
    ]


def jobs_of(cluster: ms.MoabCluster, job_id: str) -> list[str]:
    return [jid for jid, j in cluster.moab.jobs.items() if claimed_workflow(j.name) == job_id]


async def view_of(p: Pipeline, job_id: str) -> JobStatusView:
    return await p.handle(job_id).query("status", result_type=JobStatusView)


async def wait_view(p: Pipeline, job_id: str, check: Any, timeout: float = 90) -> JobStatusView:
    deadline = time.monotonic() + timeout
    while True:
        await p.poller.poll_once()
        view = await view_of(p, job_id)
        if check(view):
            return view
        assert time.monotonic() < deadline, f"{job_id}: not reached in {timeout}s: {view}"
        await asyncio.sleep(0.3)


async def reset_to_first_workflow_task(client: Client, job_id: str) -> str:
    """What the Web UI's Reset (to the first workflow task) does; the new run's id."""
    return await reset_to(client, job_id, before_activity=None)


async def reset_to(client: Client, job_id: str, *, before_activity: str | None) -> str:
    """Reset to the first workflow task, or to the workflow task that scheduled ``before_activity`` (the run
    replayed up to that point finds the activity scheduled and runs it again); the new run's id."""
    handle = client.get_workflow_handle(job_id)
    completed = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    first_task: list[int] = []
    async for e in handle.fetch_history_events():
        if e.event_type == completed:
            first_task.insert(0, e.event_id)  # the latest workflow task first
        scheduled = e.activity_task_scheduled_event_attributes.activity_type.name
        if before_activity is None and first_task:
            break
        if before_activity is not None and scheduled == before_activity:
            break
    run_id = (await handle.describe()).run_id
    answer = await client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=job_id, run_id=run_id),
            reason="operator: reset to the first workflow task",
            workflow_task_finish_event_id=first_task[0],
            request_id=str(uuid.uuid4()),
        )
    )
    return answer.run_id


async def test_a_reset_across_the_submit_takes_over_the_running_job_and_settles_it(
    pipe: Pipeline, cluster: ms.MoabCluster
) -> None:
    """The reset run's submit is a first attempt of its run, but not the first submission of the chain job: the
    job the earlier run submitted runs on and holds that run's usage records. The reset run takes it over (one
    scheduler job), its records go on from the chain's (readings of the same scheduler job, nothing counted
    twice), and the chain settles the job."""
    job_id = pipe.submit(script="sleep 20\n")
    await pipe.wait_started(job_id)
    before = await wait_view(
        pipe, job_id, lambda v: v.state == JobState.RUNNING and v.usage_records >= 1 and v.scheduler_job_id
    )
    new_run = await reset_to_first_workflow_task(pipe.client, job_id)
    after = await wait_view(pipe, job_id, lambda v: v.scheduler_job_id is not None, timeout=60)
    assert (await pipe.handle(job_id).describe()).run_id == new_run

    results = await pipe.run_until_done([job_id], timeout=180)

    assert after.scheduler_job_id == before.scheduler_job_id, "the reset run took over the running job"
    assert jobs_of(cluster, job_id) == [before.scheduler_job_id], "one scheduler job for the chain job"
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records].count(True) == 1
    assert {r.scheduler_job_id for r in records} == {before.scheduler_job_id}, "every reading of that one job"
    assert pipe.ledger.settlement(job_id) is not None, "settled on the scheduler's accounting"


async def test_a_reset_of_a_settled_job_runs_nothing_again(pipe: Pipeline, cluster: ms.MoabCluster) -> None:
    """Reset offers itself on a closed workflow too. A job that has ended and settled must not run again: the
    chain keeps its state and settlement, and the scheduler gets no second job."""
    job_id = pipe.submit(script="echo once\n")
    results = await pipe.run_until_done([job_id], timeout=90)
    assert results[job_id].state == JobState.COMPLETED
    settled = pipe.ledger.settlement(job_id)
    records = pipe.ledger.usage_records(job_id)

    await reset_to_first_workflow_task(pipe.client, job_id)
    again = await pipe.run_until_done([job_id], timeout=120)

    assert again[job_id].state == JobState.COMPLETED, "the reset run ends with the chain's state"
    assert jobs_of(cluster, job_id) == [results[job_id].scheduler_job_id], "nothing submitted again"
    assert pipe.ledger.settlement(job_id) == settled
    assert pipe.ledger.usage_records(job_id) == records
    assert pipe.ledger.job(job_id).state == JobState.COMPLETED  # type: ignore[union-attr]
    assert not pipe.audit_events("job_parked", job_id), "no operator is called for a job that has ended"
    assert len(pipe.audit_events("job_submitted", job_id)) == 1


async def test_a_reset_to_the_task_that_scheduled_the_submit_takes_over_the_running_job(
    pipe: Pipeline, cluster: ms.MoabCluster
) -> None:
    """Reset to the workflow task that scheduled ``submit_job``: the new run finds the submit scheduled in the
    history it keeps and runs it again, as attempt 1 with the input the replaced run gave it. It still takes over
    the job that run submitted: one scheduler job, every record a reading of it, settled."""
    job_id = pipe.submit(script="sleep 20\n")
    await pipe.wait_started(job_id)
    before = await wait_view(
        pipe, job_id, lambda v: v.state == JobState.RUNNING and v.usage_records >= 1 and v.scheduler_job_id
    )
    new_run = await reset_to(pipe.client, job_id, before_activity="submit_job")
    after = await wait_view(pipe, job_id, lambda v: v.scheduler_job_id is not None, timeout=60)
    assert (await pipe.handle(job_id).describe()).run_id == new_run

    results = await pipe.run_until_done([job_id], timeout=180)

    assert after.scheduler_job_id == before.scheduler_job_id, "the reset run took over the running job"
    assert jobs_of(cluster, job_id) == [before.scheduler_job_id], "one scheduler job for the chain job"
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    records = pipe.ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert {r.scheduler_job_id for r in records} == {before.scheduler_job_id}, "every reading of that one job"
    assert pipe.ledger.settlement(job_id) is not None
