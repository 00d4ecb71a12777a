"""What providers offer: clusters, priced queues (offerings), the price fixed for each job, and the providers'
usage-signing keys.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from activities.chain.ledger.common import _iso, _time
from activities.chain.ledger.core import LedgerCore
from virtengine_hpc.errors import ChainError
from virtengine_hpc.models import (
    Cluster,
    PricedQueue,
)
from virtengine_hpc.signing import key_id, public_key_from_b64


class CatalogArea(LedgerCore):
    """Clusters, priced queues, fixed job prices and provider keys."""

    def register_cluster(self, cluster: Cluster) -> None:
        """Register (or replace) a provider's cluster."""
        with self._tx(write=True) as db:
            db.execute(
                "INSERT INTO clusters (cluster_id, provider, data) VALUES (?, ?, ?) "
                "ON CONFLICT (cluster_id) DO UPDATE SET provider = excluded.provider, data = excluded.data",
                (cluster.cluster_id, cluster.provider, cluster.model_dump_json()),
            )

    def set_cluster_state(
        self, cluster_id: str, state: str, *, available_nodes: int | None = None
    ) -> Cluster:
        """Change a cluster's state (active, draining, offline, ...) and optionally its free node count."""
        with self._tx(write=True) as db:
            cluster = self._cluster(db, cluster_id)
            if cluster is None:
                raise ChainError(f"unknown cluster {cluster_id}")
            update: dict[str, Any] = {"state": state}
            if available_nodes is not None:
                update["available_nodes"] = available_nodes
            try:
                changed = Cluster.model_validate({**cluster.model_dump(), **update})
            except ValueError as exc:
                raise ChainError(f"invalid cluster update: {exc}") from None
            db.execute(
                "UPDATE clusters SET data = ? WHERE cluster_id = ?", (changed.model_dump_json(), cluster_id)
            )
            return changed

    @staticmethod
    def _cluster(db: sqlite3.Connection, cluster_id: str) -> Cluster | None:
        row = db.execute("SELECT data FROM clusters WHERE cluster_id = ?", (cluster_id,)).fetchone()
        return Cluster.model_validate_json(row["data"]) if row else None

    def cluster(self, cluster_id: str) -> Cluster | None:
        with self._tx(write=False) as db:
            return self._cluster(db, cluster_id)

    def clusters(self, provider: str | None = None) -> list[Cluster]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT data FROM clusters ORDER BY cluster_id").fetchall()
        found = [Cluster.model_validate_json(r["data"]) for r in rows]
        return [c for c in found if provider is None or c.provider == provider]

    def add_queue(self, queue: PricedQueue) -> None:
        """Register (or replace) a priced queue (an offering) on a registered cluster."""
        with self._tx(write=True) as db:
            if self._cluster(db, queue.cluster_id) is None:
                raise ChainError(f"priced queue {queue.offering_id}: unknown cluster {queue.cluster_id}")
            db.execute(
                "INSERT INTO queues (offering_id, cluster_id, data) VALUES (?, ?, ?) "
                "ON CONFLICT (offering_id) DO UPDATE SET "
                "cluster_id = excluded.cluster_id, data = excluded.data",
                (queue.offering_id, queue.cluster_id, queue.model_dump_json()),
            )

    @staticmethod
    def _queue(db: sqlite3.Connection, offering_id: str) -> PricedQueue | None:
        row = db.execute("SELECT data FROM queues WHERE offering_id = ?", (offering_id,)).fetchone()
        return PricedQueue.model_validate_json(row["data"]) if row else None

    def queue(self, offering_id: str) -> PricedQueue | None:
        with self._tx(write=False) as db:
            return self._queue(db, offering_id)

    def queues(self) -> list[PricedQueue]:
        with self._tx(write=False) as db:
            rows = db.execute("SELECT data FROM queues ORDER BY offering_id").fetchall()
        return [PricedQueue.model_validate_json(r["data"]) for r in rows]

    def _fix_price(
        self, db: sqlite3.Connection, job_id: str, offering_id: str, when: str, now: datetime
    ) -> None:
        """Keep the offering as it stands now as the job's price, unless the job has one already: what the tenant
        accepted (and escrowed for) is what settles it, whatever the provider changes in the offering later."""
        queue = self._queue(db, offering_id)
        if queue is not None:
            db.execute(
                "INSERT OR IGNORE INTO job_prices (job_id, fixed_at, fixed_when, data) VALUES (?, ?, ?, ?)",
                (job_id, _iso(now), when, queue.model_dump_json()),
            )

    def _price(self, db: sqlite3.Connection, row: sqlite3.Row) -> PricedQueue | None:
        """The job's fixed price; a job from before prices were fixed (none stored) pays the offering's current
        one."""
        found = db.execute("SELECT data FROM job_prices WHERE job_id = ?", (row["job_id"],)).fetchone()
        if found is not None:
            return PricedQueue.model_validate_json(found["data"])
        return self._queue(db, row["offering_id"])

    def job_price(self, job_id: str) -> tuple[PricedQueue, datetime, str] | None:
        """The offering as it was fixed for ``job_id``, when, and at which step (``submitted`` or ``taken``)."""
        with self._tx(write=False) as db:
            row = db.execute(
                "SELECT fixed_at, fixed_when, data FROM job_prices WHERE job_id = ?", (job_id,)
            ).fetchone()
        if row is None:
            return None
        return PricedQueue.model_validate_json(row["data"]), _time(row["fixed_at"]), row["fixed_when"]

    def register_provider_key(self, provider: str, public_key_b64: str) -> str:
        """Register a provider's usage-signing public key (raw Ed25519, base64); returns its key id.

        A provider may hold several keys (rotation): records signed with any registered key of theirs verify.
        """
        public_key = public_key_from_b64(public_key_b64)
        kid = key_id(public_key)
        with self._tx(write=True) as db:
            db.execute(
                "INSERT OR IGNORE INTO provider_keys (provider, key_id, public_key, registered_at) "
                "VALUES (?, ?, ?, ?)",
                (provider, kid, public_key_b64, _iso(self._now())),
            )
        return kid

    def registered_keys(self, provider: str | None = None) -> list[tuple[str, str, str, str]]:
        """``(provider, key_id, public_key_b64, registered_at)`` of every registered usage-signing key (or one
        provider's), oldest first."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT provider, key_id, public_key, registered_at FROM provider_keys "
                "WHERE ? IS NULL OR provider = ? ORDER BY registered_at, provider, key_id",
                (provider, provider),
            ).fetchall()
        return [(r["provider"], r["key_id"], r["public_key"], r["registered_at"]) for r in rows]

    def provider_keys(self, provider: str) -> dict[str, str]:
        """``{key_id: public_key_b64}`` of a provider's registered keys."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT key_id, public_key FROM provider_keys WHERE provider = ?", (provider,)
            ).fetchall()
        return {r["key_id"]: r["public_key"] for r in rows}
