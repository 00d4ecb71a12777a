"""HPCJobWorkflow: one durable workflow per on-chain HPC job (workflow id = chain job id).

route (validate + routing enforcement) → submit → watch … (usage record every ``report_interval`` while running)
→ final usage record (``is_final``) + accounting → terminal status.

Only orchestration lives here (invariant 1 in docs/architecture.md): the clock is ``workflow.now()``, every side effect is an
activity, and everything the workflow needs arrives in its input. A submitted job waits for its cluster's monitor
(``workflows/cluster_monitor.py``) to signal a change, or for its own timer when a report or deadline is due, so
history grows by a few events per report period (invariant 3); a run that began before the monitor, or with it
turned off, waits inside a heartbeating ``watch_job`` activity instead. The workflow continues as new when
Temporal suggests it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
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
        WATCH_WITH_MONITOR,
    )
    from virtengine_hpc.errors import NON_RETRYABLE_TYPES
    from virtengine_hpc.messages import (
        JOB_WORKFLOW_NAME,
        PARKED,
        CancelInput,
        CancelRequest,
        Carried,
        FindInput,
        FindOutput,
        JobResult,
        JobStatusView,
        JobWorkflowInput,
        MonitorSettings,
        Observation,
        ParkInput,
        PeriodDue,
        PeriodRecorded,
        RecoverInput,
        RecoverOutput,
        Recovery,
        RetryRequest,
        RouteOutcome,
        RouteRequest,
        SubmitInput,
        SubmitOutput,
        SubmitReport,
        TransitionInput,
        UsageInput,
        UsageOutput,
        WatchEntry,
        WatchInput,
        WatchOutput,
        WatchRegistration,
    )
    from virtengine_hpc.scheduling import NativeStatus
    from virtengine_hpc.states import JobState, LifecycleEvent, lifecycle_event, transition_path
    from virtengine_hpc.usage import next_report_due

SA_STATE = SearchAttributeKey.for_keyword("VeJobState")
SA_CLUSTER = SearchAttributeKey.for_keyword("VeClusterId")
SA_SCHEDULER_JOB = SearchAttributeKey.for_keyword("VeSchedulerJobId")
SA_TENANT = SearchAttributeKey.for_keyword("VeTenant")
SA_TEMPLATE = SearchAttributeKey.for_keyword("VeTemplate")
SEARCH_ATTRIBUTES = (SA_STATE, SA_CLUSTER, SA_SCHEDULER_JOB, SA_TENANT, SA_TEMPLATE)

# Usage reports ride on the watch activity (one activity per report cycle instead of two).
PATCH_USAGE_IN_WATCH = "usage-report-in-watch"
PATCH_MULTI_CLUSTER = "multi-cluster-task-queues"
"""Since 0.2: a job routed to another cluster runs its scheduler activities on that cluster's task queue."""
PATCH_RECOVER_SUBMISSION = "recover-failed-submission"
"""A job whose submit attempts all failed without a refusal is looked up before it is failed, and adopted if one
of the attempts created it (the load benchmark found jobs failed on chain while they ran)."""
PATCH_NO_JOB_LEFT_BEHIND = "no-job-left-behind"
"""Since 0.3: every exit of a job goes through its finish path. A Temporal cancel (Web UI, ``temporal workflow
cancel``) is a provider cancel; a step that fails for good closes the job as failed instead of failing the
workflow; cancel retries back off; a job whose final accounting or terminal report cannot be sent is parked for an
operator; walltime counts only running time; a queue wait has no limit unless ``max_queue_wait`` is set; final
accounting is sent even with usage reporting off. Decided once per run, so runs that began before it replay."""
PATCH_UPGRADE_ON_CONTINUE_AS_NEW = "upgrade-on-continue-as-new"
"""Since 0.3: a job is pinned to the build of the workers that started it; when another build becomes current, the
job continues as new at its next step and the new run starts on that build, so old builds drain."""
PATCH_STARTED_BEFORE_FINAL = "started-before-final"
"""A job the scheduler started that a poll first saw ended (it exited at once: queued, then failed) goes through
running on the way, so the ``started`` callback fires and its final usage record is sent, whatever the polls saw."""
PATCH_CLUSTER_MONITOR = "cluster-monitor"
"""Since 0.4: a submitted job waits for its cluster's monitor to signal a change (one status query per cluster and
poll interval, whatever the number of workers) or for its own timer (report due, deadline, a safety-net check),
instead of holding a heartbeating watch activity. Decided once per run: a run that began before watches the old way.
"""
PATCH_TENANT_REFUSED = "tenant-account-refused"
"""A submit refused for the tenant's account (``TenantAccountError``: none, or a privileged one) created nothing and
cannot succeed until the operator changes ``hpc.tenants``: the job fails at once instead of first looking for a job
that cannot exist, a lookup that retries for as long as the scheduler is unreachable."""
PATCH_PARKED_MOVES = "continue-as-new-while-parked"
"""A parked job wakes every ``max_watch_seconds`` and continues as new when its history is long or another build
became current (the new run waits parked the same way): a job waiting for an operator pinned its build for ever."""
PATCH_FAILED_REPORT_KEEPS_PERIOD = "failed-report-keeps-period"
"""A period report that failed for good leaves the period where the last record ended and waits an interval before
the next try: it moved the next period's start to the moment of the failure, so the next record began after a gap
it billed nonetheless (``usage verify`` failed the job: a record not starting where the one before ended)."""
PATCH_RESET_RUN_LOOKS_FIRST = "reset-run-submit-looks-first"
"""A run made by a reset (the Web UI's Reset, ``temporal workflow reset``) to before its submit finished submits
as a retry does, looking the job up first: the run it replaced may have submitted it, and a first attempt's
submission without a lookup started the tenant's job a second time."""
PATCH_ENDED_ON_CHAIN = "route-ended-on-chain"
"""A job that routing finds already ended on chain (a reset run of a closed workflow) ends its workflow with the
chain's state and does nothing else: it was submitted again and its reports, refused, parked it for ever."""
PATCH_WALLTIME_ACROSS_REQUEUES = "walltime-across-requeues"
"""A requeued job goes on with the walltime its earlier runs left: the count started again at every requeue, so a
job that requeued itself (``scontrol requeue $SLURM_JOB_ID``) before its limit ran for ever, every run past its
escrow unpaid (settlement never charges more than the escrow)."""
PATCH_RESUMED_PARK_FINISHES = "resumed-park-cancel-finishes"
"""A cancel of a job parked on its finish path in a run that continued a parked one goes on finishing it: it went
back to the drive loop, whose watch sent a period record after the final one already on chain, and the job never
settled (every final record after it refused)."""
PATCH_MONITOR_SENDS_PERIODS = "monitor-sends-period-records"
"""A running job's period usage records are sent by its cluster monitor's round, which signals each one: the job
records it from the signal and keeps no report timer (a signal and a workflow task a period instead of a timer, a
workflow task and a local activity), and reports itself only when its monitor has sent nothing for
``max_watch_seconds``. Asked at a job's first period report of a run: a run that began before it reports as before.
"""
PATCH_LOCAL_CHAIN_STEPS = "local-chain-steps"
"""Since 0.4: routing, lifecycle reports and the final usage record run as local activities (one history event each
instead of six), the submission reports the job queued itself, and a run records this one marker where it recorded
``PATCH_NO_JOB_LEFT_BEHIND`` and ``PATCH_CLUSTER_MONITOR`` (both implied): a short job's history halves. Decided
once per run, so runs that began before it replay as they ran."""
PATCH_MONITOR_SENDS_FIRST_PERIOD = "monitor-sends-first-period"
"""A running job registers with its cluster monitor for its period records when it reports running, so the monitor
sends the first record of a run too (4 history events a period, where the job's own first record cost 8: timer,
workflow task, a patch marker and its upsert, the local activity's marker, the next timer); a run records this one
marker where it recorded ``PATCH_LOCAL_CHAIN_STEPS`` (implied, with ``PATCH_MONITOR_SENDS_PERIODS``). Decided once
per run, so runs that began before it replay as they ran."""
PATCH_CHECK_MOVES_WITH_RECORDS = "safety-check-moves-with-records"
"""A served job's safety-net check that its monitor's records have since put off is moved in the workflow task of
the record that finds it about to fire (a timer cancelled and started, 2 history events) instead of firing and
starting again (5 events an hour, which kept a report period above 4 events on average)."""
LOCAL_STEP_TIMEOUT = timedelta(seconds=10)
LOCAL_STEP_ATTEMPTS = 3
"""A local step's attempts (each at most ``LOCAL_STEP_TIMEOUT``) before it runs as an ordinary activity: a local
activity keeps its workflow task open, extended every 8 s at three events each, so a slow or unreachable chain would
grow the history for as long as it lasts, where an ordinary activity costs six events and its retries none. (A
local activity's schedule-to-close timeout does not bound its retries on this SDK: counted attempts do.)"""
CANCEL_BACKOFF_CAP = timedelta(minutes=5)
_MIN_TIMER = timedelta(milliseconds=100)
_DONE = object()
"""What ``_guarded`` returns for a step that ran to its end."""
_ACCEPTED = "accepted by the scheduler"
_NON_RETRYABLE = list(NON_RETRYABLE_TYPES)
_REFUSED_BEFORE_TENANT_PATCH = frozenset(_NON_RETRYABLE) - {"TenantAccountError"}


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
        self.v2 = False  # PATCH_NO_JOB_LEFT_BEHIND, decided when the run starts
        self.local = False  # PATCH_LOCAL_CHAIN_STEPS, decided when the run starts
        self.first_by_monitor = False  # PATCH_MONITOR_SENDS_FIRST_PERIOD, decided when the run starts
        self.by_monitor = False  # PATCH_CLUSTER_MONITOR, decided when the run starts
        self.observed: NativeStatus | None = None  # the monitor's latest news, not yet applied
        self._timer: asyncio.Future[None] | None = None
        self._timer_at: datetime | None = None
        self._timer_checks = False  # the timer is for the safety-net check (nothing earlier to wake for)
        self._moves_check: bool | None = None  # PATCH_CHECK_MOVES_WITH_RECORDS, asked at the first move
        # When this run last tried a period record, and last registered with its monitor or heard from it.
        self._report_tried_at: datetime | None = None
        self._report_failed_at: datetime | None = None
        self._contact_at: datetime | None = None
        # Its monitor sends the job's period records (c.reports_by_monitor) but went quiet: the job sends its own
        # until the monitor's next record arrives.
        self._fallen_back = False
        self._stays_on_build = False  # another build is current, and this run does not move to it
        # (workflow.now() when a period report's local activity answered, the worker's clock at that moment)
        self._answered: tuple[datetime, datetime] | None = None
        self.recovered = False  # a recovery run has found where the job stands
        if inp.recovery is not None and inp.carried is None:
            rec = inp.recovery
            self.c = Carried(
                state=rec.chain_state,
                cluster_id=rec.cluster_id or inp.cluster_id,
                scheduler_job_id=rec.scheduler_job_id,
                cancel_requested=True,
                cancel_reason=f"closed by the reconciler: {rec.reason}"[:512],
            )

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
            parked=self.c.parked,
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

    @workflow.update
    def retry_parked(self, request: RetryRequest) -> JobStatusView:
        """An operator fixed what parked the job (``jobs retry JOB``): try the failed step again."""
        self.c = self.c.model_copy(update={"parked": None})
        return self.status()

    @retry_parked.validator
    def _validate_retry(self, request: RetryRequest) -> None:
        if self.c.parked is None:
            raise ApplicationError(
                f"job {self.job.job_id} is not parked ({self.c.state.value})", type="NotParked"
            )

    @workflow.signal(name="observe")
    def observe(self, observation: Observation) -> None:
        """The cluster's monitor saw the job's state change (only the newest news matters)."""
        self.observed = observation.status

    @workflow.signal(name="period_recorded")
    def period_recorded(self, recorded: PeriodRecorded) -> None:
        """The cluster's monitor sent the job's next period record (or found it on chain): the job records it. A
        record the job already holds (its own report got there first, a round that was retried) changes nothing."""
        out = recorded.usage
        if out.record_id is None or out.sequence != self.c.next_sequence or self.c.final_sent:
            return
        self._record_sent(out)
        self._fallen_back = False
        self._contact_at = workflow.now()

    @workflow.query(name="period_due")
    def period_due(self) -> PeriodDue:
        """The period record the job's monitor is to send for it, and when it is due (the monitor sends nothing
        earlier); none while the job does not run, has begun to finish, or keeps its own report timer."""
        interval = self.settings.report_interval_seconds
        due = self._report_due()
        serves = self.c.reports_by_monitor and self.c.scheduler_job_id is not None
        if not serves or due is None or self.c.final_state is not None or self.c.parked is not None:
            return PeriodDue(interval_seconds=interval)
        return PeriodDue(
            report=self._usage_input(final=False),
            due_at=due,
            interval_seconds=interval,
            started_at=self.c.started_at,
        )

    def _request_cancel(self, request: CancelRequest) -> None:
        if not self.c.state.final and not self.c.cancel_requested:
            self.c = self.c.model_copy(update={"cancel_requested": True, "cancel_reason": request.reason})

    # ---- main ---------------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: JobWorkflowInput) -> JobResult:
        # One marker for a new run: it implies the patches before it (asked, in this order, only of a run that
        # began before it, whose replay finds their markers as they were recorded).
        self.first_by_monitor = workflow.patched(PATCH_MONITOR_SENDS_FIRST_PERIOD)
        self.local = self.first_by_monitor or workflow.patched(PATCH_LOCAL_CHAIN_STEPS)
        self.v2 = self.local or workflow.patched(PATCH_NO_JOB_LEFT_BEHIND)
        # The monitor is the default (hpc.job_service.cluster_monitor); a job started with it off takes the
        # watch-activity path, as before the monitor existed, and so does the replay of a run that began before
        # it: whichever way a run began, it keeps.
        self.by_monitor = (
            self.v2
            and self.settings.cluster_monitor
            and (self.local or workflow.patched(PATCH_CLUSTER_MONITOR))
        )
        if self.v2:
            await self._drive_to_the_end()
        else:
            await self._drive()
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

    async def _drive(self) -> None:
        if self.c.scheduler_job_id is None and not self.c.state.final:
            await self._route_and_submit()
        while not self.c.state.final:
            await self._watch_once()
            if self.observed is not None:
                continue  # news from the monitor first: a new run would not hear it again
            if not self.c.state.final and (self._history_is_long() or self._new_build_is_current()):
                await self._continue_as_new()

    async def _continue_as_new(self) -> None:
        await workflow.wait_condition(workflow.all_handlers_finished)
        # The next run starts on the deployment's current build (this one stays pinned to its own).
        workflow.continue_as_new(
            self.inp.model_copy(update={"carried": self.c}),
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )

    async def _drive_to_the_end(self) -> None:
        """Drive the job to a final state on chain, whatever happens on the way.

        A Temporal cancel (the Web UI's Cancel, ``temporal workflow cancel``) arrives as ``CancelledError`` (or as
        the cancelled activity the workflow was waiting on): it becomes a provider cancel (the scheduler job is
        cancelled, usage settled, the chain told), and the workflow then completes. A step that fails for good (a
        non-retryable error) closes the job as failed the same way; a second failure parks it for an operator.
        Every step, the closing of a failed one included, runs under the same guard, so a cancel can arrive at
        any moment. Only ``continue_as_new`` leaves early.
        """
        while True:
            outcome = await self._guarded(self._recover_then_drive)
            if outcome is _DONE:
                return
            if isinstance(outcome, ActivityError):
                await self._guarded(functools.partial(self._close_after_error, outcome))

    async def _guarded(self, step: Callable[[], Awaitable[None]]) -> object:
        """Run a step: ``_DONE`` when it ran to its end, the ``ActivityError`` that failed it for good, or None
        when a workflow cancel interrupted it (then recorded as a provider cancel)."""
        try:
            await step()
            return _DONE
        except asyncio.CancelledError:
            self._on_workflow_cancel()
        except ActivityError as err:
            if not _is_cancel(err):
                return err
            self._on_workflow_cancel()  # the workflow cancel reached the activity it was waiting on
        return None

    async def _recover_then_drive(self) -> None:
        if self.inp.recovery is not None and self.inp.carried is None and not self.recovered:
            await self._begin_recovery(self.inp.recovery)
            self.recovered = True
        if self.c.parked is not None:
            # This run continued a parked one (onto a fresh history or a new build): it waits as that one did.
            await self._resume_parked(self.c.parked)
            if self.c.final_state is not None and not self.c.state.final:
                # It was parked while finishing: finish as decided then (a watch could report usage again).
                await self._finish(self.c.final_state, self.c.final_message, partial=self.c.final_partial)
        await self._drive()

    async def _resume_parked(self, why: str) -> None:
        """Wait parked as the run this one continued did. A cancel while it was parked on its finish path is a
        cancel of that finish path, as in the run it continued (``_until_done``): the job goes on finishing as
        decided, and only a cancel of a job parked elsewhere goes back to the drive loop."""
        try:
            await self._park(why, resumed=True)
        except asyncio.CancelledError:
            if self.c.final_state is None or not workflow.patched(PATCH_RESUMED_PARK_FINISHES):
                raise
            self._on_workflow_cancel()

    def _on_workflow_cancel(self) -> None:
        """A Temporal cancel is a provider cancel: the scheduler job is cancelled and the job finishes as usual."""
        if self.c.state.final:
            return
        self._request_cancel(CancelRequest(reason="cancelled by the operator (Temporal workflow cancel)"))
        if not self.c.cancel_sent:
            # A new cancel goes out even if one is waiting for its backoff: the operator asked now.
            self.c = self.c.model_copy(update={"cancel_retry_at": None})

    async def _close_after_error(self, err: ActivityError) -> None:
        """A step failed for good: close the job as failed (stopping its scheduler job); park on a second one."""
        why = f"{_activity_of(err)} failed: {_cause(err)}"[:1000]
        if self.c.closing_error:
            await self._park(why)
            return
        workflow.logger.error("job %s: %s; closing it as failed", self.job.job_id, why)
        self.c = self.c.model_copy(
            update={
                "closing_error": why,
                "forced_final": JobState.FAILED,
                "forced_message": why,
                "cancel_requested": True,
                "cancel_reason": why,
                "cancel_retry_at": None,
            }
        )

    async def _begin_recovery(self, rec: Recovery) -> None:
        """This run only closes a job an earlier run left open (the reconciler started it): find its scheduler
        job and its usage so far, then cancel and finish it through the normal path."""
        if self.c.cluster_id != self.inp.cluster_id:
            self._follow_cluster()
        found: RecoverOutput = await workflow.execute_activity(
            RECOVER_JOB,
            RecoverInput(
                job_id=self.job.job_id,
                workflow_id=workflow.info().workflow_id,
                cluster_id=self.c.cluster_id,
                scheduler_job_id=rec.scheduler_job_id,
            ),
            task_queue=self.c.task_queue,
            start_to_close_timeout=timedelta(seconds=300),
            heartbeat_timeout=self._heartbeat_timeout(),
            retry_policy=self._retry(unlimited=True),
            result_type=RecoverOutput,
        )
        now = workflow.now()
        ran = (
            rec.chain_state in (JobState.RUNNING, JobState.SUSPENDED) or found.first_period_start is not None
        )
        started = (found.first_period_start or now) if ran else None
        update: dict[str, object] = {
            "scheduler_job_id": found.scheduler_job_id,
            "submitted_at": now if found.scheduler_job_id else None,
            "started_at": started,
            "last_report_at": found.last_period_end or started,
            "next_sequence": found.next_sequence,
            "last_cumulative": found.cumulative,
            "running_since": now if rec.chain_state == JobState.RUNNING else None,
        }
        if found.scheduler_lost:
            # The scheduler has no trace of the job the records name: watch it vanish (after the grace) and close
            # it with the usage already recorded, instead of cancelling what cannot be found.
            update |= {"cancel_requested": False, "cancel_reason": ""}
        self.c = self.c.model_copy(update=update)
        if found.scheduler_job_id is not None:
            workflow.upsert_search_attributes([SA_SCHEDULER_JOB.value_set(found.scheduler_job_id)])

    async def _park(self, why: str, *, resumed: bool = False) -> None:
        """Wait for an operator: the job cannot make progress on its own (alerted through ``VeJobState``).

        Ends when the operator retries (``retry_parked``) or cancels the workflow; either way the job leaves the
        parked state, and a cancel propagates to the caller. A job parked for long continues as new, still parked
        (``PATCH_PARKED_MOVES``); the run that resumes it (``resumed``) does not alert again.
        """
        self.c = self.c.model_copy(update={"parked": why})
        workflow.upsert_search_attributes([SA_STATE.value_set(PARKED)])
        moving = False
        try:
            if not resumed:
                await self._alert_parked(why)
            if workflow.patched(PATCH_PARKED_MOVES):
                moving = await self._wait_parked()
            else:
                await workflow.wait_condition(lambda: self.c.parked is None)
        finally:
            if not moving:
                self.c = self.c.model_copy(update={"parked": None})
                workflow.upsert_search_attributes([SA_STATE.value_set(self.c.state.value)])
        if moving:
            if self.observed is not None:  # news the new run would not hear again: it registers anew instead
                self.c = self.c.model_copy(update={"monitored": False})
            await self._continue_as_new()

    async def _wait_parked(self) -> bool:
        """Until the operator retries (False), or until the job should move to a fresh run (True): its history
        is long or another build became current. Nothing else wakes a parked job, so it looks every
        ``max_watch_seconds``, as a watch does."""
        every = timedelta(seconds=self.settings.max_watch_seconds)
        while True:
            try:
                await workflow.wait_condition(lambda: self.c.parked is None, timeout=every)
                return False
            except TimeoutError:
                if self._history_is_long() or self._new_build_is_current():
                    return True

    async def _alert_parked(self, why: str) -> None:
        try:
            await workflow.execute_activity(
                PARK_JOB,
                ParkInput(
                    job_id=self.job.job_id,
                    cluster_id=self.c.cluster_id,
                    state=self.c.state,
                    reason=why,
                    scheduler_job_id=self.c.scheduler_job_id,
                ),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=self._retry(unlimited=True),
            )
        except ActivityError as err:
            if _is_cancel(err):
                raise asyncio.CancelledError() from None
            raise

    async def _until_done(self, what: str, step: Callable[[], Awaitable[None]]) -> None:
        """Run a step of the finish path until it succeeds, parking the job after each failure for good.

        A workflow cancel meanwhile asks for what this path is doing already: the step is simply tried again.
        """
        while True:
            try:
                await step()
                return
            except asyncio.CancelledError:
                self._on_workflow_cancel()
                continue
            except ActivityError as err:
                if _is_cancel(err):
                    self._on_workflow_cancel()
                    continue
                why = f"{what} could not be sent: {_cause(err)}"[:1000]
            try:
                await self._park(why)
            except asyncio.CancelledError:
                self._on_workflow_cancel()

    async def _route_and_submit(self) -> None:
        if self.c.cancel_requested:
            await self._close_unsubmitted()
            return
        request = RouteRequest(
            job=self.job, cluster_id=self.c.cluster_id, workflow_id=workflow.info().workflow_id
        )
        outcome: RouteOutcome
        if self.local:
            outcome = await self._chain_step(
                ROUTE_JOB, request, timeout=timedelta(seconds=60), result_type=RouteOutcome
            )
        else:
            outcome = await workflow.execute_activity(
                ROUTE_JOB,
                request,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=self._retry(unlimited=True),
                result_type=RouteOutcome,
            )
        if not outcome.accepted:
            if self._ended_on_chain(outcome):
                return
            await self._finish(JobState.FAILED, f"{outcome.code}: {outcome.message}")
            return
        if outcome.cluster_id != self.c.cluster_id:
            self.c = self.c.model_copy(update={"cluster_id": outcome.cluster_id})
            self._follow_cluster()
        if self.c.cancel_requested:
            await self._close_unsubmitted()
            return
        if self.v2:
            self.c = self.c.model_copy(update={"submit_started": True})
        looked_up = False
        try:
            submitted: SubmitOutput = await workflow.execute_activity(
                SUBMIT_JOB,
                SubmitInput(
                    workflow_id=workflow.info().workflow_id,
                    job=self.job,
                    cluster_id=self.c.cluster_id,
                    partition=outcome.partition,
                    max_attempts=self.settings.retry.max_retries + 1,
                    look_first=self._replaces_a_run(),
                    report=self._queued_report(),
                ),
                task_queue=self.c.task_queue,
                start_to_close_timeout=timedelta(seconds=300),
                heartbeat_timeout=self._heartbeat_timeout(),
                retry_policy=self._retry(),
                result_type=SubmitOutput,
                # A cancelled submit may still be creating the job: wait until the attempt has really ended, so
                # the lookup that follows finds what it created.
                cancellation_type=(
                    ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
                    if self.v2
                    else ActivityCancellationType.TRY_CANCEL
                ),
            )
        except ActivityError as err:
            if self.v2 and _is_cancel(err):
                raise  # a workflow cancel during the submit: the caller cancels, looking the job up first
            recovered = await self._recover_submission(err)
            if recovered is None:
                await self._finish(JobState.FAILED, f"submission failed: {_cause(err)}")
                return
            submitted, looked_up = recovered, True
        if submitted.reported:  # (only asked for on the local path)
            self._adopt(submitted.scheduler_job_id, state=JobState.QUEUED)
            self._entered(self.c.state, JobState.QUEUED, _ACCEPTED, watched=self.by_monitor)
            return
        self._adopt(submitted.scheduler_job_id)
        # A submission that was to report it tried, and audited it first (one found by a lookup may not have).
        audited = self.local and not looked_up
        await self._transition(JobState.QUEUED, LifecycleEvent.SUBMITTED, _ACCEPTED, audited=audited)

    def _queued_report(self) -> SubmitReport | None:
        """What the submission reports once the scheduler has the job (on the local path): queued."""
        if not self.local:
            return None
        monitor = self._monitor_settings() if self.by_monitor else None
        return SubmitReport(
            old_state=self.c.state,
            event=LifecycleEvent.SUBMITTED,
            message=_ACCEPTED,
            tenant=self.job.tenant,
            monitor=monitor,
        )

    def _ended_on_chain(self, outcome: RouteOutcome) -> bool:
        """The job has already ended on chain: the workflow ends with the chain's state, reporting nothing."""
        final = outcome.chain_state
        if final is None or not final.final or not workflow.patched(PATCH_ENDED_ON_CHAIN):
            return False
        workflow.logger.warning("job %s: %s; ending the workflow", self.job.job_id, outcome.message)
        self.c = self.c.model_copy(update={"state": final, "status_message": outcome.message})
        workflow.upsert_search_attributes([SA_STATE.value_set(final.value)])
        return True

    @staticmethod
    def _replaces_a_run() -> bool:
        """This run was made by a reset: its id is not the one its history started under (a run started or
        continued as new has its own)."""
        info = workflow.info()
        return info.run_id != info.original_execution_run_id and workflow.patched(PATCH_RESET_RUN_LOOKS_FIRST)

    def _adopt(self, scheduler_job_id: str, *, state: JobState | None = None) -> None:
        """The job has its scheduler id (and, when the submission reported it, its new state: one upsert)."""
        self.c = self.c.model_copy(
            update={"scheduler_job_id": scheduler_job_id, "submitted_at": workflow.now()}
        )
        updates = [SA_SCHEDULER_JOB.value_set(scheduler_job_id)]
        if state is not None:
            updates.append(SA_STATE.value_set(state.value))
        workflow.upsert_search_attributes(updates)

    async def _close_unsubmitted(self) -> None:
        """Cancelled (or closing after an error) before the job had a scheduler id.

        A submit that was already under way may have created the job: look it up first; if it exists, the watch
        loop cancels it and finishes the job with its usage. Otherwise the job ends here, never having run.
        """
        if self.v2 and self.c.submit_started:
            found = await self._find_submitted()
            if found is None:
                # A scheduler call that cannot be interrupted (a command already sent) may still land: look again
                # once it has had the time to.
                await workflow.sleep(timedelta(seconds=max(10.0, 2 * self.settings.poll_interval_seconds)))
                found = await self._find_submitted()
            self.c = self.c.model_copy(update={"submit_started": False})
            if found is not None:
                self._adopt(found)
                return
        final = JobState.FAILED if self.c.closing_error else JobState.CANCELLED
        await self._finish(final, self.c.closing_error or self.c.cancel_reason)

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
        if _refused(err, also_tenant=True) and workflow.patched(PATCH_TENANT_REFUSED):
            return None
        found = await self._find_submitted()
        if found is None:
            return None
        return SubmitOutput(scheduler_job_id=found, adopted=True)

    async def _find_submitted(self) -> str | None:
        found: FindOutput = await workflow.execute_activity(
            FIND_JOB,
            FindInput(
                workflow_id=workflow.info().workflow_id, job_id=self.job.job_id, cluster_id=self.c.cluster_id
            ),
            task_queue=self.c.task_queue,
            start_to_close_timeout=timedelta(seconds=300),
            heartbeat_timeout=self._heartbeat_timeout(),
            retry_policy=self._retry(unlimited=True),
            result_type=FindOutput,
        )
        return found.scheduler_job_id

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
        if self._cancel_due():
            await self._send_cancel(self.c.cancel_reason)
            if self.c.state.final:
                return
        now = self._now()
        deadline = self._deadline()
        if deadline is not None and now >= deadline:
            await self._enforce_deadline()
            if not self.v2 or self.c.state.final or self.c.cancel_sent or self.c.cancel_retry_at is None:
                return
            deadline = None  # its cancel waits out a backoff: watch the job until then
        if self.by_monitor:
            await self._wait_for_monitor(now, deadline)
            return
        plan = self._watch_plan(now, deadline)
        if plan is None:
            await self._report_usage(final=False)
            return
        return_by, report = plan
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
            last_start_time=self.c.start_time if self.v2 else None,
        )
        poll = self.settings.poll_interval_seconds
        handle = workflow.start_activity(
            WATCH_JOB,
            request,
            task_queue=self.c.task_queue,
            start_to_close_timeout=(return_by - now) + timedelta(seconds=4 * poll + 120),
            heartbeat_timeout=max(self._heartbeat_timeout(), timedelta(seconds=4 * poll)),
            retry_policy=self._retry(unlimited=True),
            result_type=WatchOutput,
        )
        result = await self._await_watch(handle)
        if result is None:
            return
        if result.missing_since != self.c.missing_since:
            self.c = self.c.model_copy(update={"missing_since": result.missing_since})
        if result.usage is not None:
            self._record_sent(result.usage)
        if result.changed:
            await self._apply(result.status)

    async def _wait_for_monitor(self, now: datetime, deadline: datetime | None) -> None:
        """Wait for the monitor's news or for this job's next timer; apply what it brought."""
        if not self.c.monitored:
            await self._register_with_monitor()  # a run that continued an older one, or a recovery run
            now = self._now()
        due = self._report_due()
        served = due is not None and self.c.reports_by_monitor and not self._fallen_back
        if served and self._contact_at is None:
            self._contact_at = now  # a run that continued another: its monitor's silence counts from here
        if due is not None and self._fallen_back:
            # Its monitor may be back: it goes first, and the job sends the record only a few rounds later.
            poll, interval = self.settings.poll_interval_seconds, self.settings.report_interval_seconds
            due += timedelta(seconds=min(interval, 4 * poll))
        contact = self._contact_at or now
        check_at = contact + timedelta(seconds=self.settings.max_watch_seconds)
        if due is not None and now >= due and (not served or now >= check_at):
            if served:
                # Its monitor has sent nothing for max_watch_seconds: the job reports itself (from where its last
                # record ended: no gap) until the monitor's next record arrives, and registers with it again.
                self._fallen_back = True
            self._report_tried_at = now
            await self._report_usage(final=False, watch=self._monitor_takes_over(due))
            return
        wake_at = min(
            t for t in (None if served else due, deadline, self._cancel_retry_at(), check_at) if t is not None
        )
        await self._sleep_until(max(wake_at, now), checks=wake_at == check_at)
        if self.observed is not None:
            status, self.observed = self.observed, None
            self._contact_at = workflow.now()
            if not status.found or status.state != self.c.state or self._restarted(status):
                try:
                    await self._apply(status)
                except BaseException:
                    # The job did not get where the monitor said (a refused report, a cancel): the monitor must
                    # hear where it stands, or it would not tell it again.
                    self.c = self.c.model_copy(update={"monitored": False})
                    raise
            return
        now = workflow.now()
        if self._contact_at is not None:
            # (The monitor's period records, signalled meanwhile, are news too: they move the check.)
            check_at = self._contact_at + timedelta(seconds=self.settings.max_watch_seconds)
        if now < check_at:
            return
        due = self._report_due()
        if served and due is not None and now >= due:
            return  # its record is overdue: the job sends it on the next pass, registering again with it
        # Nothing heard for a long while: tell the monitor again where the job stands, so it signals any change it
        # has seen and this job missed (a monitor that ended or was reset starts again).
        await self._register_with_monitor()

    def _now(self) -> datetime:
        """``workflow.now()``, or later when a local activity ran in this workflow task.

        The workflow's clock stands still for the whole task, and a period report (a local activity, retries
        included) can take longer than the time to the next step: timed from the task's start, every later
        report would be late by as long (a lost answer retried for 2 s pushed the next report past the job's end).
        The activity says when it answered; histories recorded before it say nothing, and replay as before.
        """
        now = workflow.now()
        if self._answered is not None and self._answered[0] == now:
            return max(now, self._answered[1])
        return now

    def _cancel_retry_at(self) -> datetime | None:
        if self.c.cancel_requested and not self.c.cancel_sent:
            return self.c.cancel_retry_at
        return None

    async def _sleep_until(self, wake_at: datetime, *, checks: bool = False) -> None:
        """Until ``wake_at`` (``checks``: the safety-net check), news from the monitor or a cancel: one timer lives
        on across the monitor's signals, so news costs no timer events; a check the monitor's records put off is
        moved by the record that finds it about to fire."""
        now = self._now()
        replace = (
            self._timer is None or self._timer.done() or self._timer_at is None or self._timer_at > wake_at
        )
        if not replace and self._check_put_off() and self._timer_at is not None:
            later = self._timer_at < wake_at
            if later and self._moves_check is None:
                self._moves_check = workflow.patched(PATCH_CHECK_MOVES_WITH_RECORDS)
            replace = later and bool(self._moves_check)
            if not replace:
                self._timer_checks = False  # it fires when it must (or the run keeps it): nothing to wake for
        if replace:
            if self._timer is not None and not self._timer.done():
                self._timer.cancel()
            delay = max(wake_at - now, _MIN_TIMER)
            self._timer = asyncio.ensure_future(workflow.sleep(delay))
            self._timer_at = now + delay
            self._timer_checks = checks
        timer = self._timer
        assert timer is not None
        # A job whose monitor sends its records wakes for nothing else while it runs: it also wakes to continue
        # as new, when its history (which grows with every record) is long or another build became current.
        await workflow.wait_condition(
            lambda: (
                timer.done()
                or self.observed is not None
                or self._cancel_due()
                or (self.c.reports_by_monitor and (self._history_is_long() or self._build_changed()))
                or (self._moves_check is not False and self._check_put_off())
            )
        )

    def _check_put_off(self) -> bool:
        """The timer is for a safety-net check that news from the monitor has since put off, and would fire before
        the monitor's next records are likely to arrive (two report intervals): moving it now, in the workflow task
        that news came with, costs a cancel and a start, where letting it fire costs a workflow task of its own."""
        if not self._timer_checks or self._timer is None or self._timer.done() or self._timer_at is None:
            return False
        if self._contact_at is None or not self.c.reports_by_monitor or self._fallen_back:
            return False
        check_at = self._contact_at + timedelta(seconds=self.settings.max_watch_seconds)
        soon = self._timer_at - workflow.now() <= 2 * timedelta(seconds=self.settings.report_interval_seconds)
        return soon and check_at > self._timer_at

    async def _register_with_monitor(self) -> None:
        registration = self._registration(self.c.state, None)
        assert registration is not None
        await workflow.execute_activity(
            WATCH_WITH_MONITOR,
            registration,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=self._retry(unlimited=True),
        )
        self.c = self.c.model_copy(update={"monitored": True})
        self._contact_at = workflow.now()

    def _monitor_takes_over(self, due: datetime) -> WatchRegistration | None:
        """The registration that has the job's monitor send its period records after this one, or None: the job
        keeps its own report timer (its monitor does not round often enough, or the run began before
        ``PATCH_MONITOR_SENDS_PERIODS``)."""
        if not self._monitor_can_send():
            return None
        implied = self.c.reports_by_monitor or self.first_by_monitor
        if not implied and not workflow.patched(PATCH_MONITOR_SENDS_PERIODS):
            return None
        interval = timedelta(seconds=self.settings.report_interval_seconds)
        return self._registration(JobState.RUNNING, None, report_due=due + interval)

    def _monitor_can_send(self) -> bool:
        """The job's monitor rounds often enough (twice a report interval) to send its period records."""
        often = 2 * self.settings.poll_interval_seconds <= self.settings.report_interval_seconds
        return self.by_monitor and often

    def _registration(
        self, state: JobState, began: datetime | None, *, report_due: datetime | None = None
    ) -> WatchRegistration | None:
        """What the cluster's monitor is told of this job in a new state (None: the job is not watched by it).

        A running job's registration says when its next period record is due once its monitor sends them, and,
        since ``PATCH_MONITOR_SENDS_FIRST_PERIOD``, from the run's first period on."""
        if not self.by_monitor or self.c.scheduler_job_id is None:
            return None
        start = began if state == JobState.RUNNING and began is not None else self.c.start_time
        by_monitor = self.c.reports_by_monitor or (self.first_by_monitor and self._monitor_can_send())
        if report_due is None and by_monitor and state == JobState.RUNNING:
            last = self.c.last_report_at or self.c.started_at or workflow.now()
            report_due = last + timedelta(seconds=self.settings.report_interval_seconds)
        return WatchRegistration(
            workflow_id=workflow.info().workflow_id,
            monitor=self._monitor_settings(),
            entry=WatchEntry(
                scheduler_job_id=self.c.scheduler_job_id,
                state=state,
                start_time=start,
                report_due=report_due if self.settings.usage_enabled else None,
            ),
        )

    def _monitor_settings(self) -> MonitorSettings:
        return MonitorSettings(
            cluster_id=self.c.cluster_id,
            task_queue=self.c.task_queue or workflow.info().task_queue,
            poll_interval_seconds=self.settings.poll_interval_seconds,
            vanished_grace_seconds=self.settings.vanished_grace_seconds,
            heartbeat_timeout_seconds=self.settings.heartbeat_timeout_seconds,
        )

    def _watch_plan(
        self, now: datetime, deadline: datetime | None
    ) -> tuple[datetime, UsageInput | None] | None:
        """Until when the next watch runs and the report it carries; None when a report is due right now."""
        return_by = now + timedelta(seconds=self.settings.max_watch_seconds)
        due = self._report_due()
        report: UsageInput | None = None
        if due is not None:
            if now >= due:
                return None
            return_by = min(return_by, due)
            if (deadline is None or due <= deadline) and workflow.patched(PATCH_USAGE_IN_WATCH):
                report = self._usage_input(final=False)
        if deadline is not None:
            return_by = min(return_by, deadline)
        if self.c.cancel_requested and not self.c.cancel_sent and self.c.cancel_retry_at is not None:
            return_by = max(min(return_by, self.c.cancel_retry_at), now)
        return return_by, report

    async def _await_watch(self, handle: workflow.ActivityHandle[WatchOutput]) -> WatchOutput | None:
        """The watch's answer, or None when a cancel request cut it short."""
        try:
            await workflow.wait_condition(lambda: handle.done() or self._cancel_due())
        except asyncio.CancelledError:
            if self.v2:
                handle.cancel()  # the workflow itself was cancelled: stop watching, the caller cancels the job
            raise
        if handle.done():
            return await handle
        handle.cancel()
        if self.v2:
            try:
                await handle
            except ActivityError:  # cancelled watch: nothing to apply (a workflow cancel still propagates)
                return None
            return None
        try:
            await handle
        except (ActivityError, BaseException):  # cancelled watch: nothing to apply
            return None
        return None

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
        # A final state the provider imposes (deadline, closing after an error) replaces the "cancelled" its own
        # cancel caused; since 0.3 a job that ended on its own first keeps the state it really ended in.
        imposed = target == JobState.CANCELLED or not self.v2
        if target.final and self.c.forced_final is not None and imposed:
            target, message = self.c.forced_final, self.c.forced_message
        elif target == JobState.CANCELLED and self.c.cancel_requested:
            message = self.c.cancel_reason or message
        if self.v2 and self._restarted(status):
            # Requeued and running again between two polls: the chain sees the requeue, the walltime starts over.
            await self._transition(JobState.QUEUED, LifecycleEvent.QUEUED, "requeued by the scheduler")
            await self._transition(JobState.RUNNING, LifecycleEvent.STARTED, message, began=status.start_time)
            return
        path = self._path_to(target, status)
        if self.c.started_at is None and (status.start_time is not None or JobState.RUNNING in path):
            # The job ran (perhaps between two polls): its usage starts when the scheduler started it. (A run made by
            # a reset can hear its monitor's first period records before the news that the job runs: they stand.)
            started = status.start_time or workflow.now()
            last = self.c.last_report_at or started
            self.c = self.c.model_copy(update={"started_at": started, "last_report_at": last})
        for step in path:
            if step.final:
                self.c = self.c.model_copy(update={"exit_code": status.exit_code})
                await self._finish(step, message)
                return
            began = status.start_time if self.c.state != JobState.SUSPENDED else None
            await self._transition(step, lifecycle_event(self.c.state, step), message, began=began)

    def _path_to(self, target: JobState, status: NativeStatus) -> list[JobState]:
        """The states to report on the way to ``target``: through running when the scheduler says a job that
        ends now had started, though no poll saw it run."""
        path = transition_path(self.c.state, target)
        ran_unseen = (
            target.final
            and status.start_time is not None
            and self.c.state.order < JobState.RUNNING.order
            and JobState.RUNNING not in path
        )
        if ran_unseen and workflow.patched(PATCH_STARTED_BEFORE_FINAL):
            return [*transition_path(self.c.state, JobState.RUNNING), target]
        return path

    def _restarted(self, status: NativeStatus) -> bool:
        return (
            self.c.state == JobState.RUNNING
            and status.state == JobState.RUNNING
            and self.c.start_time is not None
            and status.start_time is not None
            and status.start_time != self.c.start_time
        )

    async def _finish(self, final: JobState, message: str, *, partial: bool = False) -> None:
        """Close the job: final usage record and accounting (if it ran), then the terminal status.

        ``partial``: the scheduler cannot give final accounting (the job vanished, or we closed it at a deadline),
        so the last reading closes the records.
        """
        ran = self.c.scheduler_job_id is not None and self.c.started_at is not None
        if not self.v2:
            if ran and self.settings.usage_enabled:
                await self._report_usage(final=True, final_state=final, partial=partial)
            await self._transition(final, lifecycle_event(self.c.state, final), message)
            return
        if self.c.final_state is not None:
            # Finishing was interrupted (parked, then cancelled) and has begun again: the job ends as decided the
            # first time, and a final record already sent is not sent twice.
            final, message = self.c.final_state, self.c.final_message
        else:
            self.c = self.c.model_copy(
                update={"final_state": final, "final_message": message, "final_partial": partial}
            )
        if ran and not self.c.final_sent:  # with usage reporting off too: the job settles on its accounting
            # On the local path the final record's step reports the final state too, once the record is sent.
            then = self._transition_input(final, lifecycle_event(self.c.state, final), message)
            reported = False

            async def final_usage() -> None:
                nonlocal reported
                reported = await self._report_usage(
                    final=True, final_state=final, partial=partial, then=then if self.local else None
                )

            await self._until_done("the final usage record and accounting", final_usage)
            if reported:
                workflow.upsert_search_attributes([SA_STATE.value_set(final.value)])
                self._entered(then.old_state, final, message, watched=then.watch is not None)
                return
        # (a final record sent on the local path tried to report the final state along, and audited it first)
        audited = self.local and ran

        async def terminal_report() -> None:
            event = lifecycle_event(self.c.state, final)
            await self._transition(final, event, message, audited=audited)

        await self._until_done(f"the terminal status ({final.value})", terminal_report)

    async def _transition(
        self,
        new: JobState,
        event: LifecycleEvent | None,
        message: str,
        *,
        began: datetime | None = None,
        audited: bool = False,
    ) -> None:
        """Report the job's move to ``new`` and enter it (``audited``: the step that was to report it along
        audited its lifecycle event already)."""
        request = self._transition_input(new, event, message, began=began, audited=audited)
        if self.local:
            # Its local attempts audited the lifecycle event: an activity that takes over does not audit it again.
            again = request.model_copy(update={"lifecycle_audited": True})
            await self._chain_step(
                REPORT_TRANSITION, request, timeout=timedelta(seconds=60), as_activity=again
            )
        else:
            await workflow.execute_activity(
                REPORT_TRANSITION,
                request,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=self._retry(unlimited=True),
            )
        workflow.upsert_search_attributes([SA_STATE.value_set(new.value)])
        self._entered(request.old_state, new, message, watched=request.watch is not None, began=began)
        if request.watch is not None and request.watch.entry.report_due is not None:
            # Registered for its period records: its monitor sends them from now on.
            self.c = self.c.model_copy(update={"reports_by_monitor": True})

    def _transition_input(
        self,
        new: JobState,
        event: LifecycleEvent | None,
        message: str,
        *,
        began: datetime | None = None,
        audited: bool = False,
    ) -> TransitionInput:
        """The report of the job's move from its state to ``new`` (and what its monitor is told of it)."""
        return TransitionInput(
            job_id=self.job.job_id,
            cluster_id=self.c.cluster_id,
            old_state=self.c.state,
            new_state=new,
            event=event,
            message=message[:1024] if self.v2 else message,
            exit_code=self.c.exit_code if new.final else None,
            scheduler_job_id=self.c.scheduler_job_id,
            tenant=self.job.tenant,
            watch=self._registration(new, began),
            lifecycle_audited=audited,
        )

    def _entered(
        self, old: JobState, new: JobState, message: str, *, watched: bool, began: datetime | None = None
    ) -> None:
        """The job is in its new state, reported (its search attribute is the caller's)."""
        self.c = self.c.model_copy(update={"state": new, "status_message": message})
        if watched:
            self.c = self.c.model_copy(update={"monitored": not new.final})
            self._contact_at = workflow.now()
        if self.v2:
            self._track_run_time(old, new, began)

    async def _chain_step(
        self,
        activity: str,
        arg: object,
        *,
        timeout: timedelta,
        result_type: type | None = None,
        heartbeat_timeout: timedelta | None = None,
        as_activity: object | None = None,
    ) -> Any:
        """A step that needs only the chain and this worker: a local activity (one marker in history instead of
        an activity's three events and the workflow task that follows). One that has not finished in
        ``LOCAL_STEP_ATTEMPTS`` attempts runs on as an ordinary activity (with ``as_activity`` for input, when
        given), with the retries an ordinary one has.

        Raises ``ActivityError`` as an ordinary activity does: a local activity's failure arrives here as the
        bare ``ApplicationError``, which is wrapped, so the callers' handling (the finish path, parking, closing
        after an error) sees one kind of failure whichever way the step ran.
        """
        try:
            return await workflow.execute_local_activity(
                activity,
                arg,
                start_to_close_timeout=min(timeout, LOCAL_STEP_TIMEOUT),
                retry_policy=self._retry(attempts=LOCAL_STEP_ATTEMPTS),
                result_type=result_type,
            )
        except ApplicationError as err:
            if err.non_retryable or err.type in _NON_RETRYABLE:
                raise _failed_for_good(activity, err) from err
            last: Exception = err
        except ActivityError as err:
            if _is_cancel(err):
                raise
            last = err
        workflow.logger.warning(
            "job %s: %s did not finish as a local activity in %d attempts, running it as an activity: %s",
            self.job.job_id,
            activity,
            LOCAL_STEP_ATTEMPTS,
            last,
        )
        return await workflow.execute_activity(
            activity,
            arg if as_activity is None else as_activity,
            start_to_close_timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            retry_policy=self._retry(unlimited=True),
            result_type=result_type,
        )

    def _track_run_time(self, old: JobState, new: JobState, began: datetime | None) -> None:
        """Keep the time the job has run, for its walltime: suspended time and the wait in the queue after a
        requeue do not count; every run does (the scheduler gives a requeued run a fresh time limit, the tenant's
        walltime and escrow cover all runs together)."""
        now = workflow.now()
        run_seconds, since, start_time = self.c.run_seconds, self.c.running_since, self.c.start_time
        if old == JobState.RUNNING and since is not None:
            run_seconds += max(0.0, (now - since).total_seconds())
            since = None
        if new == JobState.RUNNING:
            since = began if began is not None and began <= now else now
            start_time = began or start_time
        queued_since = self.c.queued_since
        if new == JobState.QUEUED:
            queued_since = now
            # (asked only on a requeue, where it decides something: a first queued state records no marker)
            if run_seconds > 0 and not workflow.patched(PATCH_WALLTIME_ACROSS_REQUEUES):
                run_seconds = 0.0
        self.c = self.c.model_copy(
            update={
                "run_seconds": run_seconds,
                "running_since": since,
                "queued_since": queued_since,
                "start_time": start_time,
            }
        )

    async def _report_usage(
        self,
        *,
        final: bool,
        final_state: JobState | None = None,
        partial: bool = False,
        watch: WatchRegistration | None = None,
        then: TransitionInput | None = None,
    ) -> bool:
        """Send a usage record (the final one with its accounting); True when ``then``, the transition a final
        record reports along, went with it."""
        unlimited = final or self.settings.retry_on_failure
        request = self._usage_input(final=final, final_state=final_state, partial=partial, then=then)
        if watch is not None:
            request = request.model_copy(update={"watch": watch})
        try:
            out: UsageOutput
            if final and self.local and self.c.task_queue is None:
                # The scheduler's final accounting, the record and the settlement, on this very worker.
                out = await self._chain_step(
                    REPORT_USAGE,
                    request,
                    timeout=timedelta(seconds=300),
                    result_type=UsageOutput,
                    heartbeat_timeout=self._heartbeat_timeout(),
                )
            elif self.by_monitor and not final and self.c.task_queue is None:
                # A period record is a reading and a chain call on this very worker: a local activity costs one
                # history event instead of three and a round trip through the server.
                out = await workflow.execute_local_activity(
                    REPORT_USAGE,
                    request,
                    start_to_close_timeout=timedelta(seconds=300),
                    retry_policy=self._retry(unlimited=unlimited),
                    result_type=UsageOutput,
                )
                if out.answered_at is not None:
                    self._answered = (workflow.now(), out.answered_at)
            else:
                out = await workflow.execute_activity(
                    REPORT_USAGE,
                    request,
                    task_queue=self.c.task_queue,
                    start_to_close_timeout=timedelta(seconds=300),
                    heartbeat_timeout=self._heartbeat_timeout(),
                    retry_policy=self._retry(unlimited=unlimited),
                    result_type=UsageOutput,
                )
        except (ActivityError, ApplicationError):  # a local activity's failure arrives unwrapped
            if final and self.v2:
                raise  # the job cannot settle without it: the finish path parks it
            if not self.by_monitor:
                # The attempts ran out (or the error is final): the next record covers this period too, from
                # where the last one ended; it is tried an interval from now.
                if workflow.patched(PATCH_FAILED_REPORT_KEEPS_PERIOD):
                    self._report_failed_at = workflow.now()
                else:
                    self.c = self.c.model_copy(update={"last_report_at": workflow.now()})
            return False  # (waiting for the monitor: the next try comes an interval after this one)
        if watch is not None:
            # Registered: the monitor sends the next period records.
            self.c = self.c.model_copy(update={"reports_by_monitor": True, "monitored": True})
            self._contact_at = workflow.now()
        if out.record_id is None and not final:
            return False  # the job has ended: its final record follows once the monitor says so
        if not final and out.sequence is not None and out.sequence < self.c.next_sequence:
            return False  # its monitor's signal brought this very record first
        self._record_sent(out)
        if final:
            if self.v2:
                self.c = self.c.model_copy(update={"final_sent": True})
            self.final_record_id = out.record_id
            self.charged, self.refunded = out.charged, out.refunded
        return out.reported

    def _usage_input(
        self,
        *,
        final: bool,
        final_state: JobState | None = None,
        partial: bool = False,
        then: TransitionInput | None = None,
    ) -> UsageInput:
        assert self.c.scheduler_job_id is not None
        unlimited = final or self.settings.retry_on_failure
        return UsageInput(
            job_id=self.job.job_id,
            tenant=self.job.tenant,
            provider=self.job.provider,
            storage_gb=self.job.resources.storage_gb,
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
            until_end=self.by_monitor,
            then_report=then,
        )

    def _record_sent(self, out: UsageOutput) -> None:
        """The chain holds the records up to the one the report ended on (``next_sequence``, or the one after it
        when a final record followed a period record already under that sequence): advance past it."""
        last = out.sequence if out.sequence is not None else self.c.next_sequence
        self.c = self.c.model_copy(
            update={
                "next_sequence": max(last, self.c.next_sequence) + 1,
                "last_cumulative": out.cumulative,
                "last_report_at": out.period_end,
            }
        )

    async def _send_cancel(self, reason: str) -> None:
        assert self.c.scheduler_job_id is not None
        try:
            await workflow.execute_activity(
                CANCEL_JOB,
                CancelInput(
                    job_id=self.job.job_id,
                    cluster_id=self.c.cluster_id,
                    scheduler_job_id=self.c.scheduler_job_id,
                    reason=reason,
                ),
                task_queue=self.c.task_queue,
                start_to_close_timeout=timedelta(seconds=120),
                heartbeat_timeout=self._heartbeat_timeout(),
                retry_policy=self._retry(),
            )
        except ActivityError as err:
            if not self.v2 or _is_cancel(err):
                workflow.logger.warning("cancel of %s failed, will retry: %s", self.job.job_id, _cause(err))
                return
            if _for_good(err):
                await self._park(
                    f"the scheduler refuses to cancel job {self.c.scheduler_job_id}: {_cause(err)}"
                )
                self.c = self.c.model_copy(update={"cancel_retry_at": None})
                return
            failures = self.c.cancel_failures + 1
            backoff = min(
                CANCEL_BACKOFF_CAP,
                timedelta(seconds=self.settings.retry.max_backoff_seconds * 2 ** min(failures - 1, 10)),
            )
            workflow.logger.warning(
                "cancel of %s failed %d times, next try in %s: %s",
                self.job.job_id,
                failures,
                backoff,
                _cause(err),
            )
            self.c = self.c.model_copy(
                update={"cancel_failures": failures, "cancel_retry_at": workflow.now() + backoff}
            )
            return
        self.c = self.c.model_copy(
            update={"cancel_sent": True, "cancel_failures": 0, "cancel_retry_at": None}
        )

    def _cancel_due(self) -> bool:
        """A cancel should go out now: asked for, not yet sent, and not waiting out a backoff."""
        if not self.c.cancel_requested or self.c.cancel_sent:
            return False
        retry_at = self.c.cancel_retry_at
        return retry_at is None or workflow.now() >= retry_at

    async def _enforce_deadline_v2(self) -> None:
        """Past a deadline: cancel the job (with the cancel's backoff, never faster), then give the scheduler a
        few polls to say it ended before closing it ourselves as timed out."""
        grace = self.c.deadline_grace_until
        if grace is not None and workflow.now() >= grace:
            final = self.c.forced_final or JobState.CANCELLED
            await self._finish(final, self.c.forced_message or self.c.cancel_reason, partial=True)
            return
        if not self.c.cancel_requested:  # an operator's or tenant's cancel already under way stays theirs
            why = self._deadline_reason()
            self.c = self.c.model_copy(
                update={
                    "forced_final": JobState.TIMEOUT,
                    "forced_message": why,
                    "cancel_requested": True,
                    "cancel_reason": why,
                }
            )
        if self._cancel_due():
            await self._send_cancel(self.c.cancel_reason)
        if self.c.cancel_sent and grace is None:
            # The scheduler will report the job cancelled; give it a few polls, then close it as timed out.
            grace = workflow.now() + timedelta(seconds=4 * self.settings.poll_interval_seconds + 30)
            self.c = self.c.model_copy(update={"deadline_grace_until": grace})

    def _deadline_reason(self) -> str:
        if self.c.state == JobState.RUNNING:
            return f"ran past its walltime of {self.job.walltime_seconds} s; cancelled by the provider"
        limit = self.settings.max_queue_wait_seconds or 0
        if self.c.started_at is not None:
            return f"requeued and not started again within max_queue_wait ({limit:.0f} s)"
        return f"not started within max_queue_wait ({limit:.0f} s)"

    async def _enforce_deadline(self) -> None:
        if self.v2:
            await self._enforce_deadline_v2()
            return
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
        if self.v2:
            return self._deadline_v2()
        if self.c.started_at is not None:
            return self.c.started_at + timedelta(
                seconds=self.job.walltime_seconds + self.settings.walltime_grace_seconds
            )
        if self.c.submitted_at is not None:
            return self.c.submitted_at + timedelta(seconds=self.settings.job_timeout_default_seconds)
        return None

    def _deadline_v2(self) -> datetime | None:
        """Walltime counts only running time (a suspended job has no deadline); a queue wait is limited only
        when ``max_queue_wait`` is set."""
        if self.c.state == JobState.RUNNING:
            since = self.c.running_since or self.c.started_at
            if since is None:
                return None
            left = self.job.walltime_seconds + self.settings.walltime_grace_seconds - self.c.run_seconds
            return since + timedelta(seconds=max(0.0, left))
        limit = self.settings.max_queue_wait_seconds
        if limit is not None and self.c.state in (JobState.QUEUED, JobState.STARTING):
            since = self.c.queued_since or self.c.submitted_at
            return None if since is None else since + timedelta(seconds=limit)
        return None

    def _report_due(self) -> datetime | None:
        if not self.settings.usage_enabled or self.c.state != JobState.RUNNING:
            return None
        last = self.c.last_report_at or self.c.started_at
        interval = timedelta(seconds=self.settings.report_interval_seconds)
        if last is None or not self.by_monitor:
            if last is None:
                return None
            failed = self._report_failed_at  # set only on the patched path (PATCH_FAILED_REPORT_KEEPS_PERIOD)
            return last + interval if failed is None else max(last, failed) + interval
        # On the job's own schedule (its start + whole intervals): a reading taken a moment after its timer fired
        # does not push every later report back by that moment.
        due = next_report_due(self.c.started_at, last, interval)
        if self._report_tried_at is not None:
            # A report that found the job ended sent nothing: the next try waits an interval.
            due = max(due, self._report_tried_at + interval)
        return due

    def _history_is_long(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() > self.settings.continue_as_new_after_events
        )

    def _new_build_is_current(self) -> bool:
        """Another build of the workers became current: continue as new onto it (docs/deploys.md)."""
        changed = workflow.info().is_target_worker_deployment_version_changed()
        if changed and workflow.patched(PATCH_UPGRADE_ON_CONTINUE_AS_NEW):
            return True
        self._stays_on_build = changed  # (a run that began before it stays: nothing to wake for)
        return False

    def _build_changed(self) -> bool:
        """Another build became current and this run moves to it at its next step."""
        return workflow.info().is_target_worker_deployment_version_changed() and not self._stays_on_build

    def _heartbeat_timeout(self) -> timedelta:
        """How long Temporal waits for an activity's heartbeat before it gives the attempt up and retries it.

        Activities heartbeat every 2 s while they wait; a dead worker is noticed within this, and a loaded but
        alive one must not lose its attempts to it (``hpc.job_service.activity_heartbeat_timeout``)."""
        return timedelta(seconds=self.settings.heartbeat_timeout_seconds)

    def _retry(self, *, unlimited: bool = False, attempts: int | None = None) -> RetryPolicy:
        r = self.settings.retry
        if attempts is None:
            attempts = 0 if unlimited else r.max_retries + 1
        return RetryPolicy(
            initial_interval=timedelta(seconds=r.initial_backoff_seconds),
            maximum_interval=timedelta(seconds=r.max_backoff_seconds),
            backoff_coefficient=r.backoff_multiplier,
            maximum_attempts=attempts,
            non_retryable_error_types=_NON_RETRYABLE,
        )


def _failed_for_good(activity: str, err: ApplicationError) -> ActivityError:
    """A local activity's failure as an ordinary activity's (``ActivityError`` whose cause is the error)."""
    wrapped = ActivityError(
        f"{activity} failed",
        scheduled_event_id=0,
        started_event_id=0,
        identity="",
        activity_type=activity,
        activity_id="",
        retry_state=None,
    )
    wrapped.__cause__ = err
    return wrapped


def _refused(err: ActivityError, *, also_tenant: bool = False) -> bool:
    """True when the activity failed with a non-retryable domain error (the scheduler refused the job, bad
    input; with ``also_tenant``, the tenant's account: ``PATCH_TENANT_REFUSED``): then no attempt can have created
    a job."""
    cause = err.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    types = _NON_RETRYABLE if also_tenant else _REFUSED_BEFORE_TENANT_PATCH
    return isinstance(cause, ApplicationError) and cause.non_retryable and cause.type in types


def _is_cancel(err: ActivityError) -> bool:
    """The activity ended because the workflow was cancelled while it waited on it."""
    return isinstance(err.cause, CancelledError)


def _for_good(err: ActivityError) -> bool:
    """True when the activity's last error was non-retryable: trying again the same way cannot help."""
    cause = err.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return isinstance(cause, ApplicationError) and cause.non_retryable


def _activity_of(err: ActivityError) -> str:
    return err.activity_type or "a step"


def _cause(err: ActivityError) -> str:
    cause = err.cause
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    return str(cause or err)
