"""The chain poller: starts one HPCJobWorkflow per pending on-chain job, idempotently.

Every ``job_poll_interval`` it lists this provider's pending jobs for its cluster and starts a workflow whose id is
the chain job id, with the duplicate-id policy that refuses a second run: a poller restart, two pollers, or a job
seen twice can never start a job twice (the reference kept its "seen" set in memory). It never lets more than
``max_concurrent_jobs`` workflows of its cluster run at once; the rest wait on chain (audit ``job_queue_full``),
none is dropped. A job whose spec does not validate is failed on chain with the reason (audit
``job_validation_failed``) while every other job goes on. Tenant cancellations seen on chain become ``cancel``
signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from pydantic import ValidationError as PydanticValidationError
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from activities.audit import AuditLog
from activities.chain.client import ChainClient, ChainJob, StatusReport
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, CancelRequest, JobSettings, JobWorkflowInput
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState
from workflows.hpc_job import initial_search_attributes

log = logging.getLogger(__name__)


@dataclass
class PollStats:
    started: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    waiting: int = 0
    cancelled: list[str] = field(default_factory=list)
    paused: int = 0  # pending jobs left on chain because hpc.enabled is false


class ChainPoller:
    def __init__(
        self,
        client: Client,
        chain: ChainClient,
        config: Config,
        audit: AuditLog,
        *,
        task_queue: str,
        settings: JobSettings,
    ) -> None:
        self.client = client
        self.chain = chain
        self.config = config
        self.audit = audit
        self.task_queue = task_queue
        self.settings = settings
        self.cluster_id = config.hpc.cluster_id
        self.provider = config.provider.address
        self._recent: dict[str, float] = {}  # started but perhaps not yet visible in the visibility store
        self._signalled: set[str] = set()

    async def run(self, stop: asyncio.Event) -> None:
        interval = self.config.hpc.job_service.job_poll_interval.total_seconds()
        if not self.config.hpc.enabled:
            log.warning(
                "hpc.enabled is false: no new jobs are taken; running jobs go on and tenant cancellations "
                "are still forwarded",
                extra={"cluster_id": self.cluster_id},
            )
        while not stop.is_set():
            try:
                await self.poll_once()
            except HPCError as exc:  # chain unreachable: try again next round, lose nothing
                log.warning("poll failed: %s", exc, extra={"cluster_id": self.cluster_id})
            except RPCError as exc:
                log.warning("poll failed talking to Temporal: %s", exc, extra={"cluster_id": self.cluster_id})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)

    async def running_ids(self) -> set[str]:
        query = (
            f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND ExecutionStatus = 'Running' "
            f"AND VeClusterId = '{self.cluster_id}'"
        )
        ids = {wf.id async for wf in self.client.list_workflows(query)}
        now = time.monotonic()
        self._recent = {k: t for k, t in self._recent.items() if now - t < 60 and k not in ids}
        return ids | set(self._recent)

    async def poll_once(self) -> PollStats:
        stats = PollStats()
        await self._forward_cancellations(stats)
        if not self.config.hpc.enabled:
            # Switched off: what runs finishes (its workflow needs nothing from here); nothing new starts.
            running = await self.running_ids()
            pending_jobs = await self.chain.pending_jobs(self.cluster_id, self.provider, limit=1000)
            stats.paused = sum(1 for job in pending_jobs if job.job_id not in running)
            return stats
        limit = self.config.hpc.job_service.max_concurrent_jobs
        running = await self.running_ids()
        free = limit - len(running)
        pending = await self.chain.pending_jobs(self.cluster_id, self.provider, limit=limit + 100)
        pending = [job for job in pending if job.job_id not in running]
        for job in pending:
            if free <= 0:
                stats.waiting += 1
                continue
            started = await self._start(job, stats)
            if started:
                free -= 1
        if stats.waiting:
            self.audit.record(
                "job_queue_full",
                cluster_id=self.cluster_id,
                success=False,
                details={"waiting": stats.waiting, "running": len(running), "max_concurrent_jobs": limit},
            )
        return stats

    async def _start(self, chain_job: ChainJob, stats: PollStats) -> bool:
        try:
            spec = JobSpec.model_validate(chain_job.raw_spec)
        except PydanticValidationError as exc:
            await self._reject(chain_job, _summarize(exc), stats)
            return False
        if spec.job_id != chain_job.job_id:
            await self._reject(chain_job, f"spec job_id {spec.job_id!r} differs from the chain's", stats)
            return False
        inp = JobWorkflowInput(
            job=spec, cluster_id=self.cluster_id, provider=self.provider, settings=self.settings
        )
        try:
            await self.client.start_workflow(
                JOB_WORKFLOW_NAME,
                inp,
                id=spec.job_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                search_attributes=initial_search_attributes(inp),
            )
        except WorkflowAlreadyStartedError:
            return False
        self._recent[spec.job_id] = time.monotonic()
        stats.started.append(spec.job_id)
        log.info(
            "started workflow for job %s",
            spec.job_id,
            extra={"job_id": spec.job_id, "workflow_id": spec.job_id, "cluster_id": self.cluster_id},
        )
        return True

    async def _reject(self, chain_job: ChainJob, reason: str, stats: PollStats) -> None:
        message = f"invalid job: {reason}"[:1024]
        self.audit.record(
            "job_validation_failed",
            job_id=chain_job.job_id,
            cluster_id=self.cluster_id,
            success=False,
            error_msg=message,
        )
        await self.chain.report_status(
            StatusReport(
                job_id=chain_job.job_id, state=JobState.FAILED, message=message, cluster_id=self.cluster_id
            )
        )
        stats.rejected.append(chain_job.job_id)

    async def _forward_cancellations(self, stats: PollStats) -> None:
        for job_id in await self.chain.cancel_requested_jobs(self.cluster_id, self.provider):
            if job_id in self._signalled:
                continue
            handle: WorkflowHandle[object, object] = self.client.get_workflow_handle(job_id)
            try:
                await handle.signal("cancel", CancelRequest(reason="cancelled by the tenant on chain"))
            except RPCError:
                # No workflow yet (still waiting for a slot): cancel it on chain directly.
                job = await self.chain.get_job(job_id)
                if job is not None and job.state == JobState.PENDING:
                    await self.chain.report_status(
                        StatusReport(
                            job_id=job_id, state=JobState.CANCELLED, message="cancelled by the tenant"
                        )
                    )
                    self.audit.record(
                        "job_cancelled",
                        job_id=job_id,
                        cluster_id=self.cluster_id,
                        details={"reason": "cancelled before it started"},
                    )
                else:
                    continue
            self._signalled.add(job_id)
            stats.cancelled.append(job_id)


def _summarize(exc: PydanticValidationError) -> str:
    parts = []
    for item in exc.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "job"
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
