"""The sweep for scheduler jobs no workflow names, on the real SLURM cluster (``workers/sweeper.py``).

The late ``sbatch`` of a killed submit attempt, landing after the retry's duplicate check, is played by the
adapter's own submission call (``_submit_new``, what every attempt's ``sbatch`` is) for a workflow whose submit
has finished: one sweep, one scheduler listing, cancels it and audits it, and the workflow's own job is left
alone (the workflow then closes it as usual). The same late job after the workflow has closed and settled is cancelled as unowned; one whose workflow
the chain does not know (another provider's, another test run's) is left alone; with ``unowned_jobs: report``
nothing is cancelled.

A job a tenant submits itself (its job's ``sbatch`` runs as the tenant's account) carries no valid marker: no
workflow will ever watch or bill it. The sweep lists every job of the tenants' accounts and cancels such a job in
one round, audited under the account and its tenant (never under a workflow its name claims), while the marked
job of a live workflow runs on.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.client import Client

from activities.audit import read_events
from activities.schedulers.base import SubmitRequest
from activities.schedulers.batch.base import Owner
from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import make_config
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import CancelRequest, JobStatusView
from virtengine_hpc.states import JobState
from workers.metrics import MeteredAuditLog, WorkerMetrics
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
    sc.remove_outputs(env, SCOPE)


@pytest.fixture(autouse=True)
def _no_leftovers(env: dict[str, Any]) -> Any:
    """Each test's pipeline has a cluster id of its own, so a job an earlier test left would carry a marker made
    for another cluster: to this test's sweep, a job without a valid marker. Each test cleans up after itself."""
    yield
    sc.cancel_test_jobs(env, SCOPE)
    for name in sc.slurm_command(env, ["squeue", "-h", "-o", "%A|%j"]).splitlines():
        job_id, _, job_name = name.partition("|")
        if job_name.startswith(sc.TEST_PREFIX + SCOPE):
            sc.slurm_command(env, ["scancel", job_id])


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


def sweep(
    p: Pipeline, env: dict[str, Any], config: Config | None = None, secrets: Secrets | None = None
) -> JobSweep:
    """A sweep as the poller process runs it: with an adapter of its own (its calls are the sweep's alone)."""
    config = config or p.config
    own = SlurmAdapter.from_config(config, secrets or sc.secrets(env), config.hpc.cluster_id)
    metrics = WorkerMetrics()
    audit = MeteredAuditLog(config.hpc.audit, metrics)  # the poller's: every record counted
    return JobSweep(p.client, p.ledger, own, config, audit, metrics=metrics)


def reporting(config: Config) -> Config:
    job_service = config.hpc.job_service.model_copy(update={"unowned_jobs": "report"})
    return config.model_copy(update={"hpc": config.hpc.model_copy(update={"job_service": job_service})})


def tenant_sbatch(env: dict[str, Any], account: str, name: str) -> str:
    """What a tenant's job script can run: ``sbatch`` as the tenant's own account (tests/test_slurm_tenants.py
    shows a real job's ``sbatch`` does exactly this), any name, no limit. Run here directly as the account, held,
    so it waits in the queue whatever else runs on the shared cluster."""
    argv = [
        "sbatch",
        "--parsable",
        "--hold",
        "-t",
        "60",
        "-J",
        name,
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 3600",
    ]
    out = subprocess.run(
        ["runuser", "-u", account, "--", *argv],
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = out.stdout.strip().split(";")[0]
    assert job_id.isdigit(), out
    return job_id


def tenant_hetjob(env: dict[str, Any], account: str, name: str) -> list[str]:
    """A heterogeneous job a tenant's script submits itself (two components, held): its components' ids, the
    leader's first."""
    script = f"#!/bin/bash\n#SBATCH -J {name} -t 60 -o /dev/null\n#SBATCH hetjob\n#SBATCH -t 60\nsleep 3600\n"
    out = subprocess.run(
        ["runuser", "-u", account, "--", "sbatch", "--parsable", "--hold"],
        input=script,
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
        check=True,
    )
    leader = out.stdout.strip().split(";")[0]
    assert leader.isdigit(), out
    rows = sc.slurm_command(env, ["squeue", "-h", "-t", "all", "-O", "JobID:|,HetJobID:|"]).splitlines()
    others = [r.split("|")[0] for r in rows if r.split("|")[1:2] == [leader] and r.split("|")[0] != leader]
    return [leader, *others]


def native_state(env: dict[str, Any], job_id: str) -> str:
    return sc.slurm_command(env, ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"]).strip()


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
    """The sweep's records of live jobs (each test's pipeline has a cluster id of its own, so the jobs earlier
    tests ran carry markers of other clusters: a second round reports those that ended lately as ``ended``)."""
    return [
        e["details"]
        for e in read_events(p.config.hpc.audit.log_path)
        if e["event_type"] == event
        and e["details"].get("found_by") == "sweep"
        and not e["details"].get("ended")
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
    assert calls == {"squeue": 1, "sacct": 1, "scancel": 1}, (
        "one listing for the whole cluster, one read of the jobs that ended, one cancel"
    )
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


async def test_a_job_its_tenant_requeues_after_it_settled_is_cancelled_before_it_runs_again(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """Slurm requeues a batch job that has already ended while the controller still holds it (``MinJobAge``), and
    the job's owner may ask for it: the job waits out Slurm's hold after a requeue (the credential lifetime plus
    1 s: 121 s by default, 31 s on the dev cluster) and runs again under the same id, after its
    workflow settled it, with nothing to watch or bill that run. The sweep cancels it while it waits. Slurm rewrote
    the record of the run that ended (REQUEUED, no start, 0 s): the adapter still reads that run for its batch
    step's time, so the job's accounting is what its records billed (before: 0 s against the 4 s billed)."""
    job_id = pipe.submit(
        job_id=sc.workflow_id(SCOPE + "rerun"),
        script="#!/bin/bash\nsleep 4\n",
        resources={"memory_mb_per_node": 256},
    )
    results = await pipe.run_until_done([job_id], timeout=300)
    assert results[job_id].state == JobState.COMPLETED, results[job_id].message
    own = results[job_id].scheduler_job_id or ""
    requeue = ["runuser", "-u", sc.account_of(env), "--", "scontrol", "requeue", own]
    out = subprocess.run(
        requeue, env={**os.environ, "SLURM_CONF": env["slurm_conf"]}, capture_output=True, text=True
    )
    assert out.returncode == 0, out  # the tenant's own account may requeue its finished job
    assert native_state(env, own) == "PENDING"

    stats = await sweep(pipe, env).sweep_once()

    assert stats.unowned == [own]
    assert (await sc.wait_final(slurm(pipe), own)).state == JobState.CANCELLED
    [audited] = swept(pipe, "unowned_job_cancelled")
    assert audited["scheduler_job_id"] == own
    runs = sc.slurm_command(
        env, ["sacct", "--duplicates", "-X", "-P", "-n", "-j", own, "-o", "State,ElapsedRaw"]
    )
    assert [r.split("|")[0].split()[0] for r in runs.splitlines()] == ["REQUEUED", "CANCELLED"], runs
    billed = sum(r.metrics.wall_clock_seconds for r in pipe.ledger.usage_records(job_id))
    for _ in range(30):  # slurmdbd records the cancel a moment after the controller
        usage = await slurm(pipe).usage(own)
        if usage.final:
            break
        await asyncio.sleep(1)
    assert usage.final and abs(usage.reading.wall_clock_seconds - billed) <= 1 and billed >= 4, (runs, billed)


async def test_report_only_leaves_the_job_running_and_audits_it(
    pipe: Pipeline, env: dict[str, Any], tmp_path: Path
) -> None:
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "report"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    zombie = await late_sbatch(pipe, job_id)
    stats = await sweep(pipe, env, reporting(pipe.config)).sweep_once()

    assert stats.duplicates == [zombie]
    # (other runs' jobs of the tenants' accounts on the shared cluster are reported too: only this one matters)
    [audited] = [d for d in swept(pipe, "unowned_job_found") if d["kind"] == "duplicate"]
    assert audited["scheduler_job_id"] == zombie and audited["kept"] == own
    status = (await slurm(pipe).status_batch([zombie]))[zombie]
    assert status.found and not status.state.final, "reported, not cancelled"
    await slurm(pipe).cancel(zombie)


async def test_a_job_a_tenant_submits_itself_is_cancelled_and_audited_in_one_sweep(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "live"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    alice = sc.account_of(env, TENANT)
    free = tenant_sbatch(env, alice, sc.workflow_id(SCOPE + "free"))

    sweeper = sweep(pipe, env)
    listed = {job.scheduler_job_id: job for job in await sweeper.adapter.swept_jobs()}
    assert free in listed and listed[free].workflow_id is None and listed[free].user == alice
    assert listed[own].workflow_id == job_id, "the workflow's own job carries its valid marker"
    stats = await sweeper.sweep_once()

    assert stats.unmarked == [free] and stats.duplicates == [] and stats.unowned == []
    assert (await sc.wait_final(slurm(pipe), free)).state == JobState.CANCELLED
    [audited] = [
        e for e in read_events(pipe.config.hpc.audit.log_path) if e["event_type"] == "unowned_job_cancelled"
    ]
    assert audited["job_id"] is None, "no chain job is this job's: it is audited under its account and tenant"
    details = audited["details"]
    assert details["scheduler_job_id"] == free and details["kind"] == "unmarked"
    assert details["account"] == alice and details["tenant"] == TENANT and details["found_by"] == "sweep"
    assert sweeper.metrics is not None
    assert sweeper.metrics.swept.labels(sweeper.cluster_id, "unmarked", "cancelled")._value.get() == 1
    await still_its_own(pipe, job_id, own)


async def test_a_job_named_after_another_tenants_workflow_is_cancelled_and_not_audited_as_hers(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """Bob's script names its own job after Alice's live workflow (its id is readable in squeue): no valid
    marker, so it is cancelled; the audit record names Bob's account and tenant, never Alice's workflow."""
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "victim"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    bob = sc.account_of(env, sc.BOB)
    forged = tenant_sbatch(env, bob, f"vehpc-{job_id}.{'0' * 32}")

    stats = await sweep(pipe, env).sweep_once()

    assert stats.unmarked == [forged] and stats.duplicates == []
    assert (await sc.wait_final(slurm(pipe), forged)).state == JobState.CANCELLED
    audits = [
        e for e in read_events(pipe.config.hpc.audit.log_path) if e["event_type"].endswith("_cancelled")
    ]
    assert [e["job_id"] for e in audits] == [None], audits
    details = audits[0]["details"]
    assert details["account"] == bob and details["tenant"] == sc.BOB and details["claims"] == job_id
    await still_its_own(pipe, job_id, own)


async def test_report_only_reports_a_tenants_own_job_once_and_leaves_it(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    free = tenant_sbatch(env, sc.account_of(env, TENANT), sc.workflow_id(SCOPE + "reported"))
    sweeper = sweep(pipe, env, reporting(pipe.config))
    try:
        first, second = await sweeper.sweep_once(), await sweeper.sweep_once()
        assert first.unmarked == [free] and second.unmarked == []
        [audited] = swept(pipe, "unowned_job_found")
        assert audited["scheduler_job_id"] == free and audited["kind"] == "unmarked"
        assert native_state(env, free) == "PENDING", "reported, not cancelled"
    finally:
        sc.slurm_command(env, ["scancel", free])


async def test_a_job_its_open_workflow_names_is_left_alone_even_under_another_marker_key(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """After the marker key changed (or on a poller that holds another key than the workers), a running job's
    marker no longer verifies: as long as its open workflow names it, the sweep leaves it (and says so)."""
    job_id = pipe.submit(job_id=sc.workflow_id(SCOPE + "rotated"), script="#!/bin/bash\nsleep 60\n")
    own = await named_job(pipe, job_id)
    other_key = sc.secrets(env).model_copy(
        update={"marker_secret": SecretStr("another-marker-secret-" + "9" * 32)}
    )

    stats = await sweep(pipe, env, secrets=other_key).sweep_once()

    assert stats.unmarked == [] and stats.left >= 1
    assert not [e for e in audited_about(pipe, own) if e["event_type"].startswith("unowned")]
    await still_its_own(pipe, job_id, own)


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


def over(config: Config, env: dict[str, Any], transport: str) -> Config:
    """The same configuration with the cluster reached over another transport."""
    section = type(config.hpc.slurm).model_validate(sc.slurm_section(env, transport))
    return config.model_copy(update={"hpc": config.hpc.model_copy(update={"slurm": section})})


async def tenant_job_that_ran(
    p: Pipeline, env: dict[str, Any], account: str, label: str, name: str | None = None
) -> str:
    """A short job a tenant's script submits itself as its account (named ``name``, else after a workflow id of
    its own), run to its end and recorded by slurmdbd."""
    out = subprocess.run(
        [
            "runuser", "-u", account, "--", "sbatch", "--parsable", "-t", "1",
            "-J", name or sc.workflow_id(SCOPE + label), "-o", "/dev/null", "--wrap", "sleep 2",
        ],
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    free = out.stdout.strip().split(";")[0]
    assert (await sc.wait_final(slurm(p), free, timeout=300)).state == JobState.COMPLETED
    ended = [
        "sacct",
        "-X",
        "-n",
        "-P",
        "-u",
        account,
        "-S",
        "now-600",
        "-E",
        "now+60",
        "-s",
        "CD",
        "-o",
        "JobIDRaw",
    ]
    while free not in sc.slurm_command(env, ended).split():
        await asyncio.sleep(0.5)  # slurmdbd records the end a moment after the controller
    return free


def audited_about(p: Pipeline, scheduler_job_id: str) -> list[dict[str, Any]]:
    return [
        e
        for e in read_events(p.config.hpc.audit.log_path)
        if e["details"].get("scheduler_job_id") == scheduler_job_id
    ]


@pytest.mark.parametrize("transport", ["cli", "rest"])
async def test_a_tenants_job_that_ran_between_two_rounds_is_audited(
    pipe: Pipeline, env: dict[str, Any], transport: str
) -> None:
    """A tenant's script times its own jobs between two rounds (a held canary it watches vanishes when a round
    ran): a job that starts after one round and ends before the next is never live at a round. The provider
    must still learn of it: the next round audits it under the account and tenant, once, with what it held."""
    alice = sc.account_of(env, TENANT)
    sweeper = sweep(pipe, env, over(pipe.config, env, transport))
    await sweeper.sweep_once()
    free = await tenant_job_that_ran(pipe, env, alice, "between")

    first, second = await sweeper.sweep_once(), await sweeper.sweep_once()

    assert free not in first.unmarked + second.unmarked, "it ended: nothing is left to cancel"
    audited = audited_about(pipe, free)
    assert len(audited) == 1, f"the provider never learns of tenant job {free} that ran unbilled: {audited}"
    details = audited[0]["details"]
    assert details["account"] == alice and details["tenant"] == TENANT and details["kind"] == "unmarked"
    assert details["ended"] is True and details["elapsed_seconds"] >= 1
    assert details["allocated"]["cpus"] >= 1 and details["allocated"]["nodes"] == 1


async def test_a_tenants_job_under_the_marked_name_of_its_own_chain_job_that_ran_between_rounds_is_audited(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """A tenant sees its chain jobs' names (``squeue``), marker included, and the marker binds the workflow, the
    cluster and the account, not the scheduler job: its own job under such a name carries a valid marker. Live at
    a round it is a job its workflow does not name; between two rounds it ran unbilled all the same, and the next
    round must audit it (it was left out as marked, never reported)."""
    alice = sc.account_of(env, TENANT)
    name = slurm(pipe).job_name(Owner(sc.workflow_id(SCOPE + "copied"), alice))
    sweeper = sweep(pipe, env)
    await sweeper.sweep_once()
    free = await tenant_job_that_ran(pipe, env, alice, "copied", name=name)

    first, second = await sweeper.sweep_once(), await sweeper.sweep_once()

    assert free in first.ran + second.ran, f"tenant job {free} under a copied marked name is never reported"
    audited = audited_about(pipe, free)
    assert len(audited) == 1, audited
    details = audited[0]["details"]
    assert audited[0]["event_type"] == "unowned_job_found" and audited[0]["job_id"] is None
    assert details["account"] == alice and details["tenant"] == TENANT and details["ended"] is True
    assert details["kind"] == "unowned" and details["allocated"]["cpus"] >= 1


async def test_a_job_that_ran_while_no_poller_swept_is_audited_once_by_the_next_pollers_first_round(
    pipe: Pipeline, env: dict[str, Any]
) -> None:
    """The poller restarts (a deploy, a crash): a tenant's job that ran and ended after the last round of the old
    poller and before the first of the new one was never live at a round. The new poller's first round reads back
    to the old one's last round (kept in the state directory) and audits it; a poller started after that one
    finds the record in the audit log and does not audit it again."""
    alice = sc.account_of(env, TENANT)
    job_service = pipe.config.hpc.job_service.model_copy(update={"sweep_lookback": timedelta(minutes=10)})
    config = pipe.config.model_copy(
        update={"hpc": pipe.config.hpc.model_copy(update={"job_service": job_service})}
    )
    await sweep(pipe, env, config).sweep_once()  # the old poller's last round
    free = await tenant_job_that_ran(pipe, env, alice, "restart")

    stats = await sweep(pipe, env, config).sweep_once()  # the new poller's first round

    assert free in stats.ran, (
        f"the first round after a restart never reads tenant job {free} that ran meanwhile"
    )
    assert free not in (await sweep(pipe, env, config).sweep_once()).ran, "audited by the poller before it"
    audited = audited_about(pipe, free)
    assert len(audited) == 1, audited
    assert audited[0]["event_type"] == "unowned_job_found" and audited[0]["details"]["account"] == alice


@pytest.mark.parametrize("transport", ["cli", "rest"])
async def test_a_tenants_heterogeneous_job_is_one_finding_cancelled_whole(
    pipe: Pipeline, env: dict[str, Any], transport: str
) -> None:
    """squeue and slurmrestd list each component of a heterogeneous job as a job of its own, and Slurm refuses to
    cancel a component but by its leader (slurmrestd's cancel stopped at it: the round raised, later findings
    ran on and nothing of the round was audited). The sweep judges the job by its leader: one finding, one
    record, every component cancelled, and the round's other findings too."""
    alice, bob = sc.account_of(env, TENANT), sc.account_of(env, sc.BOB)
    components = tenant_hetjob(env, alice, sc.workflow_id(SCOPE + "het"))
    free = tenant_sbatch(env, bob, sc.workflow_id(SCOPE + "beside-het"))
    assert len(components) == 2, components
    try:
        stats = await sweep(pipe, env, over(pipe.config, env, transport)).sweep_once()

        assert sorted(stats.unmarked) == sorted([components[0], free]), stats
        for job_id in [*components, free]:
            assert (await sc.wait_final(slurm(pipe), job_id)).state == JobState.CANCELLED, job_id
        audited = {d["scheduler_job_id"]: d["account"] for d in swept(pipe, "unowned_job_cancelled")}
        assert audited == {components[0]: alice, free: bob}
    finally:
        sc.slurm_command(env, ["scancel", components[0], free])
