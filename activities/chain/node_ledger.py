"""The node registry on the embedded chain: allowed node keys, registered nodes, node metadata updates,
capacity.

It lives in the LocalLedger's SQLite file (``Config.ledger_path``) but in its own tables (``node_*``, in
``activities/chain/schema.py``) and over its own ``SqliteStore``, so the two never share Python state; it follows
the ledger's policy: a connection per thread, WAL mode and a busy timeout let the node API, the workers and the
CLI use the file at once, every write is one short ``BEGIN IMMEDIATE`` transaction, a busy file is
``ChainUnavailable``. ``close()`` closes the file in every thread that used it.

* ``node_allowed_keys``: the provider's allow-list (``virtengine-hpc nodes allow``). Only a node whose key is
  here (and not revoked) may register or send heartbeats; a new allow replaces the key (re-keying is an
  operator act, never a node's).
* ``node_registry``: one row per node: the state its workflow last recorded, the highest accepted heartbeat
  sequence (persisted, so a restarted provider still refuses replays), the latest capacity/health/placement.
* ``node_metadata_updates``: the ``MsgUpdateNodeMetadata``-like records, keyed by a deterministic update id so
  a retried activity never writes one twice.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import Field

from activities.chain.schema import NODE_SCHEMA
from activities.chain.store import SqliteStore
from virtengine_hpc.errors import ChainError, ValidationError
from virtengine_hpc.files import ensure_private
from virtengine_hpc.models import Model
from virtengine_hpc.node.heartbeat import NodeCapacity, NodeHealth, NodePlacement
from virtengine_hpc.node.lifecycle import NodeMetadataUpdate, NodeState, NodeStateChange
from virtengine_hpc.signing import public_key_from_b64

_SET_STATE = "UPDATE node_registry SET state = ?, state_changed_at = ? WHERE cluster_id = ? AND node_id = ?"


def _now() -> datetime:
    return datetime.now(UTC)


def _ts(value: datetime) -> str:
    return value.astimezone(UTC).isoformat()


def _dt(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


class ClusterCapacity(Model):
    """What a cluster can hold right now: the sum over its nodes in state ``active``."""

    cluster_id: str
    active_nodes: int = 0
    cpus: int = 0
    memory_mb: int = 0
    gpus: int = 0
    known_nodes: int = Field(0, description="Nodes registered and not deregistered, whatever their state.")
    max_cpus_per_node: int = 0
    max_memory_mb_per_node: int = 0
    max_gpus_per_node: int = 0


class AllowedNode(Model):
    cluster_id: str
    node_id: str
    public_key: str
    scheduler_node: str
    allowed_at: datetime
    revoked_at: datetime | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class NodeRow(Model):
    cluster_id: str
    node_id: str
    public_key: str
    hostname: str
    agent_version: str
    state: NodeState
    registered_at: datetime
    state_changed_at: datetime
    last_sequence: int
    last_heartbeat_at: datetime | None
    capacity: NodeCapacity | None = None
    health: NodeHealth | None = None
    placement: NodePlacement | None = None


class HeartbeatAuth(Model):
    """What the node API needs to check one heartbeat, read in one query."""

    public_key: str
    revoked: bool
    registered: bool
    last_sequence: int
    state: NodeState | None


class SequenceResult(Model):
    accepted: bool
    last_sequence: int
    state: NodeState | None = None


class MetadataUpdateRow(Model):
    seq: int
    update_id: str
    cluster_id: str
    node_id: str
    kind: str
    state: NodeState
    previous_state: NodeState | None
    reason: str
    payload: dict[str, Any]
    created_at: datetime
    audited: bool


class NodeLedger:
    """Node tables of the embedded chain. Thread-safe (a connection per thread); each call is one short
    transaction."""

    def __init__(self, path: str | Path, *, busy_timeout: float = 10.0) -> None:
        self.path = Path(path)
        try:
            ensure_private(self.path)
        except OSError as exc:
            raise ChainError(f"cannot create node ledger {self.path}: {exc.strerror}") from None
        self._store = SqliteStore(self.path, busy_timeout=busy_timeout, label="node ledger")
        db = self._store.connect()
        try:
            db.execute("PRAGMA journal_mode = WAL")
            db.executescript(NODE_SCHEMA)
        except sqlite3.OperationalError as exc:
            # Another process holds the write lock while the tables are created: transient, like every other
            # busy write here (a worker starting during a ledger outage waits it out; benchmarks/chaos.py).
            self._store.close()
            busy = "locked" in str(exc) or "busy" in str(exc)
            raise ChainError(f"node ledger {self.path}: {exc}", transient=busy) from None

    def close(self) -> None:
        """Close the file in every thread that used it; a call after this raises ``sqlite3.ProgrammingError``."""
        self._store.close()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction of the store (``SqliteStore.tx``): ``BEGIN IMMEDIATE``, a busy file is
        ``ChainUnavailable``."""
        return self._store.tx(write=True)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._store.tx(write=False) as db:
            return db.execute(sql, params).fetchall()

    # --- allow-list -----------------------------------------------------------------------------------------

    def allow(
        self, cluster_id: str, node_id: str, public_key_b64: str, scheduler_node: str | None = None
    ) -> AllowedNode:
        """Allow (or re-key) a node. The key is checked to be a real Ed25519 public key first."""
        public_key_from_b64(public_key_b64)
        at = _ts(_now())
        with self._write() as db:
            db.execute(
                "INSERT INTO node_allowed_keys (cluster_id, node_id, public_key, scheduler_node, allowed_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (cluster_id, node_id) DO UPDATE SET"
                " public_key = excluded.public_key, scheduler_node = excluded.scheduler_node,"
                " allowed_at = excluded.allowed_at, revoked_at = NULL",
                (cluster_id, node_id, public_key_b64, scheduler_node or node_id, at),
            )
        allowed = self.allowed(cluster_id, node_id)
        assert allowed is not None
        return allowed

    def revoke(self, cluster_id: str, node_id: str) -> bool:
        with self._write() as db:
            cur = db.execute(
                "UPDATE node_allowed_keys SET revoked_at = ? WHERE cluster_id = ? AND node_id = ?"
                " AND revoked_at IS NULL",
                (_ts(_now()), cluster_id, node_id),
            )
            return cur.rowcount > 0

    def allowed(self, cluster_id: str, node_id: str) -> AllowedNode | None:
        rows = self._read(
            "SELECT * FROM node_allowed_keys WHERE cluster_id = ? AND node_id = ?", (cluster_id, node_id)
        )
        return self._allowed_row(rows[0]) if rows else None

    @staticmethod
    def _allowed_row(row: sqlite3.Row) -> AllowedNode:
        return AllowedNode(
            cluster_id=row["cluster_id"],
            node_id=row["node_id"],
            public_key=row["public_key"],
            scheduler_node=row["scheduler_node"],
            allowed_at=datetime.fromisoformat(row["allowed_at"]),
            revoked_at=_dt(row["revoked_at"]),
        )

    # --- registration and heartbeats ------------------------------------------------------------------------

    def register(
        self,
        cluster_id: str,
        node_id: str,
        *,
        public_key_b64: str,
        hostname: str,
        agent_version: str,
        capacity: NodeCapacity,
        placement: NodePlacement,
    ) -> NodeRow:
        """Record a registration (idempotent); a deregistered node allowed again starts as pending."""
        at = _ts(_now())
        with self._write() as db:
            db.execute(
                "INSERT INTO node_registry (cluster_id, node_id, public_key, hostname, agent_version, state,"
                " registered_at, state_changed_at, capacity, placement) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (cluster_id, node_id) DO UPDATE SET public_key = excluded.public_key,"
                " hostname = excluded.hostname, agent_version = excluded.agent_version,"
                " capacity = excluded.capacity, placement = excluded.placement,"
                " state = CASE WHEN node_registry.state = 'deregistered'"
                " THEN 'pending' ELSE node_registry.state END,"
                " state_changed_at = CASE WHEN node_registry.state = 'deregistered'"
                " THEN excluded.state_changed_at ELSE node_registry.state_changed_at END,"
                " registered_at = CASE WHEN node_registry.state = 'deregistered'"
                " THEN excluded.registered_at ELSE node_registry.registered_at END",
                (
                    cluster_id,
                    node_id,
                    public_key_b64,
                    hostname,
                    agent_version,
                    NodeState.PENDING.value,
                    at,
                    at,
                    capacity.model_dump_json(),
                    placement.model_dump_json(),
                ),
            )
        row = self.get(cluster_id, node_id)
        assert row is not None
        return row

    def heartbeat_auth(self, cluster_id: str, node_id: str) -> HeartbeatAuth | None:
        """The allowed key and replay state of a node, or ``None`` when the provider never allowed it."""
        rows = self._read(
            "SELECT a.public_key, a.revoked_at, r.node_id AS registered, r.last_sequence, r.state"
            " FROM node_allowed_keys a LEFT JOIN node_registry r"
            " ON r.cluster_id = a.cluster_id AND r.node_id = a.node_id"
            " WHERE a.cluster_id = ? AND a.node_id = ?",
            (cluster_id, node_id),
        )
        if not rows:
            return None
        row = rows[0]
        return HeartbeatAuth(
            public_key=row["public_key"],
            revoked=row["revoked_at"] is not None,
            registered=row["registered"] is not None,
            last_sequence=row["last_sequence"] or 0,
            state=NodeState(row["state"]) if row["state"] else None,
        )

    def accept_sequence(self, cluster_id: str, node_id: str, sequence: int, at: datetime) -> SequenceResult:
        """Persist ``sequence`` as the node's newest iff it is larger than every sequence accepted before.

        One conditional UPDATE, so two API processes racing on the same heartbeat accept it once.
        """
        with self._write() as db:
            row = db.execute(
                "UPDATE node_registry SET last_sequence = ?, last_heartbeat_at = ?"
                " WHERE cluster_id = ? AND node_id = ? AND last_sequence < ? RETURNING state",
                (sequence, _ts(at), cluster_id, node_id, sequence),
            ).fetchone()
            if row is not None:
                return SequenceResult(accepted=True, last_sequence=sequence, state=NodeState(row["state"]))
            current = db.execute(
                "SELECT last_sequence, state FROM node_registry WHERE cluster_id = ? AND node_id = ?",
                (cluster_id, node_id),
            ).fetchone()
        if current is None:
            return SequenceResult(accepted=False, last_sequence=0)
        return SequenceResult(
            accepted=False, last_sequence=current["last_sequence"], state=NodeState(current["state"])
        )

    # --- reads ----------------------------------------------------------------------------------------------

    @staticmethod
    def _row(row: sqlite3.Row) -> NodeRow:
        def load(model: Any, text: str | None) -> Any:
            return model.model_validate_json(text) if text else None

        return NodeRow(
            cluster_id=row["cluster_id"],
            node_id=row["node_id"],
            public_key=row["public_key"],
            hostname=row["hostname"],
            agent_version=row["agent_version"],
            state=NodeState(row["state"]),
            registered_at=datetime.fromisoformat(row["registered_at"]),
            state_changed_at=datetime.fromisoformat(row["state_changed_at"]),
            last_sequence=row["last_sequence"],
            last_heartbeat_at=_dt(row["last_heartbeat_at"]),
            capacity=load(NodeCapacity, row["capacity"]),
            health=load(NodeHealth, row["health"]),
            placement=load(NodePlacement, row["placement"]),
        )

    def get(self, cluster_id: str, node_id: str) -> NodeRow | None:
        rows = self._read(
            "SELECT * FROM node_registry WHERE cluster_id = ? AND node_id = ?", (cluster_id, node_id)
        )
        return self._row(rows[0]) if rows else None

    def list_nodes(self, cluster_id: str | None = None) -> list[NodeRow]:
        if cluster_id is None:
            rows = self._read("SELECT * FROM node_registry ORDER BY cluster_id, node_id")
        else:
            rows = self._read(
                "SELECT * FROM node_registry WHERE cluster_id = ? ORDER BY node_id", (cluster_id,)
            )
        return [self._row(r) for r in rows]

    def list_allowed(self, cluster_id: str | None = None) -> list[AllowedNode]:
        sql = "SELECT * FROM node_allowed_keys"
        rows = (
            self._read(sql + " ORDER BY cluster_id, node_id")
            if cluster_id is None
            else self._read(sql + " WHERE cluster_id = ? ORDER BY node_id", (cluster_id,))
        )
        return [self._allowed_row(row) for row in rows]

    def updates(self, cluster_id: str, node_id: str, limit: int = 50) -> list[MetadataUpdateRow]:
        rows = self._read(
            "SELECT * FROM node_metadata_updates WHERE cluster_id = ? AND node_id = ?"
            " ORDER BY seq DESC LIMIT ?",
            (cluster_id, node_id, limit),
        )
        return [
            MetadataUpdateRow(
                seq=r["seq"],
                update_id=r["update_id"],
                cluster_id=r["cluster_id"],
                node_id=r["node_id"],
                kind=r["kind"],
                state=NodeState(r["state"]),
                previous_state=NodeState(r["previous_state"]) if r["previous_state"] else None,
                reason=r["reason"],
                payload=json.loads(r["payload"]),
                created_at=datetime.fromisoformat(r["created_at"]),
                audited=bool(r["audited"]),
            )
            for r in reversed(rows)
        ]

    def cluster_capacity(self, cluster_id: str) -> ClusterCapacity:
        """Capacity the routing enforcer may count on: CPUs, memory and GPUs of the cluster's active nodes."""
        rows = self._read(
            "SELECT state, capacity FROM node_registry WHERE cluster_id = ? AND state != ?",
            (cluster_id, NodeState.DEREGISTERED.value),
        )
        totals = {"active_nodes": 0, "cpus": 0, "memory_mb": 0, "gpus": 0}
        maxima = {"max_cpus_per_node": 0, "max_memory_mb_per_node": 0, "max_gpus_per_node": 0}
        for row in rows:
            if row["state"] != NodeState.ACTIVE.value or not row["capacity"]:
                continue
            cap = NodeCapacity.model_validate_json(row["capacity"])
            totals["active_nodes"] += 1
            totals["cpus"] += cap.cpu_cores_total
            totals["memory_mb"] += cap.memory_mb_total
            totals["gpus"] += cap.gpus_total
            maxima["max_cpus_per_node"] = max(maxima["max_cpus_per_node"], cap.cpu_cores_total)
            maxima["max_memory_mb_per_node"] = max(maxima["max_memory_mb_per_node"], cap.memory_mb_total)
            maxima["max_gpus_per_node"] = max(maxima["max_gpus_per_node"], cap.gpus_total)
        return ClusterCapacity(cluster_id=cluster_id, known_nodes=len(rows), **totals, **maxima)

    async def available_nodes(self, cluster_id: str) -> int | None:
        """A ``CapacityProbe`` for the routing enforcer: active nodes (``None``: no node ever registered)."""
        capacity = self.cluster_capacity(cluster_id)
        return capacity.active_nodes if capacity.known_nodes else None

    # --- writes from the node workflow's activities ---------------------------------------------------------

    def apply_state(self, change: NodeStateChange) -> bool:
        """Record a transition and its metadata update in one transaction; ``False`` if this update id exists.

        A deregistration also revokes the node's allowed key, so it can neither register nor beat again
        until an operator allows it anew.
        """
        if change.state.final and change.previous.final:
            raise ValidationError("a deregistered node has no further transitions")
        payload: dict[str, Any] = {
            "previous_state": change.previous.value,
            "state": change.state.value,
            "cause": change.cause,
        }
        if change.beat is not None:
            payload["metadata"] = change.beat.model_dump(mode="json")
        at = _ts(change.at)
        with self._write() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO node_metadata_updates (update_id, cluster_id, node_id, kind, state,"
                " previous_state, reason, payload, created_at)"
                " VALUES (?, ?, ?, 'state_change', ?, ?, ?, ?, ?)",
                (
                    change.update_id,
                    change.cluster_id,
                    change.node_id,
                    change.state.value,
                    change.previous.value,
                    change.reason,
                    json.dumps(payload, sort_keys=True),
                    at,
                ),
            )
            if cur.rowcount == 0:
                return False
            db.execute(
                _SET_STATE,
                (change.state.value, at, change.cluster_id, change.node_id),
            )
            if change.beat is not None:
                self._store_metadata(
                    db, change.cluster_id, change.node_id, change.beat.model_dump(mode="json")
                )
            if change.state.final:
                db.execute(
                    "UPDATE node_allowed_keys SET revoked_at = ? WHERE cluster_id = ? AND node_id = ?"
                    " AND revoked_at IS NULL",
                    (at, change.cluster_id, change.node_id),
                )
        return True

    def record_metadata(self, updates: Sequence[NodeMetadataUpdate]) -> int:
        """Write a batch of metadata updates in one transaction; returns how many were new."""
        inserted = 0
        with self._write() as db:
            for update in updates:
                beat = update.beat.model_dump(mode="json")
                cur = db.execute(
                    "INSERT OR IGNORE INTO node_metadata_updates (update_id, cluster_id, node_id, kind,"
                    " state, payload, created_at, audited) VALUES (?, ?, ?, 'metadata', ?, ?, ?, 1)",
                    (
                        update.update_id,
                        update.cluster_id,
                        update.node_id,
                        update.state.value,
                        json.dumps({"metadata": beat}, sort_keys=True),
                        _ts(update.at),
                    ),
                )
                if cur.rowcount:
                    inserted += 1
                    self._store_metadata(db, update.cluster_id, update.node_id, beat)
        return inserted

    @staticmethod
    def _store_metadata(db: sqlite3.Connection, cluster_id: str, node_id: str, beat: dict[str, Any]) -> None:
        db.execute(
            "UPDATE node_registry SET capacity = ?, health = ?, placement = ?, latency = ?"
            " WHERE cluster_id = ? AND node_id = ?",
            (
                json.dumps(beat["capacity"], sort_keys=True),
                json.dumps(beat["health"], sort_keys=True),
                json.dumps(beat["placement"], sort_keys=True),
                json.dumps(beat["latency"], sort_keys=True),
                cluster_id,
                node_id,
            ),
        )

    def unaudited(self, update_id: str) -> bool:
        rows = self._read("SELECT audited FROM node_metadata_updates WHERE update_id = ?", (update_id,))
        return bool(rows) and not rows[0]["audited"]

    def mark_audited(self, update_id: str) -> None:
        with self._write() as db:
            db.execute("UPDATE node_metadata_updates SET audited = 1 WHERE update_id = ?", (update_id,))

    def deregister_unregistered(self, cluster_id: str, node_id: str) -> bool:
        """Deregister a node that has no workflow to ask: revoke its key; true if it was allowed."""
        revoked = self.revoke(cluster_id, node_id)
        with self._write() as db:
            db.execute(
                _SET_STATE,
                (NodeState.DEREGISTERED.value, _ts(_now()), cluster_id, node_id),
            )
        return revoked
