"""The one-model-in, one-model-out messages of the job workflow and its activities.

Everything a workflow needs arrives in its input (settings derived from the worker's config), so workflows never
read configuration, clocks or the environment. Adding a field with a default is a compatible change; removing or
renaming one is not (replay tests in ``tests/histories`` catch it).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from virtengine_hpc import activity_names
from virtengine_hpc.models import Address, Identifier, JobSpec, Model, Name, Resources, UsageMetrics
from virtengine_hpc.scheduling import NativeStatus
from virtengine_hpc.states import JobState, LifecycleEvent

JOB_WORKFLOW_NAME = "HPCJobWorkflow"
MONITOR_WORKFLOW_NAME = "ClusterMonitorWorkflow"
PARKED = "parked"
"""``VeJobState`` of a job whose workflow waits for an operator (``virtengine-hpc jobs retry JOB``)."""

# ---- payload budget ---------------------------------------------------------------------------------------------
# The most bytes each message may take once the pydantic data converter has serialized it (docs/architecture.md,
# "What travels through Temporal"). None of these messages holds a field whose size the tenant controls: the
# script, the rendered body, the environment and the template parameters stay on chain and are read there by the
# activities that need them. tests/test_payloads.py measures every payload of real runs against these figures.
PAYLOAD_BUDGET: dict[str, int] = {
    "workflow input": 8 * 1024,
    "workflow result": 2 * 1024,
    activity_names.ROUTE_JOB: 4 * 1024,
    activity_names.SUBMIT_JOB: 4 * 1024,
    activity_names.FIND_JOB: 1024,
    activity_names.WATCH_JOB: 4 * 1024,
    activity_names.REPORT_TRANSITION: 4 * 1024,
    activity_names.CANCEL_JOB: 2 * 1024,
    activity_names.REPORT_USAGE: 4 * 1024,
    activity_names.RECOVER_JOB: 2 * 1024,
    activity_names.PARK_JOB: 4 * 1024,
    activity_names.WATCH_WITH_MONITOR: 2 * 1024,
    activity_names.POLL_CLUSTER: 64 * 1024,
    "observe": 2 * 1024,
    "period_recorded": 2 * 1024,
}
"""Bytes per serialized payload: the job workflow's input (also what continue-as-new carries) and result, per
activity the most its input and its result may each take, and per signal its argument."""
WORKFLOW_INPUT_BUDGET = PAYLOAD_BUDGET["workflow input"]
"""The poller refuses a job whose workflow input would be larger (only provider settings could make it so)."""


class JobRef(Model):
    """What the workflow and its activities carry of a job: its ids and what it asks for, never its program.

    The script, template parameters and environment are the tenant's and may be large (a 1 MiB script of control
    characters is 6 MiB of JSON); they stay on chain, and ``route_job`` and ``submit_job`` read them there by
    ``job_id``, checking ``spec_sha256``. Every field here has a small bound, so a workflow input or an activity
    input is a few hundred bytes whatever the tenant sent.

    Histories recorded by v0.2.0 and earlier carry the whole ``JobSpec`` where a ``JobRef`` now stands: it is read
    as its reference (the tenant's fields dropped, no digest), so those workflows replay and go on.
    """

    job_id: Identifier
    tenant: Address
    provider: Address
    offering_id: Identifier
    cluster_id: Identifier | None = None
    name: Name = "job"
    partition: Name | None = None
    job_class: Name = "standard"
    resources: Resources = Field(default_factory=Resources)
    walltime_seconds: int = Field(3600, ge=60, le=90 * 86400)
    template_id: Identifier | None = None
    spec_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="Digest of the spec the poller accepted (models.spec_digest); None only in histories "
        "recorded by v0.2.0 and earlier.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, data: Any) -> Any:
        if isinstance(data, JobSpec):
            data = data.model_dump()
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in _SPEC_ONLY}
        return data

    @classmethod
    def of(cls, spec: JobSpec, digest: str | None) -> JobRef:
        return cls.model_validate({**spec.model_dump(), "spec_sha256": digest})


_SPEC_ONLY = frozenset(JobSpec.model_fields) - frozenset(JobRef.model_fields)
"""The spec's fields a reference leaves on chain: the tenant's program, parameters, environment, directory, price."""


def _without(data: Any, *old: str) -> Any:
    """Drop fields that earlier releases sent and this one no longer reads, so their payloads still load."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in old}
    return data


class RetrySettings(Model):
    max_retries: int = 3
    initial_backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    backoff_multiplier: float = 2.0


class JobSettings(Model):
    """What the workflow needs from the worker's config, fixed when the workflow starts."""

    poll_interval_seconds: float = 15.0
    report_interval_seconds: float = 300.0
    usage_enabled: bool = True
    retry_on_failure: bool = True
    job_timeout_default_seconds: float = 86400.0
    walltime_grace_seconds: float = 120.0
    vanished_grace_seconds: float = 120.0
    retry: RetrySettings = Field(default_factory=RetrySettings)
    max_watch_seconds: float = 3600.0
    continue_as_new_after_events: int = 5000
    heartbeat_timeout_seconds: float = Field(
        30.0,
        description="Heartbeat timeout of the job's activities (the watch's is at least four poll intervals).",
    )
    # True when absent: runs started by the builds where the monitor was the only path carry no such field and must
    # replay on it (their history holds its marker); workers always set it from hpc.job_service.cluster_monitor,
    # and a run whose history has no marker takes the watch-activity path whatever this says.
    cluster_monitor: bool = Field(
        True,
        description="Watch the job through the cluster's monitor workflow (hpc.job_service.cluster_monitor).",
    )
    max_queue_wait_seconds: float | None = Field(
        None,
        description="Cancel a job that has waited this long in the scheduler's queue without starting (reported "
        "timeout). None: no limit (long queues are normal on HPC clusters).",
    )
    task_queues: dict[str, str] = Field(
        default_factory=dict,
        description="Task queue of each of the provider's clusters: a job routed to another cluster runs its "
        "scheduler activities there (on the workers that can reach that scheduler).",
    )


class Carried(Model):
    """Workflow state carried across continue-as-new."""

    state: JobState
    cluster_id: str
    scheduler_job_id: str | None = None
    next_sequence: int = 1
    last_cumulative: UsageMetrics = Field(default_factory=UsageMetrics)
    last_report_at: datetime | None = None
    submitted_at: datetime | None = None
    started_at: datetime | None = None
    cancel_requested: bool = False
    cancel_reason: str = ""
    cancel_sent: bool = False
    status_message: str = ""
    exit_code: int | None = None
    forced_final: JobState | None = Field(None, description="Final state the provider imposes (deadline).")
    forced_message: str = ""
    deadline_grace_until: datetime | None = None
    missing_since: datetime | None = None
    task_queue: str | None = Field(
        None,
        description="Where the scheduler activities run when routing moved the job to another cluster "
        "(None: the workflow's own task queue).",
    )
    submit_started: bool = Field(
        False, description="A submit attempt was scheduled: a scheduler job may exist even without an id."
    )
    closing_error: str = Field(
        "", description="A step failed for good: the job is being closed as failed with this reason."
    )
    parked: str | None = Field(
        None, description="Why the job waits for an operator (`jobs retry`), or None when it is not parked."
    )
    cancel_failures: int = Field(
        0, description="Cancel attempts in a row that failed (backoff between them)."
    )
    cancel_retry_at: datetime | None = Field(None, description="When the next cancel attempt is due.")
    queued_since: datetime | None = Field(
        None, description="When the job last entered the scheduler's queue."
    )
    running_since: datetime | None = Field(
        None, description="Start of the current running stretch (None while queued or suspended)."
    )
    run_seconds: float = Field(
        0.0, description="Seconds the job ran before the current stretch (suspended time is not counted)."
    )
    start_time: datetime | None = Field(
        None, description="When the scheduler says the current run started (a new one means a requeue)."
    )
    final_state: JobState | None = Field(None, description="The final state decided when finishing began.")
    final_message: str = ""
    final_partial: bool = Field(
        False, description="Finishing began without final accounting from the scheduler (vanished, deadline)."
    )
    final_sent: bool = Field(False, description="The final usage record and accounting are on chain.")
    monitored: bool = Field(
        False, description="The job is registered with its cluster's monitor (it waits for its signals)."
    )
    reports_by_monitor: bool = Field(
        False,
        description="The cluster's monitor sends the job's period usage records and signals each one "
        "(``period_recorded``); the job keeps no report timer of its own while it does.",
    )


class Recovery(Model):
    """Why a run was started only to close a job that an earlier run left without a final chain state.

    The reconciler starts such a run (same workflow id) when the chain still shows a job as not final while no
    workflow is open for it: the earlier run was terminated, failed, timed out or cancelled before it could
    report, or it was never startable. The run stops the scheduler job if one may exist, sends the final usage
    from the last reading if the job ran, reports the terminal state and audits why.
    """

    reason: str = Field(
        max_length=512, description="What the reconciler found (shown on chain and in audit)."
    )
    closed_status: str = Field(
        "",
        description="How the earlier run closed (TERMINATED, FAILED, TIMED_OUT, CANCELED, COMPLETED) or ''.",
    )
    scheduler_job_id: str | None = Field(None, description="The scheduler job the earlier run had, if known.")
    cluster_id: str | None = Field(
        None, description="The cluster the earlier run had routed the job to (its VeClusterId), if known."
    )
    chain_state: JobState = Field(JobState.PENDING, description="The job's state on chain when it was found.")


class JobWorkflowInput(Model):
    job: JobRef
    cluster_id: str = Field(description="The cluster this worker serves (its task queue).")
    provider: str
    settings: JobSettings = Field(default_factory=JobSettings)
    carried: Carried | None = None
    recovery: Recovery | None = Field(
        None, description="Set by the reconciler: this run only closes a job an earlier run left open."
    )


class JobResult(Model):
    job_id: str
    state: JobState
    message: str = ""
    exit_code: int | None = None
    scheduler_job_id: str | None = None
    usage_records: int = 0
    final_record_id: str | None = None
    charged: str | None = None
    refunded: str | None = None


class JobStatusView(Model):
    """What the ``status`` query returns."""

    job_id: str
    state: JobState
    cluster_id: str
    scheduler_job_id: str | None = None
    message: str = ""
    exit_code: int | None = None
    usage_records: int = 0
    cancel_requested: bool = False
    submitted_at: datetime | None = None
    started_at: datetime | None = None
    parked: str | None = Field(None, description="Why the job waits for an operator, if it does.")


#: The reason the poller starts a job's workflow with when its tenant cancelled it before any workflow ran (the
#: cancel rides in the start). The poller audits ``job_cancelled`` for that start itself, so the workflow's close
#: of the never-submitted job does not audit it again (``report_transition``).
CANCELLED_BEFORE_START = "cancelled by the tenant"


class CancelRequest(Model):
    reason: str = Field(CANCELLED_BEFORE_START, max_length=512)


class RetryRequest(Model):
    """An operator's go-ahead for a parked job (``virtengine-hpc jobs retry JOB``): try the failed step again."""

    note: str = Field("", max_length=512)


# ---- activities -------------------------------------------------------------------------------------------------


class RouteRequest(Model):
    job: JobRef
    cluster_id: str
    workflow_id: str


class Violation(Model):
    type: Literal[
        "missing_decision",
        "stale_decision",
        "cluster_mismatch",
        "cluster_unavailable",
        "capacity_exceeded",
        "unauthorized_fallback",
    ]
    severity: int
    message: str


class RouteOutcome(Model):
    accepted: bool
    code: str = Field(
        "", description="Why it was refused: validation_failed, routing_rejected or already_final."
    )
    message: str = ""
    cluster_id: str = ""
    decision_id: str | None = None
    is_fallback: bool = False
    violations: list[Violation] = Field(default_factory=list)
    partition: str | None = None
    chain_state: JobState | None = Field(
        None,
        description="already_final: the state the job has ended in on chain (the workflow ends with it).",
    )

    @model_validator(mode="before")
    @classmethod
    def _old(cls, data: Any) -> Any:
        # Up to v0.2.0 the outcome carried the rendered body; submit_job renders it now, where it submits.
        return _without(data, "body", "exclusive")


class SubmitInput(Model):
    """Submit a job: ``submit_job`` reads its spec from chain, checks the digest and renders the body itself."""

    workflow_id: str
    job: JobRef
    cluster_id: str
    partition: str | None = None
    max_attempts: int = 4
    look_first: bool = Field(
        False,
        description="An earlier run of the workflow may have submitted the job (this run was made by a reset): "
        "even a first attempt looks the job up and adopts it, and checks for duplicates after a submission.",
    )
    report: SubmitReport | None = Field(
        None,
        description="Report the job queued once the scheduler has it (chain, audit and the cluster's monitor), "
        "as ``report_transition`` would: the workflow then needs no step of its own for it. None: it reports it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old(cls, data: Any) -> Any:
        return _without(data, "body", "exclusive")


class SubmitReport(Model):
    """The transition a submission reports itself: from ``old_state`` to queued, once the scheduler has the job."""

    old_state: JobState
    event: LifecycleEvent | None = None
    message: str = Field("", max_length=1024)
    tenant: str = ""
    monitor: MonitorSettings | None = Field(
        None, description="The cluster's monitor to tell (None: the job is not watched by a monitor)."
    )


class SubmitOutput(Model):
    scheduler_job_id: str
    adopted: bool = False
    reported: bool = Field(
        False,
        description="``SubmitInput.report`` reached the chain and the monitor; False: the workflow reports it.",
    )


class FindInput(Model):
    """Look for the scheduler job of a workflow whose submission attempts all failed without a refusal."""

    workflow_id: str
    job_id: str
    cluster_id: str


class FindOutput(Model):
    scheduler_job_id: str | None = None


class WatchInput(Model):
    job_id: str
    cluster_id: str
    scheduler_job_id: str
    last_state: JobState
    return_by: datetime = Field(
        description="Return at this time even without a change (report due, deadline)."
    )
    poll_interval_seconds: float
    vanished_grace_seconds: float = 120.0
    missing_since: datetime | None = Field(
        None, description="Since when the scheduler has not found the job."
    )
    last_start_time: datetime | None = Field(
        None,
        description="When the scheduler said the current run started: a different start while the state is the "
        "same (a requeue between two polls) is a change too.",
    )
    report: UsageInput | None = Field(
        None,
        description="Send this usage record when return_by arrives and the job still runs: one activity per "
        "report cycle instead of two keeps history at about six events per cycle.",
    )


class WatchOutput(Model):
    status: NativeStatus
    changed: bool
    missing_since: datetime | None = None
    usage: UsageOutput | None = Field(None, description="The record sent for ``WatchInput.report``, if any.")


class TransitionInput(Model):
    job_id: str
    cluster_id: str
    old_state: JobState
    new_state: JobState
    event: LifecycleEvent | None = None
    message: str = ""
    exit_code: int | None = None
    scheduler_job_id: str | None = None
    tenant: str = ""
    watch: WatchRegistration | None = Field(
        None,
        description="Tell the cluster's monitor where the job now stands (a job watched by its cluster's monitor "
        "reports each transition there too; a final state ends the watch).",
    )
    lifecycle_audited: bool = Field(
        False,
        description="An earlier step audited this transition's ``job_lifecycle_event`` (local attempts before "
        "this activity, or the step it was to be reported with): it is not audited again.",
    )


# ---- the cluster monitor ----------------------------------------------------------------------------------------


def monitor_workflow_id(task_queue: str) -> str:
    """The monitor of the cluster whose task queue this is: ``cluster-monitor/<task queue>``.

    A chain id (job) has no ``/`` and a node's workflow is ``node-<node>@<cluster>``, so it collides with neither;
    one task queue per cluster makes it one monitor per cluster, whatever the number of workers serving it.
    """
    return f"cluster-monitor/{task_queue}"


class MonitorSettings(Model):
    """What a cluster's monitor needs: where it runs and how often it asks the scheduler."""

    cluster_id: str
    task_queue: str = Field(description="The cluster's task queue: the monitor and its queries run there.")
    poll_interval_seconds: float = Field(gt=0)
    vanished_grace_seconds: float = Field(
        120.0,
        ge=0,
        description="How long a job may be missing from the scheduler before it is called vanished.",
    )
    max_history_events: int = Field(2000, ge=100, description="Continue as new beyond this many events.")
    heartbeat_timeout_seconds: float = Field(
        30.0, gt=0, description="The jobs' activity heartbeat timeout: a round's is at least this."
    )


class WatchEntry(Model):
    """A watched job as its workflow last said it stands (the monitor tells it when the scheduler disagrees)."""

    scheduler_job_id: str = Field(max_length=128)
    state: JobState
    start_time: datetime | None = None
    version: int = Field(0, description="Set by the monitor: bumped by every registration of this job.")
    report_due: datetime | None = Field(
        None,
        description="The monitor sends this job's period usage records; the next one is due about then (the job's "
        "``period_due`` query says exactly when).",
    )


class WatchRegistration(Model):
    """A job workflow tells its cluster's monitor where it stands (signal-with-start of the monitor)."""

    workflow_id: str
    monitor: MonitorSettings
    entry: WatchEntry


class WatchedSet(Model):
    """The monitor's watch set (its ``watched`` query, read by its own poll activity; never in history)."""

    entries: dict[str, WatchEntry] = Field(default_factory=dict)


class MonitorInput(Model):
    settings: MonitorSettings
    watched: dict[str, WatchEntry] = Field(
        default_factory=dict, description="Carried across continue-as-new: workflow id -> entry."
    )
    next_version: int = 1
    rounds: int = 0


class PollInput(Model):
    cluster_id: str
    vanished_grace_seconds: float


class Ended(Model):
    workflow_id: str
    version: int


class PollOutput(Model):
    watched: int = 0
    signalled: int = 0
    ended: list[Ended] = Field(
        default_factory=list, description="Jobs told of a final state or gone: the monitor forgets them."
    )
    error: str | None = Field(
        None, max_length=300, description="The status query failed (not a state change)."
    )
    reported: int = Field(
        0, description="Period usage records the round sent (or found on chain) and signalled."
    )


class Observation(Model):
    """The monitor's signal to a job workflow: the scheduler's view of the job changed."""

    status: NativeStatus


class PeriodDue(Model):
    """A job's answer to its monitor's ``period_due`` query: the period record it would send now, and from when.

    ``report`` is None when the monitor is not to send the job's period records (the job is not running, has begun
    to finish, or does not take its records from the monitor).
    """

    report: UsageInput | None = None
    due_at: datetime | None = Field(
        None, description="When the period the record covers is due (job's clock)."
    )
    interval_seconds: float = Field(0.0, ge=0, description="The job's report interval.")
    started_at: datetime | None = Field(None, description="The start the job's report schedule counts from.")


class PeriodRecorded(Model):
    """The monitor's signal to a job workflow: it sent this period record (or the chain already held it)."""

    usage: UsageOutput


class CancelInput(Model):
    job_id: str
    cluster_id: str
    scheduler_job_id: str
    reason: str = ""


class UsageInput(Model):
    job_id: str
    tenant: str
    provider: str
    cluster_id: str
    scheduler_job_id: str
    sequence: int
    period_start: datetime
    previous_cumulative: UsageMetrics
    job_state: JobState
    is_final: bool = False
    report_accounting: bool = Field(False, description="With is_final: also report accounting and settle.")
    accept_partial: bool = Field(
        False,
        description="Close with the last reading when the scheduler has no final accounting (deadline, vanished).",
    )
    max_attempts: int = 0
    until_end: bool = Field(
        False,
        description="A period report that finds the job ended sends nothing (record_id None): the final record "
        "closes that period; a period ends with its reading. Set by jobs that wait for their cluster monitor "
        "(whose report can come before the monitor's news, and which space their reports themselves).",
    )
    storage_gb: int = Field(
        0, ge=0, description="The storage the provider accepted for the job (billed for as long as it ran)."
    )
    resources: Resources | None = Field(
        None,
        description="What the job asked for (the bound of its priced allocation); when absent the usage activity "
        "reads it from the job's spec on chain.",
    )
    watch: WatchRegistration | None = Field(
        None,
        description="Once the record is on chain, register the job with its cluster's monitor this way (its "
        "``report_due`` set: the monitor sends the job's next period records).",
    )
    then_report: TransitionInput | None = Field(
        None,
        description="With is_final: report this transition (the job's final state) once the record and its "
        "accounting are sent, as ``report_transition`` would; ``UsageOutput.reported`` says whether it went.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old(cls, data: Any) -> Any:
        # Up to v0.2.0 the input carried the whole job spec; a record needs its ids and what it asked for.
        if isinstance(data, dict) and "job" in data:
            job = data["job"]
            spec = job.model_dump() if isinstance(job, BaseModel) else job
            rest = {k: v for k, v in data.items() if k != "job"}
            resources = spec.get("resources") or {}
            storage = resources.get("storage_gb", 0)
            return {
                **rest,
                **{k: spec[k] for k in ("job_id", "tenant", "provider")},
                "storage_gb": storage,
                "resources": resources,
            }
        return data


class ParkInput(Model):
    """A job that cannot make progress without an operator: audited and logged where operators look."""

    job_id: str
    cluster_id: str
    state: JobState
    reason: str
    scheduler_job_id: str | None = None


class RecoverInput(Model):
    """What a recovery run needs to know before it closes a job an earlier run left open."""

    job_id: str
    workflow_id: str
    cluster_id: str
    scheduler_job_id: str | None = Field(None, description="Known scheduler job, or None: look it up.")


class RecoverOutput(Model):
    scheduler_job_id: str | None = None
    next_sequence: int = 1
    cumulative: UsageMetrics = Field(default_factory=UsageMetrics)
    last_period_end: datetime | None = None
    first_period_start: datetime | None = None
    scheduler_lost: bool = Field(
        False,
        description="The scheduler knows no job of this workflow, but usage records name one: it ran and is gone.",
    )


class UsageOutput(Model):
    record_id: str | None = Field(
        None, description="None when nothing was sent (retry_on_failure off, or the job had already ended)."
    )
    sequence: int | None = Field(
        None,
        description="The sequence of the record the report ended on: one past the one asked for when a final "
        "report found a period record under its sequence and followed it. None from releases before it.",
    )
    cumulative: UsageMetrics
    period_end: datetime
    charged: str | None = None
    refunded: str | None = None
    answered_at: datetime | None = Field(
        None,
        description="When the report_usage activity answered, on the worker's clock: a job workflow's clock stands "
        "still while a local activity runs (retries included), so the workflow times its next step from this. "
        "None from releases before it.",
    )
    reported: bool = Field(
        False, description="``UsageInput.then_report`` reached the chain; False: the workflow reports it."
    )


SubmitInput.model_rebuild()
UsageInput.model_rebuild()
SubmitReport.model_rebuild()
TransitionInput.model_rebuild()
WatchInput.model_rebuild()
WatchOutput.model_rebuild()
PeriodDue.model_rebuild()
PeriodRecorded.model_rebuild()
