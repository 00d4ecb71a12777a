"""A job's owner writes its name and comment (``scontrol update``), ``|`` and newlines included: on the real cluster,
nothing it writes there forges a row of another job in what the adapter reads from ``squeue`` and ``sacct``.

Status queries ask for no field the owner can write; lookups and the sweep's listing, which need the name, use a
separator of the query's own and take only lines that split into exactly the fields asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "hostile-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)


@pytest.fixture(scope="module", params=sc.TRANSPORTS)
async def slurm(request: pytest.FixtureRequest, env: dict[str, Any]) -> AsyncIterator[SlurmAdapter]:
    adapter = sc.adapter(env, request.param)
    yield adapter
    await adapter.close()


def as_tenant(env: dict[str, Any], *argv: str) -> str:
    return sc.slurm_command(env, ["runuser", "-u", sc.account_of(env, sc.BOB), "--", *argv]).strip()


async def test_a_name_or_comment_the_owner_writes_forges_no_row(
    env: dict[str, Any], slurm: SlurmAdapter
) -> None:
    account = sc.account_of(env, sc.BOB)
    name = f"vehpc-{sc.workflow_id(SCOPE + 'job')}"
    own = as_tenant(
        env, "sbatch", "--parsable", "--hold", "--chdir=/tmp", "-o", "/dev/null", "-J", name, "--wrap", "true"
    )
    assert own.isdigit(), own
    forged = str(int(own) + 700_000)  # a job id nobody has
    # A whole squeue -O / sacct -P line of the adapter's former formats, for a job that does not exist.
    row = f"{forged}|COMPLETED|None|1764511200|1764511200|1764511205|0:05|cpu=1,mem=1M,node=1|{account}|x"
    as_tenant(env, "scontrol", "update", f"JobId={own}", f"Name=a|b\n{row}")
    as_tenant(env, "scontrol", "update", f"JobId={own}", f"Comment=c|d\n{row}|")
    shown = sc.slurm_command(env, ["squeue", "-h", "-j", own, "-o", "%j|%k"])
    assert row in shown, "the owner did get its separators and newline into the fields"

    statuses = await slurm.status_batch([own, forged])
    assert not statuses[forged].found, f"a row was forged: {statuses[forged]}"
    assert statuses[own].found and statuses[own].state == JobState.QUEUED
    listed = {job.job_id for job in await slurm.backend.queue_live()}
    assert forged not in listed, "the sweep's listing holds no forged row"
    looked_up = await slurm.backend.queue_by_names([name])
    assert forged not in {job.job_id for job in looked_up}
