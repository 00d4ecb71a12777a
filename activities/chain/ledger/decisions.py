"""Scheduling decisions: the cluster the chain's scheduler chose for a job (recorded by an operator or a test,
or chosen here when a provider asks for one).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import datetime
from typing import Any

from activities.chain.ledger.core import LedgerCore
from virtengine_hpc.errors import ChainError
from virtengine_hpc.models import (
    Cluster,
    SchedulingDecision,
)


class DecisionsArea(LedgerCore):
    """Scheduling decisions."""

    def _insert_decision(
        self,
        db: sqlite3.Connection,
        job_id: str,
        cluster_id: str,
        *,
        is_fallback: bool,
        fallback_reason: str | None,
        decision_reason: str,
        block_height: int,
        created_at: datetime,
    ) -> SchedulingDecision:
        decision = SchedulingDecision(
            decision_id=f"DEC-{self._next_number(db, 'next_decision_number')}",
            job_id=job_id,
            selected_cluster_id=cluster_id,
            is_fallback=is_fallback,
            fallback_reason=fallback_reason,
            decision_reason=decision_reason,
            block_height=block_height,
            created_at=created_at,
        )
        db.execute(
            "INSERT INTO decisions (decision_id, job_id, data) VALUES (?, ?, ?)",
            (decision.decision_id, job_id, decision.model_dump_json()),
        )
        return decision

    def create_decision(
        self,
        job_id: str,
        cluster_id: str,
        *,
        is_fallback: bool = False,
        fallback_reason: str | None = None,
        decision_reason: str = "recorded by operator",
        block_height: int | None = None,
        created_at: datetime | None = None,
    ) -> SchedulingDecision:
        """Record a scheduling decision for a job (tests and demo; the chain's scheduler in real life).

        An old ``block_height`` without ``created_at`` is dated at that block's time, so the decision is stale
        both by blocks and by seconds. The cluster need not exist: routing must cope with decisions for
        unknown clusters.
        """
        if block_height is not None and block_height < 0:
            raise ChainError("block_height must not be negative")
        now = self._now()
        height = self.height_at(now) if block_height is None else block_height
        when = created_at or (now if block_height is None else self.time_of_height(max(1, block_height)))
        with self._tx(write=True) as db:
            self._job_row(db, job_id)
            try:
                return self._insert_decision(
                    db,
                    job_id,
                    cluster_id,
                    is_fallback=is_fallback,
                    fallback_reason=fallback_reason,
                    decision_reason=decision_reason,
                    block_height=height,
                    created_at=when,
                )
            except ValueError as exc:
                raise ChainError(f"invalid decision: {exc}") from None

    def decisions(self, job_id: str) -> list[SchedulingDecision]:
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT data FROM decisions WHERE job_id = ? ORDER BY seq", (job_id,)
            ).fetchall()
        return [SchedulingDecision.model_validate_json(r["data"]) for r in rows]

    def _get_decision(self, job_id: str) -> SchedulingDecision | None:
        with self._tx(write=False) as db:
            row = db.execute(
                "SELECT data FROM decisions WHERE job_id = ? ORDER BY seq DESC LIMIT 1", (job_id,)
            ).fetchone()
        return SchedulingDecision.model_validate_json(row["data"]) if row else None

    async def get_decision(self, job_id: str) -> SchedulingDecision | None:
        """The job's latest decision."""
        return await asyncio.to_thread(self._get_decision, job_id)

    def schedule(self, job_id: str, reason: str) -> SchedulingDecision:
        """Pick an active cluster of the job's provider with room for it and record a decision at the current
        height.

        Prefers the cluster the job asked for (or its offering's); choosing another one is a fallback,
        recorded with its reason. Capacity counts only when a cluster reports its node totals.
        """
        now = self._now()
        with self._tx(write=True) as db:
            row = self._job_row(db, job_id)
            spec = json.loads(row["raw_spec"])
            nodes = _requested_nodes(spec)
            preferred = row["target_cluster_id"]
            rows = db.execute(
                "SELECT data FROM clusters WHERE provider = ? ORDER BY cluster_id", (row["provider"],)
            ).fetchall()
            candidates = [
                c
                for c in (Cluster.model_validate_json(r["data"]) for r in rows)
                if c.state == "active" and (c.total_nodes == 0 or c.available_nodes >= nodes)
            ]
            if not candidates:
                raise ChainError(
                    f"no active cluster of provider {row['provider']} has room for job {job_id} "
                    f"({nodes} nodes)"
                )
            chosen = next((c for c in candidates if c.cluster_id == preferred), candidates[0])
            fallback = preferred is not None and chosen.cluster_id != preferred
            return self._insert_decision(
                db,
                job_id,
                chosen.cluster_id,
                is_fallback=fallback,
                fallback_reason=(
                    f"requested cluster {preferred} is unavailable or full" if fallback else None
                ),
                decision_reason=reason[:512],
                block_height=self.height_at(now),
                created_at=now,
            )

    async def request_scheduling(self, job_id: str, reason: str) -> SchedulingDecision:
        return await asyncio.to_thread(self.schedule, job_id, reason)


def _requested_nodes(spec: dict[str, Any]) -> int:
    resources = spec.get("resources")
    nodes = resources.get("nodes", 1) if isinstance(resources, dict) else 1
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1
