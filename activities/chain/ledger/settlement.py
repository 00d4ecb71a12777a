"""Accounting and settlement: a finished job's final accounting is checked against its stored usage records and
settled from its escrow once (payment to the provider, the rest back to the tenant); a job that never ran is
refunded whole. Also what each job cost (``charges``, ``charge_breakdown``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import datetime
from decimal import Decimal

from activities.chain.client import (
    AccountingReport,
    Settlement,
)
from activities.chain.ledger.accounts import AccountsArea
from activities.chain.ledger.catalog import CatalogArea
from activities.chain.ledger.common import ROUNDING, UNIT, _text, _time
from activities.chain.ledger.views import ChargeBreakdown, JobCharge
from virtengine_hpc.errors import ChainError
from virtengine_hpc.models import (
    PricedQueue,
    UsageMetrics,
    UsageRecord,
)
from virtengine_hpc.pricing import rate_usage, usage_lines
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics


def compute_charge(metrics: UsageMetrics, queue: PricedQueue) -> Decimal:
    """The price of ``metrics`` at ``queue``'s rates, before the minimum charge and the escrow cap,
    unrounded (``virtengine_hpc.pricing.rate_usage``: the same lines ``ledger charges`` itemizes)."""
    return rate_usage(metrics, queue.pricing)


def used_anything(metrics: UsageMetrics) -> bool:
    """True when the job consumed something; only then does the queue's minimum charge apply.

    A job that ran for less than the scheduler's one-second resolution has no priced quantity (allocation x 0 s),
    but CPU time the scheduler measured shows it ran: it pays the minimum charge like any job that ran.
    """
    return any(
        value is not None and value > 0
        for value in (
            metrics.wall_clock_seconds,
            metrics.node_hours,
            metrics.cpu_core_seconds,
            metrics.gpu_seconds,
            metrics.memory_gb_seconds,
            metrics.storage_gb_hours,
            metrics.cpu_time_seconds,
        )
    )


def settle_amounts(metrics: UsageMetrics, queue: PricedQueue, escrow: Decimal) -> tuple[Decimal, Decimal]:
    """``(charged, refunded)`` for a job: the rated charge rounded to the unit, raised to the minimum charge
    when the job used anything, capped at the escrow; the rest of the escrow goes back to the tenant."""
    charge = compute_charge(metrics, queue).quantize(UNIT, rounding=ROUNDING)
    if used_anything(metrics):
        charge = max(charge, queue.pricing.minimum_charge.quantize(UNIT, rounding=ROUNDING))
    charge = min(charge, escrow)
    return charge, escrow - charge


class SettlementArea(AccountsArea, CatalogArea):
    """Final accounting, settlement, refunds and charges."""

    @staticmethod
    def _settlement(db: sqlite3.Connection, job_id: str) -> tuple[str, Settlement] | None:
        row = db.execute("SELECT kind, data FROM settlements WHERE job_id = ?", (job_id,)).fetchone()
        return (row["kind"], Settlement.model_validate_json(row["data"])) if row else None

    def settlement(self, job_id: str) -> Settlement | None:
        with self._tx(write=False) as db:
            found = self._settlement(db, job_id)
        return found[1] if found else None

    def _pay_out(
        self, db: sqlite3.Connection, row: sqlite3.Row, kind: str, charged: Decimal, now: datetime
    ) -> Settlement:
        escrow = Decimal(row["escrow"])
        refunded = escrow - charged
        settlement = Settlement(
            job_id=row["job_id"],
            provider=row["provider"],
            tenant=row["tenant"],
            escrow=escrow,
            charged=charged,
            refunded=refunded,
            settled_at=now,
        )
        if charged > 0:
            self._move(db, "payment", row["provider"], charged, row["job_id"], now)
        if refunded > 0:
            self._move(db, "refund", row["tenant"], refunded, row["job_id"], now)
        db.execute(
            "INSERT INTO settlements (job_id, kind, data) VALUES (?, ?, ?)",
            (row["job_id"], kind, settlement.model_dump_json()),
        )
        return settlement

    def _refund(self, db: sqlite3.Connection, row: sqlite3.Row, now: datetime) -> Settlement:
        found = self._settlement(db, row["job_id"])
        if found is not None:
            return found[1]
        return self._pay_out(db, row, "refund", Decimal(0), now)

    def refund_unstarted(self, job_id: str) -> Settlement:
        """Return the whole escrow of a finished job that has no usage records (it never ran, or its provider
        reported no usage at all). ``report_status`` does this by itself for a job that never ran; this is the
        operator's way out for the rest. Idempotent."""
        with self._tx(write=True) as db:
            row = self._job_row(db, job_id)
            found = self._settlement(db, job_id)
            if found is not None:
                return found[1]
            if not JobState(row["state"]).final:
                raise ChainError(f"job {job_id} is {row['state']}; only a finished job can be refunded")
            if self._has_records(db, job_id):
                raise ChainError(f"job {job_id} has usage records; it settles through its final accounting")
            return self._refund(db, row, self._now())

    def settle(self, report: AccountingReport) -> Settlement:
        """Check a job's final accounting against its stored records and settle it (see
        ``report_accounting``)."""
        now = self._now()
        with self._tx(write=True) as db:
            row = self._job_row(db, report.job_id)
            records = [
                UsageRecord.model_validate_json(r["data"])
                for r in db.execute(
                    "SELECT data FROM usage_records WHERE job_id = ? ORDER BY sequence", (report.job_id,)
                )
            ]
            self._check_accounting(report, records)
            queue = self._price(db, row)
            if queue is None:
                raise ChainError(f"job {report.job_id}: offering {row['offering_id']} has no priced queue")
            if queue.cluster_id != report.cluster_id:
                raise ChainError(
                    f"job {report.job_id}: offering {queue.offering_id} prices cluster {queue.cluster_id}, "
                    f"the accounting comes from {report.cluster_id}"
                )
            charged, _ = settle_amounts(report.totals, queue, Decimal(row["escrow"]))
            found = self._settlement(db, report.job_id)
            if found is not None:
                kind, existing = found
                if kind == "refund" and charged != existing.charged:
                    raise ChainError(
                        f"job {report.job_id} was already refunded as unstarted; its accounting charges "
                        f"{_text(charged)}"
                    )
                return existing
            return self._pay_out(db, row, "accounting", charged, now)

    @staticmethod
    def _check_accounting(report: AccountingReport, records: list[UsageRecord]) -> None:
        job = report.job_id
        finals = [r for r in records if r.is_final]
        if not finals:
            raise ChainError(f"job {job}: accounting before its final usage record")
        if finals[0].record_id != report.final_record_id:
            raise ChainError(
                f"job {job}: accounting names final record {report.final_record_id}, "
                f"the ledger holds {finals[0].record_id}"
            )
        if report.record_count != len(records):
            raise ChainError(
                f"job {job}: accounting counts {report.record_count} records, the ledger holds {len(records)}"
            )
        if records[0].cluster_id != report.cluster_id:
            raise ChainError(
                f"job {job}: accounting from {report.cluster_id}, records from {records[0].cluster_id}"
            )
        total = sum_metrics([r.metrics for r in records])
        if total != report.totals:
            wrong = [
                name
                for name in UsageMetrics.model_fields
                if getattr(total, name) != getattr(report.totals, name)
            ]
            raise ChainError(
                f"job {job}: accounting totals differ from the sum of its usage records in {', '.join(wrong)}"
            )

    async def report_accounting(self, report: AccountingReport) -> Settlement:
        """Settle a job from its escrow, once.

        The totals must equal the exact sum of the job's stored records, the final record must be stored, and
        the record count must match. The charge (``settle_amounts``) goes to the provider, the rest of the
        escrow back to the tenant. A repeat returns the same ``Settlement``.
        """
        return await asyncio.to_thread(self.settle, report)

    def _job_charge(self, db: sqlite3.Connection, row: sqlite3.Row) -> JobCharge:
        found = self._settlement(db, row["job_id"])
        charge = JobCharge(
            job_id=row["job_id"],
            tenant=row["tenant"],
            provider=row["provider"],
            offering_id=row["offering_id"],
            state=JobState(row["state"]),
            escrow=Decimal(row["escrow"]),
            created_at=_time(row["created_at"]),
        )
        if found is None:
            return charge
        kind, settlement = found
        return charge.model_copy(
            update={
                "settled": True,
                "kind": kind,
                "charged": settlement.charged,
                "refunded": settlement.refunded,
                "settled_at": settlement.settled_at,
            }
        )

    def charges(self, *, tenant: str | None = None, provider: str | None = None) -> list[JobCharge]:
        """Every job of a tenant (what it paid) or of a provider (what it earned), oldest first."""
        if tenant is None and provider is None:
            raise ChainError("name a tenant or a provider")
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT * FROM jobs WHERE (?1 IS NULL OR tenant = ?1) AND (?2 IS NULL OR provider = ?2) ORDER BY seq",
                (tenant, provider),
            ).fetchall()
            return [self._job_charge(db, row) for row in rows]

    def charge_breakdown(self, job_id: str) -> ChargeBreakdown:
        """A job's charge itemized from its stored usage records at its offering's prices."""
        with self._tx(write=False) as db:
            row = self._job_row(db, job_id)
            charge = self._job_charge(db, row)
            records = [
                UsageRecord.model_validate_json(r["data"])
                for r in db.execute(
                    "SELECT data FROM usage_records WHERE job_id = ? ORDER BY sequence", (job_id,)
                )
            ]
            queue = self._price(db, row)
        if not records or queue is None:
            return ChargeBreakdown(job=charge)
        totals = sum_metrics([r.metrics for r in records])
        rated = rate_usage(totals, queue.pricing)
        rounded = rated.quantize(UNIT, rounding=ROUNDING)
        minimum = queue.pricing.minimum_charge.quantize(UNIT, rounding=ROUNDING)
        applied = used_anything(totals) and minimum > rounded
        before_cap = minimum if applied else rounded
        return ChargeBreakdown(
            job=charge,
            totals=totals,
            lines=usage_lines(totals, queue.pricing),
            rated=rated,
            rounded=rounded,
            minimum_charge=minimum,
            minimum_applied=applied,
            capped_at_escrow=before_cap > charge.escrow,
        )
