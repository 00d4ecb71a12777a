"""The account each tenant's jobs run as, kept provider-side: ``TenantAccounts`` (rules of
``virtengine_hpc.tenancy`` + the pool's assignments in a SQLite file).

A pool account, once given to a tenant, is that tenant's for good: the assignment is a row of
``<state_store_path>/tenant-accounts.db`` (``hpc.tenants.assignments_path``), written in one ``BEGIN IMMEDIATE``
transaction with ``account`` UNIQUE, so two workers assigning at once can never hand one account to two
tenants, and a restarted worker (or any other worker sharing the file) finds the same answer. The file is
created 0600.

Schedulers and the local executor ask ``account_for(tenant, submit_account=...)``: the account a job of that
tenant runs as (the submit account only with ``hpc.tenants.isolation: none``), checked never to be root or the
submit account. Adoption checks ask ``assigned(tenant)``: the account a job was submitted as, without assigning
one.
"""

from __future__ import annotations

import contextlib
import logging
import pwd
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from virtengine_hpc.config import Config
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.files import ensure_private
from virtengine_hpc.tenancy import TenantAccountError, TenantRules, check_account

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS assignments (
    tenant TEXT PRIMARY KEY,
    account TEXT NOT NULL UNIQUE,
    assigned_at TEXT NOT NULL
)
"""


def local_uid(account: str) -> int | None:
    """The account's uid on this host, or None when it has none here (it may exist on the cluster only)."""
    try:
        return pwd.getpwnam(account).pw_uid
    except KeyError:
        return None


class AssignmentStore:
    """Pool assignments (tenant -> account) in a SQLite file shared by every worker of the provider."""

    def __init__(self, path: Path, *, busy_timeout: float = 30.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        try:
            ensure_private(path)
            with self._connect() as conn:
                conn.execute(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"hpc.tenants.assignments_path {path}: cannot open it ({exc})") from exc

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    def all(self) -> dict[str, str]:
        with self._connect() as conn:
            return dict(conn.execute("SELECT tenant, account FROM assignments").fetchall())

    def get(self, tenant: str) -> str | None:
        with self._connect() as conn:
            row = conn.execute("SELECT account FROM assignments WHERE tenant = ?", (tenant,)).fetchone()
        return None if row is None else str(row[0])

    def assign(self, tenant: str, rules: TenantRules) -> str:
        """The tenant's pool account, assigning the next free one if it has none (atomically)."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                assigned = dict(conn.execute("SELECT tenant, account FROM assignments").fetchall())
                account = rules.choose(tenant, assigned)
                if tenant not in assigned and rules.fixed_account(tenant) is None:
                    conn.execute(
                        "INSERT INTO assignments (tenant, account, assigned_at) VALUES (?, ?, ?)",
                        (tenant, account, datetime.now(UTC).isoformat()),
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return account


class TenantAccounts:
    """Which account runs a tenant's jobs; one instance per process is enough (answers are cached)."""

    def __init__(
        self,
        rules: TenantRules,
        store: AssignmentStore | None,
        *,
        uid_of: Callable[[str], int | None] = local_uid,
    ) -> None:
        self.rules = rules
        self.store = store
        self.uid_of = uid_of
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Config) -> TenantAccounts:
        tenants = config.hpc.tenants
        rules = TenantRules.from_config(tenants)
        store = None
        if rules.isolated and rules.pool:
            path = tenants.assignments_path or config.state_dir / "tenant-accounts.db"
            store = AssignmentStore(path)
        return cls(rules, store)

    @classmethod
    def shared(cls) -> TenantAccounts:
        """No isolation (``hpc.tenants.isolation: none``): every job runs as the submit account, never root."""
        return cls(TenantRules(isolated=False), None)

    @property
    def isolated(self) -> bool:
        return self.rules.isolated

    def account_for(self, tenant: str, *, submit_account: str | None) -> str:
        """The account a job of ``tenant`` runs as (assigned from the pool on the tenant's first job).

        Raises ``TenantAccountError`` when the tenant has none, or when it would be root (by name, or uid 0 on
        this host) or ``submit_account``, the account the provider itself submits and queries as."""
        if not self.isolated:
            if submit_account is None:
                raise TenantAccountError("hpc.tenants.isolation is none but no submit account is known")
            return check_account(submit_account, submit_account=None, uid=self.uid_of(submit_account))
        account = self._known.get(tenant) or self._choose(tenant)
        return check_account(account, submit_account=submit_account, uid=self.uid_of(account))

    def _choose(self, tenant: str) -> str:
        with self._lock:
            account = self.rules.fixed_account(tenant)
            if account is None:
                if self.store is None:
                    raise TenantAccountError(self.rules.missing(tenant))
                account = self.store.assign(tenant, self.rules)
            self._known[tenant] = account
            return account

    def assigned(self, tenant: str) -> str | None:
        """The account ``tenant``'s jobs were submitted as, without assigning one (None: it has none yet)."""
        if not self.isolated:
            return None
        known = self._known.get(tenant) or self.rules.fixed_account(tenant)
        if known is None and self.store is not None:
            known = self.store.get(tenant)
        return known

    def warn_if_unusable(self, cluster_id: str) -> None:
        """Say at start what would otherwise show only job by job: with isolation and no account at all, every
        job of the cluster is refused."""
        if self.isolated and not self.rules.accounts():
            log.warning(
                "hpc.tenants names no account (accounts and pool are empty): every job of cluster %s will be "
                "refused with tenant_account_missing until the operator maps tenants to accounts",
                cluster_id,
            )

    def accounts(self) -> frozenset[str]:
        """Every account a tenant's job may run as (empty with isolation none)."""
        return self.rules.accounts() if self.isolated else frozenset()
