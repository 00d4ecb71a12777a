"""The chain poller: starts one HPCJobWorkflow per pending on-chain job, idempotently.

Every ``job_poll_interval`` it reads this provider's pending jobs for its cluster (the chain lists a job for the
cluster its scheduling decision selects, so the poller of the cluster a job runs on is the one that counts it
against that cluster's limit) and starts a workflow whose id is
the chain job id, with the duplicate-id policy that refuses a second run: a poller restart, two pollers, or a job
seen twice can never start a job twice (the reference kept its "seen" set in memory). It never lets more than
``max_concurrent_jobs`` workflows of its cluster run at once; the rest wait on chain (audit ``job_queue_full``),
none is dropped. A job whose spec does not validate is failed on chain with the reason (audit
``job_validation_failed``) while every other job goes on.

It keeps up with a long backlog: it **counts** the running workflows of its cluster in Temporal's visibility store
(one ``count_workflows``) instead of listing them, asks which jobs of each page of pending jobs already have a
workflow (one query per page), and starts ``start_concurrency`` workflows at a time. Visibility is eventually
consistent, so two pollers counting at once would both fill the same free slots: only the poller that holds the
cluster's intake lease (``workers/intake_lease.py``) starts jobs, and it adds the starts it made that visibility
does not list yet to the count. The other pollers stand by and reconcile; the holder forwards tenant cancellations, so
that each is signalled once and a cancelled job without a workflow is started (with the cancel in it) and audited
once (a standby poller forwards a cancel that has waited a whole lease term: the holder is gone).

No job can stall the intake: a pending job whose workflow already ran and closed (terminated before it reported
anything) is handed to the reconciler, which starts the run that closes it; a job whose start fails on its own is
tried again with backoff while the fetch window grows past it, so the jobs behind it still start.

Tenant cancellations seen on chain become ``cancel`` signals, in a loop of their own: a backlog of starts never
delays a cancel. They are forwarded ``cancel_concurrency`` at a time in the chain's order (running jobs first, in
turns by tenant), so a tenant's flood of cancels does not delay another tenant's. Only Temporal's NOT_FOUND answer means "no workflow":
then a job still pending on chain that never had a workflow gets its workflow started with the cancel in it (the
workflow cancels and refunds it on chain), and one whose workflow closed goes to the reconciler. The intake leaves a
pending job its tenant has cancelled to this loop: it never starts one to run.
Any other error is retried next round and never touches the chain, since a workflow may still run the job.

Beside the polls, the reconciler (``workers/reconciler.py``) runs its own loop every ``reconcile_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from temporalio.api.workflowservice.v1 import SignalWithStartWorkflowExecutionResponse
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.audit import AuditLog
from activities.chain.client import ChainClient, ChainJob, StatusReport
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import (
    CANCELLED_BEFORE_START,
    JOB_WORKFLOW_NAME,
    WORKFLOW_INPUT_BUDGET,
    CancelRequest,
    JobRef,
    JobSettings,
    JobWorkflowInput,
)
from virtengine_hpc.models import accept_spec, spec_digest
from virtengine_hpc.states import JobState
from workers.intake_lease import IntakeLease
from workers.metrics import WorkerMetrics
from workers.reconciler import Backoff, Reconciler
from workflows.hpc_job import SA_STATE, initial_search_attributes

log = logging.getLogger(__name__)

MAX_START_BACKOFF_SECONDS = 300.0
"""Longest wait before a job whose workflow start failed is tried again."""
PAGE_SIZE = 500
"""Pending jobs read from the chain, and looked up in visibility, at a time."""
CANCEL_BATCH = 64
"""Cancels forwarded between two readings of the chain's cancel requests within one round (at least
``cancel_concurrency``)."""
CANCEL_PAGE = 500
"""Cancel requests read from the chain at a time: one reading never returns more, however many are on chain."""
FORGET_STARTS_AFTER = 600.0
"""Seconds after which a start this poller made counts as visible, even if visibility still does not list it."""
_SERVICE_DOWN = frozenset(
    {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED}
)
"""Answers that concern Temporal as a whole, not one job: the round ends and the next one tries again."""


@dataclass
class PollStats:
    started: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    waiting: int = 0
    cancelled: list[str] = field(default_factory=list)
    paused: int = 0  # pending jobs left on chain because hpc.enabled is false
    recovered: list[str] = field(default_factory=list)  # closed workflows handed to the reconciler
    held: list[str] = field(default_factory=list)  # jobs whose start failed, waiting for their retry
    standby: bool = False  # another poller holds the intake lease: nothing was started (or forwarded) here
    running: int = 0  # workflows of the cluster counted as running before the starts


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
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        lease: IntakeLease | None = None,
    ) -> None:
        self.client = client
        self.chain = chain
        self.config = config
        self.audit = audit
        self.task_queue = task_queue
        self.settings = settings
        self.cluster_id = config.hpc.cluster_id
        self.provider = config.provider.address
        self.metrics = metrics
        self.clock = clock
        self._recent: dict[str, float] = {}  # started here, not yet listed by the visibility store
        # Pending jobs known to have a workflow (started here, or seen running): a workflow reports its job to the
        # chain only once it is submitted, so under a backlog thousands are both; they are not looked up again.
        # One whose workflow closed while its job is pending is the reconciler's to close.
        self._taken: set[str] = set()
        self._signalled: set[str] = set()
        self._cancel_seen: dict[str, float] = {}  # when each pending cancel request was first seen (clock)
        service = config.hpc.job_service
        interval = service.job_poll_interval.total_seconds()
        self._holds = Backoff(max(interval, 1.0), MAX_START_BACKOFF_SECONDS, clock)
        self.start_concurrency = service.start_concurrency
        self.cancel_concurrency = service.cancel_concurrency
        self.lease = lease or IntakeLease(client, self.cluster_id, term=service.intake_lease)
        self.reconciler = Reconciler(
            client,
            chain,
            config,
            audit,
            task_queue=task_queue,
            settings=settings,
            metrics=metrics,
            clock=clock,
        )
        if metrics is not None:
            metrics.watch_poller(self.cluster_id)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: take pending jobs and forward cancellations every ``job_poll_interval``, each in a
        loop of its own, keep the intake lease, and reconcile every ``reconcile_interval``."""
        await asyncio.gather(
            self._loop(stop, self.take_jobs, "poll"),
            self._loop(stop, self.forward_cancellations, "cancellations"),
            self.lease.keep(stop),
            self.reconciler.run(stop),
        )

    async def _loop(self, stop: asyncio.Event, round_: Callable[[], Awaitable[PollStats]], what: str) -> None:
        interval = self.config.hpc.job_service.job_poll_interval.total_seconds()
        if what == "poll" and not self.config.hpc.enabled:
            log.warning(
                "hpc.enabled is false: no new jobs are taken; running jobs go on and tenant cancellations "
                "are still forwarded",
                extra={"cluster_id": self.cluster_id},
            )
        while not stop.is_set():
            try:
                await round_()
                if self.metrics is not None and what == "poll":
                    self.metrics.last_poll.labels(self.cluster_id).set(time.time())
            except HPCError as exc:  # chain unreachable: try again next round, lose nothing
                log.warning("%s failed: %s", what, exc, extra={"cluster_id": self.cluster_id})
                self._count_failure("chain")
            except RPCError as exc:
                log.warning(
                    "%s failed talking to Temporal: %s", what, exc, extra={"cluster_id": self.cluster_id}
                )
                self._count_failure("temporal")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval)

    async def poll_once(self) -> PollStats:
        """One round of both loops: forward tenant cancellations, then take pending jobs."""
        stats = await self.forward_cancellations()
        return await self.take_jobs(stats)

    async def forward_cancellations(self, stats: PollStats | None = None) -> PollStats:
        stats = stats or PollStats()
        await self._forward_cancellations(stats)
        return stats

    async def take_jobs(self, stats: PollStats | None = None) -> PollStats:
        """Start pending jobs while slots are free, if this poller holds the intake lease."""
        stats = stats or PollStats()
        if not self.config.hpc.enabled:
            # Switched off: what runs finishes (its workflow needs nothing from here); nothing new starts.
            pending_jobs = await self.chain.pending_jobs(self.cluster_id, self.provider, limit=1000)
            running, _ = await self.reconciler.visible([job.job_id for job in pending_jobs])
            stats.paused = sum(1 for job in pending_jobs if job.job_id not in running)
            return stats
        if not await self.lease.refresh():
            stats.standby = True
            self._set_gauges(0, 0)  # the holder's figures are the cluster's (the alerts take the max)
            return stats
        limit = self.config.hpc.job_service.max_concurrent_jobs
        stats.running = await self.count_running()
        await self._take_pending(stats, limit - stats.running)
        if stats.waiting:
            self.audit.record(
                AuditEvent.JOB_QUEUE_FULL,
                cluster_id=self.cluster_id,
                success=False,
                details={
                    "waiting": stats.waiting,
                    "running": stats.running + len(stats.started),
                    "max_concurrent_jobs": limit,
                },
            )
        return stats

    async def count_running(self) -> int:
        """The cluster's running job workflows: visibility's count, plus the starts made here that it does not
        list yet. The starts are looked up first: one listed then is in the count that follows. A workflow whose
        job is cancelled holds no slot: one started with a tenant's cancel in it submits nothing (a tenant that
        cancels thousands of pending jobs would otherwise fill every slot until their workflows closed), and a
        cancelled job's scheduler job has ended."""
        await self._forget_visible_starts()
        query = (
            f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND ExecutionStatus = 'Running' "
            f"AND VeClusterId = '{self.cluster_id}' AND VeJobState != '{JobState.CANCELLED.value}'"
        )
        return (await self.client.count_workflows(query)).count + len(self._recent)

    async def _forget_visible_starts(self) -> None:
        now = self.clock()
        self._recent = {k: t for k, t in self._recent.items() if now - t < FORGET_STARTS_AFTER}
        ids = list(self._recent)
        for chunk in range(0, len(ids), PAGE_SIZE):
            _, known = await self.reconciler.visible(ids[chunk : chunk + PAGE_SIZE])
            for job_id in known:
                self._recent.pop(job_id, None)

    async def _take_pending(self, stats: PollStats, free: int) -> None:
        """Start pending jobs oldest first while slots are free. Jobs that cannot start right now (their start
        failed, or the reconciler is closing them) are stepped over, and the next page is read while slots are
        still free, so that no number of them keeps a fresh job from starting."""
        held = self._holds.waiting_ids() | self.reconciler.backoff.waiting_ids()
        seen: list[str] = []
        after: str | None = None
        while True:
            page = await self.chain.pending_jobs(self.cluster_id, self.provider, limit=PAGE_SIZE, after=after)
            seen += [job.job_id for job in page]
            # A job its tenant has cancelled is the cancellation loop's: it starts the job's workflow with the cancel
            # in it (nothing submitted, no slot taken). Started here, the job would be submitted, run and be billed
            # before that loop's next round signalled the cancel. Once that loop has signalled it, a run holds its
            # id: it is looked at here as any other (a run of another kind, or a closed one, is found that way).
            wanted = [job for job in page if not job.cancel_requested or job.job_id in self._signalled]
            ask = [job.job_id for job in wanted if job.job_id not in held and job.job_id not in self._taken]
            running, _ = await self.reconciler.visible(ask)
            self._taken |= running
            fresh = []
            for job in wanted:
                if job.job_id in self._taken:
                    continue
                if job.job_id in held:
                    stats.held.append(job.job_id)
                else:
                    fresh.append(job)
            free = await self._start_some(fresh, free, stats)
            if len(page) < PAGE_SIZE:
                self._taken &= set(seen)  # the others left the pending list: no need to remember them
                break
            after = page[-1].job_id
            if free <= 0:
                # No slot left: the jobs after this page wait too. Counted, not read (a backlog may be long).
                stats.waiting += await self.chain.count_pending_jobs(
                    self.cluster_id, self.provider, after=after
                )
                break
        self._holds.keep_only(seen)
        self._set_gauges(stats.waiting + len(stats.held), free)

    async def _start_some(self, jobs: list[ChainJob], free: int, stats: PollStats) -> int:
        """Start up to ``free`` of ``jobs``, ``start_concurrency`` at a time, while the lease is valid; a job that
        does not start (refused, held, already running) leaves its slot to the next. The slots left."""
        queue = list(jobs)
        while queue and free > 0 and await self.lease.refresh():  # renewed within a long round too
            batch, queue = queue[:free], queue[free:]
            results = await self._start_batch(batch, stats)
            free -= sum(1 for started in results if started)
            queue = [job for job, started in zip(batch, results, strict=True) if started is None] + queue
            if None in results:
                break  # the lease ended during the batch
        stats.waiting += len(queue)
        return free

    async def _start_batch(self, batch: list[ChainJob], stats: PollStats) -> list[bool | None]:
        """``_try_start`` for each job, ``start_concurrency`` at once; ``None`` for a job left unstarted because
        the lease ended. An error that ends the round is raised once the starts in flight are done."""
        slots = asyncio.Semaphore(self.start_concurrency)

        async def one(job: ChainJob) -> bool | None:
            async with slots:
                if not self.lease.valid():
                    return None
                return await self._try_start(job, stats)

        results = await asyncio.gather(*(one(job) for job in batch), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    async def _start(self, chain_job: ChainJob, stats: PollStats) -> bool:
        inp = await self._accept(chain_job, stats)
        if inp is None:
            return False
        job_id = inp.job.job_id
        try:
            await self._start_workflow(inp)
        except WorkflowAlreadyStartedError:
            await self._already_started(chain_job, stats)
            return False
        except RPCError as exc:
            if not _payload_refused(exc):
                raise  # not about this job's size: _try_start holds the job or ends the round
            await self._reject(chain_job, f"Temporal refused its workflow input: {exc.message}", stats)
            return False
        self._recent[job_id] = self.clock()
        self._taken.add(job_id)
        stats.started.append(job_id)
        log.info(
            "started workflow for job %s",
            job_id,
            extra={"job_id": job_id, "workflow_id": job_id, "cluster_id": self.cluster_id},
        )
        return True

    async def _start_workflow(self, inp: JobWorkflowInput, *, cancel: CancelRequest | None = None) -> bool:
        """Start the job's workflow (workflow id = chain job id, never a second run); with ``cancel``, as
        signal-with-start: a run that exists by now gets the cancel instead. False when it did (the run was not
        started by this call)."""
        extra: dict[str, Any] = {}
        if cancel is not None:
            extra = {"start_signal": "cancel", "start_signal_args": [cancel]}
        handle = await self.client.start_workflow(
            JOB_WORKFLOW_NAME,
            inp,
            id=inp.job.job_id,
            task_queue=self.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=(
                WorkflowIDConflictPolicy.USE_EXISTING if cancel is not None else WorkflowIDConflictPolicy.FAIL
            ),
            search_attributes=_start_attributes(inp, cancelled=cancel is not None),
            **extra,
        )
        return _started_here(handle)

    async def _accept(self, chain_job: ChainJob, stats: PollStats) -> JobWorkflowInput | None:
        """The workflow input of a job, or None when the job is refused (failed on chain with the reason).

        The input carries the job's reference and the digest of its spec, never the script, parameters or
        environment (the activities read those from the chain), so its size does not depend on the tenant;
        the budget check guards what the provider adds (settings).
        """
        try:
            spec = accept_spec(
                chain_job.raw_spec, self.config.hpc.job_service.job_timeout_default.total_seconds()
            )
        except PydanticValidationError as exc:
            await self._reject(chain_job, _summarize(exc), stats)
            return None
        if spec.job_id != chain_job.job_id:
            await self._reject(chain_job, f"spec job_id {spec.job_id!r} differs from the chain's", stats)
            return None
        inp = JobWorkflowInput(
            job=JobRef.of(spec, spec_digest(chain_job.raw_spec)),
            cluster_id=self.cluster_id,
            provider=self.provider,
            settings=self.settings,
        )
        size = self.client.data_converter.payload_converter.to_payloads([inp])[0].ByteSize()
        if size > WORKFLOW_INPUT_BUDGET:
            reason = f"its workflow input is {size} bytes, over the budget of {WORKFLOW_INPUT_BUDGET}"
            await self._reject(chain_job, reason, stats)
            return None
        return inp

    async def _reject(
        self, chain_job: ChainJob, reason: str, stats: PollStats, *, checked: bool = False
    ) -> None:
        """Fail a job that cannot be accepted, on chain with the reason (escrow refunded).

        Unless ``checked``, a job whose workflow id already has a run (an earlier run closed and left it pending,
        perhaps after it submitted) goes to the reconciler instead, whose run stops what that run may have left.
        """
        if not checked:
            try:
                found = await self.client.get_workflow_handle(chain_job.job_id).describe()
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    raise
            else:
                if (
                    found.workflow_type == JOB_WORKFLOW_NAME
                    and found.status != WorkflowExecutionStatus.RUNNING
                ):
                    if await self.reconciler.recover(chain_job, found):
                        stats.recovered.append(chain_job.job_id)
                    return
        message = f"invalid job: {reason}"[:1024]
        self.audit.record(
            AuditEvent.JOB_VALIDATION_FAILED,
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

    async def _try_start(self, job: ChainJob, stats: PollStats) -> bool:
        """``_start``, with the failures that concern this job alone held back for a while instead of ending the
        round: the other pending jobs still start."""
        try:
            started = await self._start(job, stats)
        except RPCError as exc:
            if exc.status in _SERVICE_DOWN:
                raise
            self._hold(job, exc, stats)
            return False
        except HPCError as exc:
            if exc.transient:
                raise
            self._hold(job, exc, stats)
            return False
        if started and self.metrics is not None:
            self.metrics.starts.labels(self.cluster_id).inc()
        return started

    async def _already_started(self, job: ChainJob, stats: PollStats) -> None:
        """The job's workflow id is taken: by an open run (fine: visibility had not shown it yet) or by a closed
        one that left the job pending on chain, which the reconciler closes."""
        try:
            found = await self.client.get_workflow_handle(job.job_id).describe()
        except RPCError as exc:
            if exc.status in _SERVICE_DOWN:
                raise
            self._hold(job, exc, stats)
            return
        if found.workflow_type != JOB_WORKFLOW_NAME:
            # A workflow of another kind (a node's, under an id of an earlier release) holds this id: the job
            # could never get its own workflow, so it is refused instead of waiting for ever.
            await self._reject(
                job, f"its id is taken by a {found.workflow_type} workflow", stats, checked=True
            )
            return
        if found.status == WorkflowExecutionStatus.RUNNING:
            return
        if await self.reconciler.recover(job, found):
            stats.recovered.append(job.job_id)

    def _hold(self, job: ChainJob, error: Exception, stats: PollStats) -> None:
        delay = self._holds.attempted(job.job_id)
        stats.held.append(job.job_id)
        if self.metrics is not None:
            self.metrics.start_failures.labels(self.cluster_id).inc()
        log.warning(
            "cannot start the workflow of job %s: %s; trying it again in %.0f s, the other jobs go on",
            job.job_id,
            error,
            delay,
            extra={"job_id": job.job_id, "cluster_id": self.cluster_id},
        )

    def _set_gauges(self, pending: int, free: int) -> None:
        if self.metrics is not None:
            self.metrics.chain_pending.labels(self.cluster_id).set(pending)
            self.metrics.free_slots.labels(self.cluster_id).set(max(free, 0))

    def _count_failure(self, cause: str) -> None:
        if self.metrics is not None:
            self.metrics.poll_failures.labels(self.cluster_id, cause).inc()

    async def _forward_cancellations(self, stats: PollStats) -> None:
        """Forward the tenant cancellations on chain, ``cancel_concurrency`` at once, in the chain's order (taken
        jobs first, in turns by tenant, so that a flood of cancels does not delay another tenant's). The intake lease
        holder forwards them; a standby poller only those that have waited a whole lease term (the holder is gone),
        so that a cancel is signalled once. The chain's list is read ``CANCEL_PAGE`` at a time, from where the
        requests already handled in this round end; its first page again every ``CANCEL_BATCH`` forwards: a cancel
        requested while a flood of thousands is being forwarded takes its place in the order then, instead of
        waiting for the whole flood (each of its cancels a lookup, a start and an audit record)."""
        tried: set[str] = set()  # in this round: one that could not be forwarded is tried again next round
        batch_size = max(CANCEL_BATCH, self.cancel_concurrency)
        scan = _CancelScan()
        while True:
            todo, more = await self._cancels_to_forward(stats, scan, tried, batch_size)
            batch = todo[:batch_size]
            tried.update(batch)
            await self._forward_batch(batch, stats)
            if len(todo) <= batch_size and not more:
                # The whole list was read in this round: what it no longer holds has ended.
                self._signalled &= scan.seen
                self._cancel_seen = {j: at for j, at in self._cancel_seen.items() if j in scan.seen}
                return

    async def _cancels_to_forward(
        self, stats: PollStats, scan: _CancelScan, tried: set[str], want: int
    ) -> tuple[list[str], bool]:
        """The chain's cancel requests this poller forwards now, in the chain's order: those of its first page
        (new requests near the head of the order), then those after ``scan.after``, page by page until more than
        ``want`` are found (True: the list goes on) or the list ends (False). ``scan.after`` moves over the requests
        that need nothing more in this round, so that the next call reads on from there."""
        now = self.clock()
        standby = not await self.lease.refresh()
        stats.standby = stats.standby or standby

        def forward(job_id: str) -> bool:
            scan.seen.add(job_id)
            first_seen = self._cancel_seen.setdefault(job_id, now)
            if job_id in self._signalled or job_id in tried:
                return False
            return not standby or now - first_seen >= self.lease.term

        head = await self.chain.cancel_requested_jobs(self.cluster_id, self.provider, limit=CANCEL_PAGE)
        todo = [job_id for job_id in head if forward(job_id)]
        page = head if scan.after is None else await self._cancel_page(scan.after)
        found = False  # a request to forward among the pages read after scan.after
        while True:
            for job_id in page:
                if forward(job_id):
                    found = True
                    if job_id not in todo:
                        todo.append(job_id)
                elif not found:
                    scan.after = job_id
            if len(page) < CANCEL_PAGE:
                return todo, False
            if len(todo) > want:
                return todo, True
            page = await self._cancel_page(page[-1])

    async def _cancel_page(self, after: str) -> list[str]:
        return await self.chain.cancel_requested_jobs(
            self.cluster_id, self.provider, limit=CANCEL_PAGE, after=after
        )

    async def _forward_batch(self, batch: list[str], stats: PollStats) -> None:
        """Forward ``batch``, ``cancel_concurrency`` at once, each forwarder taking the next request in order."""
        pending = iter(batch)
        failures: list[Exception] = []

        async def forward() -> None:
            for job_id in pending:  # shared: each forwarder takes the next request, in order
                try:
                    forwarded = await self._forward_cancel(job_id)
                except (HPCError, RPCError) as exc:  # the chain or Temporal is down: next round
                    failures.append(exc)
                    return
                if forwarded:
                    self._signalled.add(job_id)
                    stats.cancelled.append(job_id)
                if failures:
                    return

        await asyncio.gather(*(forward() for _ in range(min(self.cancel_concurrency, len(batch)))))
        if failures:
            raise failures[0]

    async def _forward_cancel(self, job_id: str) -> bool:
        """Signal the job's workflow; without one, ``_cancel_without_workflow``. True when forwarded."""
        handle: WorkflowHandle[object, object] = self.client.get_workflow_handle(job_id)
        try:
            await handle.signal("cancel", CancelRequest(reason="cancelled by the tenant on chain"))
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                # The workflow may well be running the job: touch nothing, try again next round.
                log.warning(
                    "cannot forward the tenant's cancel of job %s: %s; trying again next round",
                    job_id,
                    exc,
                    extra={"job_id": job_id, "cluster_id": self.cluster_id},
                )
                return False
            return await self._cancel_without_workflow(handle, job_id)
        return True

    async def _cancel_without_workflow(self, handle: WorkflowHandle[object, object], job_id: str) -> bool:
        """The signal found no running workflow. Cancel the job on chain directly (escrow refunded) only if it is
        still pending and no workflow ever ran for it; a closed workflow may have left a scheduler job behind,
        so such a job goes to the reconciler, whose run stops it first. True when cancelled here.

        Only the intake lease holder looks further: a standby poller forwards a cancel only when the holder seems
        gone, and during a flood that outlasts a term it would otherwise look up, every round, each job the busy
        holder has not reached yet (a closed run's job is also found by the reconciler's own rounds)."""
        if not self.lease.valid():
            # The intake lease holder starts it (the same cancel reaches it): one start, one audit record.
            return False
        try:
            closed = await handle.describe()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                return False
            closed = None
        if closed is not None and closed.status == WorkflowExecutionStatus.RUNNING:
            return False  # it started meanwhile: the signal goes through next round
        job = await self.chain.get_job(job_id)
        if job is None or job.state.final:
            return False
        if closed is not None or job.state != JobState.PENDING:
            await self.reconciler.recover(job, closed)
            return False
        if not self.lease.valid():  # it ended meanwhile
            return False
        # Start its workflow with the cancel already in it (signal-with-start): the workflow stays the only writer
        # of the job's chain state, so another poller starting it at this moment cannot run a job the chain
        # refunded; if a run exists by now, it gets the signal instead.
        inp = await self._accept(job, PollStats())
        if inp is None:
            return True  # refused on chain (failed, refunded)
        try:
            started = await self._start_workflow(inp, cancel=CancelRequest(reason=CANCELLED_BEFORE_START))
        except WorkflowAlreadyStartedError:
            return False  # a run closed meanwhile: the reconciler's case, next round
        if not started:
            return True  # another cluster's poller started it a moment ago (a job for no cluster): signalled
        self.audit.record(
            AuditEvent.JOB_CANCELLED,
            job_id=job_id,
            cluster_id=self.cluster_id,
            details={"reason": "cancelled before it started"},
        )
        return True


@dataclass
class _CancelScan:
    """Where one round of the cancellation loop is in the chain's list, and every request it has read."""

    after: str | None = None
    seen: set[str] = field(default_factory=set)


def _start_attributes(inp: JobWorkflowInput, *, cancelled: bool) -> TypedSearchAttributes:
    """A job started with the tenant's cancel in it shows as cancelled from its start (it submits nothing), so that
    it takes no ``max_concurrent_jobs`` slot while it closes."""
    attributes = initial_search_attributes(inp)
    if cancelled:
        attributes = attributes.updated(SearchAttributePair(SA_STATE, JobState.CANCELLED.value))
    return attributes


def _started_here(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether a start made the run, rather than signalling one that existed (signal-with-start). Temporal says so
    in its answer (``started``, servers from 1.25), which the SDK keeps on the handle without a public accessor;
    when it cannot be read, the start counts as made here (a second audit record rather than none). A test starts a
    run twice this way on the real server, so an SDK that moves the answer fails it."""
    answer = getattr(handle, "_start_workflow_response", None)
    return not isinstance(answer, SignalWithStartWorkflowExecutionResponse) or answer.started


def _payload_refused(exc: RPCError) -> bool:
    """True when Temporal refused a start for the size of its input (this job's), not for its own trouble."""
    too_large = ("size exceeds limit", "larger than max")
    return exc.status in (RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.RESOURCE_EXHAUSTED) and any(
        text in exc.message.lower() for text in too_large
    )


def _summarize(exc: PydanticValidationError) -> str:
    parts = []
    for item in exc.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "job"
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
