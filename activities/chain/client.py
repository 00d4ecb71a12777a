"""The chain-client interface: what the provider side reads from and writes to the chain.

``LocalLedger`` (SQLite, embedded default) implements it; a client for a real VirtEngine chain implements the same
methods. Every write is idempotent so that a retried activity never duplicates anything: status reports carry the
state they move to (a repeat of the current state is a no-op), usage records are keyed by their deterministic id
(a duplicate id is ignored), accounting and settlement happen once per job.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from virtengine_hpc.models import (
    Cluster,
    Model,
    PricedQueue,
    SchedulingDecision,
    UsageMetrics,
    UsageRecord,
)
from virtengine_hpc.states import JobState
from virtengine_hpc.templates.model import TemplateRecord


class ChainJob(Model):
    """A job as the chain lists it. ``raw_spec`` is what the tenant submitted, not yet validated by us."""

    job_id: str
    raw_spec: dict[str, Any]
    state: JobState
    cancel_requested: bool = False
    escrow: Decimal = Decimal(0)
    block_height: int = 0
    created_at: datetime
    scheduler_job_id: str | None = Field(
        None, description="The scheduler job the provider last reported for it (status reports), if any."
    )


class StatusReport(Model):
    job_id: str
    state: JobState
    message: str = Field("", max_length=1024)
    exit_code: int | None = None
    scheduler_job_id: str | None = None
    cluster_id: str | None = None


class UsageSubmitResult(Model):
    accepted: list[str] = Field(default_factory=list)
    duplicates: list[str] = Field(default_factory=list)


class AccountingReport(Model):
    job_id: str
    cluster_id: str
    totals: UsageMetrics
    final_record_id: str
    record_count: int


class Settlement(Model):
    job_id: str
    provider: str
    tenant: str
    escrow: Decimal
    charged: Decimal
    refunded: Decimal
    settled_at: datetime


@runtime_checkable
class ChainClient(Protocol):
    async def current_height(self) -> int: ...

    async def pending_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[ChainJob]:
        """Jobs for this provider's cluster that no workflow has taken yet (state pending), oldest first: at most
        ``limit`` of them, after job ``after`` (paging). A job is listed for the cluster it is to run on: the
        active cluster of this provider its latest scheduling decision selects, else the one it asked for, or
        every cluster when it names none; so the poller of that cluster takes it within that cluster's limit."""
        ...

    async def count_pending_jobs(self, cluster_id: str, provider: str, after: str | None = None) -> int:
        """How many jobs ``pending_jobs`` would list after job ``after`` without a limit (a count, no listing)."""
        ...

    async def cancel_requested_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[str]:
        """Ids of this provider's non-final jobs on ``cluster_id`` (as ``pending_jobs`` assigns them, or where they
        reported running) whose tenant asked to cancel: first the jobs a workflow has taken (they may run, and
        be billed), then those still pending, each group in turns by tenant (every tenant's oldest request, then
        every tenant's second, and so on), so that a flood of cancels does not delay another tenant's cancel.
        At most ``limit`` of them, after job ``after`` in that order (paging); an ``after`` no longer listed
        starts from the first again."""
        ...

    async def open_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[ChainJob]:
        """This provider's jobs on ``cluster_id`` (or for no cluster in particular) that are not final on chain,
        pending ones included, oldest first: at most ``limit`` of them, after job ``after`` (paging). The
        reconciler reads them to find jobs that no open workflow owns."""
        ...

    async def get_job(self, job_id: str) -> ChainJob | None: ...

    async def get_cluster(self, cluster_id: str) -> Cluster | None: ...

    async def get_queue(self, offering_id: str) -> PricedQueue | None: ...

    async def get_decision(self, job_id: str) -> SchedulingDecision | None: ...

    async def request_scheduling(self, job_id: str, reason: str) -> SchedulingDecision:
        """Ask the chain for a new scheduling decision (permissive mode, missing or stale decision)."""
        ...

    async def report_status(self, report: StatusReport) -> None:
        """Move the job to ``report.state``; repeating the current state is a no-op, an illegal move raises."""
        ...

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        """Verify and store signed records; duplicates by id are ignored, a bad signature raises."""
        ...

    async def get_usage_record(self, record_id: str) -> UsageRecord | None: ...

    async def job_usage_records(self, job_id: str) -> list[UsageRecord]:
        """A job's stored records in sequence order (a recovery run continues from the last one)."""
        ...

    async def report_accounting(self, report: AccountingReport) -> Settlement:
        """Record the final accounting of a finished job and settle it from escrow (once)."""
        ...

    async def get_template(self, template_id: str) -> TemplateRecord | None:
        """A custom workload template as the chain holds it (signed, with governance's decision), if any."""
        ...
