"""The MOAB adapter against the simulator, for each transport: commands over a real sshd, and MOAB Web Services
over verified TLS. The same outcomes as the SLURM suite: completes, fails, times out, cancelled pending and
running, rejected, vanished, transient outage; plus hostile strings, exactly-once submission across a lost answer
and a restarted worker, one scheduler query per status round, and accounting from checkjob."""

from __future__ import annotations

import asyncio
import os
import pwd
import uuid
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.audit import AuditLog, read_events
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import RefusedAdoption, SubmitRequest, SubmitResult
from activities.schedulers.batch.transports import SSHRunner
from activities.schedulers.moab import MoabAdapter
from activities.tenant_accounts import AssignmentStore
from tests import moab_support as ms
from virtengine_hpc.config import TenantsConfig
from virtengine_hpc.errors import JobNotFound, SchedulerUnavailable, SecurityError, SubmissionRejected
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.metering import meter
from virtengine_hpc.states import JobState
from virtengine_hpc.tenancy import TenantAccountError, TenantRules
from workers.metrics import MeteredAuditLog, WorkerMetrics
from workers.sweeper import JobSweep

TRANSPORTS = ("ssh", "rest")


@pytest.fixture(scope="module")
def cluster() -> Iterator[ms.MoabCluster]:
    with ms.moab_cluster(walltime_cap=3.0) as c:
        yield c


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moab")


@pytest.fixture(params=TRANSPORTS)
async def moab(
    request: pytest.FixtureRequest, cluster: ms.MoabCluster, tmp_module: Path
) -> AsyncIterator[MoabAdapter]:
    adapter = cluster.adapter(tmp_module, request.param)
    yield adapter
    await adapter.close()


def _jobs_named(cluster: ms.MoabCluster, wf: str) -> list[str]:
    with cluster.moab.lock:
        return [j.job_id for j in cluster.moab.jobs.values() if claimed_workflow(j.name) == wf]


# ---- outcomes ----------------------------------------------------------------------------------------------------


async def test_completed_job_reports_exit_code_zero_and_final_usage(
    moab: MoabAdapter, cluster: ms.MoabCluster
) -> None:
    wf = ms.workflow_id("complete")
    burn = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done\nsleep 1\necho done\n"
    job = ms.spec(wf, burn, resources={"memory_mb_per_node": 256, "storage_gb": 5})
    outcome = await ms.run_job(moab, wf, job, sample_usage=True)
    assert outcome.final.state == JobState.COMPLETED and outcome.final.exit_code == 0
    assert JobState.RUNNING in outcome.states
    usage = outcome.usage
    assert usage is not None and usage.final
    reading = usage.reading
    assert (reading.cpu_time_seconds or 0) > 0, "CPU seconds come from checkjob's StatPSUtl"
    assert reading.allocated.memory_bytes == 256 * 1024 * 1024 and reading.allocated.nodes == 1
    wall = reading.wall_clock_seconds
    metered = meter(reading, job.resources)
    # memory GB-s = the allocation (256 MiB) times the wall clock, exactly
    assert metered.metrics.memory_gb_seconds == (Decimal(256 * 1024 * 1024) / Decimal(10**9) * wall).quantize(
        Decimal("0.000001")
    )
    # storage is billed as on every scheduler (the quote includes it), though MOAB allocates none itself
    assert metered.metrics.storage_gb_hours == (5 * wall / 3600).quantize(Decimal("0.000001")) > 0
    for live in outcome.live:  # cumulative: no live reading exceeds the final one
        assert (live.reading.cpu_time_seconds or 0) <= (reading.cpu_time_seconds or 0)
    name = cluster.moab.jobs[outcome.submitted.scheduler_job_id].name
    assert claimed_workflow(name) == wf and name != f"vehpc-{wf}", "the name carries the marker"
    out = cluster.output(name, outcome.submitted.scheduler_job_id.split(".")[-1])
    assert out.read_text().strip() == "done"
    again = await moab.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n"))
    assert again == SubmitResult(scheduler_job_id=outcome.submitted.scheduler_job_id, adopted=True)


async def test_failed_job_keeps_its_exit_code(moab: MoabAdapter) -> None:
    wf = ms.workflow_id("fail")
    outcome = await ms.run_job(moab, wf, ms.spec(wf, "echo failing >&2\nexit 3\n"))
    assert outcome.final.state == JobState.FAILED
    assert outcome.final.exit_code == 3
    assert "exit code 3" in outcome.final.reason
    assert outcome.usage is not None and outcome.usage.final


async def test_job_past_its_walltime_times_out(moab: MoabAdapter) -> None:
    wf = ms.workflow_id("timeout")
    outcome = await ms.run_job(moab, wf, ms.spec(wf, "sleep 60\n"))
    assert outcome.final.state == JobState.TIMEOUT, outcome.final
    assert "walltime" in outcome.final.reason
    assert outcome.usage is not None and outcome.usage.final and outcome.usage.reading.wall_clock_seconds >= 2


async def test_job_cancelled_while_running(moab: MoabAdapter) -> None:
    wf = ms.workflow_id("running-cancel")

    async def cancel(job_id: str) -> None:
        await asyncio.sleep(1)
        await moab.cancel(job_id)

    outcome = await ms.run_job(moab, wf, ms.spec(wf, "sleep 60\n"), on_running=cancel)
    assert JobState.RUNNING in outcome.states
    assert outcome.final.state == JobState.CANCELLED and outcome.final.reason.startswith("cancelled")
    assert outcome.usage is not None and outcome.usage.final and outcome.usage.reading.wall_clock_seconds >= 1
    await moab.cancel(outcome.submitted.scheduler_job_id)  # an ended job: not an error


async def test_pending_job_cancelled(cluster: ms.MoabCluster, tmp_module: Path) -> None:
    for transport in TRANSPORTS:
        adapter = cluster.adapter(tmp_module, transport, hold=True)
        wf = ms.workflow_id(f"pending-cancel-{transport}")
        submitted = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n")
        )
        status = (await adapter.status_batch([submitted.scheduler_job_id]))[submitted.scheduler_job_id]
        assert status.state == JobState.QUEUED and "user hold" in status.reason
        await adapter.cancel(submitted.scheduler_job_id)
        status = (await adapter.status_batch([submitted.scheduler_job_id]))[submitted.scheduler_job_id]
        assert status.state == JobState.CANCELLED and status.start_time is None
        usage = await adapter.usage(submitted.scheduler_job_id)
        assert usage.final and usage.reading.wall_clock_seconds == 0
        await adapter.close()


async def test_rejected_submission_is_final_with_moabs_reason(moab: MoabAdapter) -> None:
    wf = ms.workflow_id("reject")
    job = ms.spec(wf, "true\n", partition="nosuchqueue")
    with pytest.raises(SubmissionRejected) as caught:
        await moab.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n"))
    assert not caught.value.transient
    assert "nosuchqueue" in str(caught.value)
    too_big = ms.spec(wf, "true\n", resources={"nodes": 16})
    with pytest.raises(SubmissionRejected, match="MAXNODE"):
        await moab.submit(SubmitRequest(workflow_id=wf, job=too_big, body="true\n"))
    assert await moab.find(wf) is None


async def test_vanished_job_is_not_found_never_completed(cluster: ms.MoabCluster, tmp_module: Path) -> None:
    for transport in TRANSPORTS:
        adapter = cluster.adapter(tmp_module, transport, hold=True)
        wf = ms.workflow_id(f"vanish-{transport}")
        submitted = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n")
        )
        cluster.moab.vanish(submitted.scheduler_job_id)
        status = await adapter.status_batch([submitted.scheduler_job_id, "Moab.999999"])
        assert not status[submitted.scheduler_job_id].found
        assert status[submitted.scheduler_job_id].state != JobState.COMPLETED
        assert not status["Moab.999999"].found
        with pytest.raises(JobNotFound):
            await adapter.usage(submitted.scheduler_job_id)
        await adapter.close()


async def test_batch_hold_that_never_clears_fails_the_job_and_cancels_it(
    cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    adapter = cluster.adapter(tmp_module, "ssh", hold=True)
    wf = ms.workflow_id("batchhold")
    submitted = await adapter.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n"))
    cluster.moab.batch_hold(submitted.scheduler_job_id, "RMReject")
    status = (await adapter.status_batch([submitted.scheduler_job_id]))[submitted.scheduler_job_id]
    assert status.state == JobState.FAILED and "will never start" in status.reason
    assert cluster.moab.jobs[submitted.scheduler_job_id].state == "Removed", (
        "cancelled so it cannot start later"
    )
    await adapter.close()


# ---- outages --------------------------------------------------------------------------------------------------


async def test_moab_server_down_is_unavailable_not_a_state_change(
    cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    adapters = {t: cluster.adapter(tmp_module, t, hold=True) for t in TRANSPORTS}
    wf = ms.workflow_id("outage")
    held = await adapters["ssh"].submit(
        SubmitRequest(workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n")
    )
    job_id = held.scheduler_job_id
    cluster.moab.stop()
    cluster.mws.fail_with = 503
    try:
        for name, adapter in adapters.items():
            with pytest.raises(SchedulerUnavailable) as caught:
                await adapter.status_batch([job_id])
            assert caught.value.transient, name
            wf2 = ms.workflow_id(f"during-outage-{name}")
            with pytest.raises(SchedulerUnavailable):
                await adapter.submit(
                    SubmitRequest(workflow_id=wf2, job=ms.spec(wf2, "true\n"), body="true\n")
                )
    finally:
        cluster.moab.start()
        cluster.mws.fail_with = None
    for adapter in adapters.values():
        assert (await adapter.status_batch([job_id]))[job_id].state == JobState.QUEUED
    assert not [j for j in cluster.moab.jobs.values() if j.name.startswith("vehpc-moabtest-during-outage")]
    cluster.sshd.stop()
    try:
        with pytest.raises(SchedulerUnavailable):
            await adapters["ssh"].status_batch([job_id])
    finally:
        cluster.sshd.start()
    assert (await adapters["ssh"].status_batch([job_id]))[job_id].state == JobState.QUEUED
    await adapters["ssh"].cancel(job_id)
    for adapter in adapters.values():
        await adapter.close()


# ---- exactly once ----------------------------------------------------------------------------------------------


async def test_lost_submit_answer_and_restarted_worker_leave_one_job(
    moab: MoabAdapter, cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    wf = ms.workflow_id("lost-answer")
    job = ms.spec(wf, "sleep 30\n")
    real_submit = moab.backend.submit

    async def submit_then_lose_answer(plan: Any, account: str | None = None) -> str:
        await real_submit(plan, account)
        raise SchedulerUnavailable("connection reset after the job was accepted (simulated)")

    moab.backend.submit = submit_then_lose_answer  # type: ignore[method-assign]
    try:
        first = await moab.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or ""))
    finally:
        moab.backend.submit = real_submit  # type: ignore[method-assign]
    assert first.adopted, "the retry found the job the lost answer had created"
    # The worker dies and another starts: a fresh adapter (no memory of the first) submits the same workflow.
    transport = moab.config.transport
    fresh = cluster.adapter(tmp_module, transport)
    second = await fresh.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or ""))
    assert second == SubmitResult(scheduler_job_id=first.scheduler_job_id, adopted=True)
    concurrent = await asyncio.gather(
        *(fresh.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or "")) for _ in range(5))
    )
    assert {r.scheduler_job_id for r in concurrent} == {first.scheduler_job_id}
    assert _jobs_named(cluster, wf) == [first.scheduler_job_id]
    await fresh.cancel(first.scheduler_job_id)
    await fresh.close()


async def test_a_lookalike_named_like_a_workflows_job_is_never_adopted(
    moab: MoabAdapter, cluster: ms.MoabCluster
) -> None:
    """Bob's job (running as Bob's account) runs ``msub`` for Alice's next chain job: once with the bare name, once
    with the very name Alice's job will carry (seen in ``showq``, say). No lookup takes either, Alice's own job is
    submitted and adopted, and the look-alikes are reported."""
    refused: list[RefusedAdoption] = []
    moab.on_refused_adoption(refused.append)
    wf = ms.workflow_id("lookalike")
    alice, bob = cluster.tenant_users
    marked = moab.job_name(moab.owner(wf, ms.ALICE))
    bob_user = pwd.getpwnam(bob)
    planted = [
        cluster.moab.handle(bob_user.pw_uid, bob_user.pw_gid, "msub", ["-N", name, "-h"], "sleep 30\n")
        for name in (f"vehpc-{wf}", marked)
    ]
    bare, copied = (answer["stdout"].strip() for answer in planted)
    assert bare.startswith("Moab.") and copied.startswith("Moab."), planted
    assert await moab.find(wf, ms.ALICE) is None
    job = ms.spec(wf, "true\n", tenant=ms.ALICE)
    own = await moab.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n", known_job_id=copied))
    assert own.scheduler_job_id not in (bare, copied) and not own.adopted
    again = await moab.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n"))
    assert (again.scheduler_job_id, again.adopted) == (own.scheduler_job_id, True)
    assert await moab.find(wf, ms.ALICE) == own.scheduler_job_id
    reasons = {r.scheduler_job_id: r.reason for r in refused}
    assert set(reasons) == {bare, copied}
    assert reasons[copied] == f"it runs as {bob!r}, not as {alice!r}"
    assert cluster.moab.jobs[own.scheduler_job_id].name == marked
    assert cluster.moab.jobs[own.scheduler_job_id].user == alice
    for job_id in (bare, copied, own.scheduler_job_id):
        await moab.cancel(job_id)


async def test_submitter_killed_after_msub_leaves_exactly_one_job(
    cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    """A worker process killed (SIGKILL) right after msub returned, before it recorded anything."""
    import subprocess
    import sys

    wf = ms.workflow_id("killed")
    config = cluster.config(tmp_module, "ssh")
    code = (
        "import asyncio, os, signal, sys\n"
        "from activities.schedulers.base import SubmitRequest\n"
        "from activities.schedulers.moab import MoabAdapter\n"
        "from tests import moab_support as ms\n"
        "from virtengine_hpc.config import Config\n"
        "config = Config.model_validate_json(sys.stdin.read())\n"
        "adapter = MoabAdapter.from_config(config, ms.secrets(), config.hpc.cluster_id)\n"
        "real = adapter.backend.submit\n"
        "async def submit(plan, account=None):\n"
        "    await real(plan, account)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "adapter.backend.submit = submit\n"
        f"job = ms.spec({wf!r}, 'sleep 30\\n')\n"
        f"asyncio.run(adapter.submit(SubmitRequest(workflow_id={wf!r}, job=job, body='sleep 30\\n')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=config.model_dump_json(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parents[1]),
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(_jobs_named(cluster, wf)) == 1
    adapter = cluster.adapter(tmp_module, "ssh")
    again = await adapter.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "sleep 30\n"), body="x"))
    assert again.adopted and _jobs_named(cluster, wf) == [again.scheduler_job_id]
    await adapter.cancel(again.scheduler_job_id)
    await adapter.close()


# ---- batching, hostile strings, security ------------------------------------------------------------------------


async def test_status_of_many_jobs_is_one_query(cluster: ms.MoabCluster, tmp_module: Path) -> None:
    for transport in TRANSPORTS:
        adapter = cluster.adapter(tmp_module, transport, hold=True)
        ids = []
        for n in range(6):
            wf = ms.workflow_id(f"batch-{transport}-{n}")
            ids.append(
                (
                    await adapter.submit(SubmitRequest(workflow_id=wf, job=ms.spec(wf, "x\n"), body="x\n"))
                ).scheduler_job_id
            )
        before = adapter.calls
        statuses = await adapter.status_batch(ids)
        after = adapter.calls
        spent = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
        assert spent == ({"showq": 1} if transport == "ssh" else {"GET jobs": 1}), spent
        assert {job_id: s.state for job_id, s in statuses.items()} == dict.fromkeys(ids, JobState.QUEUED)
        for job_id in ids:
            await adapter.cancel(job_id)
        await adapter.close()


async def test_hostile_strings_stay_literal(moab: MoabAdapter, cluster: ms.MoabCluster) -> None:
    marker = Path(f"/tmp/vehpc-pwned-{uuid.uuid4().hex[:8]}")
    hostile = {
        "SUBST": f"$(touch {marker})",
        "TICKS": f"`touch {marker}`",
        "SEMI": f"x; touch {marker}",
        "QUOTES": 'it\'s "quoted" \\ $HOME',
    }
    body = (
        "#!/bin/bash\n#MSUB -q debug\n#PBS -N evil\n"
        'printf "%s\\n" "$SUBST" "$TICKS" "$SEMI" "$QUOTES" "$PBS_JOBNAME"\n'
    )
    wf = ms.workflow_id("hostile")
    outcome = await ms.run_job(moab, wf, ms.spec(wf, body, environment=hostile))
    assert outcome.final.state == JobState.COMPLETED
    number = outcome.submitted.scheduler_job_id.split(".")[-1]
    name = cluster.moab.jobs[outcome.submitted.scheduler_job_id].name
    lines = cluster.output(name, number).read_text().splitlines()
    assert lines == [*hostile.values(), name], "values literal; the tenant's #MSUB/#PBS lines ignored"
    assert not marker.exists()
    job = cluster.moab.jobs[outcome.submitted.scheduler_job_id]
    assert job.job_class == "batch", "the tenant's #MSUB -q did not change the queue"
    if moab.config.transport == "ssh":
        msubs = [r for r in cluster.moab.argv_log() if r["command"] == "msub" and name in r["argv"]]
        argv = msubs[0]["argv"]
        assert argv[argv.index("-N") + 1] == name
        assert argv[argv.index("-d") + 1] == str(cluster.output("x", "1").parent)
        assert not any(v in " ".join(argv) for v in hostile.values()), "tenant values never travel in argv"


async def test_ssh_arguments_reach_the_command_verbatim(cluster: ms.MoabCluster) -> None:
    runner = SSHRunner(
        host="127.0.0.1",
        port=cluster.sshd.port,
        user=cluster.user,
        key_path=cluster.sshd.client_key,
        known_hosts=cluster.sshd.known_hosts,
        timeout=10,
        env={"MOABHOMEDIR": str(cluster.moab.home)},
    )
    marker = f"/tmp/vehpc-pwned-{uuid.uuid4().hex[:8]}"
    weird = [f"$(touch {marker})", "a b  c", "it's", '"dq"', "`id`", "; rm -rf /", "\\", "*", "~", "--xml=1"]
    result = await runner.run([str(cluster.moab.bin_dir / "checkjob"), "--xml", *weird], timeout=10)
    await runner.close()
    assert "cannot locate job" in result.stderr
    logged = [r for r in cluster.moab.argv_log() if r["command"] == "checkjob" and "a b  c" in r["argv"]]
    assert logged and logged[-1]["argv"] == ["--xml", *weird]
    assert not Path(marker).exists()


async def test_security_refusals(cluster: ms.MoabCluster, tmp_module: Path) -> None:
    other = ms.make_ca(cluster.home / "other-ca", name="someone else")
    wrong_ca = cluster.adapter(tmp_module, "rest", mws_ca_cert=str(other.ca_cert))
    with pytest.raises(SecurityError, match="certificate"):
        await wrong_ca.status_batch(["Moab.1"])
    await wrong_ca.close()
    config = cluster.config(tmp_module, "rest")
    bad = MoabAdapter.from_config(
        config,
        ms.Secrets.from_env({"MOAB_USERNAME": ms.MWS_USER, "MOAB_PASSWORD": "wrong"}),
        config.hpc.cluster_id,
    )
    with pytest.raises(SecurityError) as caught:
        await bad.status_batch(["Moab.1"])
    assert "wrong" not in str(caught.value) and ms.MWS_PASSWORD not in str(caught.value)
    await bad.close()
    with pytest.raises(SecurityError, match="https"):
        cluster.adapter(tmp_module, "rest", mws_url=cluster.mws_url.replace("https://", "http://"))
    stranger = tmp_module / "known_hosts_other"
    stranger.write_text("")
    unknown_host = cluster.adapter(tmp_module, "ssh", known_hosts_path=str(stranger))
    with pytest.raises(SecurityError, match="known_hosts"):
        await unknown_host.status_batch(["Moab.1"])
    await unknown_host.close()


# ---- one account per tenant ---------------------------------------------------------------------------------------


async def test_each_tenant_submits_and_runs_as_its_own_account(
    moab: MoabAdapter, cluster: ms.MoabCluster
) -> None:
    """msub runs logged in as the tenant's account (ssh), or MWS submits with the account in credentials.user;
    the simulator takes the submitter from the socket's peer credentials, as MOAB does, and runs the job as it.
    (The simulator does not model MOAB's rights: who may cancel or read whose jobs is the site's MOAB and Unix
    configuration, not shown here.)"""
    if len(cluster.tenant_users) < 2:
        pytest.fail("the tenant accounts of the MOAB simulator could not be made (run the tests as root)")
    jobs = {ms.ALICE: cluster.tenant_users[0], ms.BOB: cluster.tenant_users[1]}
    outcomes = await asyncio.gather(
        *(
            ms.run_job(moab, wf, ms.spec(wf, "id -un\n", tenant=tenant))
            for tenant, wf in ((t, ms.workflow_id(f"tenant-{i}")) for i, t in enumerate(jobs))
        )
    )
    for (tenant, account), outcome in zip(jobs.items(), outcomes, strict=True):
        job = cluster.moab.jobs[outcome.submitted.scheduler_job_id]
        uid = pwd.getpwnam(account).pw_uid
        assert job.user == account and job.uid == uid != pwd.getpwnam(cluster.user).pw_uid
        out = cluster.output(job.name, str(job.number), account)
        assert out.read_text().strip() == account and os.stat(out).st_uid == uid, (
            "ran as the tenant's account"
        )
        assert os.stat(out.parent).st_mode & 0o777 == 0o700 and os.stat(out.parent).st_uid == uid
        assert moab.expected_account(tenant) == account
    if moab.config.transport == "ssh":
        msubs = {r["uid"] for r in cluster.moab.argv_log() if r["command"] == "msub"}
        assert {pwd.getpwnam(a).pw_uid for a in jobs.values()} <= msubs
        assert pwd.getpwnam(cluster.user).pw_uid not in msubs, "the provider's account submits no tenant job"


async def test_the_sweep_cancels_a_job_a_tenant_submitted_itself_and_leaves_the_workflows_own(
    moab: MoabAdapter, cluster: ms.MoabCluster, client: Client, tmp_path: Path
) -> None:
    """Bob's job runs ``msub`` as Bob's account with no marker: one sweep lists it with the provider's own jobs
    (one ``showq --xml``, or one MWS query), cancels it and audits it under Bob's account and tenant. Alice's
    marked job (its workflow unknown to this chain) is left alone."""
    wf = ms.workflow_id("sweep")
    bob = cluster.tenant_users[1]
    own = await moab.submit(
        SubmitRequest(workflow_id=wf, job=ms.spec(wf, "sleep 30\n", tenant=ms.ALICE), body="sleep 30\n")
    )
    bob_user = pwd.getpwnam(bob)
    answer = cluster.moab.handle(bob_user.pw_uid, bob_user.pw_gid, "msub", ["-N", "free", "-h"], "sleep 30\n")
    free = answer["stdout"].strip()
    assert free.startswith("Moab."), answer
    listed = {job.scheduler_job_id: job for job in await moab.swept_jobs()}
    assert listed[free].workflow_id is None and listed[free].user == bob
    assert listed[own.scheduler_job_id].workflow_id == wf

    config = cluster.config(tmp_path, "ssh")
    audit = AuditLog(config.hpc.audit)
    stats = await JobSweep(client, LocalLedger.from_config(config), moab, config, audit).sweep_once()

    assert stats.unmarked == [free] and stats.left == 1
    [audited] = [
        e for e in read_events(config.hpc.audit.log_path) if e["event_type"] == "unowned_job_cancelled"
    ]
    assert audited["job_id"] is None
    assert audited["details"]["account"] == bob and audited["details"]["tenant"] == ms.BOB
    status = await moab.status_batch([free, own.scheduler_job_id])
    assert status[free].state == JobState.CANCELLED and not status[own.scheduler_job_id].state.final
    await moab.cancel(own.scheduler_job_id)


async def test_the_sweep_audits_a_job_a_tenant_ran_between_two_rounds(
    moab: MoabAdapter, cluster: ms.MoabCluster, client: Client, tmp_path: Path
) -> None:
    """Bob's job runs ``msub`` as Bob's account right after a round, and the job ends before the next: it was
    never live at a round. The next round finds it in MOAB's completed queue (``showq -c --xml``, or the MWS
    jobs, which keep completed ones) and audits it once under Bob's account and tenant, with its run time and
    what it held; it ran unbilled."""
    bob = cluster.tenant_users[1]
    config = cluster.config(tmp_path, "ssh")
    metrics = WorkerMetrics()
    audit = MeteredAuditLog(config.hpc.audit, metrics)
    sweeper = JobSweep(client, LocalLedger.from_config(config), moab, config, audit, metrics=metrics)
    await sweeper.sweep_once()
    bob_user = pwd.getpwnam(bob)
    answer = cluster.moab.handle(
        bob_user.pw_uid, bob_user.pw_gid, "msub", ["-N", "between", "-l", "nodes=1:ppn=2"], "sleep 1\n"
    )
    free = answer["stdout"].strip()
    assert free.startswith("Moab."), answer
    for _ in range(300):
        if cluster.moab.jobs[free].ended:
            break
        await asyncio.sleep(0.1)
    assert cluster.moab.jobs[free].state == "Completed"

    def unbilled() -> float:
        sample = metrics.registry.get_sample_value(
            "virtengine_hpc_unbilled_cpu_seconds_total", {"cluster": config.hpc.cluster_id}
        )
        return sample or 0.0

    before = unbilled()  # (the first round read back, over the other transport's run of this test too)
    first, second = await sweeper.sweep_once(), await sweeper.sweep_once()

    assert first.ran == [free] and not second.ran, (first, second)
    audited = [
        e for e in read_events(config.hpc.audit.log_path) if e["details"].get("scheduler_job_id") == free
    ]
    assert [e["event_type"] for e in audited] == ["unowned_job_found"], audited
    details = audited[0]["details"]
    assert details["ended"] is True and details["account"] == bob and details["tenant"] == ms.BOB
    assert details["elapsed_seconds"] >= 1 and details["allocated"] == {"cpus": 2, "nodes": 1}
    assert unbilled() - before == 2 * details["elapsed_seconds"], "the CPU time no chain job billed, counted"


async def test_a_pool_account_moab_lists_jobs_of_is_never_handed_to_a_new_tenant(
    cluster: ms.MoabCluster, tmp_path: Path
) -> None:
    """Worker A's assignments file gave tenant X the pool's account and X's job runs as it; worker B keeps a file of
    its own (lost and recreated, or another host's): it sees the account's job in MOAB and refuses the new tenant
    rather than hand it the same account."""
    account = cluster.tenant_users[1]
    x, z = "virtengine1tenant0x", "virtengine1tenant0z"
    AssignmentStore(tmp_path / "a.db").assign(x, TenantRules(pool=(account,)))

    def worker(db: str) -> MoabAdapter:
        config = cluster.config(tmp_path, "ssh")
        tenants = TenantsConfig(pool=[account], assignments_path=tmp_path / db)
        config = config.model_copy(update={"hpc": config.hpc.model_copy(update={"tenants": tenants})})
        adapter = MoabAdapter.from_config(config, ms.secrets(), config.hpc.cluster_id)
        adapter.hold_jobs = True
        return adapter

    worker_a, worker_b = worker("a.db"), worker("b.db")
    x_wf, z_wf = ms.workflow_id("pool-x"), ms.workflow_id("pool-z")
    try:
        job = ms.spec(x_wf, "true\n", tenant=x)
        own = await worker_a.submit(
            SubmitRequest(workflow_id=x_wf, job=job, body="true\n", first_attempt=True)
        )
        assert cluster.moab.jobs[own.scheduler_job_id].user == account
        job = ms.spec(z_wf, "true\n", tenant=z)
        with pytest.raises(TenantAccountError, match=r"accounts of hpc\.tenants\.pool are taken"):
            await worker_b.submit(SubmitRequest(workflow_id=z_wf, job=job, body="true\n", first_attempt=True))
        assert _jobs_named(cluster, z_wf) == []
        await worker_a.cancel(own.scheduler_job_id)
    finally:
        await worker_a.close()
        await worker_b.close()


class AlteredAnswer:
    """A tenant's login shell that lets ``msub`` submit but prints another answer after it (its jobs can write
    its startup files: an exit trap there prints what it likes after every command)."""

    def __init__(self, runner: Any, answer: str) -> None:
        self.runner, self.answer = runner, answer
        self.description = runner.description

    async def run(self, argv: Any, *, stdin: str | None = None, timeout: float) -> Any:
        result = await self.runner.run(argv, stdin=stdin, timeout=timeout)
        if Path(argv[0]).name == "msub" and result.exit_code == 0:
            return type(result)(
                argv=result.argv,
                exit_code=0,
                stdout=result.stdout + f"\n{self.answer}\n",
                stderr=result.stderr,
            )
        return result

    async def close(self) -> None:
        await self.runner.close()


async def test_over_ssh_an_msub_answer_the_tenants_shell_altered_is_never_adopted(
    cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    """msub runs in the tenant account's own login. Its answer is checked with the provider's own checkjob: an id
    that names another tenant's job (to have it watched, billed or cancelled as this one) or no job at all is a
    SecurityError, and the job it named is left alone."""
    if len(cluster.tenant_users) < 2:
        pytest.fail("the tenant accounts of the MOAB simulator could not be made (run the tests as root)")
    adapter = cluster.adapter(tmp_module, "ssh", hold=True)
    try:
        decoy_wf = ms.workflow_id("decoy")
        decoy = await adapter.submit(
            SubmitRequest(workflow_id=decoy_wf, job=ms.spec(decoy_wf, "true\n", tenant=ms.BOB), body="true\n")
        )
        tenant = adapter.backend.executors.get(cluster.tenant_users[0])  # type: ignore[attr-defined]
        real = tenant.runner
        for answer, seen in (
            (decoy.scheduler_job_id, "of " + cluster.tenant_users[1]),
            ("Moab.999999", "unknown"),
        ):
            tenant.runner = AlteredAnswer(real, answer)
            wf = ms.workflow_id("lying-shell")
            with pytest.raises(SecurityError, match="altered the answer") as caught:
                await adapter.submit(
                    SubmitRequest(
                        workflow_id=wf, job=ms.spec(wf, "true\n"), body="true\n", first_attempt=True
                    )
                )
            assert f"answered job {answer}, which is " in str(caught.value) and seen in str(caught.value)
            assert len(_jobs_named(cluster, wf)) == 1, "the real job exists (the sweep cancels it), unadopted"
        tenant.runner = real
        status = (await adapter.status_batch([decoy.scheduler_job_id]))[decoy.scheduler_job_id]
        assert status.state == JobState.QUEUED, "the decoy untouched"
        await adapter.cancel(decoy.scheduler_job_id)
    finally:
        await adapter.close()


async def test_over_ssh_a_link_in_place_of_a_tenants_directory_is_refused_before_msub(
    cluster: ms.MoabCluster, tmp_module: Path
) -> None:
    """The work dir is the provider's (no tenant writes it) and checked before every msub: a link left under
    Bob's account name, pointing at a directory Alice reads, refuses Bob's job (msub never runs) and only his."""
    from tests.local_support import reachable_dir, shared_dir

    if len(cluster.tenant_users) < 2:
        pytest.fail("the tenant accounts of the MOAB simulator could not be made (run the tests as root)")
    alice, bob = cluster.tenant_users
    parent = reachable_dir("moab-work") / "jobs"
    parent.mkdir(mode=0o755)
    (parent / alice).mkdir(mode=0o700)
    os.chown(parent / alice, pwd.getpwnam(alice).pw_uid, pwd.getpwnam(alice).pw_gid)
    spy = shared_dir("moab-spy")
    (parent / bob).symlink_to(spy)
    adapter = cluster.adapter(tmp_module, "ssh", work_dir=str(parent))
    try:
        wf = ms.workflow_id("linked")
        with pytest.raises(SubmissionRejected) as caught:
            await adapter.submit(
                SubmitRequest(workflow_id=wf, job=ms.spec(wf, "id\n", tenant=ms.BOB), body="id\n")
            )
        assert caught.value.code == "work_dir_unsafe" and "is a symbolic link" in str(caught.value)
        assert not [
            r for r in cluster.moab.argv_log() if r["command"] == "msub" and any(wf in a for a in r["argv"])
        ]
        wf = ms.workflow_id("alice-goes-on")
        outcome = await ms.run_job(adapter, wf, ms.spec(wf, "id -un\n"))
        assert outcome.final.state == JobState.COMPLETED
        job = cluster.moab.jobs[outcome.submitted.scheduler_job_id]
        assert (parent / alice / f"{job.name}.o{job.number}").read_text().strip() == alice
        assert list(spy.iterdir()) == []
    finally:
        await adapter.close()
