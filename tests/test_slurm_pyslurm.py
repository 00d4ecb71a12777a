"""The optional pyslurm transport against the local cluster.

No pyslurm release on PyPI matches Slurm 22.05, so these tests skip wherever pyslurm is
not installed, which includes this project's CI. A site whose Slurm matches a pyslurm release installs it and runs
them against its own cluster: the configuration must say ``transport: pyslurm``.
"""

from __future__ import annotations

from typing import Any

import pytest

from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import SlurmAdapter
from tests import slurm_cluster as sc
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
