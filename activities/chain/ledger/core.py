"""``LedgerCore``: what every area of the ledger stands on: the SQLite store, the schema, the clock and block
heights, and the row look-ups several areas share.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Self

from activities.chain.ledger.common import _iso, _time
from activities.chain.schema import (
    SCHEMA,
    SCHEMA_OBJECTS,
    SCHEMA_VERSION,
)
from activities.chain.store import SqliteStore
from virtengine_hpc.config import Config
from virtengine_hpc.errors import ChainError
from virtengine_hpc.files import ensure_private

DEFAULT_BUSY_TIMEOUT = 30.0


class LedgerCore:
    """The ledger's file, clock and block heights; the areas in ``activities.chain.ledger`` add the rest."""

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
    def from_config(cls, config: Config) -> Self:
        """Open the ledger a ``Config`` points at (``chain.ledger_path``, ``chain.seconds_per_block``)."""
        return cls(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)

    def __repr__(self) -> str:
        return f"LocalLedger({str(self.path)!r})"

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

    @staticmethod
    def _job_row(db: sqlite3.Connection, job_id: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise ChainError(f"unknown job {job_id}", code="job_not_found")
        return row

    @staticmethod
    def _has_records(db: sqlite3.Connection, job_id: str) -> bool:
        return bool(db.execute("SELECT 1 FROM usage_records WHERE job_id = ? LIMIT 1", (job_id,)).fetchone())
