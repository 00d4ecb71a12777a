"""What the ledger's inspection methods return (the CLI, the demo and the tests read them)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

from pydantic import Field

from virtengine_hpc.models import (
    Model,
    UsageMetrics,
)
from virtengine_hpc.pricing import PriceLine
from virtengine_hpc.states import JobState


class LedgerJob(Model):
    """Everything the ledger holds about one job (``ChainJob`` is the provider's narrower view)."""

    job_id: str
    tenant: str
    provider: str
    offering_id: str
    target_cluster_id: str | None = Field(
        None, description="The cluster the job asked for (or its offering's)."
    )
    cluster_id: str | None = Field(None, description="The cluster the provider reported running it on.")
    state: JobState
    status_message: str = ""
    exit_code: int | None = None
    scheduler_job_id: str | None = None
    cancel_requested: bool = False
    taken: bool = False
    escrow: Decimal
    block_height: int
    created_at: datetime
    updated_at: datetime
    raw_spec: dict[str, Any]


class Transition(Model):
    """One accepted state change of a job (``implied`` when filled in for a skipped intermediate state)."""

    from_state: JobState | None
    to_state: JobState
    message: str = ""
    exit_code: int | None = None
    at: datetime
    block_height: int


class Transfer(Model):
    """One balance movement: ``fund``, ``escrow`` (negative, tenant), ``payment`` (provider), ``refund``
    (tenant)."""

    at: datetime
    kind: Literal["fund", "escrow", "payment", "refund"]
    account: str
    amount: Decimal
    job_id: str | None = None


class JobCharge(Model):
    """What a job costs its tenant and earns its provider: escrow, and once settled, charged and refunded."""

    job_id: str
    tenant: str
    provider: str
    offering_id: str
    state: JobState
    escrow: Decimal
    settled: bool = False
    kind: Literal["accounting", "refund"] | None = Field(
        None, description="How it settled: final accounting, or a refund of a job that never ran."
    )
    charged: Decimal = Decimal(0)
    refunded: Decimal = Decimal(0)
    settled_at: datetime | None = None
    created_at: datetime


class ChargeBreakdown(Model):
    """A job's charge itemized: usage totals priced line by line, then rounding, minimum charge and escrow cap."""

    job: JobCharge
    totals: UsageMetrics | None = Field(
        None, description="Sum of the job's usage records (None: no records)."
    )
    lines: list[PriceLine] = Field(default_factory=list)
    rated: Decimal = Decimal(0)
    rounded: Decimal = Decimal(0)
    minimum_charge: Decimal = Decimal(0)
    minimum_applied: bool = False
    capped_at_escrow: bool = False
