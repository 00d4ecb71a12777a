"""Adoption markers on the real SLURM cluster: a tenant's look-alike is never adopted, on any path.

The attack: a tenant's job script runs ``sbatch --job-name=vehpc-<the next chain job id>`` with a forged comment.
Before markers, a retried submit of that chain job looked its job up by name, adopted the look-alike, and the victim's
script never ran while her escrow paid for the attacker's job. Now the name carries a tag (an HMAC under the
provider's secret over cluster, account and workflow id, ``virtengine_hpc.markers``) and only a job carrying it,
running as the expected account, is adopted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.base import RefusedAdoption, SubmitRequest
from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm.script import SubmitPlan
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.errors import SchedulerUnavailable
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "markers-"
ATTACKER, VICTIM = sc.BOB, sc.ALICE


def wid(label: str) -> str:
    return sc.workflow_id(SCOPE + label)


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)
    for path in Path(env["jobs_dir"]).glob(f"*/lookalike-{sc.TEST_PREFIX}{SCOPE}*"):
        path.unlink(missing_ok=True)


def lookalike_sbatch(env: dict[str, Any], victim: str, *, hold: bool = False, name: str | None = None) -> str:
    """The shell lines a tenant's script runs to plant a look-alike for ``victim``'s job (its output beside the
    planting job's, in the tenant's own directory: no tenant may write the jobs directory itself)."""
    return (
        f"export SLURM_CONF={env['slurm_conf']}\n"
        f"sbatch --parsable {'--hold ' if hold else ''}--job-name={name or 'vehpc-' + victim} "
        f"--comment='vehpc;wf={victim};storage_gb=0' --output=lookalike-{victim}-%j.out "
        "--time=5 --mem=64M --wrap='echo the look-alike ran; sleep 20'\n"
    )


class RefusesFirstSubmit:
    """The victim's first ``sbatch`` fails before reaching the controller (a dropped connection), so the adapter
    looks the job up before trying again: the path a look-alike used to be adopted on."""

    def __init__(self, adapter: SlurmAdapter, victim: str) -> None:
        self.real = adapter.backend.submit
        self.victim = victim
        self.refused = 0
        adapter.backend.submit = self.submit  # type: ignore[method-assign]

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        if claimed_workflow(plan.job_name) == self.victim and not self.refused:
            self.refused += 1
            raise SchedulerUnavailable("Connection refused (simulated, before sbatch ran)")
        return await self.real(plan, account)


async def wait_lookalike(
    env: dict[str, Any], victim: str, pipe: Pipeline | None = None, timeout: float = 90
) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pipe is not None:
            await pipe.poller.poll_once()
        ids = sc.controller_jobs_of(env, victim)
        if ids:
            return ids
        await asyncio.sleep(0.5)
    raise AssertionError(f"the tenant's job never planted a look-alike for {victim}")


# ---- the whole pipeline: the look-alike comes from inside a real tenant job ---------------------------------------


@pytest.fixture(params=["cli", "rest"])
async def pipe(
    request: pytest.FixtureRequest,
    client: Client,
    tmp_path: Path,
    key_path: Path,
    task_queue: str,
    env: dict[str, Any],
) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "2s"},
            "retry": {"max_retries": 3, "initial_backoff": "200ms", "max_backoff": "1s"},
            "slurm": sc.slurm_section(env, request.param),
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env, key_path), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        p.ledger.fund(ATTACKER, Decimal("100000"))
        yield p


async def test_a_lookalike_planted_by_a_tenant_job_is_never_adopted_or_billed(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    victim = wid("victim")
    assert isinstance(pipe.adapter, SlurmAdapter)
    refuses = RefusesFirstSubmit(pipe.adapter, victim)
    attacker = pipe.submit(
        job_id=wid("attacker"),
        tenant=ATTACKER,
        script="#!/bin/bash\n" + lookalike_sbatch(env, victim),
        resources={"memory_mb_per_node": 256},
    )
    lookalikes = await wait_lookalike(env, victim, pipe)
    pipe.submit(
        job_id=victim,
        tenant=VICTIM,
        script="#!/bin/bash\necho the victim ran\n",
        resources={"memory_mb_per_node": 256},
    )
    results = await pipe.run_until_done([attacker, victim], timeout=180)

    assert refuses.refused == 1, "the victim's submit went through a lookup"
    assert results[victim].state == JobState.COMPLETED, results[victim]
    own = results[victim].scheduler_job_id or ""
    assert own not in lookalikes
    assert sc.job_output(env, victim, own).strip() == "the victim ran", "the victim's own script ran"
    records = pipe.ledger.usage_records(victim)
    assert records and {r.scheduler_job_id for r in records} == {own}, "the victim pays for her job only"
    billed = {r.scheduler_job_id for job in (attacker, victim) for r in pipe.ledger.usage_records(job)}
    assert not billed & set(lookalikes), "nobody is billed for the look-alike through a workflow"
    refused = pipe.audit_events("adoption_refused", job_id=victim)
    assert {e["details"]["scheduler_job_id"] for e in refused} == set(lookalikes)
    assert all(e["severity"] == 4 and not e["success"] for e in refused)
    assert "no valid marker" in refused[0]["error_msg"]


# ---- every adoption path, on every transport ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=sc.TRANSPORTS)
async def held(request: pytest.FixtureRequest, env: dict[str, Any]) -> AsyncIterator[SlurmAdapter]:
    adapter = sc.adapter(env, request.param, hold=True)
    yield adapter
    await adapter.close()


def plant(env: dict[str, Any], victim: str, name: str | None = None) -> str:
    """A held look-alike, submitted by the attacker's own account (as a job of that tenant would)."""
    as_attacker = ["runuser", "-u", sc.account_of(env, ATTACKER), "--"]
    job_id = sc.slurm_command(
        env, [*as_attacker, "bash", "-c", lookalike_sbatch(env, victim, hold=True, name=name)]
    )
    assert job_id.strip().isdigit(), job_id
    return job_id.strip()


async def test_no_adoption_path_takes_a_lookalike(env: dict[str, Any], held: SlurmAdapter) -> None:
    refused: list[RefusedAdoption] = []
    held.on_refused_adoption(refused.append)
    victim = wid("paths")
    marked = held.job_name(held.owner(victim, VICTIM))
    bare = plant(env, victim)
    copied = plant(env, victim, name=marked)  # the very name the victim's job carries, seen in squeue
    guessed = plant(env, victim, name=f"vehpc-{victim}.{uuid.uuid4().hex}")
    job = sc.spec(victim, "true\n", tenant=VICTIM)

    assert await held.find(victim, VICTIM) is None, "recovery and find_job find nothing of the victim's"
    # A retry whose heartbeat details name a look-alike: refused, the victim's own job is submitted.
    first = await held.submit(SubmitRequest(workflow_id=victim, job=job, body="true\n", known_job_id=copied))
    own = first.scheduler_job_id
    assert own not in (bare, copied, guessed) and not first.adopted and first.duplicates_cancelled == []
    # A plain retry adopts the victim's own job, although the look-alikes are older.
    again = await held.submit(SubmitRequest(workflow_id=victim, job=job, body="true\n"))
    assert (again.scheduler_job_id, again.adopted) == (own, True)
    assert await held.find(victim, VICTIM) == own
    assert sorted(sc.controller_jobs_of(env, victim), key=int) == sorted(
        [bare, copied, guessed, own], key=int
    )
    reasons = {r.scheduler_job_id: r.reason for r in refused}
    assert set(reasons) == {bare, copied}, "the look-alikes a lookup sees are reported, once each"
    assert reasons[bare] == "its name carries no valid marker of the workflow"
    attacker, expected = sc.account_of(env, ATTACKER), sc.account_of(env, VICTIM)
    assert reasons[copied] == f"it runs as {attacker!r}, not as {expected!r}"

    # A first attempt (no lookup) while an older look-alike exists: the victim's own job is the answer.
    other = wid("first")
    plant(env, other)
    fresh = await held.submit(
        SubmitRequest(
            workflow_id=other, job=sc.spec(other, "true\n", tenant=VICTIM), body="true\n", first_attempt=True
        )
    )
    assert not fresh.adopted and fresh.duplicates_cancelled == []
    assert fresh.scheduler_job_id == max(sc.controller_jobs_of(env, other), key=int)
