"""Every built-in template end to end on the local executor: submitted on the ledger as a tenant would, picked up
by the real poller, rendered, run as real processes (Open MPI with 2 ranks, a Dask cluster, an HTTP session the
tenant connects to), with signed usage and settlement; and the refusals a tenant would see (budget, unapproved
template, a GPU job on a host without GPUs)."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.local import LocalAdapter
from tests.conftest import make_config
from tests.local_support import shared_dir
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Secrets
from virtengine_hpc.models import PricedQueue
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from virtengine_hpc.templates import WorkloadTemplate, sign_template

PY = "/usr/bin/python3"
# Open MPI refuses to run as root unless told twice; the tenant's environment says so (as a root test runner).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.getuid() == 0 else {}
DASK_DRIVER = """\
import os
from dask.distributed import Client
client = Client(scheduler_file=os.environ["DASK_SCHEDULER_FILE"])
client.wait_for_workers(int(os.environ["DASK_WORKERS"]), timeout=90)
workers = len(client.scheduler_info()["workers"])
total = client.submit(sum, client.map(lambda x: x * x, range(100))).result()
with open(os.path.join(os.environ["DATA_OUTPUT"], "result.txt"), "w") as out:
    out.write(f"{total}\\n")
print(f"workers={workers} total={total}")
client.close()
"""


def needs(*programs: str) -> None:
    missing = [p for p in programs if not Path(p).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run temporal-dev/install-system-deps.sh")


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def job_file(p: Pipeline, job_id: str, name: str) -> Path:
    job = p.ledger.job(job_id)
    assert job is not None and job.scheduler_job_id
    assert isinstance(p.adapter, LocalAdapter)
    if name in ("stdout", "stderr"):  # written through the supervisor, in the job's directory
        return p.adapter.job_dir(job.scheduler_job_id) / name
    return p.adapter.work_dir(job.scheduler_job_id) / name  # written by the job, in its working directory


def output(p: Pipeline, job_id: str, name: str = "stdout") -> str:
    return job_file(p, job_id, name).read_text()


def settled_exactly(p: Pipeline, job_id: str) -> None:
    settlement = p.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged > 0
    assert settlement.charged + settlement.refunded == settlement.escrow == Decimal(100)


async def test_batch_mpi_and_data_templates_run_end_to_end(pipe: Pipeline) -> None:
    needs("/usr/bin/mpirun", "/usr/bin/dask-scheduler")
    shared = shared_dir()  # the jobs run as a tenant account: they read the driver and write out/ here
    driver = shared / "etl.py"
    driver.write_text(DASK_DRIVER)
    out_dir = shared / "out"
    mpi_program = (
        '-c \'from mpi4py import MPI; c = MPI.COMM_WORLD; print("rank", c.Get_rank(), "of", c.Get_size())\''
    )
    jobs = {
        "mpi": pipe.submit(
            template_id="mpi-standard",
            template_parameters={"command": PY, "args": mpi_program},
            resources={"nodes": 1, "tasks_per_node": 2},
            environment=MPI_ENV,
        ),
        "batch": pipe.submit(
            template_id="batch-standard",
            template_parameters={
                "command": PY,
                "args": "-c 'import socket, sys; print(sorted(n for _, n in socket.if_nameindex()), sys.argv[1:])' "
                "'$(touch pwned)' '`id`'",
            },
        ),
        "data": pipe.submit(
            template_id="data-processing",
            template_parameters={
                "engine": "dask",
                "application": str(driver),
                "python": PY,
                "output": str(out_dir),
            },
            resources={"nodes": 1},
        ),
    }
    results = await pipe.run_until_done(list(jobs.values()), timeout=180)
    for name, job_id in jobs.items():
        assert results[job_id].state == JobState.COMPLETED, (
            f"{name}: {results[job_id].message} {output(pipe, job_id, 'stderr')[-2000:]}"
        )
        settled_exactly(pipe, job_id)
    assert sorted(output(pipe, jobs["mpi"]).split("\n")[:2]) == ["rank 0 of 2", "rank 1 of 2"]
    assert "mpi: mpirun starting 2 task(s)" in output(pipe, jobs["mpi"], "stderr")
    # No network but loopback, and the hostile words arrived as data.
    assert output(pipe, jobs["batch"]) == "['lo'] ['$(touch pwned)', '`id`']\n"
    assert not job_file(pipe, jobs["batch"], "pwned").exists()
    assert output(pipe, jobs["data"]) == "workers=1 total=328350\n"
    assert (out_dir / "result.txt").read_text() == "328350\n"


async def test_interactive_session_serves_an_endpoint_until_cancelled(
    pipe: Pipeline, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = pipe.submit(
        template_id="interactive-session",
        template_parameters={"service": "http", "command": f"{PY} -m http.server {{port}} --bind 127.0.0.1"},
    )
    await pipe.wait_started(job_id)
    endpoint: dict[str, Any] | None = None
    for _ in range(200):
        await pipe.poller.poll_once()
        job = pipe.ledger.job(job_id)
        # The session writes its endpoint as soon as it serves; the chain hears "running" at the workflow's
        # next status poll, so wait for both before asking either.
        if job is not None and job.scheduler_job_id and job.state == JobState.RUNNING:
            path = job_file(pipe, job_id, f"virtengine-session-{job_id}.json")
            if path.exists():
                endpoint = json.loads(path.read_text())
                break
        await asyncio.sleep(0.2)
    assert endpoint is not None, "the session published its endpoint while the chain shows it running"
    assert endpoint["job_id"] == job_id and endpoint["service"] == "http" and len(endpoint["token"]) == 48
    assert oct(path.stat().st_mode & 0o777) == "0o600", "the token is readable by the job's user only"
    reply = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{endpoint['port']}/", timeout=10)
    )
    assert reply.status == 200
    assert pipe.ledger.job(job_id).state == JobState.RUNNING  # type: ignore[union-attr]
    assert "http ready at" in output(pipe, job_id)
    # The provider reads the endpoint to hand it to the tenant.
    config_file = pipe.config.hpc.job_service.state_store_path.parent / "session-config.json"
    config_file.write_text(pipe.config.model_dump_json(exclude_defaults=True))
    assert cli_main(["--config", str(config_file), "templates", "session", job_id]) == 0
    assert json.loads(capsys.readouterr().out) == endpoint
    pipe.ledger.request_cancel(job_id)
    results = await pipe.run_until_done([job_id], timeout=60)
    assert results[job_id].state == JobState.CANCELLED
    assert not path.exists(), "a closed session withdraws its endpoint"
    settled_exactly(pipe, job_id)


async def test_budget_and_approval_refusals_fail_the_job_and_refund_it(pipe: Pipeline) -> None:
    before = pipe.ledger.balance(TENANT)
    poor = pipe.submit(
        template_id="mpi-standard",
        template_parameters={"command": "true"},
        resources={"nodes": 2},
        max_price="1",
    )
    short = PricedQueue(
        offering_id="offering-short", cluster_id=pipe.cluster_id, partition="debug", max_duration_seconds=1800
    )
    pipe.ledger.add_queue(short)
    too_long = pipe.submit(
        template_id="batch-standard",
        template_parameters={"command": "true"},
        offering_id="offering-short",
        walltime_seconds=3600,
    )
    publisher = "virtengine1publisher0bob"
    signer = Signer.generate()
    pipe.ledger.register_publisher_key(publisher, public_key_b64(signer.public_key))
    template = WorkloadTemplate.model_validate(
        {
            "template_id": "bob-hello",
            "name": "hello",
            "version": "1.0.0",
            "type": "custom",
            "publisher": publisher,
            "resources": {
                "nodes": {"min": 1, "max": 1, "default": 1},
                "cpus_per_node": {"min": 1, "max": 2, "default": 1},
                "memory_mb_per_node": {"min": 64, "max": 2048, "default": 256},
                "runtime_minutes": {"min": 1, "max": 30, "default": 10},
            },
            "entrypoint": {"launcher": "direct", "command": ["echo", "hello", "{name}"]},
            "parameters": {"name": {"type": "string", "pattern": "^[a-z]{1,20}$", "required": True}},
        }
    )
    pipe.ledger.publish_template(sign_template(template, signer))
    unapproved = pipe.submit(template_id="bob-hello", template_parameters={"name": "alice"})
    # This host has no GPU: the local executor refuses a GPU job rather than bill GPU time it cannot give.
    gpu = pipe.submit(
        template_id="gpu-compute",
        template_parameters={"command": PY, "args": "-c 'print(1)'"},
        resources={"gpus_per_node": 1},
    )
    results = await pipe.run_until_done([poor, too_long, unapproved, gpu])
    assert all(results[j].state == JobState.FAILED for j in (poor, too_long, unapproved, gpu))
    assert "the local executor cannot provide 1 GPUs per node (this host has 0)" in results[gpu].message
    assert not pipe.ledger.usage_records(gpu)
    assert "budget 1 does not cover the most this job can cost" in results[poor].message
    assert (
        "walltime 3600 s is outside the offering offering-short duration bounds 60..1800 s"
        in results[too_long].message
    )
    assert "not approved by governance" in results[unapproved].message
    assert pipe.audit_events("template_rejected", unapproved)
    assert pipe.audit_events("job_validation_failed", poor)
    assert pipe.ledger.balance(TENANT) == before, "every refused job's escrow came back"
    # Once governance approves, the same template runs.
    pipe.ledger.approve_template("bob-hello")
    approved = pipe.submit(template_id="bob-hello", template_parameters={"name": "alice"})
    results = await pipe.run_until_done([approved])
    assert results[approved].state == JobState.COMPLETED
    assert output(pipe, approved) == "hello alice\n"
