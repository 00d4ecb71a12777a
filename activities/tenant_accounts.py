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
from collections.abc import Callable, Collection, Iterator, Mapping
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
        if not path.exists():
            log.warning(
                "creating the pool's assignments file %s: if tenants got pool accounts before, their file is lost "
                "or not shared with this host (hpc.tenants.assignments_path); accounts the cluster shows in use "
                "are held back",
                path,
            )
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

    def holder(self, account: str) -> str | None:
        """The tenant the pool gave ``account`` to, if any."""
        with self._connect() as conn:
            row = conn.execute("SELECT tenant FROM assignments WHERE account = ?", (account,)).fetchone()
        return None if row is None else str(row[0])

    def release(self, tenant: str) -> str | None:
        """Delete ``tenant``'s assignment (the operator's decision); the account it held, if any."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute("SELECT account FROM assignments WHERE tenant = ?", (tenant,)).fetchone()
            conn.execute("DELETE FROM assignments WHERE tenant = ?", (tenant,))
            conn.execute("COMMIT")
        return None if row is None else str(row[0])

    def get(self, tenant: str) -> str | None:
        with self._connect() as conn:
            row = conn.execute("SELECT account FROM assignments WHERE tenant = ?", (tenant,)).fetchone()
        return None if row is None else str(row[0])

    def assign(self, tenant: str, rules: TenantRules, unavailable: Collection[str] = frozenset()) -> str:
        """The tenant's pool account, assigning the next free one if it has none (atomically); never one of
        ``unavailable``."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                assigned = dict(conn.execute("SELECT tenant, account FROM assignments").fetchall())
                account = rules.choose(tenant, assigned, unavailable)
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
        self._privileged: dict[str, str] = {}
        self._held_back: dict[str, str] = {}  # pool account -> why it is never handed out by this process
        self._lock = threading.Lock()
        # Accounts the pool gave out and still holds, in the pool or no longer: their jobs are still looked up
        # and swept (a new assignment always comes from the pool, which accounts() has anyway).
        self._assigned = (
            frozenset(store.all().values()) if store is not None and rules.isolated else frozenset()
        )

    @classmethod
    def from_config(cls, config: Config) -> TenantAccounts:
        accounts = cls.unchecked(config)
        accounts.check_all()
        return accounts

    @classmethod
    def unchecked(cls, config: Config) -> TenantAccounts:
        """The mapping as configured, without the start checks (``virtengine-hpc tenants`` repairs what they
        refuse)."""
        tenants = config.hpc.tenants
        rules = TenantRules.from_config(tenants)
        store = None
        path = tenants.assignments_path or config.state_dir / "tenant-accounts.db"
        if rules.isolated and (rules.pool or path.exists()):  # a pool emptied since still holds its tenants
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
            # The explicit opt-out: the provider's own account runs every job, which only root may not be.
            uid = self.uid_of(submit_account)
            return check_account(submit_account, submit_account=None, uid=uid, lowest_uid=0)
        account = self._known.get(tenant) or self._choose(tenant)
        return check_account(
            account, submit_account=submit_account, uid=self.uid_of(account), privileged=self._privileged
        )

    def refuse(self, privileged: Mapping[str, str], *, cluster_id: str) -> None:
        """Accounts the scheduler says are privileged (account -> why: SlurmUser, an operator): never a tenant's.
        A tenant mapped to one has each of its jobs refused; the operator hears it now."""
        self._privileged.update(privileged)
        for account in sorted(self.accounts() & privileged.keys()):
            log.error(
                "hpc.tenants names %s, which is %s on cluster %s: jobs of the tenant it is given to are refused "
                "(tenant_account_refused) until it is replaced by an unprivileged account",
                account,
                privileged[account],
                cluster_id,
            )

    def check_all(self) -> None:
        """Refuse at start a configuration that names a privileged account (as this host knows it), or that fixes
        an account for one tenant which the pool gave to another."""
        if not self.isolated:
            return
        for account in sorted(self.rules.accounts()):
            try:
                check_account(account, submit_account=None, uid=self.uid_of(account))
            except TenantAccountError as exc:
                raise ConfigError(f"hpc.tenants: {exc}") from None
        held = self.store.all() if self.store is not None else {}
        for tenant, account in sorted(held.items()):
            fixed = self.rules.fixed_holder(account)
            if fixed is not None and fixed != tenant:
                raise ConfigError(f"hpc.tenants: {_shared_message(account, fixed, tenant, self._path())}")
            if account not in self.rules.pool and fixed is None:
                log.warning(
                    "pool account %s is no longer in hpc.tenants.pool but tenant %s holds it (%s): it stays that "
                    "tenant's (its jobs are still looked up and swept) and is never handed to another",
                    account,
                    tenant,
                    self._path(),
                )

    def _choose(self, tenant: str) -> str:
        with self._lock:
            account = self.rules.fixed_account(tenant)
            if account is None:
                if self.store is None:
                    raise TenantAccountError(self.rules.missing(tenant))
                try:
                    account = self.store.assign(tenant, self.rules, self._held_back.keys())
                except TenantAccountError as exc:
                    raise self._with_held_back(exc) from None
            self._check_one_holder(tenant, account)
            self._known[tenant] = account
            return account

    def _with_held_back(self, exc: TenantAccountError) -> TenantAccountError:
        """The refusal, saying which pool accounts are held back and why (on chain and in the audit record)."""
        if not self._held_back:
            return exc
        why = "; ".join(f"{account}: {reason}" for account, reason in sorted(self._held_back.items()))
        return TenantAccountError(f"{exc}; held back, not handed to a new tenant: {why}", code=exc.code)

    def _check_one_holder(self, tenant: str, account: str) -> None:
        """``account`` is ``tenant``'s alone: neither fixed for another tenant nor held by one in the pool."""
        fixed = self.rules.fixed_holder(account)
        pooled = self.store.holder(account) if self.store is not None else None
        for other in (fixed, pooled):
            if other is not None and other != tenant:
                raise TenantAccountError(
                    f"tenant {tenant}'s job is refused: "
                    + _shared_message(account, fixed or tenant, pooled or tenant, self._path()),
                    code="tenant_account_refused",
                )

    def _path(self) -> str:
        return str(self.store.path) if self.store is not None else "the assignments file"

    def needs_assignment(self, tenant: str) -> bool:
        """A job of ``tenant`` would be handed a pool account now (it has neither a fixed nor an assigned one)."""
        return (
            self.isolated
            and self.store is not None
            and tenant not in self._known
            and self.rules.fixed_account(tenant) is None
            and self.store.get(tenant) is None
        )

    def unassigned_pool(self) -> list[str]:
        """Pool accounts no tenant holds and not held back yet: what the next assignments may hand out."""
        if self.store is None:
            return []
        taken = set(self.store.all().values()) | self._held_back.keys()
        return [a for a in self.rules.pool if a not in taken]

    def hold_back(self, in_use: Mapping[str, str], *, cluster_id: str, files: bool = False) -> None:
        """Never hand out these pool accounts (account -> what shows them in use): the cluster has jobs of them
        that no assignment here explains, so some tenant holds them in an assignments file this one does not
        know (lost and recreated, or another host's own). ``files``: what shows them in use is files left in
        their job directories, which a new tenant would inherit."""
        for account, why in sorted(in_use.items()):
            if account in self._held_back:
                continue
            self._held_back[account] = why
            if files:
                log.error(
                    "pool account %s is not handed out: %s on cluster %s, and a new tenant gets a pool account "
                    "only with an empty job directory (they are an earlier tenant's: once it has its outputs, "
                    "remove them as the account, or run virtengine-hpc tenants release --clean while it still "
                    "holds the account)",
                    account,
                    why,
                    cluster_id,
                )
                continue
            log.error(
                "pool account %s is not handed out: %s on cluster %s, but %s names no tenant for it (the file "
                "was recreated, or another host keeps its own: hpc.tenants.assignments_path must be the one file "
                "every worker shares)",
                account,
                why,
                cluster_id,
                self._path(),
            )

    def assigned(self, tenant: str) -> str | None:
        """The account ``tenant``'s jobs were submitted as, without assigning one (None: it has none yet)."""
        if not self.isolated:
            return None
        known = self._known.get(tenant) or self.rules.fixed_account(tenant)
        if known is None and self.store is not None:
            known = self.store.get(tenant)
        return known

    def tenant_of(self, account: str) -> str | None:
        """The tenant whose jobs run as ``account`` (fixed, else the pool's assignment); None if none does."""
        if not self.isolated:
            return None
        fixed = self.rules.fixed_holder(account)
        if fixed is not None or self.store is None:
            return fixed
        return self.store.holder(account)

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
        """Every account a tenant's job may run or have run as: the fixed ones, the pool and the accounts the pool
        gave out that have left it since (empty with isolation none)."""
        return self.rules.accounts() | self._assigned if self.isolated else frozenset()


def _shared_message(account: str, fixed_for: str, pooled_to: str, path: str) -> str:
    return (
        f"account {account} is fixed for tenant {fixed_for} in hpc.tenants.accounts, but the pool gave it to tenant "
        f"{pooled_to} ({path}): two tenants would share one account (each could read the other's files and cancel "
        f"its jobs). Give {fixed_for} another account, or, once {pooled_to}'s jobs have ended and its files are "
        f"gone, release it from {pooled_to} (virtengine-hpc tenants release {pooled_to}; {path})"
    )
