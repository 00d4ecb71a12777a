"""Activities of the job workflow: route, submit, watch, cancel, report transitions, report usage.

All I/O of a job happens here, in methods of ``JobActivities`` whose dependencies (scheduler adapters per cluster,
chain client, signer, audit log, config) are injected by the worker. Domain errors are translated
at this boundary into ``ApplicationError`` with ``type`` = the error class and ``non_retryable`` = not transient.
Expected refusals (a malformed job, a routing rejection) are returned as outcomes, not raised, so the workflow can
report them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from pydantic import ValidationError as PydanticValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.attempts import Attempt, heartbeating
from activities.audit import AuditLog
from activities.chain.client import AccountingReport, ChainClient, ChainJob, StatusReport
from activities.monitor import MonitorActivities, register
from activities.routing import RoutingEnforcer
from activities.schedulers.base import (
    Accounting,
    NativeStatus,
    RefusedAdoption,
    SchedulerAdapter,
    SubmitRequest,
    SubmitResult,
)
from activities.schedulers.batch.workdir import UNSAFE as WORK_DIR_UNSAFE
from activities.schedulers.batcher import StatusBatcher
from activities.usage_batcher import UsageBatcher
from virtengine_hpc.activity_names import (
    CANCEL_JOB,
    FIND_JOB,
    PARK_JOB,
    RECOVER_JOB,
    REPORT_TRANSITION,
    REPORT_USAGE,
    ROUTE_JOB,
    SUBMIT_JOB,
    WATCH_JOB,
)
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config
from virtengine_hpc.errors import (
    ChainError,
    HPCError,
    IllegalTransition,
    JobNotFound,
    SchedulerError,
    SecurityError,
    ValidationError,
)
from virtengine_hpc.messages import (
    CANCELLED_BEFORE_START,
    CancelInput,
    FindInput,
    FindOutput,
    JobRef,
    ParkInput,
    RecoverInput,
    RecoverOutput,
    RouteOutcome,
    RouteRequest,
    SubmitInput,
    SubmitOutput,
    TransitionInput,
    UsageInput,
    UsageOutput,
    WatchEntry,
    WatchInput,
    WatchOutput,
    WatchRegistration,
)
from virtengine_hpc.metering import Reading, basis_of, meter, period_end, period_metrics
from virtengine_hpc.models import (
    Cluster,
    JobSpec,
    PricedQueue,
    Resources,
    UsageMetrics,
    UsageRecord,
    accept_spec,
    spec_digest,
)
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import diff_metrics, record_id, sign_record, sum_metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
_ASKED_CACHE = 20_000
MAX_MESSAGE = 1024
ADOPTION_REFUSED_SEVERITY = 4
"""A look-alike scheduler job is a tenant's attempt to be adopted in another's place (or to run unbilled)."""
SECURITY_REFUSAL_SEVERITY = 4
"""A submission refused because another account may have tampered with it (its directory, its answer)."""
"""A refusal's message is cut to this (the chain keeps as much): it may quote what the tenant sent."""


@dataclass(frozen=True)
class ResolvedBody:
    """What a job runs: its program, and whether its template asks for whole nodes."""

    text: str
    exclusive: bool = False


BodyResolver = Callable[[JobSpec, SchedulerAdapter], Awaitable[str | ResolvedBody]]
"""Turns a job into the program the scheduler runs: its script, or its template rendered for the adapter (a plain
``str`` from a site's own resolver means a script that shares nodes). ``route_job`` calls it to check the job;
``submit_job`` calls its ``render`` method if it has one (the program alone, without the checks routing made),
else the resolver itself."""


async def script_only_body(job: JobSpec, adapter: SchedulerAdapter) -> str:
    if job.script is not None:
        return job.script
    raise ValidationError(f"unknown template {job.template_id!r}")


def to_application_error(exc: HPCError) -> ApplicationError:
    """Translate a domain error; the message and type are what operators and the chain see (never secrets)."""
    details: dict[str, object] = {"code": exc.code}
    if isinstance(exc, SchedulerError) and exc.exit_code is not None:
        details["exit_code"] = exc.exit_code
    return ApplicationError(str(exc), details, type=type(exc).__name__, non_retryable=not exc.transient)


class JobActivities:
    def __init__(
        self,
        *,
        config: Config,
        adapters: Mapping[str, SchedulerAdapter],
        chain: ChainClient,
        signer: Signer,
        audit: AuditLog,
        enforcer: RoutingEnforcer,
        resolve_body: BodyResolver = script_only_body,
    ) -> None:
        self.config = config
        self.adapters = dict(adapters)
        self.chain = chain
        self.signer = signer
        self.audit = audit
        self.enforcer = enforcer
        self.resolve_body = resolve_body
        self.batchers: dict[str, StatusBatcher] = {}
        # The monitor's rounds send period records through this very path (one metering and signing path).
        self.monitor = MonitorActivities(self.adapters, report=self._report_usage)
        # Usage records of concurrent activities go to the chain together, batch_size at a time.
        self.usage_batcher = UsageBatcher(chain, config.hpc.usage_reporting.batch_size)
        # What each job asked for (its priced allocation's bound), read once from the chain per job.
        self._asked: dict[str, Resources] = {}
        for adapter in self.adapters.values():
            adapter.on_refused_adoption(self._audit_refused_adoption)

    def _audit_refused_adoption(self, refusal: RefusedAdoption) -> None:
        """A look-alike (a scheduler job named like a workflow's own without its marker) was not adopted: it is
        nobody's job here, so nothing bills it; the audit names it for the operator."""
        self.audit.record(
            AuditEvent.ADOPTION_REFUSED,
            job_id=refusal.workflow_id,
            cluster_id=refusal.cluster_id,
            success=False,
            severity=ADOPTION_REFUSED_SEVERITY,
            error_msg=f"scheduler job {refusal.scheduler_job_id} not adopted: {refusal.reason}",
            details={
                "scheduler_job_id": refusal.scheduler_job_id,
                "job_name": refusal.job_name,
                "runs_as": refusal.user,
                "expected_account": refusal.expected_account,
            },
        )

    def adapter(self, cluster_id: str) -> SchedulerAdapter:
        try:
            return self.adapters[cluster_id]
        except KeyError:
            raise ApplicationError(
                f"this worker has no scheduler adapter for cluster {cluster_id}", type="ConfigError"
            ) from None

    def batcher(self, cluster_id: str, interval: float) -> StatusBatcher:
        if cluster_id not in self.batchers:
            self.batchers[cluster_id] = StatusBatcher(self.adapter(cluster_id), interval)
        return self.batchers[cluster_id]

    # ---- routing and validation ---------------------------------------------------------------------------------

    @activity.defn(name=ROUTE_JOB)
    async def route_job(self, request: RouteRequest) -> RouteOutcome:
        """Check the job's routing, its partition's bounds and its program (the body is rendered to check it and
        then dropped: ``submit_job`` renders it again where it submits, so no result carries it)."""
        try:
            adapter = self.adapter(request.cluster_id)
            on_chain, job = await self._chain_job(request.job)
            if on_chain.state.final:
                return self._already_final(on_chain)
            routed = await self.enforcer.enforce(job, request.cluster_id)
            violations = routed.violations
            if not routed.accepted:
                return RouteOutcome(
                    accepted=False,
                    code="routing_rejected",
                    message=routed.message[:MAX_MESSAGE],
                    violations=violations,
                )
            cluster = await self.chain.get_cluster(routed.cluster_id)
            # Checked where the job will run, after any fallback: the offering prices this very cluster.
            queue = await self._offering(job, cluster, routed.cluster_id)
            # A job that names no partition runs in the one its offering is priced for, never in whichever
            # partition happens to be the cluster's first: it is billed at that offering's rates.
            partition = job.partition or queue.partition
            if cluster is not None and cluster.partitions:
                part = cluster.partition(partition)
                if part is None:
                    raise ValidationError(f"partition {partition!r} does not exist on {cluster.cluster_id}")
                partition = part.name
                _check_bounds(job, part.max_nodes, part.max_runtime_seconds)
            await self._resolve(job, adapter)
        except ValidationError as exc:
            self.audit.record(
                AuditEvent.JOB_VALIDATION_FAILED,
                job_id=request.job.job_id,
                cluster_id=request.cluster_id,
                success=False,
                error_msg=str(exc),
            )
            return RouteOutcome(accepted=False, code="validation_failed", message=str(exc)[:MAX_MESSAGE])
        except HPCError as exc:
            raise to_application_error(exc) from None
        return RouteOutcome(
            accepted=True,
            cluster_id=routed.cluster_id,
            decision_id=routed.decision.decision_id if routed.decision else None,
            is_fallback=routed.is_fallback,
            violations=violations,
            partition=partition,
        )

    @staticmethod
    def _already_final(on_chain: ChainJob) -> RouteOutcome:
        """The job has ended on chain (a reset run of a closed workflow routes it again): nothing may run again."""
        log.warning(
            "job %s is already %s on chain: nothing to route or submit (a workflow reset after the job ended?)",
            on_chain.job_id,
            on_chain.state.value,
            extra={"job_id": on_chain.job_id},
        )
        return RouteOutcome(
            accepted=False,
            code="already_final",
            message=f"the job is already {on_chain.state.value} on chain",
            chain_state=on_chain.state,
        )

    async def _offering(self, job: JobSpec, cluster: Cluster | None, routed_to: str) -> PricedQueue:
        """The job's offering, if it is one of this provider's and prices the cluster the job was routed to: a
        tenant must not run on the GPU cluster at a CPU cluster's prices, or at another provider's."""
        queue = await self.chain.get_queue(job.offering_id)
        if queue is None:
            raise ValidationError(f"offering {job.offering_id} has no priced queue on chain")
        on = cluster if queue.cluster_id == routed_to else await self.chain.get_cluster(queue.cluster_id)
        me = self.config.provider.address
        owner = on.provider if on is not None else "an unknown provider"
        if owner != me or job.provider != me:
            raise ValidationError(
                f"offering {job.offering_id} belongs to {owner} (cluster {queue.cluster_id}), not to this "
                f"provider {me}"
            )
        if queue.cluster_id != routed_to:
            raise ValidationError(
                f"offering {job.offering_id} is priced for cluster {queue.cluster_id}, not for {routed_to} where "
                "the job was routed"
            )
        return queue

    async def job_spec(self, ref: JobRef) -> JobSpec:
        """The job's spec as the chain holds it, and the one the poller accepted (same digest).

        Workflow and activity payloads carry only the reference (``JobRef``); the activities that need the
        tenant's program read it here, so its size never reaches Temporal.
        """
        return (await self._chain_job(ref))[1]

    async def _chain_job(self, ref: JobRef) -> tuple[ChainJob, JobSpec]:
        """The job as the chain holds it (its state too), and its spec checked as ``job_spec`` says."""
        found = await self.chain.get_job(ref.job_id)
        if found is None:
            raise ValidationError(f"job {ref.job_id} is not on chain")
        if ref.spec_sha256 is not None and spec_digest(found.raw_spec) != ref.spec_sha256:
            raise ValidationError(
                f"the spec of job {ref.job_id} on chain is not the one accepted for it (its digest differs)"
            )
        try:
            # The walltime the poller accepted (its ref) for a spec that names none, so the scheduler and the
            # workflow's deadline agree even if this worker's job_timeout_default differs from the poller's.
            spec = accept_spec(found.raw_spec, ref.walltime_seconds)
        except PydanticValidationError as exc:
            raise ValidationError(f"job {ref.job_id} has an invalid spec: {exc.errors()[0]['msg']}") from None
        if spec.job_id != ref.job_id:
            raise ValidationError(f"the chain returned job {spec.job_id} for {ref.job_id}")
        return found, spec

    async def _resolve(
        self, job: JobSpec, adapter: SchedulerAdapter, *, render: bool = False
    ) -> ResolvedBody:
        resolver: BodyResolver = self.resolve_body
        if render:
            resolver = getattr(resolver, "render", resolver)
        resolved = await resolver(job, adapter)
        return ResolvedBody(resolved) if isinstance(resolved, str) else resolved

    # ---- submission ---------------------------------------------------------------------------------------------

    @activity.defn(name=SUBMIT_JOB)
    async def submit_job(self, request: SubmitInput) -> SubmitOutput:
        """Submit the job once, however many attempts run, even side by side.

        The scheduler job id is heartbeated the moment the scheduler answers; a retry that finds it in its
        heartbeat details adopts it without a lookup, a retry without it looks the job up first, and a first
        attempt (nothing before it can have made a job) submits straight away. After every submission or
        adoption the adapter reconciles duplicates made by racing attempts: the oldest job is kept, the others
        are cancelled (audit ``duplicate_job_cancelled``); a first attempt whose job was accepted before any retry
        could have started (``Attempt.alone_until``) skips that check, since a retry would find its job.
        """
        adapter = self.adapter(request.cluster_id)
        attempt = Attempt.current()
        known = attempt.progress.scheduler_job_id
        job, resolved = await self._prepare(request, adapter, attempt)
        try:
            result = await heartbeating(
                adapter.submit(
                    SubmitRequest(
                        workflow_id=request.workflow_id,
                        job=job,
                        body=resolved.text,
                        partition=request.partition,
                        exclusive=resolved.exclusive,
                        first_attempt=attempt.first and not request.look_first,
                        known_job_id=known,
                        alone_until=None if request.look_first else attempt.alone_until,
                    ),
                    on_submitted=attempt.submitted,
                ),
                attempt,
            )
        except HPCError as exc:
            self._audit_security(request, exc)
            last = not exc.transient or (request.max_attempts and attempt.number >= request.max_attempts)
            if last:
                event = (
                    AuditEvent.JOB_MAX_RETRIES_EXCEEDED if exc.transient else AuditEvent.JOB_SUBMISSION_FAILED
                )
                self.audit.record(
                    event,
                    job_id=request.job.job_id,
                    cluster_id=request.cluster_id,
                    success=False,
                    error_msg=str(exc),
                    details={"attempt": attempt.number, "code": exc.code},
                )
            raise to_application_error(exc) from None
        self._audit_submission(request, result, attempt, heartbeated=known is not None)
        reported = await self._report_queued(request, result.scheduler_job_id, attempt)
        return SubmitOutput(
            scheduler_job_id=result.scheduler_job_id, adopted=result.adopted, reported=reported
        )

    async def _report_queued(self, request: SubmitInput, scheduler_job_id: str, attempt: Attempt) -> bool:
        """Report the job queued with its submission (``SubmitInput.report``), so the workflow needs no step of
        its own for it. An attempt that finds the report sent by an earlier one (heartbeated) does not send it
        again."""
        report = request.report
        if report is None:
            return False
        if attempt.progress.queued_reported:
            return True
        watch = None
        if report.monitor is not None:
            entry = WatchEntry(scheduler_job_id=scheduler_job_id, state=JobState.QUEUED)
            watch = WatchRegistration(workflow_id=request.workflow_id, monitor=report.monitor, entry=entry)
        transition = TransitionInput(
            job_id=request.job.job_id,
            cluster_id=request.cluster_id,
            old_state=report.old_state,
            new_state=JobState.QUEUED,
            event=report.event,
            message=report.message,
            scheduler_job_id=scheduler_job_id,
            tenant=report.tenant,
            watch=watch,
        )
        if not await self._report_along(transition, attempt):
            return False
        attempt.record(queued_reported=True)
        return True

    async def _report_along(self, transition: TransitionInput, attempt: Attempt) -> bool:
        """Report a transition along with the step that caused it (a submission, a final record). One that fails
        is left to the workflow, which sends it with its own retries: the step's work stands, and the chain being
        busy spends none of its attempts."""
        try:
            await heartbeating(self._report_transition(transition, lifecycle_audit=True), attempt)
        except ApplicationError as err:
            log.warning(
                "job %s: %s not reported with its step (the workflow reports it): %s",
                transition.job_id,
                transition.new_state.value,
                err,
                extra={"job_id": transition.job_id},
            )
            return False
        return True

    def _audit_security(self, request: SubmitInput, exc: HPCError) -> None:
        """A submission stopped by what looks like another account's doing (a link in place of the tenant's job
        directory, a scheduler answer its login shell altered) is also a security event, for the operator."""
        if isinstance(exc, SecurityError) or exc.code == WORK_DIR_UNSAFE:
            self.audit.record(
                AuditEvent.SECURITY_VIOLATION,
                job_id=request.job.job_id,
                cluster_id=request.cluster_id,
                success=False,
                severity=SECURITY_REFUSAL_SEVERITY,
                error_msg=str(exc),
                details={"code": exc.code, "step": SUBMIT_JOB},
            )

    def _audit_submission(
        self, request: SubmitInput, result: SubmitResult, attempt: Attempt, *, heartbeated: bool
    ) -> None:
        job_id, cluster_id = request.job.job_id, request.cluster_id
        for duplicate in result.duplicates_cancelled:
            self.audit.record(
                AuditEvent.DUPLICATE_JOB_CANCELLED,
                job_id=job_id,
                cluster_id=cluster_id,
                details={
                    "scheduler_job_id": duplicate,
                    "kept": result.scheduler_job_id,
                    "attempt": attempt.number,
                    "why": "submit attempts raced; the oldest scheduler job is kept",
                },
            )
        self.audit.record(
            AuditEvent.JOB_SUBMITTED,
            job_id=job_id,
            cluster_id=cluster_id,
            details={
                "scheduler_job_id": result.scheduler_job_id,
                "adopted": result.adopted,
                "attempt": attempt.number,
            },
        )
        if result.adopted:
            self.audit.record(
                AuditEvent.STATE_RECOVERED,
                job_id=job_id,
                cluster_id=cluster_id,
                details={
                    "scheduler_job_id": result.scheduler_job_id,
                    "why": "submit retried; adopted the job an earlier attempt heartbeated"
                    if heartbeated
                    else "submit retried; adopted existing job",
                },
            )

    async def _prepare(
        self, request: SubmitInput, adapter: SchedulerAdapter, attempt: Attempt
    ) -> tuple[JobSpec, ResolvedBody]:
        """Read the spec from chain and render the body for the adapter that submits it.

        The chain being unreachable does not use up submit attempts: the attempt waits for it (heartbeating its
        progress, so a scheduler job id an earlier attempt heartbeated is kept) until a minute before its own
        timeout. A refusal is raised with a type the workflow does not count as the scheduler's refusal: an
        earlier attempt may have submitted the job before, say, its template was withdrawn, so the workflow looks
        it up (``find_job``) and adopts it rather than fail a job that runs.
        """
        timeout = activity.info().start_to_close_timeout or timedelta(seconds=300)
        give_up = time.monotonic() + max(timeout.total_seconds() - 60, 0)
        delay = 1.0
        while True:
            try:
                job = await heartbeating(self.job_spec(request.job), attempt)
                return job, await heartbeating(self._resolve(job, adapter, render=True), attempt)
            except HPCError as exc:
                if not exc.transient or time.monotonic() + delay >= give_up:
                    raise self._unprepared(request, exc) from None
                log.warning("cannot read job %s to submit it, will retry: %s", request.job.job_id, exc)
                await heartbeating(asyncio.sleep(delay), attempt)
                delay = min(2 * delay, 30.0)

    def _unprepared(self, request: SubmitInput, exc: HPCError) -> ApplicationError:
        if not exc.transient:
            self.audit.record(
                AuditEvent.JOB_VALIDATION_FAILED,
                job_id=request.job.job_id,
                cluster_id=request.cluster_id,
                success=False,
                error_msg=str(exc),
            )
        return ApplicationError(
            str(exc), {"code": exc.code}, type="SubmissionUnprepared", non_retryable=not exc.transient
        )

    @activity.defn(name=FIND_JOB)
    async def find_job(self, request: FindInput) -> FindOutput:
        """The scheduler job that carries the workflow id, if any: asked when every submit attempt failed
        without the scheduler refusing the job (timeouts, lost answers), since such an attempt may well have
        created it. The workflow adopts what this finds instead of failing a job that runs."""
        try:
            tenant = await heartbeating(self._tenant_of(request.job_id))
            found = await heartbeating(self.adapter(request.cluster_id).find(request.workflow_id, tenant))
        except HPCError as exc:
            raise to_application_error(exc) from None
        if found is not None:
            self.audit.record(
                AuditEvent.STATE_RECOVERED,
                job_id=request.job_id,
                cluster_id=request.cluster_id,
                details={
                    "scheduler_job_id": found,
                    "why": "every submit attempt failed without a refusal; adopted the job one of them created",
                },
            )
        return FindOutput(scheduler_job_id=found)

    async def _tenant_of(self, job_id: str) -> str | None:
        """The tenant of a chain job, as the chain lists it: a lookup by workflow id counts only a job that runs
        as that tenant's account and carries the marker made for it."""
        job = await self.chain.get_job(job_id)
        tenant = job.raw_spec.get("tenant") if job is not None else None
        return tenant if isinstance(tenant, str) else None

    @activity.defn(name=RECOVER_JOB)
    async def recover_job(self, request: RecoverInput) -> RecoverOutput:
        """Where a job an earlier run left open stands: its scheduler job (looked up by the workflow id when the
        earlier run had none) and the usage records the chain already holds, so the recovery run cancels the
        right job and continues the records without a gap or a second final record."""
        try:
            found = request.scheduler_job_id
            if found is None:
                tenant = await heartbeating(self._tenant_of(request.job_id))
                found = await heartbeating(self.adapter(request.cluster_id).find(request.workflow_id, tenant))
            records = await heartbeating(self.chain.job_usage_records(request.job_id))
        except HPCError as exc:
            raise to_application_error(exc) from None
        out = RecoverOutput(scheduler_job_id=found)
        if records:
            last = records[-1]
            lost = found is None
            found = found or last.scheduler_job_id
            # A final record already sent is sent again (adopted by id) with the accounting that may be missing.
            kept = records[:-1] if last.is_final else records
            out = RecoverOutput(
                scheduler_job_id=found,
                next_sequence=len(kept) + 1,
                cumulative=sum_metrics([r.metrics for r in kept]),
                last_period_end=kept[-1].period_end if kept else records[0].period_start,
                first_period_start=records[0].period_start,
                scheduler_lost=lost,
            )
        self.audit.record(
            AuditEvent.STATE_RECOVERED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            details={
                "scheduler_job_id": found,
                "records": len(records),
                "why": "recovery run of a job an earlier run left open",
            },
        )
        return out

    @activity.defn(name=PARK_JOB)
    async def park_job(self, request: ParkInput) -> None:
        """A job waits for an operator: say so where operators look (audit, error log)."""
        log.error(
            "job %s parked: %s (virtengine-hpc jobs retry %s once fixed)",
            request.job_id,
            request.reason,
            request.job_id,
            extra={"job_id": request.job_id, "cluster_id": request.cluster_id},
        )
        self.audit.record(
            AuditEvent.JOB_PARKED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            success=False,
            error_msg=request.reason,
            details={"state": request.state.value, "scheduler_job_id": request.scheduler_job_id},
        )

    # ---- watching -----------------------------------------------------------------------------------------------

    @activity.defn(name=WATCH_JOB)
    async def watch_job(self, request: WatchInput) -> WatchOutput:
        """Follow one job until its state changes or ``return_by``; heartbeats every poll (invariant 3).

        Waiting happens here, not in the workflow, so a long job costs a handful of history events per report
        period. Status comes from the worker's batched query; a failed query is retried at the next round and is
        never a state change. A job the scheduler cannot find is given ``vanished_grace_seconds`` (accounting lags
        behind the queue) before it is reported as not found.
        """
        batcher = self.batcher(request.cluster_id, request.poll_interval_seconds)
        attempt = Attempt.current()
        # A retried watch goes on from what its predecessor last saw: a vanished job's grace period runs from
        # when it first went missing, not from whenever the latest attempt started.
        missing_since = attempt.progress.missing_since if attempt.resumed else request.missing_since
        last_seen = attempt.progress.last_state or request.last_state
        sent = await self._earlier_report(request, attempt)
        while True:
            now = datetime.now(UTC)
            try:
                # A status query can take longer than the heartbeat timeout (a controller that is down makes
                # Slurm's commands retry for a while): keep heartbeating while it runs.
                status = await heartbeating(batcher.status(request.scheduler_job_id), attempt)
            except SchedulerError as exc:
                attempt.record(error=str(exc)[:200])
                status = None
            if status is not None:
                if not status.found:
                    missing_since = missing_since or now
                    if (now - missing_since).total_seconds() >= request.vanished_grace_seconds:
                        return WatchOutput(
                            status=status, changed=True, missing_since=missing_since, usage=sent
                        )
                else:
                    missing_since, last_seen = None, status.state
                    if status.state != request.last_state or _restarted(request, status):
                        return WatchOutput(status=status, changed=True, usage=sent)
                attempt.record(
                    last_state=last_seen, found=status.found, missing_since=missing_since, error=None
                )
                if datetime.now(UTC) >= request.return_by:
                    usage = sent or await self._periodic_report(request, status, attempt)
                    return WatchOutput(status=status, changed=False, missing_since=missing_since, usage=usage)
            elif datetime.now(UTC) >= request.return_by:
                raise ApplicationError("scheduler unreachable; watch retried", type="SchedulerUnavailable")

    async def _earlier_report(self, request: WatchInput, attempt: Attempt) -> UsageOutput | None:
        """The report an earlier attempt of this watch may have sent, which the workflow never heard of.

        Whatever this attempt returns must name it, or the workflow's next record (the final one, if the job
        has ended meanwhile) would reuse its sequence. The record the predecessor heartbeated is sent again (the
        chain keeps the first); without it, the chain is asked for the report's record id.
        """
        report = request.report
        if report is None or attempt.first:
            return None
        rid = record_id(report.cluster_id, report.job_id, report.sequence)
        signed = attempt.progress.usage_record
        if signed is not None and signed.record_id == rid:
            try:
                return await self._report_usage(report, attempt)
            except ApplicationError as err:
                if not err.non_retryable:
                    raise
                return None  # the chain refused it for good: it holds no record under this sequence
        try:
            stored = await heartbeating(self.chain.get_usage_record(rid), attempt)
        except HPCError as exc:
            raise to_application_error(exc) from None
        if stored is None:
            return None
        cumulative = _add(report.previous_cumulative, stored)
        return UsageOutput(
            record_id=rid, sequence=report.sequence, cumulative=cumulative, period_end=stored.period_end
        )

    async def _periodic_report(
        self, request: WatchInput, status: NativeStatus, attempt: Attempt
    ) -> UsageOutput | None:
        """The report a watch carries, sent only while the job runs; a failure leaves it to ``report_usage``."""
        if request.report is None or not status.found or status.state != JobState.RUNNING:
            return None
        try:
            return await self._report_usage(request.report, attempt)
        except ApplicationError as err:
            if not err.non_retryable:
                raise  # transient (chain or scheduler busy): retry the watch, which adopts a record already sent
            return None

    # ---- cancellation -------------------------------------------------------------------------------------------

    @activity.defn(name=CANCEL_JOB)
    async def cancel_job(self, request: CancelInput) -> None:
        try:
            await heartbeating(self.adapter(request.cluster_id).cancel(request.scheduler_job_id))
        except HPCError as exc:
            self.audit.record(
                AuditEvent.JOB_CANCELLATION_FAILED,
                job_id=request.job_id,
                cluster_id=request.cluster_id,
                success=False,
                error_msg=str(exc),
            )
            raise to_application_error(exc) from None
        self.audit.record(
            AuditEvent.JOB_CANCELLED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            details={"scheduler_job_id": request.scheduler_job_id, "reason": request.reason},
        )

    # ---- lifecycle reports --------------------------------------------------------------------------------------

    @activity.defn(name=REPORT_TRANSITION)
    async def report_transition(self, request: TransitionInput) -> None:
        """Lifecycle callback: audit ``job_lifecycle_event`` and report the new state to the chain."""
        first = activity.info().attempt == 1 and not request.lifecycle_audited
        await self._report_transition(request, lifecycle_audit=first)

    async def _report_transition(self, request: TransitionInput, *, lifecycle_audit: bool) -> None:
        details = {
            "from": request.old_state.value,
            "to": request.new_state.value,
            "event": request.event.value if request.event else None,
            "scheduler_job_id": request.scheduler_job_id,
            "message": request.message,
            "exit_code": request.exit_code,
        }
        if lifecycle_audit:
            self.audit.record(
                AuditEvent.JOB_LIFECYCLE_EVENT,
                job_id=request.job_id,
                cluster_id=request.cluster_id,
                details=details,
            )
            if _cancelled_unsubmitted(request):
                self.audit.record(
                    AuditEvent.JOB_CANCELLED,
                    job_id=request.job_id,
                    cluster_id=request.cluster_id,
                    details={"scheduler_job_id": None, "reason": request.message},
                )
        try:
            await self.chain.report_status(
                StatusReport(
                    job_id=request.job_id,
                    state=request.new_state,
                    message=request.message[:1024],
                    exit_code=request.exit_code,
                    scheduler_job_id=request.scheduler_job_id,
                    cluster_id=request.cluster_id,
                )
            )
        except IllegalTransition as exc:
            if await self._ended_since(request):
                return
            self._report_failed(request, exc)
            raise to_application_error(exc) from None
        except HPCError as exc:
            self._report_failed(request, exc)
            raise to_application_error(exc) from None
        self.audit.record(
            AuditEvent.STATUS_REPORTED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            details={"state": request.new_state.value},
        )
        if request.watch is not None:
            await self._tell_monitor(request.watch)

    async def _ended_since(self, request: TransitionInput) -> bool:
        """The chain refused a report of a state the job has left for a final one since: a local step that ran
        again after its workflow task was lost (its marker with it), while the steps after it had reached the
        chain. The report stands as sent; the monitor is not told of the job again."""
        if request.new_state.final:
            return False
        try:
            found = await self.chain.get_job(request.job_id)
        except HPCError:
            return False  # the refusal stands; a retry asks again
        if found is None or not found.state.final:
            return False
        log.warning(
            "job %s: %s reported again after the job ended %s on chain (a local step run again): nothing to do",
            request.job_id,
            request.new_state.value,
            found.state.value,
            extra={"job_id": request.job_id},
        )
        return True

    def _report_failed(self, request: TransitionInput, exc: HPCError) -> None:
        self.audit.record(
            AuditEvent.STATUS_REPORT_FAILED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            success=False,
            error_msg=str(exc),
            details={"state": request.new_state.value},
        )

    async def _tell_monitor(self, registration: WatchRegistration) -> None:
        """The cluster's monitor hears the job's new state with the report that caused it (no step of its own)."""
        try:
            await register(activity.client(), registration)
        except RPCError as exc:
            raise ApplicationError(
                f"cannot reach the monitor of cluster {registration.monitor.cluster_id}: {exc}",
                type="TemporalUnavailable",
            ) from None

    # ---- usage --------------------------------------------------------------------------------------------------

    @activity.defn(name=REPORT_USAGE)
    async def report_usage(self, request: UsageInput) -> UsageOutput:
        """Sign and send one usage record (and, when final, the accounting that settles the job).

        Idempotent across attempts, even overlapping ones: the record id is deterministic; the signed record is
        heartbeated before it is sent and a retry sends that same record again, never a new reading; and when
        the chain answers "duplicate" (an earlier attempt's record got there first), the stored record is read
        back and carried forward, so the records always add up to the final accounting.
        """
        attempt = Attempt.current()
        out = await self._report_usage(request, attempt)
        if request.watch is not None:
            # The job's monitor sends its next period records from now on (one registration, no step of its own).
            await self._tell_monitor(request.watch)
        if request.then_report is not None and request.is_final and out.record_id is not None:
            out = out.model_copy(update={"reported": await self._report_along(request.then_report, attempt)})
        # The workflow's clock stands still while a local activity runs: this says when the report really ended.
        return out.model_copy(update={"answered_at": datetime.now(UTC)})

    async def _report_usage(self, request: UsageInput, attempt: Attempt) -> UsageOutput:
        rid = record_id(request.cluster_id, request.job_id, request.sequence)
        try:
            return await self._report_usage_once(request, rid, attempt)
        except _Ended:
            # The job ended before its workflow heard of it: its final record closes this period.
            return UsageOutput(cumulative=request.previous_cumulative, period_end=request.period_start)

    async def _report_usage_once(self, request: UsageInput, rid: str, attempt: Attempt) -> UsageOutput:
        try:
            # Chain calls heartbeat while they wait: a busy ledger waits out its busy timeout (30 s) before it
            # answers ChainUnavailable, longer than the 10 s heartbeat timeout, and a silent wait had Temporal
            # cancel and retry the attempt while the first one's write still sat in a thread (chaos benchmark).
            record = await self._send_record(request, rid, attempt)
            if record.is_final and not request.is_final:
                raise _Ended()  # the job's final record took this sequence: nothing follows it
            while request.is_final and not record.is_final:
                # An earlier report took this sequence for a period record (a watch whose answer was lost, or the
                # cluster monitor's round the job had not heard of yet): it stands, and the final record follows.
                log.warning("usage record %s is a period record; the final record follows it", rid)
                request = _following(request, record)
                rid = record_id(request.cluster_id, request.job_id, request.sequence)
                record = await self._send_record(request, rid, attempt)
            cumulative = _add(request.previous_cumulative, record)
            output = UsageOutput(
                record_id=rid, sequence=request.sequence, cumulative=cumulative, period_end=record.period_end
            )
            if request.is_final and request.report_accounting:
                settlement = await heartbeating(
                    self.chain.report_accounting(
                        AccountingReport(
                            job_id=request.job_id,
                            cluster_id=request.cluster_id,
                            totals=cumulative,
                            final_record_id=rid,
                            record_count=request.sequence,
                        )
                    ),
                    attempt,
                )
                self.audit.record(
                    AuditEvent.ACCOUNTING_REPORTED,
                    job_id=request.job_id,
                    cluster_id=request.cluster_id,
                    details={"final_record_id": rid, "records": request.sequence},
                )
                self.audit.record(
                    AuditEvent.SETTLEMENT_COMPLETED,
                    job_id=request.job_id,
                    cluster_id=request.cluster_id,
                    details={"charged": str(settlement.charged), "refunded": str(settlement.refunded)},
                )
                output = output.model_copy(
                    update={"charged": str(settlement.charged), "refunded": str(settlement.refunded)}
                )
            return output
        except HPCError as exc:
            final_attempt = request.max_attempts and attempt.number >= request.max_attempts
            if not exc.transient or final_attempt:
                event = (
                    AuditEvent.ACCOUNTING_REPORT_FAILED
                    if request.report_accounting
                    else AuditEvent.USAGE_REPORT_FAILED
                )
                self.audit.record(
                    event,
                    job_id=request.job_id,
                    cluster_id=request.cluster_id,
                    success=False,
                    error_msg=str(exc),
                    details={"record_id": rid},
                )
            raise to_application_error(exc) from None

    async def _send_record(self, request: UsageInput, rid: str, attempt: Attempt) -> UsageRecord:
        """The record the chain holds for this report, sent now unless an earlier attempt's record is there.

        A retry re-sends the record its predecessor heartbeated; without one it first asks the chain. A new
        reading is signed and heartbeated before it leaves, so that no later attempt signs another reading
        under the same id. On "duplicate" the stored record wins: it is what the chain bills.
        """
        record = attempt.progress.usage_record
        if record is None or record.record_id != rid:
            if not attempt.first:
                stored = await heartbeating(self.chain.get_usage_record(rid), attempt)
                if stored is not None:
                    return stored
            record = await heartbeating(self._new_record(request, rid), attempt)
            attempt.record(usage_record=record)
        result = await heartbeating(self.usage_batcher.submit(record), attempt)
        if rid in result.duplicates:
            stored = await heartbeating(self.chain.get_usage_record(rid), attempt)
            if stored is None:
                raise ChainError(
                    f"the chain calls usage record {rid} a duplicate but has none", transient=True
                )
            if stored != record:
                log.warning("usage record %s: the chain holds an earlier attempt's reading; carrying it", rid)
            record = stored
        elif rid not in result.accepted:
            raise ChainError(f"chain did not take usage record {rid}", transient=True)
        self.audit.record(
            AuditEvent.USAGE_REPORTED,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            details={
                "record_id": rid,
                "is_final": request.is_final,
                "state": request.job_state.value,
                "duplicate": rid in result.duplicates,
            },
        )
        return record

    async def _requested(self, request: UsageInput) -> Resources:
        """What the job asked for, as the provider accepted it: the priced allocation's upper bound.

        The input carries it (``resources``) or, from workflows that send only the job's storage, the chain's
        spec of the job is read once per job (the spec the poller accepted; the tenant cannot change it). Storage
        is always the provider-fixed ``storage_gb`` of the input.
        """
        asked = request.resources or self._asked.get(request.job_id)
        if asked is None:
            found = await self.chain.get_job(request.job_id)
            if found is None:
                raise ChainError(f"job {request.job_id} is not on chain: its allocation cannot be priced")
            try:
                asked = Resources.model_validate(found.raw_spec.get("resources") or {})
            except PydanticValidationError as exc:
                raise ValidationError(
                    f"job {request.job_id} has an invalid spec on chain: {exc.errors()[0]['msg']}"
                ) from None
            if len(self._asked) >= _ASKED_CACHE:
                self._asked.clear()
            self._asked[request.job_id] = asked
        return asked.model_copy(update={"storage_gb": request.storage_gb})

    async def _new_record(self, request: UsageInput, rid: str) -> UsageRecord:
        """A new reading of the job's cumulative usage, as a signed record of the difference to the last one."""
        adapter = self.adapter(request.cluster_id)
        accounting: Accounting | None
        try:
            accounting = await adapter.usage(request.scheduler_job_id)
        except JobNotFound:
            if not request.accept_partial:
                raise
            accounting = None  # the last reading stands: this record adds nothing
        if request.until_end and not request.is_final and accounting is not None and accounting.end_time:
            raise _Ended()
        if (
            accounting is not None
            and request.is_final
            and not accounting.final
            and not request.accept_partial
        ):
            # Accounting lags behind the queue (sacct): try again shortly rather than sign a partial reading.
            raise SchedulerError("final accounting not available yet", transient=True)
        # Every allocation is priced as the provider accepted it, storage included, whatever the scheduler reports.
        metered = meter(accounting.reading if accounting else Reading(), await self._requested(request))
        previous = request.previous_cumulative
        metrics = (
            period_metrics(metered, previous) if accounting is not None else diff_metrics(previous, previous)
        )
        taken = accounting.reading.taken_at if accounting is not None else None
        if accounting is not None and accounting.end_time is not None and request.is_final:
            taken = accounting.end_time
        if taken is not None and not request.is_final and not request.until_end:
            # A period record covers the time up to now: a reading the scheduler took earlier (a stale status file
            # of a supervisor that was restarted) must not end it in the past, or the next report is due at once
            # and the workflow reports in a tight loop (found by the chaos test's worker kill). A job that waits
            # for its cluster monitor spaces its reports itself: its period ends with the reading.
            taken = max(taken, datetime.now(UTC))
        end = period_end(request.period_start, metrics.wall_clock_seconds, taken or datetime.now(UTC))
        record = UsageRecord(
            record_id=rid,
            job_id=request.job_id,
            cluster_id=request.cluster_id,
            scheduler_job_id=request.scheduler_job_id,
            provider=request.provider,
            tenant=request.tenant,
            sequence=request.sequence,
            period_start=request.period_start,
            period_end=end,
            job_state=request.job_state,
            is_final=request.is_final,
            metrics=metrics,
            created_at=datetime.now(UTC),
            key_id=self.signer.key_id,
            version=2,
            allocation=metered.allocation,
            basis=basis_of(metrics),
        )
        return sign_record(record, self.signer)


class _Ended(Exception):
    """A period report found the job ended (``UsageInput.until_end``): nothing is sent."""


def _add(previous: UsageMetrics, record: UsageRecord) -> UsageMetrics:
    return sum_metrics([previous, record.metrics])


def _restarted(request: WatchInput, status: NativeStatus) -> bool:
    """The job runs again from a new start (requeued and restarted between two polls): a change too."""
    return (
        status.state == JobState.RUNNING
        and request.last_start_time is not None
        and status.start_time is not None
        and status.start_time != request.last_start_time
    )


def _following(request: UsageInput, stored: UsageRecord) -> UsageInput:
    """The same report, one sequence on: after ``stored``, from where it ended."""
    return request.model_copy(
        update={
            "sequence": request.sequence + 1,
            "previous_cumulative": _add(request.previous_cumulative, stored),
            "period_start": stored.period_end,
        }
    )


def _check_bounds(job: JobSpec, max_nodes: int, max_runtime_seconds: int) -> None:
    if job.resources.nodes > max_nodes:
        raise ValidationError(f"job asks for {job.resources.nodes} nodes; the partition allows {max_nodes}")
    if job.walltime_seconds > max_runtime_seconds:
        raise ValidationError(
            f"walltime {timedelta(seconds=job.walltime_seconds)} exceeds the partition's "
            f"{timedelta(seconds=max_runtime_seconds)}"
        )


__all__ = ["BodyResolver", "JobActivities", "ResolvedBody", "script_only_body", "to_application_error"]


def _cancelled_unsubmitted(request: TransitionInput) -> bool:
    """A cancel that ends a job which never had a scheduler job: no ``cancel_job`` ran to audit it, so its close
    does; except the poller's start of a job its tenant cancelled before any workflow ran, which the poller
    audited when it started it (``CANCELLED_BEFORE_START``)."""
    return (
        request.new_state == JobState.CANCELLED
        and request.scheduler_job_id is None
        and request.message != CANCELLED_BEFORE_START
    )
