"""Usage records: verified against the provider's registered keys, stored all or nothing, duplicates by id
ignored, each job's sequence continued without a gap and closed by its final record.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from datetime import UTC, datetime

from activities.chain.client import (
    UsageSubmitResult,
)
from activities.chain.ledger.catalog import CatalogArea
from activities.chain.ledger.common import _iso
from virtengine_hpc.errors import ChainError, SecurityError
from virtengine_hpc.models import (
    UsageRecord,
)
from virtengine_hpc.signing import public_key_from_b64
from virtengine_hpc.usage import record_id as make_record_id
from virtengine_hpc.usage import verify_record


class UsageArea(CatalogArea):
    """Signed usage records."""

    def _verify_signatures(self, records: Sequence[UsageRecord]) -> None:
        """Raise ``SecurityError`` naming the first record not signed by a registered key of its provider."""
        keys: dict[str, dict[str, str]] = {}
        for record in records:
            if record.provider not in keys:
                keys[record.provider] = self.provider_keys(record.provider)
            known = keys[record.provider]
            if not known:
                raise SecurityError(
                    f"usage record {record.record_id}: provider {record.provider} has no registered "
                    "signing key"
                )
            public_b64 = known.get(record.key_id)
            if public_b64 is None:
                raise SecurityError(
                    f"usage record {record.record_id}: key {record.key_id[:16]}... is not a registered "
                    f"key of provider {record.provider}"
                )
            if not verify_record(record, public_key_from_b64(public_b64)):
                raise SecurityError(f"usage record {record.record_id}: signature does not verify")

    def store_usage(self, records: Sequence[UsageRecord]) -> UsageSubmitResult:
        """Verify and store a batch of records, all or nothing (see ``submit_usage``)."""
        self._verify_signatures(records)
        accepted: list[str] = []
        duplicates: list[str] = []
        now = self._now()
        with self._tx(write=True) as db:
            seen: set[str] = set()
            for record in sorted(records, key=lambda r: (r.job_id, r.sequence)):
                exists = db.execute(
                    "SELECT 1 FROM usage_records WHERE record_id = ?", (record.record_id,)
                ).fetchone()
                if exists or record.record_id in seen:
                    duplicates.append(record.record_id)
                    continue
                self._check_record(db, record)
                db.execute(
                    "INSERT INTO usage_records (record_id, job_id, sequence, is_final, data, received_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        record.record_id,
                        record.job_id,
                        record.sequence,
                        int(record.is_final),
                        record.model_dump_json(),
                        _iso(now),
                    ),
                )
                seen.add(record.record_id)
                accepted.append(record.record_id)
        order = {r.record_id: i for i, r in enumerate(records)}
        return UsageSubmitResult(
            accepted=sorted(accepted, key=order.__getitem__),
            duplicates=sorted(duplicates, key=order.__getitem__),
        )

    def _check_record(self, db: sqlite3.Connection, record: UsageRecord) -> None:
        """A new record must belong to a known job of its provider and continue its sequence without a gap."""
        rid = record.record_id
        expected_id = make_record_id(record.cluster_id, record.job_id, record.sequence)
        if rid != expected_id:
            raise ChainError(f"usage record {rid}: id must be {expected_id}")
        row = db.execute("SELECT provider, tenant FROM jobs WHERE job_id = ?", (record.job_id,)).fetchone()
        if row is None:
            raise ChainError(f"usage record {rid}: unknown job {record.job_id}")
        if row["provider"] != record.provider:
            raise SecurityError(f"usage record {rid}: job {record.job_id} belongs to another provider")
        if row["tenant"] != record.tenant:
            raise ChainError(f"usage record {rid}: tenant {record.tenant} is not the job's tenant")
        last = db.execute(
            "SELECT sequence, is_final, data FROM usage_records WHERE job_id = ? "
            "ORDER BY sequence DESC LIMIT 1",
            (record.job_id,),
        ).fetchone()
        if last is not None and last["is_final"]:
            raise ChainError(
                f"usage record {rid}: job {record.job_id} already has its final record "
                f"(sequence {last['sequence']})"
            )
        expected = 1 if last is None else last["sequence"] + 1
        if record.sequence != expected:
            raise ChainError(
                f"usage record {rid}: sequence {record.sequence} leaves a gap, expected {expected}",
                code="usage_sequence_gap",
            )
        if last is not None:
            first_cluster = UsageRecord.model_validate_json(last["data"]).cluster_id
            if first_cluster != record.cluster_id:
                raise ChainError(
                    f"usage record {rid}: job's earlier records came from cluster {first_cluster}"
                )

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        """Verify and store signed records, all or nothing.

        Every signature must verify with a registered key of the record's provider, else ``SecurityError``
        naming the record and nothing of the batch is stored. A record whose id is already stored is a
        duplicate: ignored and listed in ``duplicates``. New records of a job must continue its sequence
        (previous + 1), and nothing may follow its final record (``ChainError``).
        """
        return await asyncio.to_thread(self.store_usage, records)

    def usage_record(self, rid: str) -> UsageRecord | None:
        with self._tx(write=False) as db:
            row = db.execute("SELECT data FROM usage_records WHERE record_id = ?", (rid,)).fetchone()
        return UsageRecord.model_validate_json(row["data"]) if row else None

    async def get_usage_record(self, record_id: str) -> UsageRecord | None:
        return await asyncio.to_thread(self.usage_record, record_id)

    def usage_record_texts(self, job_id: str) -> list[tuple[str, str]]:
        """A job's stored records as ``(record_id, stored JSON)`` in sequence order, unparsed: what ``usage verify``
        and ``usage export`` read, so that one damaged row is reported as such instead of stopping the reader."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT record_id, data FROM usage_records WHERE job_id = ? ORDER BY sequence", (job_id,)
            ).fetchall()
        return [(r["record_id"], r["data"]) for r in rows]

    def jobs_between(self, since: datetime, until: datetime) -> list[str]:
        """Jobs to account for in ``[since, until]`` (to the second), oldest first: every job that reached a
        scheduler (it has a scheduler job id) and was on chain then (created before the end, last changed after the
        start), and every job with a usage record whose period overlaps it."""

        def second(moment: datetime) -> str:
            return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")

        start, end = second(since), second(until)
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT job_id FROM jobs WHERE (scheduler_job_id IS NOT NULL "
                "AND substr(created_at, 1, 19) <= ? AND substr(updated_at, 1, 19) >= ?) "
                "OR job_id IN (SELECT job_id FROM usage_records "
                "WHERE substr(json_extract(data, '$.period_end'), 1, 19) >= ? "
                "AND substr(json_extract(data, '$.period_start'), 1, 19) <= ?) ORDER BY seq",
                (end, start, start, end),
            ).fetchall()
        return [r["job_id"] for r in rows]

    def usage_records(self, job_id: str) -> list[UsageRecord]:
        """A job's stored records in sequence order, exactly as received (signatures included)."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT data FROM usage_records WHERE job_id = ? ORDER BY sequence", (job_id,)
            ).fetchall()
        return [UsageRecord.model_validate_json(r["data"]) for r in rows]

    async def job_usage_records(self, job_id: str) -> list[UsageRecord]:
        return await asyncio.to_thread(self.usage_records, job_id)
