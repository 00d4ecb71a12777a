"""Each tenant's job directory under the shared ``work_dir``, on the real cluster (local CLI and CLI over SSH).

A tenant that could add or replace an entry of ``work_dir`` could link another tenant's directory to one it
reads and collect that tenant's outputs and session tokens. ``work_dir`` belongs to the provider (no tenant may
write it) and ``<work_dir>/<account>`` must be the account's own directory, mode 0700, not a link: checked before
every submission (over a tenant's SSH login, against the provider's last check in ``sbatch``'s own command). Here a link left in ``work_dir`` under Bob's account name (as a tenant could
plant it while ``work_dir`` was writable, the dev cluster's old layout) points at a directory Alice reads.
"""

from __future__ import annotations

import os
import pwd
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
from tests.local_support import reachable_dir, shared_dir
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.errors import SubmissionRejected
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "workdir-"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)


def wid(label: str) -> str:
    return sc.workflow_id(SCOPE + label)


def provider_dir() -> Path:
    """A fresh ``work_dir`` as the operator makes it: root's, 0755, every account may pass through to it."""
    path = reachable_dir("workdir") / "jobs"
    path.mkdir(mode=0o755)
    return path


def own_dir(parent: Path, account: str, mode: int = 0o700) -> Path:
    """``parent/account`` as the operator makes it for the account."""
    entry = pwd.getpwnam(account)
    path = parent / account
    path.mkdir(mode=mode)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(mode)
    return path


def spy_dir(account: str) -> Path:
    """A directory ``account`` owns and reads, open to every account (where a thief wants others' files)."""
    entry = pwd.getpwnam(account)
    path = shared_dir("spy") / account
    path.mkdir()
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o777)
    return path


def plant_link(path: Path, target: Path, account: str) -> None:
    """A link ``account`` left at ``path`` (made here as root: no tenant may write a provider's ``work_dir``)."""
    path.symlink_to(target)
    entry = pwd.getpwnam(account)
    os.lchown(path, entry.pw_uid, entry.pw_gid)


def request(wf: str, body: str, tenant: str) -> SubmitRequest:
    return SubmitRequest(workflow_id=wf, job=sc.spec(wf, body, tenant=tenant), body=body, first_attempt=True)


async def run_to_end(adapter: SlurmAdapter, wf: str, body: str, tenant: str) -> str:
    submitted = await adapter.submit(request(wf, body, tenant))
    final = await sc.wait_final(adapter, submitted.scheduler_job_id)
    assert final.state == JobState.COMPLETED, final
    return submitted.scheduler_job_id


async def refused(adapter: SlurmAdapter, wf: str, tenant: str) -> SubmissionRejected:
    with pytest.raises(SubmissionRejected) as caught:
        await adapter.submit(request(wf, "echo never\n", tenant))
    assert caught.value.code == "work_dir_unsafe" and not caught.value.transient
    return caught.value


@pytest.mark.parametrize("transport", ("cli", "ssh"))
async def test_a_link_in_place_of_another_tenants_directory_never_takes_its_output(
    env: dict[str, Any], transport: str
) -> None:
    alice, bob = sc.account_of(env, sc.ALICE), sc.account_of(env, sc.BOB)
    parent = provider_dir()
    own_dir(parent, alice)
    bobs = own_dir(parent, bob)
    spy = spy_dir(alice)
    adapter = sc.adapter(env, transport, work_dir=str(parent))
    try:
        # A legitimate job writes its output where the docs say: <work_dir>/<account>/vehpc-<wf>-<id>.out.
        wf1 = wid(f"bob-first-{transport}")
        first = await run_to_end(adapter, wf1, "echo bob-first-output\n", sc.BOB)
        out = bobs / f"vehpc-{wf1}-{first}.out"
        assert out.read_text() == "bob-first-output\n" and out.stat().st_uid == pwd.getpwnam(bob).pw_uid

        # After that check passed, Bob's directory is replaced by a link to Alice's: the next job is refused
        # (nothing cached), nothing of it reaches Slurm, nothing lands in Alice's directory.
        bobs.rename(parent.parent / f"bob-moved-{uuid.uuid4().hex[:6]}")
        plant_link(parent / bob, spy, alice)
        wf2 = wid(f"bob-second-{transport}")
        error = await refused(adapter, wf2, sc.BOB)
        assert f"{parent}/{bob} is a symbolic link" in str(error) and f"as {bob}" in str(error)
        assert sc.controller_jobs_of(env, wf2) == []

        # Alice's own job is not stopped by Bob's trouble.
        wf3 = wid(f"alice-{transport}")
        third = await run_to_end(adapter, wf3, "echo alice-output\n", sc.ALICE)
        assert (parent / alice / f"vehpc-{wf3}-{third}.out").read_text() == "alice-output\n"
        assert list(spy.iterdir()) == [], "nothing of Bob's reached Alice's directory"

        # A directory of Bob's that others may enter is refused the same way: files in it are not Bob's alone.
        (parent / bob).unlink()
        own_dir(parent, bob, mode=0o755)
        error = await refused(adapter, wid(f"bob-third-{transport}"), sc.BOB)
        assert "has mode 755, not 0700" in str(error)
    finally:
        await adapter.close()


async def test_a_work_dir_tenants_may_write_is_refused_before_anything_runs(env: dict[str, Any]) -> None:
    """The dev cluster's old layout (1777, sticky): any tenant could plant entries, so no job is submitted."""
    parent = shared_dir("workdir-open")
    own_dir(parent, sc.account_of(env, sc.ALICE))
    adapter = sc.adapter(env, "cli", work_dir=str(parent))
    try:
        wf = wid("open-parent")
        error = await refused(adapter, wf, sc.ALICE)
        assert f"work_dir {parent} is writable by other accounts (mode 1777)" in str(error)
        assert sc.controller_jobs_of(env, wf) == []
    finally:
        await adapter.close()


async def test_a_root_worker_makes_the_missing_directory_and_ssh_leaves_it_to_the_operator(
    env: dict[str, Any],
) -> None:
    alice = sc.account_of(env, sc.ALICE)
    parent = provider_dir()
    over_ssh = sc.adapter(env, "ssh", work_dir=str(parent))
    local = sc.adapter(env, "cli", work_dir=str(parent))
    try:
        # Over SSH the provider's account cannot give a directory away: the operator must, and is told how.
        wf = wid("ssh-missing")
        error = await refused(over_ssh, wf, sc.ALICE)
        assert f"install -d -o {alice} -g {alice} -m 0700 {parent}/{alice}" in str(error)
        assert sc.controller_jobs_of(env, wf) == [] and not (parent / alice).exists()

        # The local CLI worker runs as root: it makes the directory, the account's own and 0700.
        wf = wid("cli-makes")
        job_id = await run_to_end(local, wf, "echo made\n", sc.ALICE)
        made = (parent / alice).lstat()
        assert made.st_uid == pwd.getpwnam(alice).pw_uid and made.st_mode & 0o7777 == 0o700
        assert (parent / alice / f"vehpc-{wf}-{job_id}.out").read_text() == "made\n"
        await run_to_end(over_ssh, wid("ssh-after"), "true\n", sc.ALICE)
    finally:
        await over_ssh.close()
        await local.close()


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> AsyncIterator[Pipeline]:
    parent = provider_dir()
    own_dir(parent, sc.account_of(env, sc.ALICE))
    plant_link(parent / sc.account_of(env, sc.BOB), spy_dir(sc.account_of(env, sc.ALICE)), sc.account_of(env))
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "2s"},
            "slurm": sc.slurm_section(env, "cli", work_dir=str(parent)),
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_the_refusal_is_on_chain_and_audited_and_the_other_tenants_job_completes(
    pipe: Pipeline,
) -> None:
    pipe.ledger.fund(sc.BOB, 1000)
    bobs = pipe.submit(job_id=wid("chain-bob"), tenant=sc.BOB, resources={"memory_mb_per_node": 256})
    alices = pipe.submit(job_id=wid("chain-alice"), resources={"memory_mb_per_node": 256})
    results = await pipe.run_until_done([bobs, alices], timeout=180)

    assert results[alices].state == JobState.COMPLETED, results[alices]
    assert results[bobs].state == JobState.FAILED
    job = pipe.ledger.job(bobs)
    assert job is not None and "is a symbolic link" in job.status_message
    settlement = pipe.ledger.settlement(bobs)
    assert settlement is not None and settlement.charged == 0, "the escrow goes back in full"
    events = pipe.audit_events("job_submission_failed", bobs)
    assert events and events[-1]["details"]["code"] == "work_dir_unsafe"
    assert "symbolic link" in events[-1]["error_msg"]
    alerts = pipe.audit_events("security_violation", bobs)
    assert alerts and alerts[-1]["details"]["code"] == "work_dir_unsafe" and alerts[-1]["severity"] == 4


class ProviderCommands:
    """The commands the provider's own SSH login runs (a wrapper of its runner: every command still runs)."""

    def __init__(self, adapter: SlurmAdapter) -> None:
        self.seen: list[str] = []
        runner = adapter.backend.executors.own.runner  # type: ignore[attr-defined]
        real = runner.run

        async def run(argv: list[str], **kwargs: Any) -> Any:
            self.seen.append(argv[0])
            return await real(argv, **kwargs)

        runner.run = run

    def count(self, command: str) -> int:
        return self.seen.count(command)


def work_dir_of(env: dict[str, Any], job_id: str) -> str:
    return sc.slurm_command(env, ["squeue", "-h", "-j", job_id, "-O", "WorkDir:500"]).strip()


async def test_over_ssh_the_check_rides_in_sbatchs_round_trip_and_still_refuses_a_swapped_directory(
    env: dict[str, Any],
) -> None:
    """Over a tenant's SSH login the provider checks the directory once with its own ``stat``; later submissions
    check it in the command that runs ``sbatch`` (no provider round trip), and anything not as checked goes back
    to the provider's check: a swapped directory is refused at the very next job."""
    alice = sc.account_of(env, sc.ALICE)
    parent = provider_dir()
    alices = own_dir(parent, alice)
    spy = spy_dir(sc.account_of(env, sc.BOB))
    adapter = sc.adapter(env, "ssh", work_dir=str(parent), hold=True)
    provider = ProviderCommands(adapter)
    try:
        jobs = [
            (await adapter.submit(request(wid(f"guard-{i}"), "true\n", sc.ALICE))).scheduler_job_id
            for i in range(3)
        ]
        assert provider.count("stat") == 1, "one provider check, then the check rides with sbatch"
        assert {work_dir_of(env, job) for job in jobs} == {str(alices)}

        # Swapped for a link to a directory another tenant reads: refused at the next job, nothing submitted.
        alices.rename(parent.parent / f"alice-moved-{uuid.uuid4().hex[:6]}")
        plant_link(parent / alice, spy, sc.account_of(env, sc.BOB))
        wf = wid("guard-swapped")
        error = await refused(adapter, wf, sc.ALICE)
        assert f"{parent}/{alice} is a symbolic link" in str(error)
        assert sc.controller_jobs_of(env, wf) == [] and list(spy.iterdir()) == []
        assert provider.count("stat") == 2

        # Made again by the operator, but open to others: refused the same way.
        (parent / alice).unlink()
        own_dir(parent, alice, mode=0o750)
        error = await refused(adapter, wid("guard-open"), sc.ALICE)
        assert "has mode 750, not 0700" in str(error)

        # Put right, and a harmless change above it (work_dir 0755 -> 0711): checked again, submitted once.
        (parent / alice).chmod(0o700)
        parent.chmod(0o711)
        wf = wid("guard-harmless")
        job = (await adapter.submit(request(wf, "true\n", sc.ALICE))).scheduler_job_id
        assert sc.controller_jobs_of(env, wf) == [job] and work_dir_of(env, job) == str(parent / alice)
        checks = provider.count("stat")
        await adapter.submit(request(wid("guard-after"), "true\n", sc.ALICE))
        assert provider.count("stat") == checks, "the new state is what the next submission compares with"
    finally:
        await adapter.close()


async def test_each_tenant_login_is_kept_and_opened_again_after_it_drops(env: dict[str, Any]) -> None:
    adapter = sc.adapter(env, "ssh", hold=True)
    try:
        for i in range(3):
            await adapter.submit(request(wid(f"login-alice-{i}"), "true\n", sc.ALICE))
        await adapter.submit(request(wid("login-bob"), "true\n", sc.BOB))
        executors = adapter.backend.executors  # type: ignore[attr-defined]
        alices = executors.get(sc.account_of(env, sc.ALICE)).runner
        bobs = executors.get(sc.account_of(env, sc.BOB)).runner
        assert (alices.connects, bobs.connects) == (1, 1), "one login per account, kept across submissions"

        alices._client.get_transport().close()  # the connection drops (sshd restarted, idle timeout)
        wf = wid("login-alice-after-drop")
        job = (await adapter.submit(request(wf, "true\n", sc.ALICE))).scheduler_job_id
        assert sc.controller_jobs_of(env, wf) == [job]
        assert (alices.connects, bobs.connects) == (2, 1)
    finally:
        await adapter.close()
