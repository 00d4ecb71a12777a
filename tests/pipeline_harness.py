"""A whole provider in one test: LocalLedger (the chain), a worker with real activities, and the chain poller.

Jobs are submitted on the ledger as a tenant would and picked up by the real poller; the scheduler is whatever
adapter the test passes (the in-memory one for workflow behaviour, the local executor or SLURM end to end).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.audit import read_events
from activities.chain.client import ChainClient
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SchedulerAdapter
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import JobResult
from virtengine_hpc.models import Cluster, Partition, PricedQueue, Pricing
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from workers.poller import ChainPoller
from workers.wiring import WorkerDeps, build_worker_deps, job_settings
from workers.worker import make_worker

TENANT = "virtengine1tenant0alice"
OFFERING = "offering-standard"


@dataclass
class Pipeline:
    config: Config
    ledger: LocalLedger
    client: Client
    deps: WorkerDeps
    poller: ChainPoller
    task_queue: str
    adapter: SchedulerAdapter

    @property
    def cluster_id(self) -> str:
        return self.config.hpc.cluster_id

    def submit(self, *, decide: bool = True, max_price: str = "100", **spec: Any) -> str:
        raw: dict[str, Any] = {
            # Unique across tests: every test shares one Temporal server, and workflow id = chain job id.
            "job_id": f"JOB-{uuid.uuid4().hex[:10]}",
            "tenant": TENANT,
            "provider": self.config.provider.address,
            "offering_id": OFFERING,
            "script": "#!/bin/bash\necho hello\n",
            "walltime_seconds": 600,
            "max_price": max_price,
        }
        raw.update(spec)
        if raw.get("template_id"):
            raw.pop("script", None)
        job_id = self.ledger.submit_job(raw)
        if decide:
            self.ledger.create_decision(job_id, self.cluster_id)
        return job_id

    def handle(self, job_id: str) -> WorkflowHandle[Any, JobResult]:
        return self.client.get_workflow_handle(job_id, result_type=JobResult)

    async def wait_started(self, job_id: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await self.poller.poll_once()
            with contextlib.suppress(Exception):
                await self.handle(job_id).describe()
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"workflow for {job_id} never started")

    async def run_until_done(self, job_ids: list[str], timeout: float = 90) -> dict[str, JobResult]:
        """Poll the chain like the real poller until every job's workflow (or the poller) has finished it."""
        results: dict[str, JobResult] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(results) < len(job_ids):
            await self.poller.poll_once()
            for job_id in job_ids:
                if job_id in results:
                    continue
                try:
                    desc = await self.handle(job_id).describe()
                except RPCError:
                    job = self.ledger.job(job_id)
                    if (
                        job is not None and job.state.final
                    ):  # never got a workflow: rejected or cancelled early
                        results[job_id] = JobResult(
                            job_id=job_id, state=job.state, message=job.status_message
                        )
                    continue
                if desc.status != WorkflowExecutionStatus.RUNNING:
                    results[job_id] = await self.handle(job_id).result()
            await asyncio.sleep(0.3)
        missing = set(job_ids) - set(results)
        if missing:
            states = {j: getattr(self.ledger.job(j), "state", None) for j in missing}
            raise AssertionError(f"jobs not finished in {timeout}s: {states}")
        return results

    def audit_events(self, event_type: str | None = None, job_id: str | None = None) -> list[dict[str, Any]]:
        path = self.config.hpc.audit.log_path
        if not Path(path).exists():
            return []
        return [
            e
            for e in read_events(path)
            if (event_type is None or e["event_type"] == event_type)
            and (job_id is None or e["job_id"] == job_id)
        ]

    def states_of(self, job_id: str) -> list[JobState]:
        """The states the chain moved the job through after submission (pending, where it starts, left out)."""
        return [t.to_state for t in self.ledger.history(job_id) if t.to_state != JobState.PENDING]


def setup_ledger(
    config: Config,
    signer: Signer,
    *,
    nodes: int = 4,
    max_runtime_seconds: int = 86400,
    clock: Callable[[], datetime] | None = None,
) -> LocalLedger:
    """The provider's cluster and priced queue on a fresh ledger. Jobs of the queue (partition ``debug``) may run
    ``max_runtime_seconds``; ``clock`` is the ledger's time (a time-skipping test passes the test server's)."""
    ledger = LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block, clock=clock)
    provider = config.provider.address
    ledger.register_cluster(
        Cluster(
            cluster_id=config.hpc.cluster_id,
            provider=provider,
            name="local",
            scheduler_type=config.hpc.scheduler_type,
            partitions=(
                Partition(
                    name="debug", nodes=nodes, max_nodes=nodes, max_runtime_seconds=max_runtime_seconds
                ),
                Partition(name="long", nodes=nodes, max_nodes=2, max_runtime_seconds=7 * 86400),
            ),
            total_nodes=nodes,
            available_nodes=nodes,
        )
    )
    ledger.add_queue(
        PricedQueue(
            offering_id=OFFERING,
            cluster_id=config.hpc.cluster_id,
            partition="debug",
            pricing=Pricing(
                node_hour=Decimal("36"),
                core_hour=Decimal("3.6"),
                memory_gb_hour=Decimal("0.36"),
                minimum_charge=Decimal("0.01"),
            ),
            max_duration_seconds=max_runtime_seconds,
        )
    )
    ledger.register_provider_key(provider, public_key_b64(signer.public_key))
    ledger.fund(TENANT, Decimal("100000"))
    return ledger


@contextlib.asynccontextmanager
async def running_pipeline(
    client: Client,
    config: Config,
    key_path: Path,
    adapter: SchedulerAdapter,
    task_queue: str,
    *,
    chain: Callable[[LocalLedger], ChainClient] | None = None,
) -> AsyncIterator[Pipeline]:
    """A worker and a poller on ``task_queue``; ``chain`` wraps the ledger the provider side talks to (faults)."""
    signer = Signer.from_file(key_path)
    ledger = setup_ledger(config, signer)
    provider_chain: ChainClient = chain(ledger) if chain else ledger
    secrets = Secrets(provider_signing_key_path=key_path)
    deps = build_worker_deps(config, secrets, chain=provider_chain, adapters={config.hpc.cluster_id: adapter})
    worker: Worker = make_worker(client, deps, queue=task_queue)
    poller = ChainPoller(
        client, provider_chain, config, deps.audit, task_queue=task_queue, settings=job_settings(config)
    )
    async with worker:
        yield Pipeline(config, ledger, client, deps, poller, task_queue, adapter)
    await deps.close()
