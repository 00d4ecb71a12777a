"""Jobs: what tenants submit and cancel, what the provider's pollers list (pending, cancel requests, open jobs),
and the status reports that move a job along its state machine.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from datetime import datetime
from decimal import Decimal
from typing import Any

from activities.chain.client import (
    ChainJob,
    StatusReport,
)
from activities.chain.ledger.common import _iso, _text, _time, to_amount
from activities.chain.ledger.settlement import SettlementArea
from activities.chain.ledger.views import LedgerJob, Transition
from activities.chain.schema import (
    CANCEL_SQL,
    COUNT_PENDING_SQL,
    HISTORY_SQL,
    OPEN_SQL,
    PENDING_SQL,
    RAN_SQL,
)
from virtengine_hpc.errors import ChainError, IllegalTransition
from virtengine_hpc.models import (
    Cluster,
    PricedQueue,
)
from virtengine_hpc.states import JobState, transition_path

MAX_RAW_SPEC_BYTES = 2 * 1024 * 1024
"""A chain limits transaction size; a job spec (script at most 1 MiB, plus fields) must fit in this."""


_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""Job ids are chain-assigned on a real chain; one chosen here must still be a valid identifier."""


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return _text(value)
    if isinstance(value, datetime):
        return _iso(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _short_str(raw: dict[str, Any], key: str, *, required: bool) -> str | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ChainError(f"job spec field {key!r} must be a non-empty string of at most 256 characters")
    return value


class JobsArea(SettlementArea):
    """Tenant jobs, the provider's job lists and status reports."""

    def submit_job(self, raw_spec: dict[str, Any], escrow: Decimal | str | int | None = None) -> str:
        """Store a tenant's job as the chain would, escrowing its budget; returns the job id.

        Permissive like a chain: the spec is stored as given even if the provider's validation will reject it
        (the provider must do that itself). It needs ``tenant``, ``provider`` and ``offering_id``; ``job_id``
        is generated (``JOB-<n>``) when absent. ``escrow`` (default: the spec's ``max_price``, else 0) is
        taken from the tenant's balance; too little raises ``ChainError``.
        """
        if not isinstance(raw_spec, dict):
            raise ChainError("a job spec must be a JSON object")
        tenant = _short_str(raw_spec, "tenant", required=True)
        provider = _short_str(raw_spec, "provider", required=True)
        offering_id = _short_str(raw_spec, "offering_id", required=True)
        assert tenant is not None and provider is not None and offering_id is not None
        amount = to_amount(raw_spec.get("max_price", 0) if escrow is None else escrow, "escrow")
        wanted = raw_spec.get("job_id")
        if wanted is not None and (not isinstance(wanted, str) or not _JOB_ID_RE.fullmatch(wanted)):
            raise ChainError(f"job_id {str(wanted)[:80]!r} must match {_JOB_ID_RE.pattern}")
        target = raw_spec.get("cluster_id")
        now = self._now()
        with self._tx(write=True) as db:
            job_id = wanted
            if job_id is None:
                while True:
                    job_id = f"JOB-{self._next_number(db, 'next_job_number')}"
                    if not db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone():
                        break
            elif db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone():
                raise ChainError(f"job {job_id} already exists")
            spec = {**raw_spec, "job_id": job_id}
            try:
                spec_json = json.dumps(spec, default=_json_default, ensure_ascii=False)
            except (TypeError, ValueError) as exc:
                raise ChainError(f"job spec is not JSON: {exc}") from None
            if len(spec_json.encode()) > MAX_RAW_SPEC_BYTES:
                raise ChainError(f"job spec is larger than {MAX_RAW_SPEC_BYTES} bytes")
            if not isinstance(target, str) or not target:
                queue = self._queue(db, offering_id)
                target = queue.cluster_id if queue else None
            if amount > 0:
                self._move(db, "escrow", tenant, -amount, job_id, now)
            self._fix_price(db, job_id, offering_id, "submitted", now)
            db.execute(
                "INSERT INTO jobs (job_id, tenant, provider, offering_id, target_cluster_id, raw_spec, "
                "state, escrow, block_height, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    tenant,
                    provider,
                    offering_id,
                    target,
                    spec_json,
                    JobState.PENDING.value,
                    _text(amount),
                    self.height_at(now),
                    _iso(now),
                    _iso(now),
                ),
            )
            db.execute(
                HISTORY_SQL,
                (
                    job_id,
                    None,
                    JobState.PENDING.value,
                    "submitted by tenant",
                    None,
                    _iso(now),
                    self.height_at(now),
                ),
            )
        return job_id

    def request_cancel(self, job_id: str, *, tenant: str | None = None) -> bool:
        """The tenant asks to cancel; the provider's poller sees it in ``cancel_requested_jobs``.

        Returns False when the job is already final (nothing to cancel). ``tenant``, when given, must own the
        job.
        """
        with self._tx(write=True) as db:
            row = self._job_row(db, job_id)
            if tenant is not None and row["tenant"] != tenant:
                raise ChainError(f"job {job_id} does not belong to {tenant}")
            if JobState(row["state"]).final:
                return False
            db.execute(
                "UPDATE jobs SET cancel_requested = 1, updated_at = ? WHERE job_id = ?",
                (_iso(self._now()), job_id),
            )
            return True

    @staticmethod
    def _ledger_job(row: sqlite3.Row) -> LedgerJob:
        return LedgerJob(
            job_id=row["job_id"],
            tenant=row["tenant"],
            provider=row["provider"],
            offering_id=row["offering_id"],
            target_cluster_id=row["target_cluster_id"],
            cluster_id=row["cluster_id"],
            state=JobState(row["state"]),
            status_message=row["status_message"],
            exit_code=row["exit_code"],
            scheduler_job_id=row["scheduler_job_id"],
            cancel_requested=bool(row["cancel_requested"]),
            taken=bool(row["taken"]),
            escrow=Decimal(row["escrow"]),
            block_height=row["block_height"],
            created_at=_time(row["created_at"]),
            updated_at=_time(row["updated_at"]),
            raw_spec=json.loads(row["raw_spec"]),
        )

    @staticmethod
    def _chain_job(row: sqlite3.Row) -> ChainJob:
        return ChainJob(
            job_id=row["job_id"],
            raw_spec=json.loads(row["raw_spec"]),
            state=JobState(row["state"]),
            cancel_requested=bool(row["cancel_requested"]),
            escrow=Decimal(row["escrow"]),
            block_height=row["block_height"],
            created_at=_time(row["created_at"]),
            scheduler_job_id=row["scheduler_job_id"],
        )

    def job(self, job_id: str) -> LedgerJob | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._ledger_job(row) if row else None

    def jobs(
        self, *, state: JobState | str | None = None, provider: str | None = None, tenant: str | None = None
    ) -> list[LedgerJob]:
        wanted = None if state is None else JobState(state).value
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT * FROM jobs WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR provider = ?2) "
                "AND (?3 IS NULL OR tenant = ?3) ORDER BY seq",
                (wanted, provider, tenant),
            ).fetchall()
        return [self._ledger_job(r) for r in rows]

    def history(self, job_id: str) -> list[Transition]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT * FROM job_history WHERE job_id = ? ORDER BY id", (job_id,)).fetchall()
        return [
            Transition(
                from_state=JobState(r["from_state"]) if r["from_state"] else None,
                to_state=JobState(r["to_state"]),
                message=r["message"],
                exit_code=r["exit_code"],
                at=_time(r["at"]),
                block_height=r["block_height"],
            )
            for r in rows
        ]

    def _pending_jobs(self, cluster_id: str, provider: str, limit: int, after: str | None) -> list[ChainJob]:
        with self._tx(write=False) as db:
            rows = db.execute(PENDING_SQL, (provider, cluster_id, max(0, limit), after)).fetchall()
        return [self._chain_job(r) for r in rows]

    async def pending_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[ChainJob]:
        """Pending jobs of ``provider`` for ``cluster_id`` (decided for it, else asked for it, or for no cluster in
        particular), oldest first, after job ``after`` (an unknown ``after`` starts from the oldest).

        A job stays listed until its workflow reports any status or someone calls ``mark_taken``; the poller
        starts workflows with the job id as workflow id, so listing a job twice never starts it twice.
        """
        return await asyncio.to_thread(self._pending_jobs, cluster_id, provider, limit, after)

    def _count_pending_jobs(self, cluster_id: str, provider: str, after: str | None) -> int:
        with self._tx(write=False) as db:
            return int(db.execute(COUNT_PENDING_SQL, (provider, cluster_id, after)).fetchone()[0])

    async def count_pending_jobs(self, cluster_id: str, provider: str, after: str | None = None) -> int:
        """How many jobs ``pending_jobs`` would list after job ``after``, all of them, without reading them."""
        return await asyncio.to_thread(self._count_pending_jobs, cluster_id, provider, after)

    def _mark_taken(self, job_id: str) -> None:
        with self._tx(write=True) as db:
            row = self._job_row(db, job_id)
            db.execute("UPDATE jobs SET taken = 1 WHERE job_id = ?", (job_id,))
            self._fix_price(db, job_id, row["offering_id"], "taken", self._now())

    async def mark_taken(self, job_id: str) -> None:
        """Hide a pending job from ``pending_jobs`` (idempotent). Call it only after the job's workflow
        started (or was found already started): a mark before a crash would otherwise lose the job."""
        await asyncio.to_thread(self._mark_taken, job_id)

    def _cancel_requested_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None
    ) -> list[str]:
        with self._tx(write=False) as db:
            rows = db.execute(CANCEL_SQL, (provider, cluster_id, after, max(0, limit))).fetchall()
        return [r["job_id"] for r in rows]

    async def cancel_requested_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[str]:
        """The cancel requests in the chain's order (``ChainClient``), ``limit`` at a time after job ``after``; an
        ``after`` no longer in the list (its job ended, or its request moved) starts from the first again."""
        return await asyncio.to_thread(self._cancel_requested_jobs, cluster_id, provider, limit, after)

    def _open_jobs(self, cluster_id: str, provider: str, limit: int, after: str | None) -> list[ChainJob]:
        with self._tx(write=False) as db:
            rows = db.execute(OPEN_SQL, (provider, cluster_id, after, max(0, limit))).fetchall()
        return [self._chain_job(r) for r in rows]

    async def open_jobs(
        self, cluster_id: str, provider: str, limit: int, after: str | None = None
    ) -> list[ChainJob]:
        """Non-final jobs of ``provider`` on ``cluster_id`` (or for no cluster in particular), oldest first, after
        job ``after`` (an unknown ``after`` starts from the oldest)."""
        return await asyncio.to_thread(self._open_jobs, cluster_id, provider, limit, after)

    def _get_job(self, job_id: str) -> ChainJob | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return self._chain_job(row) if row else None

    async def get_job(self, job_id: str) -> ChainJob | None:
        return await asyncio.to_thread(self._get_job, job_id)

    async def get_cluster(self, cluster_id: str) -> Cluster | None:
        return await asyncio.to_thread(self.cluster, cluster_id)

    async def get_queue(self, offering_id: str) -> PricedQueue | None:
        return await asyncio.to_thread(self.queue, offering_id)

    def apply_status(self, report: StatusReport) -> None:
        """Move a job along its state machine (see ``report_status``)."""
        now = self._now()
        with self._tx(write=True) as db:
            row = self._job_row(db, report.job_id)
            old = JobState(row["state"])
            db.execute("UPDATE jobs SET taken = 1 WHERE job_id = ?", (report.job_id,))
            self._fix_price(db, report.job_id, row["offering_id"], "taken", now)
            if report.state == old:
                return
            path = transition_path(old, report.state)
            if not path:
                raise IllegalTransition(
                    f"job {report.job_id}: illegal transition {old.value} -> {report.state.value}"
                )
            height = self.height_at(now)
            previous = old
            for step in path:
                implied = step != report.state
                db.execute(
                    HISTORY_SQL,
                    (
                        report.job_id,
                        previous.value,
                        step.value,
                        f"implied by a report of {report.state.value}" if implied else report.message,
                        None if implied else report.exit_code,
                        _iso(now),
                        height,
                    ),
                )
                previous = step
            db.execute(
                "UPDATE jobs SET state = ?, status_message = ?, exit_code = COALESCE(?, exit_code), "
                "scheduler_job_id = COALESCE(?, scheduler_job_id), cluster_id = COALESCE(?, cluster_id), "
                "updated_at = ? WHERE job_id = ?",
                (
                    report.state.value,
                    report.message,
                    report.exit_code,
                    report.scheduler_job_id,
                    report.cluster_id,
                    _iso(now),
                    report.job_id,
                ),
            )
            if (
                report.state.final
                and self._never_ran(db, report.job_id)
                and not self._has_records(db, report.job_id)
            ):
                self._refund(db, row, now)

    async def report_status(self, report: StatusReport) -> None:
        """Move the job to ``report.state``.

        Repeating the current state is a no-op (periodic reports while running are normal). A forward jump the
        state machine can fill in (queued -> completed for a job that finished between polls) is accepted and
        its implied steps are recorded; a backward move other than a requeue, or any move out of a final
        state, raises ``IllegalTransition``. Any report marks the job as taken (it leaves ``pending_jobs``). A
        job that reaches a final state without ever running and without usage records gets its escrow
        refunded.
        """
        await asyncio.to_thread(self.apply_status, report)

    @staticmethod
    def _never_ran(db: sqlite3.Connection, job_id: str) -> bool:
        return not db.execute(RAN_SQL, (job_id,)).fetchone()
