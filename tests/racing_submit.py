"""One attempt of the ``submit_job`` activity in a process of its own, for the racing-attempts test.

    python -m tests.racing_submit WORKFLOW_ID ATTEMPT BARRIER_DIR AUDIT_LOG KEY_FILE TRANSPORT

Runs the real activity (real SLURM adapter over TRANSPORT, jobs held so they never run) as attempt ATTEMPT
with no heartbeat details, as a retry on another worker runs when its predecessor's heartbeats never arrived.
Every attempt started a minute ago with a 10 s heartbeat timeout: attempt 1 is a zombie, past the time Temporal
timed it out, which is the only way an attempt 1 can run beside its retry.
Right before its ``sbatch`` it waits until the other process got there too (files in BARRIER_DIR), so both
attempts submit: the race a timed-out attempt and its retry can run. Prints the activity's output as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.testing import ActivityEnvironment

from tests import slurm_cluster as sc
from tests.conftest import make_config
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import SubmitInput
from workers.wiring import build_worker_deps


async def barrier(directory: Path, me: str, parties: int = 2, timeout: float = 60) -> None:
    (directory / me).touch()
    deadline = time.monotonic() + timeout
    while len(list(directory.iterdir())) < parties:
        if time.monotonic() > deadline:
            raise SystemExit("the other attempt never reached its sbatch")
        await asyncio.sleep(0.02)


async def main(
    workflow_id: str, attempt: int, barrier_dir: Path, audit_log: Path, key: Path, transport: str
) -> None:
    env = sc.cluster()
    adapter = sc.adapter(env, transport, hold=True)
    real_submit = adapter.backend.submit

    async def submit_after_barrier(plan: Any, account: str | None = None) -> str:
        await barrier(barrier_dir, f"attempt-{attempt}")
        return await real_submit(plan, account)

    adapter.backend.submit = submit_after_barrier  # type: ignore[method-assign]
    # Both attempts submit as the tenant's fixed account: a per-process pool would hand each its own account (or
    # refuse one the cluster shows in use), which is not what two attempts of one job on a real deploy do.
    accounts = sc.tenant_accounts(env)
    tenants = {"accounts": {sc.ALICE: accounts[0], sc.BOB: accounts[1]}}
    config = make_config(audit_log.parent, hpc={"audit": {"log_path": str(audit_log)}, "tenants": tenants})
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key), adapters={config.hpc.cluster_id: adapter}
    )
    activity_env = ActivityEnvironment()
    activity_env.info = dataclasses.replace(
        activity_env.info,
        attempt=attempt,
        activity_type="submit_job",
        started_time=datetime.now(UTC) - timedelta(seconds=60),
        heartbeat_timeout=timedelta(seconds=10),
        start_to_close_timeout=timedelta(seconds=300),
    )
    try:
        out = await activity_env.run(
            deps.activities.submit_job,
            SubmitInput(
                workflow_id=workflow_id,
                job=sc.on_chain(config, sc.spec(workflow_id, "echo never\n")),
                cluster_id=config.hpc.cluster_id,
            ),
        )
    finally:
        await deps.close()
    print(out.model_dump_json(), flush=True)


if __name__ == "__main__":
    wf, number, directory, audit, key_file, transport = sys.argv[1:7]
    asyncio.run(main(wf, int(number), Path(directory), Path(audit), Path(key_file), transport))
