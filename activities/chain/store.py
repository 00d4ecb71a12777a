"""``SqliteStore``: the one way the embedded chain talks to its SQLite file.

The ledger (``LocalLedger``) and the node registry (``NodeLedger``) keep their tables in one file that several
processes use at once (worker, poller, node API, CLI). Both go through this store, so both follow one policy:

* each thread has its own connection, opened once and reused (opening one per call cost about 3 ms, more than
  most calls), in WAL mode with ``synchronous=NORMAL``, waiting up to ``busy_timeout`` for another process's
  write lock instead of failing with ``database is locked``;
* a write is one ``BEGIN IMMEDIATE`` transaction (it takes the write lock up front, so two writers serialise
  instead of failing half way), a read one deferred snapshot; commit on success, roll back on any exception;
* a busy file raises ``ChainUnavailable`` (transient: try again later), any other SQLite failure ``ChainError``,
  and a connection that failed is discarded, so the next call opens a fresh one;
* ``close()`` closes every connection the store opened, whichever thread opened it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from virtengine_hpc.errors import ChainError, ChainUnavailable


class SqliteStore:
    """Connections and transactions of one SQLite file.

    Args:
        path: the SQLite file.
        busy_timeout: seconds a call waits for another process's write before giving up with ``ChainUnavailable``.
        label: how error messages name the file's owner (``"ledger"``, ``"node ledger"``).
    """

    def __init__(self, path: Path, *, busy_timeout: float, label: str = "ledger") -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.label = label
        self._local = threading.local()
        self._opened: dict[int, sqlite3.Connection] = {}
        self._opened_lock = threading.RLock()
        self._closed = False

    def connect(self) -> sqlite3.Connection:
        """This thread's connection, opened once and reused: opening and closing a SQLite connection per call
        cost about 3 ms, more than most of the calls themselves."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise ChainUnavailable(f"cannot open {self.label} {self.path}: {exc}") from None
        conn.row_factory = sqlite3.Row
        try:
            # WAL + NORMAL survives process crashes; only a power cut can lose the last commits.
            conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise ChainError(f"{self.label} {self.path} is not a usable SQLite database: {exc}") from None
        mark = _ThreadMark()
        with self._opened_lock:
            self._opened[id(mark)] = conn
        # When the thread ends (or the store is dropped), its thread-local slot and the mark in it go, and the
        # connection is closed with them, as a connection held only by the thread-local would be.
        weakref.finalize(mark, _close_one, self._opened, self._opened_lock, id(mark)).atexit = False
        self._local.conn, self._local.mark = conn, mark
        return conn

    def discard_connection(self) -> None:
        """Close this thread's connection (after a failure); the next call opens a new one."""
        conn = getattr(self._local, "conn", None)
        mark = getattr(self._local, "mark", None)
        self._local.conn = self._local.mark = None
        if mark is not None:
            _close_one(self._opened, self._opened_lock, id(mark))
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def close(self) -> None:
        """Close every connection this store opened, in every thread; the store cannot be used afterwards (as a
        closed ``sqlite3.Connection``, it raises ``sqlite3.ProgrammingError``)."""
        with self._opened_lock:
            self._closed = True
            opened = list(self._opened.values())
            self._opened.clear()
        for conn in opened:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()

    @contextmanager
    def tx(self, write: bool) -> Iterator[sqlite3.Connection]:
        """One transaction: ``BEGIN IMMEDIATE`` for writes (take the write lock up front, wait on busy), else
        a deferred read snapshot. Commits on success, rolls back on any exception."""
        conn = self.connect()
        try:
            try:
                conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as exc:
                raise ChainUnavailable(f"{self.label} {self.path} is busy: {exc}") from None
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            self.discard_connection()
            if "locked" in str(exc) or "busy" in str(exc):
                raise ChainUnavailable(f"{self.label} {self.path} is busy: {exc}") from None
            raise ChainError(f"{self.label} {self.path}: {exc}") from None
        except sqlite3.DatabaseError:
            self.discard_connection()
            raise


class _ThreadMark:
    """Sits in one thread's thread-local slot beside its connection; collected when the thread ends."""

    __slots__ = ("__weakref__",)


def _close_one(opened: dict[int, sqlite3.Connection], lock: threading.RLock, key: int) -> None:
    """Close and forget the connection kept under ``key`` (nothing when ``close()`` took it already)."""
    with lock:
        conn = opened.pop(key, None)
    if conn is not None:
        with contextlib.suppress(sqlite3.Error):
            conn.close()
