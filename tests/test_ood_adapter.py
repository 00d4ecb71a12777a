"""The Open OnDemand adapter: OIDC client credentials against a real-JWT identity provider (signature checked
against its JWKS), then submission through the underlying scheduler (MOAB over a real sshd) as the tenant's mapped
cluster user. Outcomes, the users jobs really run as, session URLs, refusals, exactly once, outages."""

from __future__ import annotations

import asyncio
import os
import pwd
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from activities.schedulers.base import SubmitRequest, SubmitResult
from activities.schedulers.ood import OODAdapter
from activities.tenant_accounts import AssignmentStore
from tests import moab_support as ms
from tests.conftest import make_config
from tests.sim import oidc
from tests.sim.https import HttpsServer
from tests.sim.moab import ensure_user
from virtengine_hpc.config import Config, Secrets, TenantsConfig
from virtengine_hpc.errors import (
    ConfigError,
    SchedulerUnavailable,
    SecurityError,
    SubmissionRejected,
)
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState
from virtengine_hpc.tenancy import TenantAccountError, TenantRules

USERS = ("vehpc-ood1", "vehpc-ood2")
ALICE, BOB, CAROL = "virtengine1tenant0alice", "virtengine1tenant0bob", "virtengine1tenant0carol"
CLIENT_ID = "virtengine-provider"
SECRET = f"s-{uuid.uuid4().hex}"
DASHBOARD = "https://ondemand.example.org"


@pytest.fixture(scope="module")
def users() -> tuple[str, str]:
    if not all(ensure_user(u, system=False) for u in USERS):
        # Root could create them: that it did not is a failure, not a missing precondition.
        if os.geteuid() == 0:
            pytest.fail(f"could not create the cluster users {', '.join(USERS)} as root (useradd failed)")
        pytest.skip("needs root to create the two cluster users the tenants map to")
    return USERS


@pytest.fixture(scope="module")
def cluster(users: tuple[str, str]) -> Iterator[ms.MoabCluster]:
    with ms.moab_cluster(walltime_cap=3.0) as c:
        # What the operator makes: a work dir of root's (this configuration names no provider account) and in it
        # each user's own job directory.
        os.chown(c.work_dir, 0, 0)
        for user in users:
            entry = pwd.getpwnam(user)
            (c.work_dir / user).mkdir(mode=0o700)
            os.chown(c.work_dir / user, entry.pw_uid, entry.pw_gid)
        yield c


@pytest.fixture(scope="module")
def idp(cluster: ms.MoabCluster) -> Iterator[oidc.IdP]:
    provider = oidc.IdP(CLIENT_ID, SECRET, users=[USERS[0], USERS[1]])
    server = HttpsServer(cluster.ca, oidc.IdPHandler, oidc.setup(provider))
    server.start()
    provider.issuer = server.url
    provider.server = server  # type: ignore[attr-defined]
    yield provider
    server.stop()


def ood_config(cluster: ms.MoabCluster, idp: oidc.IdP, tmp: Path, **ood: Any) -> Config:
    section = {
        "dashboard_url": DASHBOARD,
        "oidc_issuer": idp.issuer,
        "oidc_token_url": f"{idp.issuer}/token",
        "oidc_client_id": CLIENT_ID,
        "oidc_users_claim": "ood_users",
        "ca_cert": str(cluster.ca.ca_cert),
        "underlying_scheduler": "moab",
    }
    section.update(ood)
    return make_config(
        tmp,
        hpc={
            "scheduler_type": "ood",
            "cluster_id": f"ood-{uuid.uuid4().hex[:8]}",
            "retry": {"max_retries": 1, "initial_backoff": "100ms", "max_backoff": "200ms"},
            "moab": cluster.moab_section("ssh", ssh_user="placeholder"),
            "ood": section,
            "tenants": {"accounts": {ALICE: USERS[0], BOB: USERS[1], CAROL: "vehpcnobody"}},
        },
    )


def secrets(secret: str = SECRET) -> Secrets:
    return Secrets.from_env({"OOD_OIDC_CLIENT_SECRET": secret, "PROVIDER_MARKER_SECRET": ms.MARKER_SECRET})


@pytest.fixture
async def ood(cluster: ms.MoabCluster, idp: oidc.IdP, tmp_path: Path) -> AsyncIterator[OODAdapter]:
    config = ood_config(cluster, idp, tmp_path)
    adapter = OODAdapter.from_config(config, secrets(), config.hpc.cluster_id)
    yield adapter
    await adapter.close()


async def test_jobs_run_as_each_tenants_cluster_user(ood: OODAdapter, cluster: ms.MoabCluster) -> None:
    wf_a, wf_b = ms.workflow_id("ood-alice"), ms.workflow_id("ood-bob")
    a, b = await asyncio.gather(
        ms.run_job(ood, wf_a, ms.spec(wf_a, "id -un\n", tenant=ALICE)),
        ms.run_job(ood, wf_b, ms.spec(wf_b, "id -un\nexit 3\n", tenant=BOB)),
    )
    assert a.submitted.scheduler_job_id.startswith(f"{USERS[0]}/Moab.")
    assert b.submitted.scheduler_job_id.startswith(f"{USERS[1]}/Moab.")
    assert a.final.state == JobState.COMPLETED and a.final.exit_code == 0
    assert b.final.state == JobState.FAILED and b.final.exit_code == 3
    for outcome, user in ((a, USERS[0]), (b, USERS[1])):
        native = outcome.submitted.scheduler_job_id.split("/")[1]
        job = cluster.moab.jobs[native]
        assert job.user == user and job.uid == pwd.getpwnam(user).pw_uid, (
            "submitted over SSH as the mapped user"
        )
        out = cluster.work_dir / user / f"{job.name}.o{job.number}"  # the user's own directory, 0700
        assert out.read_text().strip() == user and os.stat(out).st_uid == job.uid, "and ran as that user"
        assert outcome.usage is not None and outcome.usage.final
        assert outcome.usage.scheduler_job_id == outcome.submitted.scheduler_job_id
    ssh_users = {r["uid"] for r in cluster.moab.argv_log() if r["command"] == "msub"}
    assert {pwd.getpwnam(u).pw_uid for u in USERS} <= ssh_users


async def test_running_session_names_the_dashboard_and_cancel_ends_it(ood: OODAdapter) -> None:
    wf = ms.workflow_id("ood-session")
    raw = ms.spec(wf, "x", tenant=ALICE).model_dump(exclude={"script"})
    job = JobSpec.model_validate({**raw, "template_id": "interactive-session"})
    # The body is what the template resolver rendered; a stand-in service that runs until cancelled.
    submitted = await ood.submit(SubmitRequest(workflow_id=wf, job=job, body="sleep 60\n"))
    job_id = submitted.scheduler_job_id
    assert job_id.startswith(f"{USERS[0]}/") and job_id.endswith("/session")
    for _ in range(100):
        status = (await ood.status_batch([job_id]))[job_id]
        if status.state == JobState.RUNNING:
            break
        await asyncio.sleep(0.1)
    assert status.state == JobState.RUNNING
    assert f"connect at {DASHBOARD}/pun/sys/dashboard/batch_connect/sessions" in status.reason
    await ood.cancel(job_id)
    status = (await ood.status_batch([job_id]))[job_id]
    assert status.state == JobState.CANCELLED and "pun/sys" not in status.reason
    await ood.cancel(job_id)  # ended: not an error


async def test_refusals_submit_nothing(
    ood: OODAdapter, cluster: ms.MoabCluster, idp: oidc.IdP, tmp_path: Path
) -> None:
    before = len(cluster.moab.jobs)
    wf = ms.workflow_id("ood-refused")
    with pytest.raises(
        TenantAccountError, match=r"has no cluster account: hpc\.tenants\.accounts does not name it"
    ):
        await ood.submit(
            SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n", tenant="virtengine1nobody0x"), body="x")
        )
    with pytest.raises(SecurityError, match="vehpcnobody"):  # mapped, but the IdP does not list the user
        await ood.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n", tenant=CAROL), body="x"))
    config = ood_config(cluster, idp, tmp_path)
    wrong = OODAdapter.from_config(config, secrets("not-the-secret"), config.hpc.cluster_id)
    with pytest.raises(SecurityError, match="refused client") as caught:
        await wrong.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n", tenant=ALICE), body="x"))
    assert "not-the-secret" not in str(caught.value) and SECRET not in str(caught.value)
    await wrong.close()
    for knob, value, match in (
        ("sign_with_stranger", True, "Signature verification failed"),
        ("lifetime", -120, "expired"),
        ("audience", "someone-else", "(?i)audience"),
    ):
        setattr(idp, knob, value)
        fresh = OODAdapter.from_config(config, secrets(), config.hpc.cluster_id)
        try:
            with pytest.raises(SecurityError, match=match):
                await fresh.submit(
                    SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n", tenant=ALICE), body="x")
                )
        finally:
            setattr(idp, knob, {"sign_with_stranger": False, "lifetime": 300, "audience": None}[knob])
            await fresh.close()
    assert len(cluster.moab.jobs) == before
    with pytest.raises(ConfigError, match="https"):
        OODAdapter.from_config(
            ood_config(cluster, idp, tmp_path, oidc_token_url=f"http://127.0.0.1:{idp.server.port}/token"),  # type: ignore[attr-defined]
            secrets(),
            "c",
        )


async def test_exactly_once_across_a_lost_answer_and_a_restarted_worker(
    ood: OODAdapter, cluster: ms.MoabCluster, idp: oidc.IdP, tmp_path: Path
) -> None:
    wf = ms.workflow_id("ood-once")
    job = ms.spec(wf, "sleep 30\n", tenant=BOB)
    inner = ood.adapter_for(USERS[1])
    real = inner.backend.submit  # type: ignore[attr-defined]

    async def lose_answer(plan: Any, account: str | None = None) -> str:
        await real(plan, account)
        raise SchedulerUnavailable("answer lost (simulated)")

    inner.backend.submit = lose_answer  # type: ignore[attr-defined]
    try:
        first = await ood.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or ""))
    finally:
        inner.backend.submit = real  # type: ignore[attr-defined]
    assert first.adopted
    restarted = OODAdapter.from_config(ood.config, secrets(), ood.cluster_id)
    again = await restarted.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or ""))
    assert again == SubmitResult(scheduler_job_id=first.scheduler_job_id, adopted=True)
    assert await restarted.find(wf) == first.scheduler_job_id
    assert [j.job_id for j in cluster.moab.jobs.values() if claimed_workflow(j.name) == wf] == [
        first.scheduler_job_id.split("/")[1]
    ]
    await restarted.cancel(first.scheduler_job_id)
    await restarted.close()


async def test_find_looks_only_under_the_tenants_own_cluster_user(ood: OODAdapter) -> None:
    """A recovery run of Alice's job asks for its workflow id: a job under Bob's cluster user that carries that id
    (and a valid marker, made for Bob's account) is never Alice's."""
    wf = ms.workflow_id("ood-scope")
    bobs = await ood.submit(
        SubmitRequest(workflow_id=wf, job=ms.spec(wf, "sleep 30\n", tenant=BOB), body="x")
    )
    assert bobs.scheduler_job_id.startswith(f"{USERS[1]}/")
    try:
        assert await ood.find(wf, ALICE) is None, "Alice's lookup does not search Bob's jobs"
        assert await ood.find(wf, CAROL) is None, "a tenant whose user has no jobs finds nothing"
        assert await ood.find(wf, BOB) == bobs.scheduler_job_id
    finally:
        await ood.cancel(bobs.scheduler_job_id)


async def test_outages_are_unavailable_not_state_changes(
    ood: OODAdapter, cluster: ms.MoabCluster, idp: oidc.IdP, tmp_path: Path
) -> None:
    config = ood_config(cluster, idp, tmp_path)
    wf = ms.workflow_id("ood-outage")
    job = ms.spec(wf, "sleep 30\n", tenant=ALICE)
    submitted = await ood.submit(SubmitRequest(workflow_id=wf, job=job, body="x"))
    idp.fail_with = 503
    try:
        fresh = OODAdapter.from_config(config, secrets(), config.hpc.cluster_id)
        with pytest.raises(SchedulerUnavailable):
            await fresh.submit(SubmitRequest(workflow_id=ms.workflow_id("x"), job=job, body="x"))
        await fresh.close()
    finally:
        idp.fail_with = None
    cluster.moab.stop()
    try:
        with pytest.raises(SchedulerUnavailable):
            await ood.status_batch([submitted.scheduler_job_id])
    finally:
        cluster.moab.start()
    status = await ood.status_batch([submitted.scheduler_job_id, "no-slash", "u/x/y"])
    assert status[submitted.scheduler_job_id].state in (JobState.QUEUED, JobState.RUNNING)
    assert not status["no-slash"].found and not status["u/x/y"].found
    await ood.cancel(submitted.scheduler_job_id)


async def test_a_link_in_place_of_a_users_directory_refuses_its_job_and_only_its_job(
    ood: OODAdapter, cluster: ms.MoabCluster
) -> None:
    """Each user's output goes to ``<work_dir>/<user>``, checked before every submission: a link left there,
    pointing at a directory another user reads, refuses that user's job (msub never runs); the other user's job
    runs. (Before, every user's output went to the work dir itself, which all of them could write.)"""
    victim = cluster.work_dir / USERS[1]
    moved = cluster.work_dir.parent / f"moved-{uuid.uuid4().hex[:6]}"
    victim.rename(moved)
    spy = cluster.home / f"spy-{uuid.uuid4().hex[:6]}"
    spy.mkdir(mode=0o777)
    spy.chmod(0o777)
    victim.symlink_to(spy)
    try:
        wf = ms.workflow_id("ood-linked")
        with pytest.raises(SubmissionRejected, match="is a symbolic link") as caught:
            await ood.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "id -un\n", tenant=BOB), body="x"))
        assert caught.value.code == "work_dir_unsafe"
        assert not [j for j in cluster.moab.jobs.values() if claimed_workflow(j.name) == wf]
        wf = ms.workflow_id("ood-goes-on")
        outcome = await ms.run_job(ood, wf, ms.spec(wf, "id -un\n", tenant=ALICE))
        assert outcome.final.state == JobState.COMPLETED
        assert list(spy.iterdir()) == []
    finally:
        victim.unlink()
        moved.rename(victim)


async def test_a_pool_user_with_jobs_is_never_handed_to_a_new_tenant(
    cluster: ms.MoabCluster, idp: oidc.IdP, tmp_path: Path
) -> None:
    """Worker A's assignments file gave tenant X the pool's cluster user and X's job runs as it; worker B keeps a
    file of its own (lost and recreated, or another host's). Before handing the user to a new tenant, B asks the
    scheduler under OOD for that user's jobs, as OOD's Active Jobs app does (as that user), and refuses the new
    tenant Z rather than run Z's jobs as X's user."""
    x, z = "virtengine1tenant0x", "virtengine1tenant0z"
    AssignmentStore(tmp_path / "a.db").assign(x, TenantRules(pool=(USERS[1],)))

    def worker(db: str) -> OODAdapter:
        config = ood_config(cluster, idp, tmp_path)
        tenants = TenantsConfig(pool=[USERS[1]], assignments_path=tmp_path / db)
        config = config.model_copy(update={"hpc": config.hpc.model_copy(update={"tenants": tenants})})
        return OODAdapter.from_config(config, secrets(), config.hpc.cluster_id)

    worker_a, worker_b = worker("a.db"), worker("b.db")
    x_wf, z_wf = ms.workflow_id("ood-pool-x"), ms.workflow_id("ood-pool-z")
    try:
        own = await worker_a.submit(
            SubmitRequest(workflow_id=x_wf, job=ms.spec(x_wf, "sleep 30\n", tenant=x), body="x")
        )
        assert own.scheduler_job_id.startswith(f"{USERS[1]}/")
        with pytest.raises(TenantAccountError, match=r"accounts of hpc\.tenants\.pool are taken") as refused:
            await worker_b.submit(
                SubmitRequest(workflow_id=z_wf, job=ms.spec(z_wf, "true\n", tenant=z), body="x")
            )
        assert f"held back, not handed to a new tenant: {USERS[1]}: " in str(refused.value)
        assert [j for j in cluster.moab.jobs.values() if claimed_workflow(j.name) == z_wf] == []
        assert AssignmentStore(tmp_path / "b.db").all() == {}, "nothing recorded for the new tenant"
        await worker_a.cancel(own.scheduler_job_id)
    finally:
        await worker_a.close()
        await worker_b.close()
