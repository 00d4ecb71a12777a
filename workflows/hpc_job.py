"""HPCJobWorkflow: one durable workflow per on-chain HPC job (workflow id = chain job id).

route (validate + routing enforcement) → submit → watch … (usage record every ``report_interval`` while running)
→ final usage record (``is_final``) + accounting → terminal status.

Only orchestration lives here (DESIGN.md invariant 1): the clock is ``workflow.now()``, every side effect is an
activity, and everything the workflow needs arrives in its input. Waiting happens inside the heartbeating
``watch_job`` activity, which returns only on a state change or when a report or deadline is due, so history grows
by a few events per report period (invariant 3); the workflow continues as new when Temporal suggests it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.schedulers.base import NativeStatus
    from virtengine_hpc.messages import (
        JOB_WORKFLOW_NAME,
        CancelInput,
        CancelRequest,
        Carried,
        FindInput,
        FindOutput,
        JobResult,
        JobStatusView,
        JobWorkflowInput,
        RouteOutcome,
        RouteRequest,
        SubmitInput,
        SubmitOutput,
        TransitionInput,
        UsageInput,
        UsageOutput,
        WatchInput,
        WatchOutput,
    )
    from virtengine_hpc.states import JobState, LifecycleEvent, lifecycle_event, transition_path

SA_STATE = SearchAttributeKey.for_keyword("VeJobState")
SA_CLUSTER = SearchAttributeKey.for_keyword("VeClusterId")
SA_SCHEDULER_JOB = SearchAttributeKey.for_keyword("VeSchedulerJobId")
SA_TENANT = SearchAttributeKey.for_keyword("VeTenant")
SA_TEMPLATE = SearchAttributeKey.for_keyword("VeTemplate")
SEARCH_ATTRIBUTES = (SA_STATE, SA_CLUSTER, SA_SCHEDULER_JOB, SA_TENANT, SA_TEMPLATE)

# Usage reports ride on the watch activity (one activity per report cycle instead of two).
PATCH_USAGE_IN_WATCH = "usage-report-in-watch"
# Short activities heartbeat every 2 s while they wait on the scheduler; a dead worker is noticed within this.
SHORT_HEARTBEAT = timedelta(seconds=10)
PATCH_MULTI_CLUSTER = "multi-cluster-task-queues"
"""Since 0.2: a job routed to another cluster runs its scheduler activities on that cluster's task queue."""
PATCH_RECOVER_SUBMISSION = "recover-failed-submission"
"""A job whose submit attempts all failed without a refusal is looked up before it is failed, and adopted if one
of the attempts created it (the load benchmark found jobs failed on chain while they ran)."""
_NON_RETRYABLE = [
    "ValidationError",
    "ConfigError",
    "SubmissionRejected",
    "SecurityError",
    "IllegalTransition",
]


def initial_search_attributes(inp: JobWorkflowInput) -> TypedSearchAttributes:
    """Search attributes set when the poller starts the workflow (no secrets: ids and states only)."""
    pairs: list[SearchAttributePair[str]] = [
        SearchAttributePair(SA_STATE, JobState.PENDING.value),
        SearchAttributePair(SA_CLUSTER, inp.cluster_id),
        SearchAttributePair(SA_TENANT, inp.job.tenant),
        SearchAttributePair(SA_TEMPLATE, inp.job.template_id or "script"),
    ]
    return TypedSearchAttributes(pairs)


@workflow.defn(name=JOB_WORKFLOW_NAME)
class HPCJobWorkflow:
    @workflow.init
    def __init__(self, inp: JobWorkflowInput) -> None:
        self.inp = inp
        self.job = inp.job
        self.settings = inp.settings
        self.c: Carried = inp.carried or Carried(state=JobState.PENDING, cluster_id=inp.cluster_id)
        self.final_record_id: str | None = None
        self.charged: str | None = None
        self.refunded: str | None = None

    # ---- handlers -----------------------------------------------------------------------------------------------

    @workflow.query
    def status(self) -> JobStatusView:
        return JobStatusView(
            job_id=self.job.job_id,
            state=self.c.state,
            cluster_id=self.c.cluster_id,
            scheduler_job_id=self.c.scheduler_job_id,
            message=self.c.status_message,
            exit_code=self.c.exit_code,
            usage_records=self.c.next_sequence - 1,
            cancel_requested=self.c.cancel_requested,
            submitted_at=self.c.submitted_at,
            started_at=self.c.started_at,
        )

    @workflow.signal
    def cancel(self, request: CancelRequest) -> None:
        self._request_cancel(request)

    @workflow.update
    def request_cancel(self, request: CancelRequest) -> JobStatusView:
        self._request_cancel(request)
        return self.status()

    @request_cancel.validator
    def _validate_cancel(self, request: CancelRequest) -> None:
        if self.c.state.final:
            raise ApplicationError(
                f"job {self.job.job_id} already ended ({self.c.state.value})", type="JobEnded"
            )

    def _request_cancel(self, request: CancelRequest) -> None:
        if not self.c.state.final and not self.c.cancel_requested:
            self.c = self.c.model_copy(update={"cancel_requested": True, "cancel_reason": request.reason})

    # ---- main ---------------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: JobWorkflowInput) -> JobResult:
        if self.c.scheduler_job_id is None and not self.c.state.final:
            await self._route_and_submit()
        while not self.c.state.final:
            await self._watch_once()
            if not self.c.state.final and self._history_is_long():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(self.inp.model_copy(update={"carried": self.c}))
        await workflow.wait_condition(workflow.all_handlers_finished)
        return JobResult(
            job_id=self.job.job_id,
            state=self.c.state,
            message=self.c.status_message,
            exit_code=self.c.exit_code,
            scheduler_job_id=self.c.scheduler_job_id,
            usage_records=self.c.next_sequence - 1,
            final_record_id=self.final_record_id,
            charged=self.charged,
            refunded=self.refunded,
        )

    async def _route_and_submit(self) -> None:
        if self.c.cancel_requested:
            await self._finish(JobState.CANCELLED, self.c.cancel_reason)
            return
        outcome: RouteOutcome = await workflow.execute_activity(
            "route_job",
            RouteRequest(job=self.job, cluster_id=self.c.cluster_id, workflow_id=workflow.info().workflow_id),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=self._retry(unlimited=True),
            result_type=RouteOutcome,
        )
        if not outcome.accepted:
            await self._finish(JobState.FAILED, f"{outcome.code}: {outcome.message}")
            return
        if outcome.cluster_id != self.c.cluster_id:
            self.c = self.c.model_copy(update={"cluster_id": outcome.cluster_id})
            self._follow_cluster()
        if self.c.cancel_requested:
            await self._finish(JobState.CANCELLED, self.c.cancel_reason)
            return
        try:
            submitted: SubmitOutput = await workflow.execute_activity(
                "submit_job",
                SubmitInput(
                    workflow_id=workflow.info().workflow_id,
                    job=self.job,
                    cluster_id=self.c.cluster_id,
                    partition=outcome.partition,
                    body=outcome.body,
                    max_attempts=self.settings.retry.max_retries + 1,
                    exclusive=outcome.exclusive,
                ),
                task_queue=self.c.task_queue,
                start_to_close_timeout=timedelta(seconds=300),
                heartbeat_timeout=SHORT_HEARTBEAT,
                retry_policy=self._retry(),
                result_type=SubmitOutput,
            )
        except ActivityError as err:
            recovered = await self._recover_submission(err)
            if recovered is None:
                await self._finish(JobState.FAILED, f"submission failed: {_cause(err)}")
                return
            submitted = recovered
        self.c = self.c.model_copy(
            update={"scheduler_job_id": submitted.scheduler_job_id, "submitted_at": workflow.now()}
        )
        workflow.upsert_search_attributes([SA_SCHEDULER_JOB.value_set(submitted.scheduler_job_id)])
        await self._transition(JobState.QUEUED, LifecycleEvent.SUBMITTED, "accepted by the scheduler")

    async def _recover_submission(self, err: ActivityError) -> SubmitOutput | None:
        """The scheduler job one of the failed submit attempts created, if any.

        An attempt that timed out (its heartbeats lost by an overloaded server) or whose answer was lost may have
        created the job; failing the job then leaves it running on the cluster, unwatched and unbilled, while
        the chain refunds the tenant. Unless the scheduler refused the job outright (a definitive, non-retryable
        error: nothing was created), look it up, retrying for as long as the scheduler cannot answer, and adopt
        what carries this workflow's id.
        """
        if _refused(err) or not workflow.patched(PATCH_RECOVER_SUBMISSION):
            return None
        found: FindOutput = await workflow.execute_activity(
            "find_job",
            FindInput(
                workflow_id=workflow.info().workflow_id, job_id=self.job.job_id, cluster_id=self.c.cluster_id
            ),
            task_queue=self.c.task_queue,
            start_to_close_timeout=timedelta(seconds=300),
            heartbeat_timeout=SHORT_HEARTBEAT,
            retry_policy=self._retry(unlimited=True),
            result_type=FindOutput,
        )
        if found.scheduler_job_id is None:
            return None
        return SubmitOutput(scheduler_job_id=found.scheduler_job_id, adopted=True)

    def _follow_cluster(self) -> None:
        """Routing moved the job to another cluster: send its scheduler activities (submit, watch, cancel, usage)
        to that cluster's task queue, where the workers that reach its scheduler listen. Route, transitions and
        workflow tasks stay on the workflow's own queue (they need only the chain).

        Workflows that started before 0.2 ran everything on their own queue; ``workflow.patched`` keeps their
        histories replaying (tests/test_replay.py).
        """
        if not workflow.patched(PATCH_MULTI_CLUSTER):
            return
        queue = self.settings.task_queues.get(self.c.cluster_id)
        if queue == workflow.info().task_queue:
            queue = None
        self.c = self.c.model_copy(update={"task_queue": queue})
        workflow.upsert_search_attributes([SA_CLUSTER.value_set(self.c.cluster_id)])

    async def _watch_once(self) -> None:
        assert self.c.scheduler_job_id is not None
        if self.c.cancel_requested and not self.c.cancel_sent:
            await self._send_cancel(self.c.cancel_reason)
            if self.c.state.final:
                return
        now = workflow.now()
        deadline = self._deadline()
        if deadline is not None and now >= deadline:
            await self._enforce_deadline()
            return
        return_by = now + timedelta(seconds=self.settings.max_watch_seconds)
        due = self._report_due()
        report: UsageInput | None = None
        if due is not None:
            if now >= due:
                await self._report_usage(final=False)
                return
            return_by = min(return_by, due)
            if (deadline is None or due <= deadline) and workflow.patched(PATCH_USAGE_IN_WATCH):
                report = self._usage_input(final=False)
        if deadline is not None:
            return_by = min(return_by, deadline)
        request = WatchInput(
            job_id=self.job.job_id,
            cluster_id=self.c.cluster_id,
            scheduler_job_id=self.c.scheduler_job_id,
            last_state=self.c.state,
            return_by=return_by,
            poll_interval_seconds=self.settings.poll_interval_seconds,
            vanished_grace_seconds=self.settings.vanished_grace_seconds,
            missing_since=self.c.missing_since,
            report=report,
        )
        poll = self.settings.poll_interval_seconds
        handle = workflow.start_activity(
            "watch_job",
            request,
            task_queue=self.c.task_queue,
            start_to_close_timeout=(return_by - now) + timedelta(seconds=4 * poll + 120),
            heartbeat_timeout=timedelta(seconds=max(10.0, 4 * poll)),
            retry_policy=self._retry(unlimited=True),
            result_type=WatchOutput,
        )
        await workflow.wait_condition(
            lambda: handle.done() or (self.c.cancel_requested and not self.c.cancel_sent)
        )
        if not handle.done():
            handle.cancel()
            try:
                await handle
            except (ActivityError, BaseException):  # cancelled watch: nothing to apply
                return
            return
        result: WatchOutput = await handle
        if result.missing_since != self.c.missing_since:
            self.c = self.c.model_copy(update={"missing_since": result.missing_since})
        if result.usage is not None:
            self._record_sent(result.usage)
        if result.changed:
            await self._apply(result.status)

    async def _apply(self, status: NativeStatus) -> None:
        if not status.found:
            await self._finish(
                JobState.FAILED,
                f"job {self.c.scheduler_job_id} vanished: the scheduler has no record of it in its queue or accounting",
                partial=True,
            )
            return
        target = status.state
        message = status.reason or status.native_state
        if target.final and self.c.forced_final is not None:
            target, message = self.c.forced_final, self.c.forced_message
        elif target == JobState.CANCELLED and self.c.cancel_requested:
            message = self.c.cancel_reason or message
        path = transition_path(self.c.state, target)
        if self.c.started_at is None and (status.start_time is not None or JobState.RUNNING in path):
            # The job ran (perhaps between two polls): its usage starts when the scheduler started it.
            started = status.start_time or workflow.now()
            self.c = self.c.model_copy(update={"started_at": started, "last_report_at": started})
        for step in path:
            if step.final:
                self.c = self.c.model_copy(update={"exit_code": status.exit_code})
                await self._finish(step, message)
                return
            await self._transition(step, lifecycle_event(self.c.state, step), message)

    async def _finish(self, final: JobState, message: str, *, partial: bool = False) -> None:
        """Close the job: final usage record and accounting (if it ran), then the terminal status.

        ``partial``: the scheduler cannot give final accounting (the job vanished, or we closed it at a deadline),
        so the last reading closes the records.
        """
        if (
            self.c.scheduler_job_id is not None
            and self.c.started_at is not None
            and self.settings.usage_enabled
        ):
            await self._report_usage(final=True, final_state=final, partial=partial)
        await self._transition(final, lifecycle_event(self.c.state, final), message)

    async def _transition(self, new: JobState, event: LifecycleEvent | None, message: str) -> None:
        old = self.c.state
        await workflow.execute_activity(
            "report_transition",
            TransitionInput(
                job_id=self.job.job_id,
                cluster_id=self.c.cluster_id,
                old_state=old,
                new_state=new,
                event=event,
                message=message,
                exit_code=self.c.exit_code if new.final else None,
                scheduler_job_id=self.c.scheduler_job_id,
                tenant=self.job.tenant,
            ),
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=self._retry(unlimited=True),
        )
        self.c = self.c.model_copy(update={"state": new, "status_message": message})
        workflow.upsert_search_attributes([SA_STATE.value_set(new.value)])

    async def _report_usage(
        self, *, final: bool, final_state: JobState | None = None, partial: bool = False
    ) -> None:
        unlimited = final or self.settings.retry_on_failure
        try:
            out: UsageOutput = await workflow.execute_activity(
                "report_usage",
                self._usage_input(final=final, final_state=final_state, partial=partial),
                task_queue=self.c.task_queue,
                start_to_close_timeout=timedelta(seconds=300),
                heartbeat_timeout=SHORT_HEARTBEAT,
                retry_policy=self._retry(unlimited=unlimited),
                result_type=UsageOutput,
            )
        except ActivityError:
            # retry_on_failure is off and the attempts ran out: the next record covers this period too.
            self.c = self.c.model_copy(update={"last_report_at": workflow.now()})
            return
        self._record_sent(out)
        if final:
            self.final_record_id = out.record_id
            self.charged, self.refunded = out.charged, out.refunded

    def _usage_input(
        self, *, final: bool, final_state: JobState | None = None, partial: bool = False
    ) -> UsageInput:
        assert self.c.scheduler_job_id is not None
        unlimited = final or self.settings.retry_on_failure
        return UsageInput(
            job=self.job,
            cluster_id=self.c.cluster_id,
            scheduler_job_id=self.c.scheduler_job_id,
            sequence=self.c.next_sequence,
            period_start=self.c.last_report_at or self.c.started_at or workflow.now(),
            previous_cumulative=self.c.last_cumulative,
            job_state=final_state or self.c.state,
            is_final=final,
            report_accounting=final,
            accept_partial=partial,
            max_attempts=0 if unlimited else self.settings.retry.max_retries + 1,
        )

    def _record_sent(self, out: UsageOutput) -> None:
        """The chain holds record ``next_sequence``: advance the sequence and the cumulative reading."""
        self.c = self.c.model_copy(
            update={
                "next_sequence": self.c.next_sequence + 1,
                "last_cumulative": out.cumulative,
                "last_report_at": out.period_end,
            }
        )

    async def _send_cancel(self, reason: str) -> None:
        assert self.c.scheduler_job_id is not None
        try:
            await workflow.execute_activity(
                "cancel_job",
                CancelInput(
                    job_id=self.job.job_id,
                    cluster_id=self.c.cluster_id,
                    scheduler_job_id=self.c.scheduler_job_id,
                    reason=reason,
                ),
                task_queue=self.c.task_queue,
                start_to_close_timeout=timedelta(seconds=120),
                heartbeat_timeout=SHORT_HEARTBEAT,
                retry_policy=self._retry(),
            )
        except ActivityError as err:
            workflow.logger.warning("cancel of %s failed, will retry: %s", self.job.job_id, _cause(err))
            return
        self.c = self.c.model_copy(update={"cancel_sent": True})

    async def _enforce_deadline(self) -> None:
        grace = self.c.deadline_grace_until
        if grace is not None and workflow.now() >= grace:
            # Cancelled at the deadline, and the scheduler still has not said it ended: close it ourselves.
            await self._finish(JobState.TIMEOUT, self.c.forced_message, partial=True)
            return
        if self.c.started_at is None:
            why = (
                f"not started within job_timeout_default ({self.settings.job_timeout_default_seconds:.0f} s)"
            )
        else:
            why = f"ran past its walltime of {self.job.walltime_seconds} s; cancelled by the provider"
        self.c = self.c.model_copy(update={"forced_final": JobState.TIMEOUT, "forced_message": why})
        if not self.c.cancel_sent:
            self.c = self.c.model_copy(update={"cancel_requested": True, "cancel_reason": why})
            await self._send_cancel(why)
        if self.c.cancel_sent:
            # The scheduler will report the job cancelled; give it a few polls, then close it as timed out.
            grace = workflow.now() + timedelta(seconds=4 * self.settings.poll_interval_seconds + 30)
            self.c = self.c.model_copy(update={"deadline_grace_until": grace})

    def _deadline(self) -> datetime | None:
        if self.c.deadline_grace_until is not None:
            return self.c.deadline_grace_until
        if self.c.started_at is not None:
            return self.c.started_at + timedelta(
                seconds=self.job.walltime_seconds + self.settings.walltime_grace_seconds
            )
        if self.c.submitted_at is not None:
            return self.c.submitted_at + timedelta(seconds=self.settings.job_timeout_default_seconds)
        return None

    def _report_due(self) -> datetime | None:
        if not self.settings.usage_enabled or self.c.state != JobState.RUNNING:
            return None
        last = self.c.last_report_at or self.c.started_at
        return None if last is None else last + timedelta(seconds=self.settings.report_interval_seconds)

    def _history_is_long(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() > self.settings.continue_as_new_after_events
        )

    def _retry(self, *, unlimited: bool = False) -> RetryPolicy:
        r = self.settings.retry
        return RetryPolicy(
            initial_interval=timedelta(seconds=r.initial_backoff_seconds),
            maximum_interval=timedelta(seconds=r.max_backoff_seconds),
            backoff_coefficient=r.backoff_multiplier,
            maximum_attempts=0 if unlimited else r.max_retries + 1,
            non_retryable_error_types=_NON_RETRYABLE,
        )


def _refused(err: ActivityError) -> bool:
    """True when the activity failed with a non-retryable domain error (the scheduler refused the job, bad
    input): then no attempt can have created a job."""
    cause = err.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return isinstance(cause, ApplicationError) and cause.non_retryable and cause.type in _NON_RETRYABLE


def _cause(err: ActivityError) -> str:
    cause = err.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return str(cause or err)
