"""The optional pyslurm transport against the local cluster.

No pyslurm release on PyPI matches Slurm 22.05, so the tests of pyslurm itself skip wherever it is not installed,
which includes this project's CI. A site whose Slurm matches a pyslurm release installs it and runs them against its
own cluster: the configuration must say ``transport: pyslurm``. The transport's accounting (``sacct``, not pyslurm)
is tested here on the real cluster, with a stand-in for pyslurm's part.
"""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any

import pytest

from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm import adapter as adapter_module
from activities.schedulers.slurm import backends as backends_module
from activities.schedulers.slurm.backends import CliBackend, PyslurmBackend
from tests import slurm_cluster as sc
from tests.test_slurm_adapter import _WorkerAhead
from virtengine_hpc.config import Secrets
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
SCOPE = "pyslurm-"


def test_pyslurm_transport_without_pyslurm_is_a_clear_config_error() -> None:
    try:
        import pyslurm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pyslurm is installed here")
    env = {
        "cluster": "c",
        "controller_host": "127.0.0.1",
        "controller_port": 6817,
        "partition": "debug",
        "account": "a",
        "jobs_dir": "/tmp",
        "slurm_conf": "/nonexistent",
    }
    with pytest.raises(ConfigError, match="pyslurm is not installed"):
        # pyslurm cannot submit as each tenant's account: only a single trusted tenant's provider may pick it
        SlurmAdapter.from_config(sc.config(env, "pyslurm", tenants={"isolation": "none"}), Secrets(), "c1")


async def test_pyslurm_submit_status_cancel() -> None:
    pytest.importorskip("pyslurm", reason="pyslurm is not installed (no PyPI release matches Slurm 22.05)")
    env: dict[str, Any] = sc.cluster()
    adapter = sc.adapter(env, "pyslurm", hold=True)
    try:
        wf = sc.workflow_id(SCOPE + "held")
        submitted = await adapter.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n")
        )
        again = await adapter.submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n"))
        assert again.adopted and again.scheduler_job_id == submitted.scheduler_job_id
        status = (await adapter.status_batch([submitted.scheduler_job_id]))[submitted.scheduler_job_id]
        assert status.state == JobState.QUEUED
        await adapter.cancel(submitted.scheduler_job_id)
        final = await sc.wait_final(adapter, submitted.scheduler_job_id, timeout=60)
        assert final.state == JobState.CANCELLED
    finally:
        await adapter.close()
        sc.cancel_test_jobs(env, SCOPE)


async def test_pyslurm_transport_bills_every_run_of_a_requeued_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyslurm 22.5's accounting API returns one record per job id (its filter never asks slurmdbd for a requeued
    job's earlier runs), so the transport reads accounting with ``sacct --duplicates``: a job requeued after a few
    seconds and cancelled while pending again is billed its first run, not the 0 s of its last record.

    pyslurm cannot be installed here: a stand-in module plays the controller's part, holding no job (as once
    ``MinJobAge`` has passed), and the accounting under test is the real cluster's, read by the pyslurm transport."""
    env: dict[str, Any] = sc.cluster()
    stand_in = types.ModuleType("pyslurm")
    stand_in.Jobs = types.SimpleNamespace(load=dict)  # type: ignore[attr-defined]
    monkeypatch.setattr(adapter_module, "load_pyslurm", lambda: stand_in)
    cli = sc.adapter(env, "cli")
    pys = sc.adapter(env, "pyslurm", tenants={"isolation": "none"})
    wf = sc.workflow_id(SCOPE + "requeued")
    job_id = ""

    def runs(*extra: str) -> list[list[str]]:
        out = sc.slurm_command(
            env, ["sacct", *extra, "-X", "-P", "-n", "-j", job_id, "-o", "State,ElapsedRaw"]
        )
        return [line.split("|") for line in out.splitlines() if line]

    try:
        submitted = await cli.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "sleep 300\n"), body="sleep 300\n")
        )
        job_id = submitted.scheduler_job_id
        await sc.wait_for(cli, job_id, lambda s: s.state == JobState.RUNNING, timeout=120)
        await asyncio.sleep(4)
        sc.slurm_command(env, ["scontrol", "requeue", job_id])
        for _ in range(60):  # slurmdbd records the pending run a moment after the requeue
            if len(runs("--duplicates")) == 2:
                break
            await asyncio.sleep(0.5)
        sc.slurm_command(env, ["scancel", job_id])
        usage = await sc.final_usage(pys, job_id)
        every = runs("--duplicates")
        assert [r[0].split()[0] for r in every] == ["REQUEUED", "CANCELLED"] and int(every[0][1]) >= 4, every
        assert [r[1] for r in runs()] == ["0"]  # the latest record alone: what pyslurm's accounting API gives
        assert usage.final and usage.reading.wall_clock_seconds == sum(int(r[1]) for r in every), every
        assert pys.calls["sacct"] >= 1
    finally:
        if job_id:
            await cli.cancel(job_id)
        await cli.close()
        await pys.close()


async def test_pyslurm_transport_reads_the_jobs_that_ended_between_two_sweep_rounds() -> None:
    """The sweep's read of the jobs that ended since its last round is the transport's accounting, ``sacct`` (as
    the cli transport's): a short job of a lookup account that ran and ended is in it. It raised before (logged
    once: "cannot list the accounts' ended jobs"), so such a job was never found over pyslurm.

    pyslurm cannot be installed here: a stand-in module plays the controller's part, and the accounting under test
    is the real cluster's. (pyslurm cannot submit as each tenant's account, so a configuration refuses it with
    tenant accounts; the backend is built here with the tenants' accounts as its lookup accounts.)"""
    env: dict[str, Any] = sc.cluster()
    stand_in = types.ModuleType("pyslurm")
    cli = sc.adapter(env, "cli")
    assert isinstance(cli.backend, CliBackend)
    backend = PyslurmBackend(stand_in, cluster=env["cluster"], user="root", sacct=cli.backend)
    alice = sc.account_of(env)
    job_id = sc.slurm_command(
        env, ["runuser", "-u", alice, "--", "sbatch", "--parsable", "-t", "1", "-J", sc.workflow_id(SCOPE + "ended"),
              "-o", "/dev/null", "--wrap", "sleep 1"],
    ).strip().split(";")[0]  # fmt: skip
    try:
        for _ in range(240):  # it waits its turn on the shared cluster, then slurmdbd records its end
            ended = {job.job_id: job for job in await backend.ended_since(600)}
            if job_id in ended:
                break
            await asyncio.sleep(0.5)
        assert job_id in ended, f"job {job_id} of {alice} ran and ended: the pyslurm transport never reads it"
        assert ended[job_id].user == alice and ended[job_id].elapsed_seconds >= 1
        assert backend.calls["sacct"] >= 1
    finally:
        sc.slurm_command(env, ["scancel", job_id])
        await cli.close()


async def test_pyslurm_counts_a_running_jobs_time_on_the_controllers_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pyslurm, like ``squeue``, counts a running job's ``run_time`` on the worker's host, to its clock, from the
    job's start on the controller's: a worker a minute ahead billed that minute in every running reading, which the
    final record never took back. The stand-in holds the real running job as pyslurm would, its run time counted
    to the worker's clock put a minute ahead (the adapter's clock as well)."""
    env: dict[str, Any] = sc.cluster()
    cli = sc.adapter(env, "cli")
    wf = sc.workflow_id(SCOPE + "skew")
    job_id = ""
    jobs: dict[int, Any] = {}
    stand_in = types.ModuleType("pyslurm")
    stand_in.Jobs = types.SimpleNamespace(load=lambda: jobs)  # type: ignore[attr-defined]
    monkeypatch.setattr(adapter_module, "load_pyslurm", lambda: stand_in)
    pys = sc.adapter(env, "pyslurm", tenants={"isolation": "none"})
    try:
        submitted = await cli.submit(
            SubmitRequest(workflow_id=wf, job=sc.spec(wf, "sleep 20\n"), body="sleep 20\n")
        )
        job_id = submitted.scheduler_job_id
        await sc.wait_for(cli, job_id, lambda s: s.state == JobState.RUNNING, timeout=120)
        start = int(sc.slurm_command(env, ["squeue", "-h", "-j", job_id, "-O", "StartTime"]).strip())
        await asyncio.sleep(2)
        jobs[int(job_id)] = types.SimpleNamespace(
            id=int(job_id),
            state="RUNNING",
            name=wf,
            start_time=start,
            run_time=int(time.time()) + 60 - start,  # pyslurm's _calc_run_time: time(NULL) - start
            allocated_tres="cpu=1,mem=256M,node=1",
        )
        monkeypatch.setattr(backends_module, "datetime", _WorkerAhead)
        running = await pys.usage(job_id)
        used = time.time() - start
        assert not running.final and running.reading.wall_clock_seconds <= used + 1, (running.reading, used)
    finally:
        if job_id:
            await cli.cancel(job_id)
        await cli.close()
        await pys.close()
