"""The reconciler: closes the chain jobs that no open workflow owns.

A job's workflow is the only thing that moves it to a final state on chain. When the workflow is gone before it
got there (terminated or cancelled from the Web UI or CLI, failed, timed out, completed without its final report,
or never there at all for a job the chain shows as taken), the tenant's escrow stays locked and the scheduler job
may run on, unwatched and unbilled. Every ``hpc.job_service.reconcile_interval`` the reconciler pages through this
provider's jobs on its cluster that are not final on chain (``ChainClient.open_jobs``, oldest first), asks
Temporal's visibility store which of them have a running workflow (one query per page), confirms each of the rest
with a strongly consistent ``describe`` (visibility lags), and starts a *recovery run* for the same workflow id:
``JobWorkflowInput.recovery`` says why, how the earlier run closed, its scheduler job and the chain state. That run
only closes the job: it stops the scheduler job if one may exist, sends the final usage from the last reading if
the job ran, reports the terminal state on chain and audits.

Each finding is audited (``job_reconciled``, with the reason and the closed status) and counted. A job is never
hammered: after a recovery attempt (whether its start failed or the run ended without closing the job) the next
one for that job waits ``reconcile_interval * 2^(n-1)``, at most an hour, and such jobs are counted in a gauge so
an operator sees them. A pending job with no workflow at all is the poller's intake, not a finding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.audit import AuditLog
from activities.chain.client import ChainClient, ChainJob
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, PARKED, JobRef, JobSettings, JobWorkflowInput, Recovery
from virtengine_hpc.models import accept_spec, spec_digest
from virtengine_hpc.states import JobState
from workers.metrics import WorkerMetrics
from workflows.hpc_job import SA_CLUSTER, SA_SCHEDULER_JOB, SA_STATE, initial_search_attributes

log = logging.getLogger(__name__)

PAGE_SIZE = 200
"""Chain jobs read, and looked up in one visibility query, at a time."""
MAX_BACKOFF_SECONDS = 3600.0
"""Longest wait between two recovery attempts for the same job."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def recovery_ref(raw_spec: Mapping[str, Any], default_walltime: float) -> JobRef:
    """The reference a recovery run carries. It only stops and settles the job (it never submits), so a spec that
    today's rules refuse (accepted by an earlier release with looser limits) still gets one: its ids and what it
    asked for are read leniently, the tenant's fields are dropped."""
    try:
        return JobRef.of(accept_spec(raw_spec, default_walltime), spec_digest(raw_spec))
    except PydanticValidationError:
        pass
    try:
        return JobRef.model_validate(dict(raw_spec))
    except PydanticValidationError:
        ids = ("job_id", "tenant", "provider", "offering_id", "cluster_id")
        return JobRef.model_validate({k: raw_spec[k] for k in ids if raw_spec.get(k) is not None})


class Backoff:
    """Per-job waits between attempts: after the n-th attempt the next one waits ``base * 2^(n-1)``, at most
    ``cap`` seconds. Kept in memory only: a restart at worst tries a job once more, sooner."""

    def __init__(self, base: float, cap: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base = base
        self.cap = cap
        self.clock = clock
        self._entries: dict[str, tuple[int, float]] = {}

    def attempts(self, job_id: str) -> int:
        return self._entries.get(job_id, (0, 0.0))[0]

    def waiting(self, job_id: str) -> bool:
        """The job had an attempt and its wait is not over."""
        entry = self._entries.get(job_id)
        return entry is not None and self.clock() < entry[1]

    def attempted(self, job_id: str) -> float:
        """Record an attempt; returns the wait before the next one."""
        attempts = self.attempts(job_id) + 1
        delay = min(self.base * 2 ** (attempts - 1), self.cap)
        self._entries[job_id] = (attempts, self.clock() + delay)
        return delay

    def forget(self, job_id: str) -> None:
        self._entries.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        keep = set(job_ids)
        self._entries = {k: v for k, v in self._entries.items() if k in keep}

    def waiting_ids(self) -> set[str]:
        now = self.clock()
        return {k for k, (_, due) in self._entries.items() if now < due}

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class ReconcileStats:
    checked: int = 0
    recovered: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    retrying: int = 0  # jobs with no open workflow although a recovery was attempted before
    deferred: int = 0  # of those, the ones still waiting for their next attempt


class Reconciler:
    """Finds this provider's chain jobs on one cluster that are not final while no workflow is open for them,
    and starts a recovery run for each (same workflow id)."""

    def __init__(
        self,
        client: Client,
        chain: ChainClient,
        config: Config,
        audit: AuditLog,
        *,
        task_queue: str,
        settings: JobSettings,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.client = client
        self.chain = chain
        self.audit = audit
        self.task_queue = task_queue
        self.settings = settings
        self.metrics = metrics
        self.page_size = page_size
        self.cluster_id = config.hpc.cluster_id
        self.provider = config.provider.address
        self.interval = config.hpc.job_service.reconcile_interval.total_seconds()
        self.default_walltime = config.hpc.job_service.job_timeout_default.total_seconds()
        self.backoff = Backoff(self.interval, max(MAX_BACKOFF_SECONDS, self.interval), clock)
        self.rounds = 0  # rounds completed (tests wait on it)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.reconcile_once()
            except HPCError as exc:  # chain unreachable: next round
                log.warning("reconcile failed: %s", exc, extra={"cluster_id": self.cluster_id})
            except RPCError as exc:
                log.warning(
                    "reconcile failed talking to Temporal: %s", exc, extra={"cluster_id": self.cluster_id}
                )
            except Exception:  # a bug must not end the loop that closes every abandoned job: log it, go on
                log.exception("reconcile round failed", extra={"cluster_id": self.cluster_id})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)

    def waiting(self, job_id: str) -> bool:
        """The job's last recovery attempt was recent: leave it alone until its backoff is over."""
        return self.backoff.waiting(job_id)

    async def reconcile_once(self) -> ReconcileStats:
        stats = ReconcileStats()
        seen: list[str] = []
        after: str | None = None
        while True:
            page = await self.chain.open_jobs(self.cluster_id, self.provider, self.page_size, after=after)
            await self._check_page(page, stats)
            seen += [job.job_id for job in page]
            if len(page) < self.page_size:
                break
            after = page[-1].job_id
        self.backoff.keep_only(seen)  # jobs that became final need no more backoff
        await self._refresh_gauges(stats)
        self.rounds += 1
        return stats

    async def _check_page(self, page: list[ChainJob], stats: ReconcileStats) -> None:
        running, known = await self.visible([job.job_id for job in page])
        for job in page:
            stats.checked += 1
            if job.job_id in running:
                continue  # an open workflow owns it
            if job.state == JobState.PENDING and job.job_id not in known:
                continue  # no workflow yet: the poller's intake starts it
            await self._confirm(job, stats)

    async def visible(self, job_ids: list[str]) -> tuple[set[str], set[str]]:
        """Of ``job_ids``: those with a running workflow, and those with any workflow, as visibility sees them.

        Visibility lags a few seconds: a workflow that has just closed may still look running (it is found in
        the next round), and one that has just started may be missing (``describe`` then sees it running).
        """
        safe = [job_id for job_id in job_ids if _SAFE_ID.fullmatch(job_id)]
        running: set[str] = set()
        known = set(job_ids) - set(safe)  # not queryable: let describe decide
        if not safe:
            return running, known
        quoted = ", ".join(f"'{job_id}'" for job_id in safe)
        query = f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND WorkflowId IN ({quoted})"
        async for execution in self.client.list_workflows(query):
            known.add(execution.id)
            if execution.status == WorkflowExecutionStatus.RUNNING:
                running.add(execution.id)
        return running, known

    async def _confirm(self, job: ChainJob, stats: ReconcileStats) -> None:
        """``describe`` is strongly consistent: only a workflow that is really closed (or absent) is a finding."""
        try:
            closed: WorkflowExecutionDescription | None = await self.client.get_workflow_handle(
                job.job_id
            ).describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning(
                    "cannot look up the workflow of job %s: %s",
                    job.job_id,
                    exc,
                    extra={"job_id": job.job_id, "cluster_id": self.cluster_id},
                )
                return
            closed = None
        if closed is not None and closed.status == WorkflowExecutionStatus.RUNNING:
            return
        if closed is None and job.state == JobState.PENDING:
            return
        if self.backoff.attempts(job.job_id):  # an earlier attempt did not close it
            stats.retrying += 1
            if self.backoff.waiting(job.job_id):
                stats.deferred += 1
                return
        await self.recover(job, closed, stats)

    async def recover(
        self, job: ChainJob, closed: WorkflowExecutionDescription | None, stats: ReconcileStats | None = None
    ) -> bool:
        """Start the run that closes ``job`` (its workflow ``closed``, or none at all); True if it started.

        The chain is read again first: the workflow may have reported the final state just before it closed.
        A job whose last attempt is recent waits for its backoff. The start refuses to run beside an open
        workflow (``FAIL`` on conflict), so two reconcilers, or the poller and a reconciler, never start two.
        """
        if self.backoff.waiting(job.job_id):
            return False
        current = await self.chain.get_job(job.job_id)
        if current is None or current.state.final:
            self.backoff.forget(job.job_id)
            return False
        recovery = self._recovery(current, closed)
        try:
            ref = recovery_ref(current.raw_spec, self.default_walltime)
        except PydanticValidationError as exc:
            self._failed(current, recovery, f"its ids do not validate ({exc.error_count()} errors)", stats)
            return False
        inp = JobWorkflowInput(
            job=ref,
            cluster_id=self.cluster_id,
            provider=self.provider,
            settings=self.settings,
            recovery=recovery,
        )
        try:
            await self.client.start_workflow(
                JOB_WORKFLOW_NAME,
                inp,
                id=current.job_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                search_attributes=_attributes(inp, recovery),
            )
        except WorkflowAlreadyStartedError:
            return False  # a run is open again (started meanwhile): it owns the job
        except RPCError as exc:
            self._failed(current, recovery, f"cannot start the recovery run: {exc}", stats)
            return False
        self._found(current, recovery)
        if stats is not None:
            stats.recovered.append(current.job_id)
        return True

    def _recovery(self, job: ChainJob, closed: WorkflowExecutionDescription | None) -> Recovery:
        state = job.state.value
        cluster_id: str | None = None
        if closed is None:
            reason = f"no workflow exists for the job while the chain shows it {state}"
            status, scheduler_job_id = "", job.scheduler_job_id
        else:
            status = closed.status.name if closed.status is not None else ""
            reason = f"its workflow closed ({status}) while the chain shows the job {state}"
            scheduler_job_id = closed.typed_search_attributes.get(SA_SCHEDULER_JOB) or job.scheduler_job_id
            cluster_id = closed.typed_search_attributes.get(SA_CLUSTER)  # where routing had sent it
        if job.cancel_requested:
            reason += "; the tenant asked to cancel it"
        return Recovery(
            reason=reason,
            closed_status=status,
            scheduler_job_id=scheduler_job_id,
            cluster_id=cluster_id,
            chain_state=job.state,
        )

    def _found(self, job: ChainJob, recovery: Recovery) -> None:
        attempts = self.backoff.attempts(job.job_id)
        self.backoff.attempted(job.job_id)
        log.warning(
            "job %s: %s; started a run that closes it%s",
            job.job_id,
            recovery.reason,
            f" (attempt {attempts + 1})" if attempts else "",
            extra={"job_id": job.job_id, "workflow_id": job.job_id, "cluster_id": self.cluster_id},
        )
        self.audit.record(
            AuditEvent.JOB_RECONCILED,
            job_id=job.job_id,
            cluster_id=self.cluster_id,
            details=_details(recovery, attempts + 1),
        )

    def _failed(self, job: ChainJob, recovery: Recovery, error: str, stats: ReconcileStats | None) -> None:
        if stats is not None:
            stats.failed.append(job.job_id)
        attempts = self.backoff.attempts(job.job_id) + 1
        delay = self.backoff.attempted(job.job_id)
        log.error(
            "job %s: %s, but %s; trying again in %.0f s",
            job.job_id,
            recovery.reason,
            error,
            delay,
            extra={"job_id": job.job_id, "cluster_id": self.cluster_id},
        )
        self.audit.record(
            AuditEvent.JOB_RECONCILED,
            job_id=job.job_id,
            cluster_id=self.cluster_id,
            success=False,
            error_msg=error[:1024],
            details=_details(recovery, attempts),
        )

    async def _refresh_gauges(self, stats: ReconcileStats) -> None:
        if self.metrics is None:
            return
        self.metrics.reconciler_retrying.labels(self.cluster_id).set(stats.retrying)
        count = await self.client.count_workflows(
            f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND ExecutionStatus = 'Running' "
            f"AND VeJobState = '{PARKED}' AND VeClusterId = '{self.cluster_id}'"
        )
        self.metrics.parked.labels(self.cluster_id).set(count.count)
        self.metrics.last_reconcile.labels(self.cluster_id).set(time.time())


def _attributes(inp: JobWorkflowInput, recovery: Recovery) -> TypedSearchAttributes:
    """The run's search attributes: those of a new run, with the state the chain shows and the known scheduler
    job (so ``jobs list`` shows the job where it is while the run closes it)."""
    pairs = [
        SearchAttributePair(SA_STATE, recovery.chain_state.value),
        SearchAttributePair(SA_CLUSTER, inp.cluster_id),
    ]
    if recovery.scheduler_job_id:
        pairs.append(SearchAttributePair(SA_SCHEDULER_JOB, recovery.scheduler_job_id))
    return initial_search_attributes(inp).updated(*pairs)


def _details(recovery: Recovery, attempt: int) -> dict[str, object]:
    return {
        "reason": recovery.reason,
        "closed_status": recovery.closed_status,
        "chain_state": recovery.chain_state.value,
        "scheduler_job_id": recovery.scheduler_job_id,
        "attempt": attempt,
    }
