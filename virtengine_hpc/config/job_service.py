"""How the service runs jobs (``hpc.job_service``), reports usage, retries activities and audits."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field

from virtengine_hpc.config.base import Duration, Section


class JobServiceConfig(Section):
    """How jobs are taken from the chain and how long they may take (seed: ``hpc.job_service``)."""

    job_poll_interval: Duration = Field(timedelta(seconds=15), description="How often the chain is polled.")
    job_timeout_default: Duration = Field(
        timedelta(hours=24),
        description="The walltime of a job whose spec names none (the longest it may run). It does not limit how "
        "long a job waits in the queue: that is max_queue_wait.",
    )
    max_concurrent_jobs: int = Field(
        100,
        ge=1,
        le=100_000,
        description="Jobs in flight at once on the cluster, whatever the number of pollers; the rest wait on chain.",
    )
    start_concurrency: int = Field(
        4,
        ge=1,
        le=512,
        description="Workflow starts the poller has in flight at once while it takes pending jobs. A single "
        "SQLite dev server gains nothing above 4; a Temporal cluster with several history shards gains more.",
    )
    cancel_concurrency: int = Field(
        8,
        ge=1,
        le=512,
        description="Tenant cancellations the poller forwards at once (a signal, or for a job without a workflow a "
        "start with the cancel in it). Each round takes those of running jobs first, and in turns by tenant, so a "
        "tenant's flood of cancels cannot delay another tenant's.",
    )
    intake_lease: Duration = Field(
        timedelta(seconds=30),
        ge=timedelta(seconds=10),
        description="Term of the lease that lets one poller of a cluster at a time start jobs (so that several "
        "pollers never run more than max_concurrent_jobs). The holder renews it while it lives; if it dies, "
        "another poller takes over within two terms.",
    )
    max_queue_wait: Duration | None = Field(
        None,
        description="Cancel a job that has waited this long in the scheduler's queue without starting and report "
        "it timed out. Unset (the default): no limit, long queues are normal on HPC clusters.",
    )
    walltime_grace: Duration = Field(
        timedelta(minutes=2),
        description="How long past its walltime (counted in running time only: suspended time does not count) a "
        "job may run before the provider cancels it and reports it timed out; the scheduler normally ends it "
        "first.",
    )
    reconcile_interval: Duration = Field(
        timedelta(seconds=60),
        gt=timedelta(0),
        description="How often the poller's reconciler looks for chain jobs that are not final while no workflow "
        "is open for them, and starts a run that closes each (docs/operations.md). A job whose workflow "
        "closed reaches a final chain state within about this plus one such run.",
    )
    activity_heartbeat_timeout: Duration = Field(
        timedelta(seconds=30),
        ge=timedelta(seconds=5),
        le=timedelta(minutes=10),
        description="How long Temporal waits for a job activity's heartbeat (sent every 2 s while it runs) before "
        "it gives the attempt up and starts a retry, perhaps on another worker: a dead worker's submit, usage "
        "report or cancel is taken over after about this long. Too short, and a loaded but alive worker loses "
        "attempts it is still running (10 s lost 412 attempts with 1,000 jobs on one 2-core host, 30 s lost 14; "
        "docs/benchmarks.md). A job's watch waits at least four scheduler poll intervals. Fixed per job when it "
        "starts.",
    )
    cluster_monitor: bool = Field(
        True,
        description="Watch jobs through one cluster monitor workflow per cluster (one status query per poll "
        "interval, whatever the number of workers; a watched job holds no activity), whose round also sends "
        "running jobs' period usage records. False: each job started from then on waits in a heartbeating watch "
        "activity of its own, batched per worker process, and sends its own records, as before 0.4. Fixed per "
        "job when it starts: a running job keeps the way it began with.",
    )
    sweep_interval: Duration | None = Field(
        timedelta(seconds=60),
        gt=timedelta(0),
        description="How often the poller lists, in one scheduler query per cluster, the live jobs that carry "
        "this provider's marker of a workflow and every live job of a tenant's account, and looks for those no "
        "workflow names: the duplicate of a submit whose request the scheduler completed after the retry had "
        "checked, a job whose workflow has closed while its chain job is settled (docs/reliability.md), or a job a "
        "tenant submitted itself, which carries no valid marker (docs/operations.md). Each round also reads, in one "
        "query, the tenants' accounts' jobs that ended since the previous round began and reports those that ran unseen "
        "(unowned_job_found, ended: true). Null: no sweep. SLURM and "
        "MOAB (the others cannot list their jobs).",
    )
    sweep_lookback: Duration = Field(
        timedelta(hours=24),
        gt=timedelta(0),
        description="How far back a poller's first sweep round reads accounting for jobs of the tenants' "
        "accounts that ran and ended unseen (before this poller started, while no poller swept): back to the "
        "last round this host's pollers made (kept in the state directory), but never further than this; this "
        "far when no such round is kept (a first start, a takeover on another host).",
    )
    unowned_jobs: Literal["cancel", "report"] = Field(
        "cancel",
        description="What the sweep does with a job no workflow names: cancel it (audit duplicate_job_cancelled "
        "or unowned_job_cancelled), or only report it (audit unowned_job_found, once) and leave it running.",
    )
    enable_state_recovery: bool = Field(
        True, description="Kept for compatibility: recovery always comes from Temporal's workflow history."
    )
    vanished_job_grace: Duration = Field(
        timedelta(minutes=2),
        description="How long a job may be missing from both queue and accounting before it is failed as vanished "
        "(accounting lags the queue by seconds).",
    )
    state_store_path: Path = Field(
        Path("/var/lib/virtengine/hpc-state"),
        description="Local state (LocalLedger file, local adapter jobs).",
    )
    continue_as_new_after_events: int = Field(
        5000,
        ge=200,
        le=9000,
        description="A job's workflow starts a fresh run (continue-as-new, state carried) once its history "
        "holds this many events, or earlier when Temporal suggests it (4,096 events on a default server). "
        "Keeps every run well below Temporal's 10,240-event warning, whatever the job's duration.",
    )


class UsageReportingConfig(Section):
    """Signed usage records and final accounting (seed: ``hpc.usage_reporting``)."""

    enabled: bool = Field(
        True, description="Emit signed usage records while jobs run and final accounting when they end."
    )
    report_interval: Duration = Field(timedelta(minutes=5), description="Period of signed usage records.")
    batch_size: int = Field(50, ge=1, le=10_000, description="Usage records per chain submission.")
    retry_on_failure: bool = Field(
        True, description="Retry failed usage submissions (records are never dropped)."
    )


class RetryConfig(Section):
    """Retry policy of the job workflow's activities (scheduler and chain calls)."""

    max_retries: int = Field(
        3,
        ge=0,
        le=100,
        description="Retries of a failed activity (scheduler or chain call) before the error is final.",
    )
    initial_backoff: Duration = Field(timedelta(seconds=1), description="Wait before the first retry.")
    max_backoff: Duration = Field(timedelta(seconds=30), description="Longest wait between two retries.")
    backoff_multiplier: float = Field(
        2.0, ge=1.0, le=10.0, description="Each wait is the previous one times this, up to max_backoff."
    )


class AuditConfig(Section):
    """The append-only, hash-chained audit log and which event categories it records."""

    enabled: bool = Field(True, description="Write the hash-chained audit log; false writes nothing at all.")
    log_path: Path = Field(
        Path("/var/log/virtengine/hpc-audit.log"),
        description="The audit log file (JSON lines); its directory is created.",
    )
    log_job_events: bool = Field(
        True,
        description="Record job events (submitted, lifecycle, validation and submission failures, status).",
    )
    log_security_events: bool = Field(
        True,
        description="Record security, routing and node events (routing violations, bad signatures, rejected heartbeats).",
    )
    log_usage_reports: bool = Field(True, description="Record usage, accounting and settlement events.")
