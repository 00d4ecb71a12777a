"""The built-in templates end to end on the real local SLURM cluster (``temporal-dev/slurm-up.sh``): MPI with 2
tasks through ``srun``, real MPI (mpi4py, 2 ranks) through ``mpirun`` inside the allocation, batch without network,
Dask in the allocation, and an interactive session the tenant connects to. GPU templates are checked as rendered
sbatch scripts (``tests/test_templates.py``): this cluster has no GPU gres.

Skipped when the cluster is not up, unless ``VEHPC_REQUIRE_SLURM=1`` (CI after starting it): then it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import urllib.request
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
from tests.conftest import REPO, make_config
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Secrets
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.slurm
PY = "/usr/bin/python3"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.getuid() == 0 else {}


def cluster_env() -> dict[str, Any]:
    env_file = Path(os.environ.get("VEHPC_DEV_DIR", REPO / ".dev")) / "slurm" / "env.json"
    why = f"{env_file} does not exist"
    if env_file.exists():
        env: dict[str, Any] = json.loads(env_file.read_text())
        try:
            ping = subprocess.run(
                ["scontrol", "ping"],
                env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
                capture_output=True,
                text=True,
                timeout=15,
            )
            if "UP" in ping.stdout:
                return env
            why = f"scontrol ping: {(ping.stdout + ping.stderr).strip()[:200]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"scontrol ping failed: {exc}"
    message = f"the local SLURM cluster is not up ({why}); start it with: sudo temporal-dev/slurm-up.sh"
    if os.environ.get("VEHPC_REQUIRE_SLURM") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    env = cluster_env()
    tmp_path.chmod(0o755)
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "slurm",
            "cluster_id": f"slurm-{uuid.uuid4().hex[:8]}",
            "job_service": {"job_poll_interval": "500ms", "vanished_job_grace": "60s"},
            "slurm": {
                "cluster_name": env["cluster"],
                "controller_host": env["controller_host"],
                "default_partition": env["partition"],
                "account": env["account"],
                "work_dir": env["jobs_dir"],  # each tenant's job directory is <jobs_dir>/<account>
                "slurm_conf": env["slurm_conf"],
                "transport": "cli",
                "job_poll_interval": "500ms",
                "accounting_grace": "30s",
            },
            "tenants": sc.tenants_section(env),
        },
    )
    adapter = SlurmAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


def submit(p: Pipeline, **spec: Any) -> str:
    # The test prefix lets the SLURM tests' cleanup find leftovers by name.
    return p.submit(job_id=sc.workflow_id("tpl"), **spec)


def job_dir(p: Pipeline) -> Path:
    """Where the tenant's jobs run and write: its account's own directory."""
    assert p.config.hpc.slurm.work_dir is not None
    return p.config.hpc.slurm.work_dir / p.config.hpc.tenants.accounts[TENANT]


def slurm_output(p: Pipeline, job_id: str, suffix: str = "out") -> str:
    job = p.ledger.job(job_id)
    assert job is not None and job.scheduler_job_id
    path = job_dir(p) / f"vehpc-{job_id}-{job.scheduler_job_id}.{suffix}"
    return path.read_text() if path.exists() else f"({path.name} does not exist)"


async def test_templates_run_on_slurm(pipe: Pipeline) -> None:
    driver = job_dir(pipe) / f"etl-{uuid.uuid4().hex[:8]}.py"  # where the tenant's job can read it
    driver.write_text(
        "import os\nfrom dask.distributed import Client\n"
        "c = Client(scheduler_file=os.environ['DASK_SCHEDULER_FILE'])\n"
        "c.wait_for_workers(int(os.environ['DASK_WORKERS']), timeout=90)\n"
        "print('total', c.submit(sum, c.map(lambda x: x + 1, range(10))).result())\n"
    )
    task_probe = (
        '-c \'import os; print("task", os.environ["SLURM_PROCID"], "of", os.environ["SLURM_NTASKS"])\''
    )
    mpi_probe = (
        '-c \'from mpi4py import MPI; c = MPI.COMM_WORLD; print("rank", c.Get_rank(), "of", c.Get_size())\''
    )
    jobs = {
        "srun": submit(
            pipe,
            template_id="mpi-standard",
            template_parameters={"command": PY, "args": task_probe},
            resources={"nodes": 1, "tasks_per_node": 2},
        ),
        "mpirun": submit(
            pipe,
            template_id="mpi-standard",
            template_parameters={"command": PY, "args": mpi_probe, "launcher": "mpirun"},
            resources={"nodes": 1, "tasks_per_node": 2},
            environment=MPI_ENV,
        ),
        "batch": submit(
            pipe,
            template_id="batch-standard",
            template_parameters={"command": PY, "args": "-c 'import socket; print(socket.if_nameindex())'"},
        ),
        "data": submit(
            pipe,
            template_id="data-processing",
            template_parameters={"engine": "dask", "application": str(driver), "python": PY},
            resources={"nodes": 1},
        ),
    }
    results = await pipe.run_until_done(list(jobs.values()), timeout=300)
    for name, job_id in jobs.items():
        assert results[job_id].state == JobState.COMPLETED, (
            f"{name}: {results[job_id].message}\n{slurm_output(pipe, job_id, 'err')[-2000:]}"
        )
        settlement = pipe.ledger.settlement(job_id)
        assert settlement is not None and settlement.charged > 0
        assert settlement.charged + settlement.refunded == settlement.escrow == Decimal(100)
    assert sorted(slurm_output(pipe, jobs["srun"]).splitlines()) == ["task 0 of 2", "task 1 of 2"]
    assert "mpi: srun starting 2 task(s)" in slurm_output(pipe, jobs["srun"], "err")
    assert sorted(slurm_output(pipe, jobs["mpirun"]).splitlines()) == ["rank 0 of 2", "rank 1 of 2"]
    assert slurm_output(pipe, jobs["batch"]).strip() == "[(1, 'lo')]"
    assert slurm_output(pipe, jobs["data"]).strip() == "total 55"


async def test_interactive_session_on_slurm(pipe: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    job_id = submit(
        pipe,
        template_id="interactive-session",
        template_parameters={"service": "http", "command": f"{PY} -m http.server {{port}} --bind 127.0.0.1"},
    )
    await pipe.wait_started(job_id)
    path = job_dir(pipe) / f"virtengine-session-{job_id}.json"
    for _ in range(300):
        await pipe.poller.poll_once()
        if path.exists():
            break
        await asyncio.sleep(0.2)
    endpoint = json.loads(path.read_text())
    account = pwd.getpwnam(pipe.config.hpc.tenants.accounts[TENANT])
    # The session's token is the tenant account's own: its file 0600, in a directory no other account enters.
    assert path.stat().st_uid == account.pw_uid and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_uid == account.pw_uid and path.parent.stat().st_mode & 0o777 == 0o700
    reply = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{endpoint['port']}/", timeout=10)
    )
    assert reply.status == 200 and endpoint["job_id"] == job_id
    # The provider's CLI finds it in the tenant account's directory, where the job wrote it.
    config_file = pipe.config.hpc.job_service.state_store_path.parent / "session-config.json"
    config_file.write_text(pipe.config.model_dump_json(exclude_defaults=True))
    capsys.readouterr()
    assert cli_main(["--config", str(config_file), "templates", "session", job_id]) == 0
    assert json.loads(capsys.readouterr().out) == endpoint
    pipe.ledger.request_cancel(job_id)
    results = await pipe.run_until_done([job_id], timeout=120)
    assert results[job_id].state == JobState.CANCELLED
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == Decimal(100)
