"""``LocalLedger``: the embedded stand-in for the chain, one SQLite file.

It holds what the chain would hold for the provider side: clusters, priced queues, provider usage-signing
keys, accounts with balances, tenant jobs with their escrow and state history, scheduling decisions, signed
usage records and settlements. It implements the ``ChainClient`` protocol (the provider's view) plus admin and
tenant methods that the CLI (``virtengine-hpc ledger ...``), the demo and the tests use. The full description,
with the settlement arithmetic, is in ``docs/ledger.md``.

Several processes use one file at once (worker, poller, CLI): the database runs in WAL mode, every write is
one short ``BEGIN IMMEDIATE`` transaction (so two writers serialise instead of failing half way), and every
connection waits on a busy timeout instead of raising ``database is locked``. Each call opens its own
connection: that costs tens of microseconds, is safe across threads and ``fork``, and keeps no lock between
calls.

The ``ChainClient`` methods are coroutines that run their SQLite work in a worker thread
(``asyncio.to_thread``), so a busy database never blocks a worker's event loop. The admin, tenant and
inspection methods are plain functions: the CLI and test set-up call them outside an event loop, and each is
one short transaction.

Amounts are ``Decimal`` stored as TEXT and never pass through a float or an SQL ``SUM``. The ledger's unit is
``0.000001`` (six decimal places): an amount with more places is refused, a computed charge is rounded to it
with ``ROUND_HALF_EVEN``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from activities.chain.client import (
    AccountingReport,
    ChainJob,
    Settlement,
    StatusReport,
    UsageSubmitResult,
)
from activities.chain.schema import (
    CANCEL_SQL,
    COUNT_PENDING_SQL,
    HISTORY_SQL,
    OPEN_SQL,
    PENDING_SQL,
    RAN_SQL,
    SCHEMA,
    SCHEMA_OBJECTS,
    SCHEMA_VERSION,
)
from activities.chain.store import SqliteStore
from virtengine_hpc.config import Config
from virtengine_hpc.errors import ChainError, IllegalTransition, SecurityError
from virtengine_hpc.files import ensure_private
from virtengine_hpc.models import (
    Cluster,
    Model,
    PricedQueue,
    SchedulingDecision,
    UsageMetrics,
    UsageRecord,
)
from virtengine_hpc.pricing import PriceLine, rate_usage, usage_lines
from virtengine_hpc.signing import key_id, public_key_from_b64
from virtengine_hpc.states import JobState, transition_path
from virtengine_hpc.templates.builtins import is_builtin
from virtengine_hpc.templates.model import SignedTemplate, TemplateRecord
from virtengine_hpc.usage import record_id as make_record_id
from virtengine_hpc.usage import sum_metrics, verify_record

UNIT = Decimal("0.000001")
"""The ledger's smallest amount. Amounts with more decimal places are refused; charges are rounded to it."""
ROUNDING = ROUND_HALF_EVEN
MAX_RAW_SPEC_BYTES = 2 * 1024 * 1024
"""A chain limits transaction size; a job spec (script at most 1 MiB, plus fields) must fit in this."""
DEFAULT_BUSY_TIMEOUT = 30.0
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""Job ids are chain-assigned on a real chain; one chosen here must still be a valid identifier."""


# ---- views returned by the inspection methods --------------------------------------------------------------


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


# ---- helpers -----------------------------------------------------------------------------------------------


def to_amount(value: Any, what: str = "amount") -> Decimal:
    """Parse an amount exactly; refuse negatives, non-numbers and more than six decimal places."""
    if isinstance(value, bool) or value is None:
        raise ChainError(f"{what} must be a number, not {value!r}")
    try:
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except (InvalidOperation, ValueError):
        raise ChainError(f"{what} {str(value)[:40]!r} is not a number") from None
    if not amount.is_finite() or amount < 0:
        raise ChainError(f"{what} {str(value)[:40]!r} must be a finite, non-negative number")
    if amount != amount.quantize(UNIT, rounding=ROUNDING):
        raise ChainError(f"{what} {value} has more than six decimal places (the ledger's unit is {UNIT})")
    return amount


def _text(amount: Decimal) -> str:
    """Plain-notation text of an amount (never an exponent), exact."""
    return format(amount, "f")


def _iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat()


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)


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


# ---- the ledger --------------------------------------------------------------------------------------------


class LocalLedger:
    """The chain, embedded: a SQLite file shared safely by every process of one provider host.

    Args:
        path: the SQLite file (created with its directory if missing).
        seconds_per_block: block time used when the file is created; afterwards the file's own value wins, so
        every
            process computes the same heights.
        genesis_time: when block 1 began (default: creation time); only used when the file is created.
        clock: the current time (tests inject one); must return an aware datetime.
        busy_timeout: seconds a call waits for another process's write before giving up with
        ``ChainUnavailable``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        seconds_per_block: float = 6.0,
        genesis_time: datetime | None = None,
        clock: Callable[[], datetime] | None = None,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        if seconds_per_block <= 0:
            raise ChainError("seconds_per_block must be positive")
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self._clock = clock or (lambda: datetime.now(UTC))
        self._store = SqliteStore(self.path, busy_timeout=busy_timeout)
        # Every job's script and environment is in this file: private to the provider's account (its -wal and
        # -shm files get the same mode from SQLite).
        try:
            ensure_private(self.path)
        except OSError as exc:
            raise ChainError(f"cannot create ledger {self.path}: {exc.strerror}") from None
        self._init_schema(seconds_per_block, genesis_time or self._now())

    @classmethod
    def from_config(cls, config: Config) -> LocalLedger:
        """Open the ledger a ``Config`` points at (``chain.ledger_path``, ``chain.seconds_per_block``)."""
        return cls(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)

    def __repr__(self) -> str:
        return f"LocalLedger({str(self.path)!r})"

    # ---- connections and transactions ----------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        return self._store.connect()

    def _discard_connection(self) -> None:
        self._store.discard_connection()

    def _tx(self, write: bool) -> AbstractContextManager[sqlite3.Connection]:
        """One transaction of the store (``SqliteStore.tx``): ``BEGIN IMMEDIATE`` for writes, else a read."""
        return self._store.tx(write)

    def _init_schema(self, seconds_per_block: float, genesis: datetime) -> None:
        conn = self._connect()
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ChainError(f"ledger {self.path}: cannot switch to WAL mode (got {mode})")
        except sqlite3.DatabaseError as exc:
            self._discard_connection()
            raise ChainError(f"ledger {self.path} is not a usable SQLite database: {exc}") from None
        except ChainError:
            self._discard_connection()
            raise
        defaults = {
            "schema_version": SCHEMA_VERSION,
            "genesis_time": _iso(genesis),
            "seconds_per_block": repr(float(seconds_per_block)),
            "next_job_number": "1",
            "next_decision_number": "1",
        }
        meta = self._complete_schema(set(defaults))
        if meta is None:
            with self._tx(write=True) as db:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                for key, value in defaults.items():
                    db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, value))
                meta = {row["key"]: row["value"] for row in db.execute("SELECT key, value FROM meta")}
        if meta["schema_version"] != SCHEMA_VERSION:
            raise ChainError(
                f"ledger {self.path} has schema version {meta['schema_version']}, "
                f"this code needs {SCHEMA_VERSION}"
            )
        self.genesis_time = _time(meta["genesis_time"])
        self.seconds_per_block = float(meta["seconds_per_block"])

    def _complete_schema(self, keys: set[str]) -> dict[str, str] | None:
        """The meta values when every table, index and meta key exists already, else ``None``.

        Opening an existing ledger then takes no write lock: a worker or poller that (re)starts while another
        process holds the write lock (a long transaction, an outage) opens it at once instead of failing after
        the busy timeout (found by ``benchmarks/chaos.py``).
        """
        with self._tx(write=False) as db:
            names = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            if not names >= SCHEMA_OBJECTS:
                return None
            meta = {row["key"]: row["value"] for row in db.execute("SELECT key, value FROM meta")}
        return meta if keys <= set(meta) else None

    def _now(self) -> datetime:
        now = self._clock()
        return now if now.tzinfo else now.replace(tzinfo=UTC)

    @staticmethod
    def _next_number(db: sqlite3.Connection, counter: str) -> int:
        value = int(db.execute("SELECT value FROM meta WHERE key = ?", (counter,)).fetchone()[0])
        db.execute("UPDATE meta SET value = ? WHERE key = ?", (str(value + 1), counter))
        return value

    # ---- block height --------------------------------------------------------------------------------------

    def height_at(self, moment: datetime) -> int:
        """Block height at ``moment``: ``floor((moment - genesis) / seconds_per_block) + 1``, never below
        1."""
        elapsed = (moment - self.genesis_time).total_seconds()
        return max(1, math.floor(elapsed / self.seconds_per_block) + 1)

    def time_of_height(self, height: int) -> datetime:
        """When block ``height`` began (used to date decisions created at an old height)."""
        return self.genesis_time + timedelta(seconds=(height - 1) * self.seconds_per_block)

    def height(self) -> int:
        return self.height_at(self._now())

    async def current_height(self) -> int:
        return self.height()

    # ---- accounts ------------------------------------------------------------------------------------------

    @staticmethod
    def _balance(db: sqlite3.Connection, account: str) -> Decimal:
        row = db.execute("SELECT balance FROM accounts WHERE account = ?", (account,)).fetchone()
        return Decimal(row["balance"]) if row else Decimal(0)

    def _move(
        self,
        db: sqlite3.Connection,
        kind: str,
        account: str,
        amount: Decimal,
        job_id: str | None,
        now: datetime,
    ) -> None:
        """Add ``amount`` (negative to take) to ``account`` and log the transfer; refuses to overdraw."""
        balance = self._balance(db, account) + amount
        if balance < 0:
            raise ChainError(
                f"insufficient funds: account {account} has {_text(balance - amount)}, needs {_text(-amount)}"
            )
        db.execute(
            "INSERT INTO accounts (account, balance) VALUES (?, ?) "
            "ON CONFLICT (account) DO UPDATE SET balance = excluded.balance",
            (account, _text(balance)),
        )
        db.execute(
            "INSERT INTO transfers (at, kind, account, amount, job_id) VALUES (?, ?, ?, ?, ?)",
            (_iso(now), kind, account, _text(amount), job_id),
        )

    def fund(self, account: str, amount: Decimal | str | int) -> Decimal:
        """Credit ``account`` (a faucet for tenants in the demo and tests); returns the new balance."""
        value = to_amount(amount)
        if not account or len(account) > 256:
            raise ChainError("account must be a non-empty string of at most 256 characters")
        with self._tx(write=True) as db:
            self._move(db, "fund", account, value, None, self._now())
            return self._balance(db, account)

    def balance(self, account: str) -> Decimal:
        with self._tx(write=False) as db:
            return self._balance(db, account)

    def transfers(self, *, job_id: str | None = None, account: str | None = None) -> list[Transfer]:
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT * FROM transfers WHERE (?1 IS NULL OR job_id = ?1) AND (?2 IS NULL OR account = ?2) "
                "ORDER BY id",
                (job_id, account),
            ).fetchall()
        return [
            Transfer(
                at=_time(r["at"]),
                kind=r["kind"],
                account=r["account"],
                amount=Decimal(r["amount"]),
                job_id=r["job_id"],
            )
            for r in rows
        ]

    # ---- clusters, queues, provider keys -------------------------------------------------------------------

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

    # ---- jobs (tenant side) --------------------------------------------------------------------------------

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

    # ---- jobs (inspection) ---------------------------------------------------------------------------------

    @staticmethod
    def _job_row(db: sqlite3.Connection, job_id: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise ChainError(f"unknown job {job_id}", code="job_not_found")
        return row

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

    # ---- jobs (provider side: ChainClient) -----------------------------------------------------------------

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

    # ---- scheduling decisions ------------------------------------------------------------------------------

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

    # ---- status reports ------------------------------------------------------------------------------------

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

    @staticmethod
    def _has_records(db: sqlite3.Connection, job_id: str) -> bool:
        return bool(db.execute("SELECT 1 FROM usage_records WHERE job_id = ? LIMIT 1", (job_id,)).fetchone())

    # ---- usage records -------------------------------------------------------------------------------------

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

    # ---- accounting and settlement -------------------------------------------------------------------------

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

    # ---- workload templates (custom, signed, approved by governance) ----------------------------------------

    def register_publisher_key(self, publisher: str, public_key_b64: str) -> str:
        """Register a template publisher's Ed25519 public key (raw, base64); returns its key id.

        On a real chain the publisher's account key signs the publishing transaction; here the registry ties
        keys to publisher addresses, so a template claiming a publisher is refused unless that publisher's key
        signed it.
        """
        public_key = public_key_from_b64(public_key_b64)
        kid = key_id(public_key)
        if not publisher or len(publisher) > 256:
            raise ChainError("publisher must be a non-empty string of at most 256 characters")
        with self._tx(write=True) as db:
            db.execute(
                "INSERT OR IGNORE INTO publisher_keys (publisher, key_id, public_key, registered_at) "
                "VALUES (?, ?, ?, ?)",
                (publisher, kid, public_key_b64, _iso(self._now())),
            )
        return kid

    def publisher_keys(self, publisher: str) -> dict[str, str]:
        """``{key_id: public_key_b64}`` of a publisher's registered keys."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT key_id, public_key FROM publisher_keys WHERE publisher = ?", (publisher,)
            ).fetchall()
        return {r["key_id"]: r["public_key"] for r in rows}

    def publish_template(self, signed: SignedTemplate) -> TemplateRecord:
        """Store a signed custom template as ``pending`` (usable only after ``approve_template``).

        Refused: a bad signature or a key that is not a registered key of the template's publisher
        (``SecurityError``); a built-in id; an id owned by another publisher (``SecurityError``); a version
        already published with other content (versions are immutable). Publishing the same bytes again returns
        the existing record.
        """
        template = signed.template
        if not signed.verify():
            raise SecurityError(
                f"template {template.template_id} {template.version}: signature does not verify"
            )
        if signed.key_id not in self.publisher_keys(template.publisher):
            raise SecurityError(
                f"template {template.template_id}: key {signed.key_id[:16]}... is not a registered key of "
                f"publisher {template.publisher}"
            )
        if is_builtin(template.template_id):
            raise ChainError(f"template id {template.template_id} is a built-in template's")
        now = self._now()
        digest = template.digest()
        with self._tx(write=True) as db:
            owner = db.execute(
                "SELECT publisher FROM templates WHERE template_id = ? LIMIT 1", (template.template_id,)
            ).fetchone()
            if owner is not None and owner["publisher"] != template.publisher:
                raise SecurityError(
                    f"template id {template.template_id} belongs to publisher {owner['publisher']}"
                )
            row = db.execute(
                "SELECT data FROM templates WHERE template_id = ? AND version = ?",
                (template.template_id, template.version),
            ).fetchone()
            if row is not None:
                existing = TemplateRecord.model_validate_json(row["data"])
                if existing.digest != digest:
                    raise ChainError(
                        f"template {template.template_id} {template.version} is already published with other "
                        "content; publish a new version"
                    )
                return existing
            record = TemplateRecord(
                template_id=template.template_id,
                version=template.version,
                publisher=template.publisher,
                status="pending",
                signed=signed,
                digest=digest,
                published_at=now,
                published_height=self.height_at(now),
            )
            db.execute(
                "INSERT INTO templates (template_id, version, publisher, status, data) VALUES (?, ?, ?, ?, ?)",
                (
                    record.template_id,
                    record.version,
                    record.publisher,
                    record.status,
                    record.model_dump_json(),
                ),
            )
            return record

    def _template_row(self, db: sqlite3.Connection, template_id: str, version: str | None) -> sqlite3.Row:
        if version is None:
            row = db.execute(
                "SELECT * FROM templates WHERE template_id = ? ORDER BY seq DESC LIMIT 1", (template_id,)
            ).fetchone()
        else:
            row = db.execute(
                "SELECT * FROM templates WHERE template_id = ? AND version = ?", (template_id, version)
            ).fetchone()
        if row is None:
            what = template_id if version is None else f"{template_id} {version}"
            raise ChainError(f"unknown template {what}", code="template_not_found")
        return row

    def decide_template(
        self,
        template_id: str,
        status: Literal["approved", "rejected", "revoked"],
        *,
        version: str | None = None,
        decided_by: str = "governance",
        reason: str = "",
    ) -> TemplateRecord:
        """Governance's decision on a published version (default: the latest): approve, reject or revoke.

        Approval records the digest of the exact template approved; a template whose content no longer hashes
        to it is refused by providers. Revoking an approved version stops new jobs from using it.
        """
        now = self._now()
        with self._tx(write=True) as db:
            row = self._template_row(db, template_id, version)
            record = TemplateRecord.model_validate_json(row["data"])
            if record.status == status:
                return record
            allowed = {"approved": ("pending",), "rejected": ("pending",), "revoked": ("approved",)}[status]
            if record.status not in allowed:
                raise ChainError(
                    f"template {template_id} {record.version} is {record.status}; it cannot become {status}"
                )
            changed = record.model_copy(
                update={
                    "status": status,
                    "approved_digest": record.digest if status == "approved" else record.approved_digest,
                    "decided_by": decided_by[:256],
                    "decided_at": now,
                    "decided_height": self.height_at(now),
                    "reason": reason[:512],
                }
            )
            db.execute(
                "UPDATE templates SET status = ?, data = ? WHERE seq = ?",
                (status, changed.model_dump_json(), row["seq"]),
            )
            return changed

    def approve_template(
        self, template_id: str, *, version: str | None = None, **kwargs: Any
    ) -> TemplateRecord:
        return self.decide_template(template_id, "approved", version=version, **kwargs)

    def template(self, template_id: str) -> TemplateRecord | None:
        """The version jobs use: the latest approved one, else the latest published (which providers refuse)."""
        with self._tx(write=False) as db:
            row = db.execute(
                "SELECT data FROM templates WHERE template_id = ? "
                "ORDER BY (status = 'approved') DESC, seq DESC LIMIT 1",
                (template_id,),
            ).fetchone()
        return TemplateRecord.model_validate_json(row["data"]) if row else None

    def templates(self, *, status: str | None = None) -> list[TemplateRecord]:
        """Every published version (optionally with one status), oldest first."""
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT data FROM templates WHERE (?1 IS NULL OR status = ?1) ORDER BY seq", (status,)
            ).fetchall()
        return [TemplateRecord.model_validate_json(r["data"]) for r in rows]

    async def get_template(self, template_id: str) -> TemplateRecord | None:
        """The chain's record of a custom template (see ``template``); None when none was published."""
        return await asyncio.to_thread(self.template, template_id)

    # ---- charges and earnings ----------------------------------------------------------------------------

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


def _requested_nodes(spec: dict[str, Any]) -> int:
    resources = spec.get("resources")
    nodes = resources.get("nodes", 1) if isinstance(resources, dict) else 1
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes > 0 else 1
