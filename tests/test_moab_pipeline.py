"""MOAB end to end: chain poller, job workflow, the MOAB adapter over SSH against the simulator, signed usage,
settlement. Every outcome a tenant can see, on one provider."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client

from activities.schedulers.moab import MoabAdapter
from tests import moab_support as ms
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import verify_record


@pytest.fixture(scope="module")
def cluster() -> Iterator[ms.MoabCluster]:
    # Every job's walltime is capped at 10 s: long enough that the cancelled job is cancelled (poller, signal,
    # workflow, mjobctl over SSH) before its cap even on a loaded machine; the walltime job still times out.
    with ms.moab_cluster(walltime_cap=10.0, max_nodes=2) as c:
        yield c


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, cluster: ms.MoabCluster
) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "moab",
            "cluster_id": f"moab-{uuid.uuid4().hex[:8]}",
            "job_service": {"vanished_job_grace": "3s"},
            "moab": cluster.moab_section("ssh", job_poll_interval="300ms", default_queue="debug"),
            "tenants": cluster.tenants_section(),
        },
    )
    adapter = MoabAdapter.from_config(config, ms.secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_every_outcome_through_moab(pipe: Pipeline, key_path: Path, cluster: ms.MoabCluster) -> None:
    jobs = {
        "success": pipe.submit(script="i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done\necho ok\n"),
        "failure": pipe.submit(script="echo oops >&2\nexit 3\n"),
        "walltime": pipe.submit(script="sleep 120\n"),
        "cancelled": pipe.submit(script="sleep 120\n"),
        "rejected": pipe.submit(script="true\n", resources={"nodes": 3}),  # the chain allows 4; MOAB 2
    }
    await pipe.wait_started(jobs["cancelled"])
    for _ in range(150):
        await pipe.poller.poll_once()
        if pipe.ledger.job(jobs["cancelled"]).state == JobState.RUNNING:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.2)
    pipe.ledger.request_cancel(jobs["cancelled"])
    results = await pipe.run_until_done(list(jobs.values()), timeout=90)
    state = {label: results[job_id].state for label, job_id in jobs.items()}
    assert state == {
        "success": JobState.COMPLETED,
        "failure": JobState.FAILED,
        "walltime": JobState.TIMEOUT,
        "cancelled": JobState.CANCELLED,
        "rejected": JobState.FAILED,
    }
    assert pipe.ledger.job(jobs["failure"]).exit_code == 3  # type: ignore[union-attr]
    assert "MAXNODE" in results[jobs["rejected"]].message
    public = Signer.from_file(key_path).public_key
    for label in ("success", "failure", "walltime", "cancelled"):
        records = pipe.ledger.usage_records(jobs[label])
        assert [r.sequence for r in records] == list(range(1, len(records) + 1)), label
        assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
        assert all(verify_record(r, public) for r in records)
        settlement = pipe.ledger.settlement(jobs[label])
        assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    # one MOAB job per chain job, each named after its workflow, in the queue the offering was priced for
    for label in ("success", "failure", "walltime", "cancelled"):
        named = [j for j in cluster.moab.jobs.values() if claimed_workflow(j.name) == jobs[label]]
        assert len(named) == 1 and named[0].job_class == "debug"
