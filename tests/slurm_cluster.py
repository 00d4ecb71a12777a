"""The local SLURM cluster for tests: find it, build adapters for each transport, wait for jobs, clean up.

The cluster comes from ``temporal-dev/slurm-up.sh`` (``.dev/slurm/env.json`` describes it). When it is not up, the
SLURM tests skip with a message saying how to start it, unless ``VEHPC_REQUIRE_SLURM=1`` (set by
``scripts/run-tests.sh`` when it started the cluster, i.e. in CI): then a missing cluster is a failure.

Every test job's workflow id starts with ``slurmtest-<run>-`` (so its Slurm name with ``vehpc-slurmtest-<run>-``),
where ``<run>`` is drawn once per test process (or set by ``VEHPC_TEST_RUN``), and ends in a random suffix: no test
ever adopts a job of an earlier run, and ``cancel_test_jobs`` cleans up by name prefix without touching the jobs of
another test run sharing the cluster (two checkouts tested at once on one machine).

Jobs run as tenant accounts, as in production: ``tenants_section`` maps Alice and Bob to the cluster's first two
tenant accounts and hands the others out as a pool (assignments in a file of this test process), so the
provider's own account (root for the local CLI, ``hpcuser`` over SSH and slurmrestd) never runs a test job. A job's
output is in ``<jobs_dir>/<account>/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import Accounting, NativeStatus
from activities.schedulers.slurm import SlurmAdapter
from virtengine_hpc.config import Config, Secrets, load_config
from virtengine_hpc.errors import SchedulerUnavailable
from virtengine_hpc.markers import claimed_workflow
from virtengine_hpc.models import JobSpec

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("VEHPC_DEV_DIR", REPO / ".dev")) / "slurm"
RUN = os.environ.get("VEHPC_TEST_RUN") or uuid.uuid4().hex[:6]
TEST_PREFIX = f"slurmtest-{RUN}-"
TRANSPORTS = ("cli", "ssh", "rest")
ALICE, BOB = "virtengine1tenant0alice", "virtengine1tenant0bob"
_ASSIGNMENTS = Path(tempfile.mkdtemp(prefix="vehpc-tenants-")) / "tenant-accounts.db"

_cached: dict[str, Any] | None = None
_checked = False


def _probe() -> dict[str, Any] | str:
    env_file = STATE / "env.json"
    if not env_file.exists():
        return f"{env_file} does not exist"
    env = json.loads(env_file.read_text())
    try:
        out = subprocess.run(
            ["scontrol", "ping"],
            env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol ping failed: {exc}"
    if "UP" not in out.stdout:
        return f"scontrol ping: {(out.stdout + out.stderr).strip()[:200]}"
    return env


def cluster() -> dict[str, Any]:
    """The cluster's env.json, or skip (fail under ``VEHPC_REQUIRE_SLURM=1``) when it is not up."""
    global _cached, _checked
    if not _checked:
        probed = _probe()
        _checked = True
        _cached = probed if isinstance(probed, dict) else None
        if _cached is None:
            cluster.why = probed  # type: ignore[attr-defined]
    if _cached is None:
        why = getattr(cluster, "why", "unknown")
        message = f"the local SLURM cluster is not up ({why}); start it with: sudo temporal-dev/slurm-up.sh"
        if os.environ.get("VEHPC_REQUIRE_SLURM") == "1":
            pytest.fail(f"VEHPC_REQUIRE_SLURM=1 but {message}")
        pytest.skip(message)
    return _cached


def tenant_accounts(env: dict[str, Any]) -> list[str]:
    accounts = list(env.get("tenant_accounts") or [])
    if len(accounts) < 3:
        pytest.fail(
            "the local SLURM cluster has no tenant accounts (env.json tenant_accounts); rerun "
            "temporal-dev/slurm-up.sh, which creates them"
        )
    return accounts


def tenants_section(env: dict[str, Any]) -> dict[str, Any]:
    """``hpc.tenants`` for tests: Alice and Bob fixed to the first two accounts, the rest as a pool."""
    accounts = tenant_accounts(env)
    return {
        "accounts": {ALICE: accounts[0], BOB: accounts[1]},
        "pool": accounts[2:],
        "assignments_path": str(_ASSIGNMENTS),
    }


def account_of(env: dict[str, Any], tenant: str = ALICE) -> str:
    return str(tenants_section(env)["accounts"][tenant])


def workflow_id(label: str = "") -> str:
    return f"{TEST_PREFIX}{label}{'-' if label else ''}{uuid.uuid4().hex[:10]}"


def slurm_section(env: dict[str, Any], transport: str, **overrides: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "cluster_name": env["cluster"],
        "controller_host": env["controller_host"],
        "controller_port": env["controller_port"],
        "default_partition": env["partition"],
        "account": env["account"],
        "work_dir": env["jobs_dir"],
        "slurm_conf": env["slurm_conf"],
        "transport": transport,
        "job_poll_interval": "500ms",
        "connection_timeout": "20s",
        "max_retries": 2,
        "accounting_grace": "30s",
    }
    if transport == "ssh":
        section.update(
            ssh_host=env["ssh_host"],
            ssh_port=env["ssh_port"],
            ssh_user=env["ssh_user"],
            ssh_key_path=env["ssh_key_file"],
            known_hosts_path=env["ssh_known_hosts"],
            tenant_key_dir=env["tenant_key_dir"],
        )
    if transport == "rest":
        section.update(
            auth_method="jwt",
            rest_url=env["slurmrestd_url"],
            rest_user=env["rest_user"],
            api_version=env["slurmrestd_api_version"],
        )
    section.update(overrides)
    return section


MARKER_SECRET = "slurmtest-adoption-marker-secret-0123456789"
"""The tests' ``PROVIDER_MARKER_SECRET``: every adapter of every test process marks and adopts alike."""


def secrets(env: dict[str, Any], key_path: Path | None = None) -> Secrets:
    """The slurmrestd token of SlurmUser: it may submit as each tenant's account. The adoption markers' key is
    ``MARKER_SECRET`` unless a signing key is given (then derived from it, as in a worker without the secret)."""
    token = Path(env["submit_jwt_token_file"]).read_text().strip()
    return Secrets(
        slurm_jwt_token=SecretStr(token),
        provider_signing_key_path=key_path,
        marker_secret=None if key_path else SecretStr(MARKER_SECRET),
    )


def config(
    env: dict[str, Any], transport: str, *, tenants: dict[str, Any] | None = None, **overrides: Any
) -> Config:
    """``tenants`` replaces the tests' ``hpc.tenants`` (Alice and Bob fixed, a pool)."""
    return load_config(
        data={
            "hpc": {
                "scheduler_type": "slurm",
                "cluster_id": "slurm-test",
                "slurm": slurm_section(env, transport, **overrides),
                "tenants": tenants_section(env) if tenants is None else tenants,
                "retry": {"max_retries": 2, "initial_backoff": "200ms", "max_backoff": "1s"},
            }
        },
        env={},
    )


def adapter(
    env: dict[str, Any],
    transport: str,
    *,
    hold: bool = False,
    tenants: dict[str, Any] | None = None,
    **overrides: Any,
) -> SlurmAdapter:
    built = SlurmAdapter.from_config(
        config(env, transport, tenants=tenants, **overrides), secrets(env), "slurm-test"
    )
    built.hold = hold
    return built


def spec(wf: str, script: str, **extra: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "job_id": wf,
        "tenant": "virtengine1tenant0alice",
        "provider": "virtengine1provider0test",
        "offering_id": "offering-standard",
        "script": script,
        "walltime_seconds": 300,
        "resources": {"memory_mb_per_node": 256},
    }
    raw.update(extra)
    return JobSpec.model_validate(raw)


def on_chain(config: Config, job: JobSpec) -> JobSpec:
    """Store the job on the config's ledger as a tenant would: ``submit_job`` reads the spec from the chain."""
    LocalLedger.from_config(config).submit_job(job.model_dump(mode="json"))
    return job


async def wait_for(
    adapter: SlurmAdapter, job_id: str, predicate: Any, timeout: float = 90, interval: float = 0.5
) -> NativeStatus:
    """Poll ``status_batch`` until ``predicate(status)``; returns that status."""
    deadline = time.monotonic() + timeout
    status: NativeStatus | None = None
    while time.monotonic() < deadline:
        try:
            status = (await adapter.status_batch([job_id]))[job_id]
        except SchedulerUnavailable:  # another test may have stopped slurmctld for a moment
            await asyncio.sleep(1)
            continue
        if predicate(status):
            return status
        await asyncio.sleep(interval)
    raise AssertionError(f"job {job_id} did not get there in {timeout:.0f} s; last status {status}")


async def wait_final(adapter: SlurmAdapter, job_id: str, timeout: float = 120) -> NativeStatus:
    return await wait_for(adapter, job_id, lambda s: s.found and s.state.final, timeout)


async def final_usage(adapter: SlurmAdapter, job_id: str, tries: int = 60) -> Accounting:
    """The job's usage once the adapter calls it final (accounting records the end a moment after the controller),
    or the last reading after ``tries`` seconds: the caller asserts ``final``."""
    usage = await adapter.usage(job_id)
    for _ in range(tries - 1):
        if usage.final:
            break
        await asyncio.sleep(1)
        usage = await adapter.usage(job_id)
    return usage


def time_used(env: dict[str, Any], job_id: str) -> int:
    """A running job's run time in seconds as the controller's ``squeue`` says it (TimeUsed, ``[D-]HH:MM:SS``)."""
    used = slurm_command(env, ["squeue", "-h", "-j", job_id, "-O", "TimeUsed"]).strip()
    days, _, clock = used.rpartition("-")
    seconds = sum(int(part) * 60**i for i, part in enumerate(reversed(clock.split(":"))))
    return seconds + 86400 * int(days or 0)


def slurm_command(env: dict[str, Any], argv: Sequence[str], timeout: float = 30) -> str:
    """Run a Slurm command as root (independent of the adapter), epoch times; returns stdout."""
    out = subprocess.run(
        list(argv),
        env={**os.environ, "SLURM_CONF": env["slurm_conf"], "SLURM_TIME_FORMAT": "%s"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout


def sacct_jobs_named(env: dict[str, Any], name: str) -> list[str]:
    """Every job id accounting holds under ``name`` (all users, last 2 days): the exactly-once oracle."""
    out = slurm_command(
        env, ["sacct", "-a", "-X", "-P", "-n", "-S", "now-2days", "--name", name, "-o", "JobIDRaw"]
    )
    return [line.strip() for line in out.splitlines() if line.strip()]


def controller_jobs_named(env: dict[str, Any], name: str) -> list[str]:
    """Every job id the controller holds under ``name``, any user, any state (complete for ``MinJobAge``)."""
    out = slurm_command(env, ["squeue", "-h", "-t", "all", "-n", name, "-o", "%A"])
    return sorted(line.strip() for line in out.splitlines() if line.strip())


def sacct_jobs_of(env: dict[str, Any], workflow: str) -> list[str]:
    """Every job id accounting holds (all users, last 2 days) under a name that claims ``workflow``: its marked
    name ``vehpc-<workflow>.<tag>`` or a bare ``vehpc-<workflow>`` (a look-alike). The exactly-once oracle."""
    out = slurm_command(env, ["sacct", "-a", "-X", "-P", "-n", "-S", "now-2days", "-o", "JobIDRaw,JobName"])
    return _claiming(out, workflow)


def controller_jobs_of(env: dict[str, Any], workflow: str) -> list[str]:
    """Every job id the controller holds (any user, any state) under a name that claims ``workflow``."""
    return sorted(_claiming(slurm_command(env, ["squeue", "-h", "-t", "all", "-o", "%A|%j"]), workflow))


def _claiming(out: str, workflow: str) -> list[str]:
    rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
    return [job_id.strip() for job_id, name in rows if claimed_workflow(name.strip()) == workflow]


async def wait_in_accounting(env: dict[str, Any], workflow: str, timeout: float = 40) -> list[str]:
    """Job ids accounting holds under a workflow's job name, once it has heard of them.

    Accounting learns of a job 4-5 s after submission, and a name query can trail an id query by a few seconds
    more. Name queries find only jobs that were eligible to run: held jobs never show up this way.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = sacct_jobs_of(env, workflow)
        if ids:
            return ids
        await asyncio.sleep(1)
    return []


def cancel_test_jobs(env: dict[str, Any], scope: str) -> None:
    """scancel every job (of any user) whose workflow id starts with ``slurmtest-<scope>``: the end of a test
    module cleans up its own jobs only, never another module's running at the same time."""
    prefix = f"vehpc-{TEST_PREFIX}{scope}"
    out = slurm_command(env, ["squeue", "-h", "-o", "%A|%j"])
    ids = [
        line.split("|", 1)[0]
        for line in out.splitlines()
        if "|" in line and line.split("|", 1)[1].startswith(prefix)
    ]
    if ids:
        slurm_command(env, ["scancel", *ids])


def output_path(env: dict[str, Any], wf: str, job_id: str, suffix: str = "out") -> Path | None:
    """Where a job's output is: in its account's directory (``<jobs_dir>/<account>/``), None if nowhere yet."""
    name = f"vehpc-{wf}-{job_id}.{suffix}"
    return next(Path(env["jobs_dir"]).glob(f"*/{name}"), None)


def job_output(env: dict[str, Any], wf: str, job_id: str, suffix: str = "out") -> str:
    deadline = time.monotonic() + 10
    path = output_path(env, wf, job_id, suffix)
    while path is None and time.monotonic() < deadline:
        time.sleep(0.2)
        path = output_path(env, wf, job_id, suffix)
    return path.read_text() if path is not None else ""


def remove_outputs(env: dict[str, Any], scope: str) -> None:
    for path in Path(env["jobs_dir"]).glob(f"*/vehpc-{TEST_PREFIX}{scope}*"):
        path.unlink(missing_ok=True)
