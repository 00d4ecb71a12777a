"""One build of the workers, in process: what a host running a given release runs (versioned deploys).

Used by tests/test_upgrades.py (old and new builds side by side) and tests/record_histories.py (a job that moves
to a new build at continue-as-new).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.chain.local_ledger import LocalLedger
from tests.memory_adapter import MemoryAdapter
from virtengine_hpc.config import Config, Secrets
from workers.versioning import deployment_config
from workers.wiring import build_worker_deps, task_queue
from workers.worker import job_activities


@asynccontextmanager
async def build_workers(
    client: Client,
    config: Config,
    key_path: Path,
    ledger: LocalLedger,
    adapter: MemoryAdapter,
    job_workflow: type,
    build_id: str,
) -> AsyncIterator[Worker]:
    """One build's worker for the config's cluster (what a host running that release runs)."""
    config = config.model_copy(update={"temporal": config.temporal.model_copy(update={"build_id": build_id})})
    cluster = config.hpc.cluster_id
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), chain=ledger, adapters={cluster: adapter}
    )
    worker = Worker(
        client,
        task_queue=task_queue(config),
        workflows=[job_workflow, *deps.extra_workflows],
        activities=[*job_activities(deps.activities), *deps.extra_activities],
        deployment_config=deployment_config(config.temporal),
        graceful_shutdown_timeout=timedelta(seconds=1),
    )
    try:
        async with worker:
            yield worker
    finally:
        await deps.close()
