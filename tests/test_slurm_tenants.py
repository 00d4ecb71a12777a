"""One account per tenant, on the real SLURM cluster, for each transport (local CLI, CLI over SSH, slurmrestd).

Two tenants' jobs run as two accounts (Slurm's own accounting says so); from inside a real job, tenant A cannot read
B's output, cannot cancel B's job, and a job A's script submits with ``sbatch`` runs as A's account, not the
provider's submit account (the sweep cancels it: tests/test_sweep.py). Jobs for a tenant without an account, or
for root or a Slurm operator, are refused with the documented error and nothing reaches Slurm; a pool account
some tenant's jobs run as is never handed to a new tenant by a worker whose assignments file does not know it; through the whole pipeline the refusal is on chain and in the audit log while the
other tenant's job runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import secrets
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client

from activities.audit import read_events
from activities.schedulers.base import SubmitRequest, hold_back_taken
from activities.schedulers.batch.base import Owner
from activities.schedulers.slurm import SlurmAdapter
from activities.tenant_accounts import AssignmentStore
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.local_support import reachable_dir
from tests.pipeline_harness import Pipeline, running_pipeline
from tests.sim.moab import ensure_user
from virtengine_hpc.config import load_config
from virtengine_hpc.errors import ConfigError, SchedulerUnavailable, SecurityError
from virtengine_hpc.states import JobState
from virtengine_hpc.tenancy import TenantAccountError, TenantRules

pytestmark = pytest.mark.slurm
SCOPE = "tenants-"
MALLORY = "virtengine1tenant0mallory"


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return sc.cluster()


@pytest.fixture(scope="module", autouse=True)
def _cleanup(env: dict[str, Any]) -> Any:
    yield
    sc.cancel_test_jobs(env, SCOPE)
    sc.remove_outputs(env, SCOPE)


def wid(label: str) -> str:
    return sc.workflow_id(SCOPE + label)


def owner(env: dict[str, Any], job_id: str) -> str:
    """The job's user as the controller records it (any state it still holds)."""
    return sc.slurm_command(env, ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%u"]).strip()


async def accounting_user(env: dict[str, Any], job_id: str) -> str:
    """``sacct -o User`` of the job, once accounting has heard of it (4-5 s after submission)."""
    for _ in range(60):
        line = sc.slurm_command(env, ["sacct", "-X", "-P", "-n", "-j", job_id, "-o", "User"]).strip()
        if line:
            return line
        await asyncio.sleep(1)
    raise AssertionError(f"job {job_id} never reached accounting")


@pytest.mark.parametrize("transport", sc.TRANSPORTS)
async def test_two_tenants_run_as_two_accounts_that_cannot_touch_each_other(
    env: dict[str, Any], transport: str
) -> None:
    adapter = sc.adapter(env, transport)
    alice, bob = sc.account_of(env, sc.ALICE), sc.account_of(env, sc.BOB)
    provider = adapter.backend.user
    try:
        wf_b = wid(f"bob-{transport}")
        bob_job = sc.spec(wf_b, "echo bob-secret\nsleep 120\n", tenant=sc.BOB)
        b = await adapter.submit(SubmitRequest(workflow_id=wf_b, job=bob_job, body=bob_job.script or ""))
        b_id = b.scheduler_job_id
        await sc.wait_for(adapter, b_id, lambda s: s.state == JobState.RUNNING)
        b_out = sc.output_path(env, wf_b, b_id)
        for _ in range(50):
            b_out = sc.output_path(env, wf_b, b_id)
            if b_out is not None and b_out.read_text().strip():
                break
            await asyncio.sleep(0.2)
        assert b_out is not None and b_out.parent.name == bob and b_out.read_text().strip() == "bob-secret"
        assert b_out.parent.stat().st_mode & 0o777 == 0o700

        wf_a = wid(f"alice-{transport}")
        child = f"vehpc-{wf_a}-child"
        script = (
            f"cat {b_out} && echo READ-BOBS-OUTPUT || echo cat-refused\n"
            f"scancel {b_id} && echo CANCELLED-BOBS-JOB || echo scancel-refused\n"
            f"echo child=$(sbatch --parsable --hold -J {child} -o /dev/null --wrap true)\n"
        )
        alice_job = sc.spec(wf_a, script, tenant=sc.ALICE)
        a = await adapter.submit(SubmitRequest(workflow_id=wf_a, job=alice_job, body=script))
        a_id = a.scheduler_job_id
        final = await sc.wait_final(adapter, a_id)
        assert final.state == JobState.COMPLETED, final
        out = sc.job_output(env, wf_a, a_id) + sc.job_output(env, wf_a, a_id, "err")

        assert "Permission denied" in out and "cat-refused" in out and "bob-secret" not in out, out
        assert "scancel-refused" in out and "CANCELLED-BOBS-JOB" not in out, out
        assert (await adapter.status_batch([b_id]))[b_id].state == JobState.RUNNING, "Bob's job goes on"
        child_id = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("child="))
        assert child_id.isdigit(), out
        assert owner(env, child_id) == alice != provider, "a job's own sbatch runs as its tenant's account"
        swept = {job.scheduler_job_id: job for job in await adapter.swept_jobs()}
        assert swept[child_id].workflow_id is None and swept[child_id].user == alice, (
            "the sweep lists it as a job without a valid marker, which it cancels (tests/test_sweep.py)"
        )

        assert await accounting_user(env, a_id) == alice
        assert await accounting_user(env, b_id) == bob
        assert provider not in (alice, bob) and "root" not in (alice, bob)

        # The provider's account (a Slurm operator) still follows and cancels every tenant's job.
        await adapter.cancel(b_id)
        assert (await sc.wait_final(adapter, b_id)).state == JobState.CANCELLED
        assert await adapter.find(wf_b) == b_id, "lookups by name search the tenants' accounts"
        assert adapter.expected_account(sc.BOB) == bob
        sc.slurm_command(env, ["scancel", child_id])
    finally:
        await adapter.close()


@pytest.mark.parametrize("transport", sc.TRANSPORTS)
async def test_a_tenant_without_an_account_is_refused_and_nothing_is_submitted(
    env: dict[str, Any], transport: str
) -> None:
    only_alice = {"accounts": {sc.ALICE: sc.account_of(env, sc.ALICE)}}
    adapter = sc.adapter(env, transport, tenants=only_alice)
    wf = wid(f"nobody-{transport}")
    try:
        job = sc.spec(wf, "true\n", tenant=MALLORY)
        with pytest.raises(TenantAccountError, match="has no cluster account") as caught:
            await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True))
        assert caught.value.code == "tenant_account_missing" and not caught.value.transient
        assert sc.controller_jobs_of(env, wf) == []
    finally:
        await adapter.close()


async def test_root_is_refused_as_a_tenant_account_everywhere(env: dict[str, Any]) -> None:
    # In the configuration: root by name, or the provider's own submit account.
    for tenants in ({"accounts": {MALLORY: "root"}}, {"pool": ["root"]}):
        with pytest.raises(ConfigError, match="root can never be a tenant's account"):
            load_config(data={"hpc": {"tenants": tenants}}, env={})
    for transport, key in (("ssh", "ssh_user"), ("rest", "rest_user")):
        section = sc.slurm_section(env, transport)
        with pytest.raises(ConfigError, match=f"hpc.slurm.{key} {section[key]} is also a tenant account"):
            load_config(
                data={"hpc": {"slurm": section, "tenants": {"accounts": {MALLORY: section[key]}}}}, env={}
            )
    # At submit: without isolation every job would run as the worker's own account, root here: refused.
    shared = sc.adapter(env, "cli", tenants={"isolation": "none"})
    wf = wid("as-root")
    try:
        with pytest.raises(TenantAccountError, match=r"as root \(uid 0\)") as caught:
            await shared.submit(
                SubmitRequest(workflow_id=wf, job=sc.spec(wf, "id\n"), body="id\n", first_attempt=True)
            )
        assert caught.value.code == "tenant_account_refused"
        assert sc.controller_jobs_of(env, wf) == []
    finally:
        await shared.close()


def test_pyslurm_cannot_impersonate_and_refuses_to_run_with_isolation(env: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="pyslurm cannot submit as each tenant's own account"):
        SlurmAdapter.from_config(sc.config(env, "pyslurm"), sc.secrets(env), "slurm-test")


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, env: dict[str, Any]
) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "usage_reporting": {"report_interval": "2s"},
            "slurm": sc.slurm_section(env, "cli"),
            # Alice has an account; nobody else does (no pool).
            "tenants": {"accounts": {sc.ALICE: sc.account_of(env, sc.ALICE)}},
        },
    )
    adapter = SlurmAdapter.from_config(config, sc.secrets(env), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_the_refusal_is_on_chain_and_audited_and_nothing_else_stops(pipe: Pipeline) -> None:
    pipe.ledger.fund(MALLORY, 1000)
    refused = pipe.submit(job_id=wid("chain-mallory"), tenant=MALLORY, resources={"memory_mb_per_node": 256})
    runs = pipe.submit(job_id=wid("chain-alice"), resources={"memory_mb_per_node": 256})
    results = await pipe.run_until_done([refused, runs], timeout=180)

    assert results[runs].state == JobState.COMPLETED, results[runs]
    assert results[refused].state == JobState.FAILED
    job = pipe.ledger.job(refused)
    assert job is not None and f"tenant {MALLORY} has no cluster account" in job.status_message
    settlement = pipe.ledger.settlement(refused)
    assert settlement is not None and settlement.charged == 0, "the escrow goes back in full"
    events = pipe.audit_events("job_submission_failed", refused)
    assert events and events[-1]["details"]["code"] == "tenant_account_missing"
    assert MALLORY in events[-1]["error_msg"]


@contextlib.contextmanager
def lying_shell(account: str, wf: str, answer: str) -> Iterator[None]:
    """The account's ``~/.bashrc`` (a non-interactive ssh session sources it; the account's jobs can write it)
    puts first on PATH an ``sbatch`` that submits the job but answers ``answer`` for the submission of ``wf``."""
    home = Path(pwd.getpwnam(account).pw_dir)
    wrapper_dir = home / f".vehpc-test-{uuid.uuid4().hex[:8]}"
    bashrc = home / ".bashrc"
    original = bashrc.read_bytes()
    wrapper_dir.mkdir()
    (wrapper_dir / "sbatch").write_text(
        "#!/bin/bash\n"
        'script=$(cat); real=$(printf "%s\\n" "$script" | /usr/bin/sbatch "$@") || exit $?\n'
        f'case "$script" in *{wf}*) echo {answer} ;; *) echo "$real" ;; esac\n'
    )
    (wrapper_dir / "sbatch").chmod(0o755)
    bashrc.write_bytes(f"export PATH={wrapper_dir}:$PATH\n".encode() + original)
    try:
        yield
    finally:
        bashrc.write_bytes(original)
        shutil.rmtree(wrapper_dir, ignore_errors=True)


def root_decoy(env: dict[str, Any], name: str) -> str:
    """A held job of root's (another account than any tenant's) named ``name``."""
    argv = ["sbatch", "--parsable", "--hold", "-J", name, "-o", "/dev/null", "--wrap", "true"]
    return sc.slurm_command(env, argv).strip()


class ProviderCommands:
    """The SSH commands the provider's own login starts (a wrapper of its runner: every command still runs)."""

    def __init__(self, adapter: SlurmAdapter) -> None:
        self.seen: list[str] = []
        self.runner = adapter.backend.executors.own.runner  # type: ignore[attr-defined]
        real = self.runner.run

        async def run(argv: list[str], **kwargs: Any) -> Any:
            self.seen.append(argv[0])
            return await real(argv, **kwargs)

        self.runner.run = run


async def test_over_ssh_a_tenant_shell_that_alters_sbatchs_answer_is_caught(env: dict[str, Any]) -> None:
    """Over SSH, sbatch runs in the tenant account's own login shell, whose startup files its jobs can write. A
    PATH wrapper that submits the job but answers another job's id (to have that job watched, billed or cancelled
    as this one) is caught by the provider's own ``scontrol``, kept running on the provider's login."""
    account = sc.tenant_accounts(env)[-1]
    decoy_wf, wf = wid("decoy"), wid("lying-shell")
    root_job = root_decoy(env, f"vehpc-{decoy_wf}")
    adapter = sc.adapter(env, "ssh", tenants={"accounts": {MALLORY: account}}, hold=True)
    provider = ProviderCommands(adapter)
    try:
        job = sc.spec(wf, "true\n", tenant=MALLORY)
        with (
            lying_shell(account, wf, root_job),
            pytest.raises(SecurityError, match="altered the answer") as caught,
        ):
            await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True))
        assert f"answered job {root_job}, which is 'vehpc-{decoy_wf}' of root" in str(caught.value)
        assert "squeue" not in provider.seen and adapter.backend.calls["scontrol show job"] == 1  # type: ignore[attr-defined]
        assert (await adapter.status_batch([root_job]))[root_job].state == JobState.QUEUED, (
            "the decoy untouched"
        )
    finally:
        await adapter.close()
        sc.slurm_command(env, ["scancel", root_job])


async def test_over_ssh_a_decoy_named_to_forge_the_controllers_record_is_caught(env: dict[str, Any]) -> None:
    """``scontrol`` prints a job's name raw, and its owner writes it (spaces, newlines, anything). Another
    account's job named as the submission followed by ``UserId=<the tenant's account>(...)`` reads, up to that
    point, exactly as the tenant's own record: it is still refused. A name made of record lines and scontrol's
    prompts leaves nothing behind in the kept ``scontrol``: the next honest submission is checked and accepted."""
    account = sc.tenant_accounts(env)[-1]
    adapter = sc.adapter(env, "ssh", tenants={"accounts": {MALLORY: account}}, hold=True)
    decoys: list[str] = []
    try:
        for label, forged in (
            ("forged-owner", " UserId={account}(1002) GroupId={account}(1002)"),
            (
                "forged-lines",
                "\n\nscontrol: show hostnames vehpc-end-0\nvehpc-end-0\nJobId=1 JobName=x UserId={account}(1)",
            ),
        ):
            wf = wid(label)
            name = adapter.job_name(Owner(wf, account))
            decoys.append(root_decoy(env, name + forged.format(account=account)))
            job = sc.spec(wf, "true\n", tenant=MALLORY)
            with (
                lying_shell(account, wf, decoys[-1]),
                pytest.raises(SecurityError, match="altered the answer"),
            ):
                await adapter.submit(
                    SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True)
                )
        wf = wid("honest-after-decoys")
        request = SubmitRequest(
            workflow_id=wf, job=sc.spec(wf, "true\n", tenant=MALLORY), body="true\n", first_attempt=True
        )
        job_id = (await adapter.submit(request)).scheduler_job_id
        assert sc.controller_jobs_of(env, wf) == [job_id]
        assert adapter.backend.calls["scontrol show job"] == 3  # type: ignore[attr-defined]
    finally:
        await adapter.close()
        sc.slurm_command(env, ["scancel", *decoys])


async def test_over_ssh_checking_the_answer_starts_no_command_per_submission(env: dict[str, Any]) -> None:
    """The provider's check of each answer goes to one ``scontrol`` kept running on its own login, not to a new
    SSH command (a session, a login shell and ``squeue``'s start on the login node) per submission; when that
    ``scontrol`` goes away, the next check starts another."""
    adapter = sc.adapter(env, "ssh", hold=True)
    provider = ProviderCommands(adapter)
    try:
        await adapter.submit(request(wid("kept-first"), sc.ALICE))
        started = provider.runner.commands
        jobs = {wid(f"kept-{i}"): "" for i in range(3)}
        for wf in jobs:
            jobs[wf] = (await adapter.submit(request(wf, sc.ALICE))).scheduler_job_id
        assert provider.runner.commands == started, f"no SSH command of the provider's: {provider.seen}"
        assert "squeue" not in provider.seen
        assert all(sc.controller_jobs_of(env, wf) == [job] for wf, job in jobs.items())

        adapter.backend.job_records._stream.channel.close()  # type: ignore[attr-defined]
        wf = wid("kept-after-end")
        job = (await adapter.submit(request(wf, sc.ALICE))).scheduler_job_id
        assert sc.controller_jobs_of(env, wf) == [job]
        assert provider.runner.commands == started + 1, "one new scontrol"
    finally:
        await adapter.close()


async def test_over_ssh_the_end_of_each_answer_is_seen_whatever_token_is_drawn(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each answer of the kept ``scontrol`` ends at a token it prints back (``show hostnames``); hostlist reads a
    token's trailing digits as a number and prints 20 or more of them back changed, so a token drawn all digits
    never showed up, the check waited out its timeout and went to ``squeue``."""
    monkeypatch.setattr(secrets, "token_hex", lambda n: "7" * 2 * n)
    adapter = sc.adapter(env, "ssh", hold=True)
    adapter.backend.job_records.timeout = 5  # type: ignore[attr-defined]
    provider = ProviderCommands(adapter)
    try:
        for i in range(2):
            wf = wid(f"digits-{i}")
            job = (await adapter.submit(request(wf, sc.ALICE))).scheduler_job_id
            assert sc.controller_jobs_of(env, wf) == [job]
        assert "squeue" not in provider.seen, "each answer read from the kept scontrol"
    finally:
        await adapter.close()


async def test_over_ssh_a_login_without_a_running_scontrol_checks_each_answer_with_squeue(
    env: dict[str, Any],
) -> None:
    """When the provider's ``scontrol`` cannot be kept running (here: not where the login looks for it), each
    answer is still checked, with a new ``squeue`` command as before, and the failed start is not tried again for
    every submission."""
    adapter = sc.adapter(env, "ssh", hold=True)
    provider = ProviderCommands(adapter)
    adapter.backend.job_records.argv = ["/nonexistent/scontrol", "-o"]  # type: ignore[attr-defined]
    try:
        await adapter.submit(request(wid("no-scontrol-first"), sc.ALICE))
        started, checks = provider.runner.commands, provider.seen.count("squeue")
        jobs = {wid(f"no-scontrol-{i}"): "" for i in range(2)}
        for wf in jobs:
            jobs[wf] = (await adapter.submit(request(wf, sc.ALICE))).scheduler_job_id
        assert all(sc.controller_jobs_of(env, wf) == [job] for wf, job in jobs.items())
        assert provider.seen.count("squeue") == checks + 2, "each answer checked by squeue"
        assert provider.runner.commands == started + 2, "squeue alone, no new start of the missing scontrol"
    finally:
        await adapter.close()


async def test_over_ssh_a_controller_the_kept_scontrol_cannot_reach_is_no_reason_to_refuse_a_submission(
    env: dict[str, Any],
) -> None:
    """The kept ``scontrol`` gets no record because the controller did not answer it (a restart, "Socket timed
    out" under load: here it reads a slurm.conf whose controller port nobody listens on). That is not "the
    controller does not hold the job": the answer is checked with ``squeue`` instead and the honest submission
    stands, exactly one job of the workflow on the cluster and no security violation against its tenant."""
    conf_dir = reachable_dir("dead-ctld")
    conf = conf_dir / "slurm.conf"
    text = Path(env["slurm_conf"]).read_text()
    conf.write_text(text.replace(f"SlurmctldPort={env['controller_port']}", "SlurmctldPort=1"))
    conf.chmod(0o644)
    adapter = sc.adapter(env, "ssh", hold=True)
    provider = ProviderCommands(adapter)
    adapter.backend.job_records.argv = ["env", f"SLURM_CONF={conf}", "scontrol", "-o"]  # type: ignore[attr-defined]
    wf = wid("dead-ctld")
    try:
        job = (await adapter.submit(request(wf, sc.ALICE))).scheduler_job_id
        assert sc.controller_jobs_of(env, wf) == [job]
        assert "squeue" in provider.seen, "the answer was checked with squeue"
    finally:
        await adapter.close()
        shutil.rmtree(conf_dir, ignore_errors=True)


async def test_closing_the_adapter_does_not_wait_for_a_check_the_login_node_never_answers(
    env: dict[str, Any],
) -> None:
    """A worker that stops closes its adapter; a check still waiting on the kept ``scontrol`` (here a command that
    never answers, within a timeout of 10 minutes) fails at once instead of holding the close up."""
    adapter = sc.adapter(env, "ssh", hold=True)
    records = adapter.backend.job_records  # type: ignore[attr-defined]
    records.argv, records.timeout = ["sleep", "600"], 600
    query = asyncio.create_task(records.show_job("1"))
    while records._stream is None:  # the command started, the query waits for its answer
        await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(adapter.close(), 30)
        with pytest.raises(SchedulerUnavailable):
            await asyncio.wait_for(query, 30)
    finally:
        query.cancel()


def request(wf: str, tenant: str) -> SubmitRequest:
    """A first attempt on time (``alone_until`` ahead): it submits and checks nothing but ``sbatch``'s answer."""
    job = sc.spec(wf, "true\n", tenant=tenant)
    alone = datetime.now(UTC) + timedelta(seconds=30)
    return SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True, alone_until=alone)


@pytest.mark.parametrize("transport", sc.TRANSPORTS)
async def test_a_tenant_mapped_to_a_slurm_operator_is_refused_and_nothing_is_submitted(
    env: dict[str, Any], transport: str
) -> None:
    """hpcuser is a Slurm operator here (it may cancel every user's jobs). On the cli transport the provider's
    own account is root, so the configuration cannot tell; the adapter reads the operators from the cluster at
    its first use and refuses the job. Over ssh and slurmrestd hpcuser is the provider's own account, refused
    when the configuration is loaded."""
    operator = env["job_user"]
    tenants = {"accounts": {sc.ALICE: sc.account_of(env, sc.ALICE), MALLORY: operator}}
    if transport != "cli":
        with pytest.raises(ConfigError, match="is also a tenant account"):
            sc.adapter(env, transport, tenants=tenants)
        return
    adapter = sc.adapter(env, transport, tenants=tenants)
    wf = wid(f"operator-{transport}")
    try:
        job = sc.spec(wf, "true\n", tenant=MALLORY)
        with pytest.raises(
            TenantAccountError, match=f"refusing to run a tenant's job as {operator}: a Slurm Operator"
        ) as caught:
            await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True))
        assert caught.value.code == "tenant_account_refused" and not caught.value.transient
        assert sc.controller_jobs_of(env, wf) == []
    finally:
        await adapter.close()


async def test_a_lost_assignments_file_does_not_hand_a_taken_pool_account_to_a_new_tenant(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """Worker A's file gave tenant X the pool's account; X's job runs as it. Worker B has a file of its own (the
    default per-host path, or A's deleted and recreated): its pool shows that account free. Before handing it to
    a new tenant, B asks the cluster, sees X's job under it, and refuses the new tenant rather than share it."""
    account = sc.tenant_accounts(env)[-1]
    x, z = "virtengine1tenant0x", "virtengine1tenant0z"
    pool_a = {"pool": [account], "assignments_path": str(tmp_path / "a.db")}
    pool_b = {"pool": [account], "assignments_path": str(tmp_path / "b.db")}
    AssignmentStore(tmp_path / "a.db").assign(x, TenantRules(pool=(account,)))  # A's earlier assignment
    worker_a = sc.adapter(env, "cli", tenants=pool_a, hold=True)
    worker_b = sc.adapter(env, "cli", tenants=pool_b, hold=True)
    x_wf, z_wf = wid("pool-x"), wid("pool-z")
    try:
        x_job = await worker_a.submit(
            SubmitRequest(
                workflow_id=x_wf, job=sc.spec(x_wf, "true\n", tenant=x), body="true\n", first_attempt=True
            )
        )
        assert owner(env, x_job.scheduler_job_id) == account
        with pytest.raises(TenantAccountError, match=r"accounts of hpc\.tenants\.pool are taken") as caught:
            await worker_b.submit(
                SubmitRequest(
                    workflow_id=z_wf, job=sc.spec(z_wf, "true\n", tenant=z), body="true\n", first_attempt=True
                )
            )
        assert caught.value.code == "tenant_account_missing"
        assert sc.controller_jobs_of(env, z_wf) == []
        assert AssignmentStore(tmp_path / "b.db").all() == {}, "nothing recorded for the new tenant"
    finally:
        await worker_a.close()
        await worker_b.close()


def test_release_refuses_an_account_whose_jobs_the_cluster_still_shows(
    env: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tenants release X`` is how an operator moves X's pool account to another tenant, whose fixed account is
    never checked against the cluster: released while X's job runs, the next tenant's jobs would run as the
    same uid beside it (cancel it, read its outputs in the same directory). The command asks the cluster and
    refuses, naming what it found; ``--force`` releases it anyway."""
    from virtengine_hpc.cli import main

    account = sc.tenant_accounts(env)[-1]
    x = "virtengine1tenant0x"
    AssignmentStore(tmp_path / "assignments.db").assign(x, TenantRules(pool=(account,)))
    path = tmp_path / "config.yaml"
    tenants = {"pool": [account], "assignments_path": str(tmp_path / "assignments.db")}
    # A job directory of this test's own: other tests' outputs in the shared one would hold the release back.
    work = str(reachable_dir("slurm-work"))
    audit_log = tmp_path / "audit.log"
    hpc = {
        "scheduler_type": "slurm",
        "cluster_id": "slurm-test",
        "slurm": sc.slurm_section(env, "cli", work_dir=work),
        "audit": {"log_path": str(audit_log)},
    }
    path.write_text(yaml.safe_dump({"hpc": {**hpc, "tenants": tenants}}))
    monkeypatch.setenv("PROVIDER_MARKER_SECRET", sc.MARKER_SECRET)
    job = sc.slurm_command(
        env, ["runuser", "-u", account, "--", "sbatch", "--parsable", "--hold", "-t", "5", "-J", wid("release"),
              "-o", "/dev/null", "--wrap", "sleep 600"],
    ).strip()  # fmt: skip
    try:
        assert main(["-c", str(path), "tenants", "release", x]) == 2
        err = capsys.readouterr().err
        assert f"{account} of tenant {x} still has jobs" in err and "--force" in err, err
        assert AssignmentStore(tmp_path / "assignments.db").all() == {x: account}, "nothing released"
    finally:
        sc.slurm_command(env, ["scancel", job])
    assert main(["-c", str(path), "tenants", "release", x, "--force"]) == 0
    assert f"released {account} from tenant {x}" in capsys.readouterr().out
    assert AssignmentStore(tmp_path / "assignments.db").all() == {}
    records = [(e["event_type"], e["details"]) for e in read_events(audit_log)]
    assert [(kind, d["forced"]) for kind, d in records] == [
        ("tenant_account_release_refused", False),
        ("tenant_account_released", True),
    ], "the refusal and the forced release are both on record"
    who = pwd.getpwuid(os.getuid()).pw_name
    assert all(d["tenant"] == x and d["account"] == account and d["released_by"] == who for _, d in records)


def release(config: Path, tenant: str, *flags: str) -> int:
    from virtengine_hpc.cli import main

    return main(["-c", str(config), "tenants", "release", tenant, *flags])


async def test_release_hands_a_pool_account_on_only_with_an_empty_job_directory(
    env: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """X's real job leaves its output and files of its own (in a directory it made read-only) in
    ``<work_dir>/<account>``. Released with them, the account's next tenant would run as the same uid in that
    directory and read them. ``tenants release X`` refuses while the directory holds files, naming them, and audits
    the refusal; once X has its outputs, ``--clean`` removes them as the account (``find``, fixed argvs) and
    releases it, audited too. (X's job is in accounting, which ``--force`` passes over.)"""
    account = sc.tenant_accounts(env)[-1]
    x = "virtengine1tenant0x"
    work, assignments = reachable_dir("slurm-work"), tmp_path / "assignments.db"
    AssignmentStore(assignments).assign(x, TenantRules(pool=(account,)))
    tenants = {"pool": [account], "assignments_path": str(assignments)}
    adapter = sc.adapter(env, "cli", tenants=tenants, work_dir=str(work))
    wf = wid("leftover")
    script = "echo x-results > results.txt\nmkdir -p keep/deep && echo x > keep/deep/f && chmod 500 keep/deep keep\n"
    try:
        job = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, script, tenant=x), body=script)
        )
        assert (await sc.wait_final(adapter, job.scheduler_job_id)).state == JobState.COMPLETED
    finally:
        await adapter.close()
    directory = work / account
    assert (directory / "results.txt").read_text() == "x-results\n"
    config = tmp_path / "config.yaml"
    hpc = {"scheduler_type": "slurm", "cluster_id": "slurm-test", "tenants": tenants}
    hpc |= {"slurm": sc.slurm_section(env, "cli", work_dir=str(work))}
    hpc |= {"audit": {"log_path": str(tmp_path / "audit.jsonl")}}
    config.write_text(yaml.safe_dump({"hpc": hpc}))
    monkeypatch.setenv("PROVIDER_MARKER_SECRET", sc.MARKER_SECRET)

    assert await asyncio.to_thread(release, config, x, "--force") == 2
    err = capsys.readouterr().err
    assert f"{account} of tenant {x}: its job directory holds" in err and "'results.txt'" in err, err
    assert "--clean" in err
    assert AssignmentStore(assignments).all() == {x: account}, "nothing released"
    assert (directory / "keep" / "deep" / "f").exists()

    assert await asyncio.to_thread(release, config, x, "--force", "--clean") == 0
    assert f"released {account} from tenant {x}" in capsys.readouterr().out
    assert list(directory.iterdir()) == [], "emptied, read-only directories too"
    assert directory.stat().st_uid == pwd.getpwnam(account).pw_uid, "the directory itself stays the account's"
    assert AssignmentStore(assignments).all() == {}
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(e["event_type"], e["details"]["account"], e["details"]["files_removed"]) for e in events] == [
        ("tenant_account_release_refused", account, False),
        ("tenant_account_released", account, True),
    ]
    assert "results.txt" in events[0]["error_msg"] and events[0]["details"]["tenant"] == x
    assert {e["details"]["released_by"] for e in events} == {pwd.getpwuid(os.getuid()).pw_name}, "who asked"


async def test_a_pool_account_whose_job_directory_holds_files_is_never_handed_to_a_new_tenant(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """An unassigned pool account the cluster shows no job of (its last tenant's jobs older than
    ``accounting_lookback``, or released with ``--keep-files``) whose job directory still holds files: the pool
    never hands it to a new tenant, who is refused with the reason (on chain and in the audit, through the submit
    activity) while the directory holds them; once it is empty, the account is handed out."""
    fresh = "vehpc-fresh1"  # an account with no Slurm association: it has never run a job
    if not ensure_user(fresh, system=False):
        pytest.fail(f"cannot create the account {fresh} (run the tests as root)")
    work = reachable_dir("slurm-work")
    entry = pwd.getpwnam(fresh)
    (work / fresh).mkdir(mode=0o700)
    (work / fresh / "left.txt").write_text("the last tenant's\n")
    for path in (work / fresh, work / fresh / "left.txt"):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    tenants = {"pool": [fresh], "assignments_path": str(tmp_path / "a.db")}
    z, wf = "virtengine1tenant0z", wid("fresh-z")
    adapter = sc.adapter(env, "cli", tenants=tenants, work_dir=str(work), hold=True)
    try:
        with pytest.raises(TenantAccountError, match=r"accounts of hpc\.tenants\.pool are taken") as refused:
            await adapter.submit(
                SubmitRequest(
                    workflow_id=wf, job=sc.spec(wf, "true\n", tenant=z), body="true\n", first_attempt=True
                )
            )
        assert f"held back, not handed to a new tenant: {fresh}: its job directory holds 'left.txt'" in str(
            refused.value
        )
        assert sc.controller_jobs_of(env, wf) == []
        assert AssignmentStore(tmp_path / "a.db").all() == {}, "nothing recorded for the new tenant"
    finally:
        await adapter.close()
    (work / fresh / "left.txt").unlink()
    again = sc.adapter(env, "cli", tenants=tenants, work_dir=str(work), hold=True)
    try:
        await hold_back_taken(again, again.tenants, z, cluster_id=again.cluster_id)
        assert again.tenants.account_for(z, submit_account=again.backend.user) == fresh
    finally:
        await again.close()


async def test_a_pool_account_whose_job_directory_its_last_tenant_made_unreadable_is_passed_over(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """A tenant's last job can ``chmod 0`` its own job directory on its way out: the account itself can no longer
    list it. The pool must not hand that account out (what it holds is unknown) and must not stop either: the new
    tenant gets the next, empty, pool account (before, the failed listing refused every new tenant's first job).
    ``--clean`` gives the directory its owner's bits back first and empties it."""
    unreadable, empty = "vehpc-fresh2", "vehpc-fresh3"  # accounts with no Slurm association: never ran a job
    for account in (unreadable, empty):
        if not ensure_user(account, system=False):
            pytest.fail(f"cannot create the account {account} (run the tests as root)")
    work = reachable_dir("slurm-work")
    directory, entry = work / unreadable, pwd.getpwnam(unreadable)
    directory.mkdir(mode=0o700)
    (directory / ".planted").write_text("the last tenant's\n")
    for path in (directory, directory / ".planted"):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    directory.chmod(0)
    tenants = {"pool": [unreadable, empty], "assignments_path": str(tmp_path / "a.db")}
    z = "virtengine1tenant0z"
    adapter = sc.adapter(env, "cli", tenants=tenants, work_dir=str(work), hold=True)
    try:
        await hold_back_taken(adapter, adapter.tenants, z, cluster_id=adapter.cluster_id)
        assert adapter.tenants.account_for(z, submit_account=adapter.backend.user) == empty

        await adapter.remove_account_files(unreadable)
        assert await adapter.account_files(unreadable) == []
        assert not (directory / ".planted").exists()
    finally:
        await adapter.close()


async def test_release_of_an_account_whose_job_directory_its_tenant_made_unreadable_refuses_then_cleans(
    env: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tenants release`` of an account whose tenant left its job directory unreadable (``chmod 0``) refuses,
    audited, and says how to go on; ``--clean`` empties it as the account and releases it (before, the failed
    listing ended the command with an error and ``--clean`` never ran)."""
    account, x = "vehpc-fresh4", "virtengine1tenant0x"
    if not ensure_user(account, system=False):
        pytest.fail(f"cannot create the account {account} (run the tests as root)")
    work, assignments = reachable_dir("slurm-work"), tmp_path / "assignments.db"
    directory, entry = work / account, pwd.getpwnam(account)
    directory.mkdir(mode=0o700)
    (directory / ".planted").write_text("x's\n")
    for path in (directory, directory / ".planted"):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    directory.chmod(0)
    AssignmentStore(assignments).assign(x, TenantRules(pool=(account,)))
    tenants = {"pool": [account], "assignments_path": str(assignments)}
    config = tmp_path / "config.yaml"
    hpc = {"scheduler_type": "slurm", "cluster_id": "slurm-test", "tenants": tenants}
    hpc |= {"slurm": sc.slurm_section(env, "cli", work_dir=str(work))}
    hpc |= {"audit": {"log_path": str(tmp_path / "audit.jsonl")}}
    config.write_text(yaml.safe_dump({"hpc": hpc}))
    monkeypatch.setenv("PROVIDER_MARKER_SECRET", sc.MARKER_SECRET)

    assert await asyncio.to_thread(release, config, x) == 2
    assert "cannot be listed as the account" in capsys.readouterr().err
    assert AssignmentStore(assignments).all() == {x: account}, "nothing released"

    assert await asyncio.to_thread(release, config, x, "--clean") == 0
    assert list(directory.iterdir()) == [] and AssignmentStore(assignments).all() == {}
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(e["event_type"], e["details"]["files_removed"]) for e in events] == [
        ("tenant_account_release_refused", False),
        ("tenant_account_released", True),
    ]
