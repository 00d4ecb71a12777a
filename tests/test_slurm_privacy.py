"""What Slurm's own configuration hides and bounds between tenants, on the real cluster as
``temporal-dev/slurm-up.sh`` sets it up (``PrivateData=accounts,jobs,usage,users`` in slurm.conf and
slurmdbd.conf; partition ``MaxTime`` and each tenant association's ``MaxWall`` at the longest walltime offered;
a ``job_submit.lua`` that refuses a raise of a job's time limit by anyone but root, SlurmUser and the provider).

One tenant sees nothing of another's jobs (names, owners, scripts, accounting), while the provider's account, a
Slurm operator, still follows every tenant's job; a tenant cannot raise its pending job's time limit (the
workflow's own deadline, walltime plus ``walltime_grace``, stops a job that runs longer in any case:
``tests/test_job_lifecycle.py``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

import pytest

from activities.schedulers.base import SubmitRequest
from tests import slurm_cluster as sc
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "privacy-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)


def as_account(env: dict[str, Any], account: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """A Slurm command as a tenant's account would run it from its own job or login."""
    return subprocess.run(
        ["runuser", "-u", account, "--", *argv],
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
        timeout=30,
    )


async def in_accounting(env: dict[str, Any], job_id: str) -> None:
    for _ in range(60):
        if sc.slurm_command(env, ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobIDRaw"]).strip():
            return
        await asyncio.sleep(1)
    raise AssertionError(f"job {job_id} never reached accounting")


async def test_a_tenant_sees_nothing_of_another_tenants_job_while_the_provider_follows_both(
    env: dict[str, Any],
) -> None:
    alice, bob = sc.account_of(env, sc.ALICE), sc.account_of(env, sc.BOB)
    adapter = sc.adapter(env, "cli", hold=True)
    canary = "echo bobs-private-script-canary\n"
    try:
        wf_a, wf_b = sc.workflow_id(SCOPE + "alice"), sc.workflow_id(SCOPE + "bob")
        a = await adapter.submit(SubmitRequest(workflow_id=wf_a, job=sc.spec(wf_a, "true\n"), body="true\n"))
        b = await adapter.submit(
            SubmitRequest(workflow_id=wf_b, job=sc.spec(wf_b, canary, tenant=sc.BOB), body=canary)
        )
        a_id, b_id = a.scheduler_job_id, b.scheduler_job_id
        await in_accounting(env, b_id)

        listed = as_account(env, alice, "squeue", "-h", "-t", "all", "-o", "%i|%j|%u").stdout
        ids = {line.split("|")[0] for line in listed.splitlines()}
        assert a_id in ids, "a tenant sees its own jobs"
        assert b_id not in ids and wf_b not in listed and bob not in listed, listed
        shown = as_account(env, alice, "scontrol", "show", "job", b_id)
        assert shown.returncode != 0 and f"JobId={b_id}" not in shown.stdout, shown
        script = as_account(env, alice, "scontrol", "write", "batch_script", b_id, "-")
        # (it exits 0 even when it refuses)
        assert "canary" not in script.stdout and "retrieval failed" in script.stderr, script
        accounted = as_account(
            env, alice, "sacct", "-X", "-n", "-P", "-j", b_id, "-o", "JobIDRaw,JobName,User"
        )
        assert accounted.stdout.strip() == "", accounted
        mine = as_account(env, alice, "sacct", "-X", "-n", "-P", "-j", a_id, "-o", "JobIDRaw")
        assert mine.stdout.split() == [a_id], "accounting still answers a tenant about its own job"
        users = as_account(env, alice, "sacctmgr", "-n", "-P", "show", "assoc", "format=user")
        assert bob not in users.stdout, users

        # The provider's account (root here; hpcuser, a Slurm operator, over SSH) still follows both.
        for transport in ("cli", "ssh"):
            follower = adapter if transport == "cli" else sc.adapter(env, "ssh")
            try:
                statuses = await follower.status_batch([a_id, b_id])
                assert all(statuses[j].found and statuses[j].state == JobState.QUEUED for j in (a_id, b_id))
                assert await follower.find(wf_b, sc.BOB) == b_id
            finally:
                if follower is not adapter:
                    await follower.close()
    finally:
        await adapter.close()


def partition_max_minutes(env: dict[str, Any]) -> int:
    line = sc.slurm_command(env, ["scontrol", "-o", "show", "partition", env["partition"]])
    value = next(f.split("=", 1)[1] for f in line.split() if f.startswith("MaxTime="))
    assert value != "UNLIMITED", "the partition bounds a job's time limit"
    days, _, clock = value.rpartition("-")
    hours, minutes, _ = clock.split(":")
    return int(days or 0) * 1440 + int(hours) * 60 + int(minutes)


def limit_minutes(env: dict[str, Any], job_id: str) -> int:
    seconds = sc.slurm_command(env, ["squeue", "-h", "-j", job_id, "-O", "TimeLimit"]).strip()
    days, _, clock = seconds.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 1440 + parts[0] * 60 + parts[1]


async def test_a_tenant_cannot_raise_its_pending_jobs_time_limit(env: dict[str, Any]) -> None:
    """Slurm lets a job's owner raise its pending job's limit up to the partition's MaxTime and the association's
    MaxWall; the cluster's job_submit plugin refuses any raise but the provider's, a tenant may still lower it, and
    a job asking more than MaxTime is refused at submission."""
    alice = sc.account_of(env, sc.ALICE)
    bound = partition_max_minutes(env)
    name = f"vehpc-{sc.workflow_id(SCOPE + 'limit')}"
    submitted = as_account(
        env,
        alice,
        "sbatch",
        "--parsable",
        "--hold",
        "-t",
        "2",
        "-J",
        name,
        "-o",
        "/dev/null",
        "--wrap",
        "true",
    )
    assert submitted.returncode == 0, submitted
    job_id = submitted.stdout.strip()
    try:
        for asked in (10, bound, bound + 1, 90 * 1440):
            raised = as_account(env, alice, "scontrol", "update", f"jobid={job_id}", f"timelimit={asked}")
            assert raised.returncode != 0, raised
            assert limit_minutes(env, job_id) == 2
        lowered = as_account(env, alice, "scontrol", "update", f"jobid={job_id}", "timelimit=1")
        assert lowered.returncode == 0 and limit_minutes(env, job_id) == 1, lowered
        too_long = as_account(
            env, alice, "sbatch", "--parsable", "--hold", "-t", str(bound + 1), "-J", name, "--wrap", "true"
        )
        assert too_long.returncode != 0, "a job asking more than the provider offers is refused outright"
    finally:
        sc.slurm_command(env, ["scancel", job_id])


def job_fields(env: dict[str, Any], job_id: str) -> dict[str, str]:
    shown = sc.slurm_command(env, ["scontrol", "-o", "show", "job", job_id])
    return dict(item.split("=", 1) for item in shown.split() if "=" in item)


async def test_a_tenant_cannot_give_its_pending_job_more_than_it_was_accepted_with(
    env: dict[str, Any],
) -> None:
    """A tenant that requeues its job (or catches it pending) and raises its CPUs, memory, GPUs or nodes, or moves
    it to another partition, account or QOS, would run with more than its quote priced: the cluster's job_submit
    plugin refuses every such change but the provider's. Name and comment stay the owner's to change (the
    markers are bound to the account, not to the name)."""
    alice = sc.account_of(env, sc.ALICE)
    name = f"vehpc-{sc.workflow_id(SCOPE + 'grow')}"
    submitted = as_account(
        env, alice, "sbatch", "--parsable", "--hold", "-c", "1", "--mem=100M", "-t", "2", "-J", name,
        "-o", "/dev/null", "--wrap", "true",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted
    job_id = submitted.stdout.strip()
    try:
        before = job_fields(env, job_id)
        for change in (
            "NumCPUs=2",
            "MinMemoryNode=4000",
            "NumNodes=1-2",
            "Gres=gpu:1",
            "Partition=debug",
            "QOS=normal",
        ):
            grown = as_account(env, alice, "scontrol", "update", f"jobid={job_id}", change)
            assert grown.returncode != 0, (change, grown)
        after = job_fields(env, job_id)
        for key in ("NumCPUs", "MinMemoryNode", "NumNodes", "Partition", "QOS", "TresPerNode"):
            assert after.get(key) == before.get(key), key
        renamed = as_account(env, alice, "scontrol", "update", f"jobid={job_id}", f"name={name}-x")
        assert renamed.returncode == 0, renamed
        provider = as_account(env, "hpcuser", "scontrol", "update", f"jobid={job_id}", "NumCPUs=2")
        assert provider.returncode == 0 and job_fields(env, job_id)["NumCPUs"] == "2", provider
    finally:
        sc.slurm_command(env, ["scancel", job_id])


def test_no_tenant_can_fill_the_controllers_job_table(env: dict[str, Any]) -> None:
    """A tenant's script that submits in a loop stops at its association's MaxSubmitJobs; every tenant's limit
    together stays under the controller's MaxJobCount, so no tenant's flood makes another's (or the provider's)
    sbatch fail with "Slurm temporarily unable to accept job"."""
    shown = sc.slurm_command(env, ["scontrol", "show", "config"])
    max_job_count = int(
        next(line.split("=", 1)[1] for line in shown.splitlines() if line.startswith("MaxJobCount"))
    )
    limits = {}
    for tenant in env["tenant_accounts"]:
        row = sc.slurm_command(
            env, ["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={tenant}", "format=maxsubmit"]
        ).split()
        limits[tenant] = int(row[0]) if row and row[0] else None
    assert all(limit is not None for limit in limits.values()), f"a tenant without MaxSubmitJobs: {limits}"
    assert sum(limit or 0 for limit in limits.values()) < max_job_count, (limits, max_job_count)
