"""Which cluster account runs a tenant's jobs: the rules, without I/O.

Tenants are adversaries: each tenant's jobs run as that tenant's own unprivileged account, never as the
provider's submit account and never as root (invariant 15 in docs/architecture.md). ``hpc.tenants`` says how:

* ``accounts`` fixes an account for a tenant; it wins.
* ``pool`` lists accounts handed out to the other tenants, one per tenant, in order, on a tenant's first job.
  The assignment is kept for good (``activities/tenant_accounts.py`` stores it), so a tenant keeps its account
  across restarts and on every worker that shares the store, and two tenants never share one.
* ``isolation: none`` is the explicit opt-out: every job runs as the provider's submit account.

A tenant with no account gets ``TenantAccountError`` (non-retryable): its job is refused with that reason on
chain and in the audit log, and nothing else stops. A privileged account is refused the same way, wherever it
comes from: root (by name or uid 0), a system account (uid below ``UID_MIN`` of ``/etc/login.defs``, 1000 by
default, where the account exists on the worker's host), MUNGE's and Slurm's own accounts, the provider's submit
account, and what the scheduler itself says is privileged (SlurmUser, Slurm operators and administrators).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from virtengine_hpc.config import SERVICE_ACCOUNTS, TenantsConfig
from virtengine_hpc.errors import TenantAccountError

ROOT = "root"
LOGIN_DEFS = Path("/etc/login.defs")
DEFAULT_UID_MIN = 1000
_UID_MIN_LINE = re.compile(r"^\s*UID_MIN\s+(\d+)\s*$", re.M)

__all__ = ["TenantAccountError"]  # defined with the other domain errors; imported from here as well


@functools.cache
def uid_min(path: Path = LOGIN_DEFS) -> int:
    """The lowest uid of an ordinary login account on this host (``UID_MIN`` of ``login.defs``; 1000 without)."""
    try:
        found = _UID_MIN_LINE.search(path.read_text(errors="replace"))
    except OSError:
        return DEFAULT_UID_MIN
    return int(found.group(1)) if found else DEFAULT_UID_MIN


def _refused(account: str, why: str) -> TenantAccountError:
    return TenantAccountError(
        f"refusing to run a tenant's job as {account}: {why}; tenant jobs run as ordinary unprivileged accounts "
        "(hpc.tenants)",
        code="tenant_account_refused",
    )


def check_account(
    account: str,
    *,
    submit_account: str | None,
    uid: int | None = None,
    privileged: Mapping[str, str] | None = None,
    lowest_uid: int | None = None,
) -> str:
    """``account`` if a tenant's job may run as it: never root (by name or uid 0), a system account (``uid`` below
    ``lowest_uid``, default ``UID_MIN`` of this host), MUNGE's or Slurm's own account, the submit account, or one
    of ``privileged`` (account -> why, as the scheduler says)."""
    if account == ROOT or uid == 0:
        raise TenantAccountError(
            f"refusing to run a tenant's job as {account} (uid 0): tenant jobs run unprivileged",
            code="tenant_account_refused",
        )
    if account in SERVICE_ACCOUNTS:
        raise _refused(account, SERVICE_ACCOUNTS[account])
    floor = uid_min() if lowest_uid is None else lowest_uid
    if uid is not None and uid < floor:
        raise _refused(account, f"uid {uid} is a system account's (below UID_MIN {floor} of /etc/login.defs)")
    if submit_account is not None and account == submit_account:
        raise TenantAccountError(
            f"refusing to run a tenant's job as {account}, the provider's own submit account: each tenant "
            "needs an account of its own (hpc.tenants)",
            code="tenant_account_refused",
        )
    why = (privileged or {}).get(account)
    if why is not None:
        raise _refused(account, why)
    return account


@dataclass(frozen=True)
class TenantRules:
    """``hpc.tenants`` as rules: which account a tenant has or would get."""

    fixed: Mapping[str, str] = field(default_factory=dict)
    pool: tuple[str, ...] = ()
    isolated: bool = True

    @classmethod
    def from_config(cls, tenants: TenantsConfig) -> TenantRules:
        return cls(
            fixed=dict(tenants.accounts),
            pool=tuple(tenants.pool),
            isolated=tenants.isolation == "per_tenant",
        )

    def fixed_account(self, tenant: str) -> str | None:
        return self.fixed.get(tenant)

    def next_free(self, taken: Collection[str]) -> str | None:
        """The first pool account no tenant holds yet (fixed accounts are never in the pool)."""
        return next((a for a in self.pool if a not in taken), None)

    def accounts(self) -> frozenset[str]:
        """Every account a tenant's job may run as: the fixed ones and the pool."""
        return frozenset(self.fixed.values()) | frozenset(self.pool)

    def fixed_holder(self, account: str) -> str | None:
        """The tenant ``accounts`` fixes ``account`` for, if any."""
        return next((t for t, a in self.fixed.items() if a == account), None)

    def choose(
        self, tenant: str, assigned: Mapping[str, str], unavailable: Collection[str] = frozenset()
    ) -> str:
        """The account of ``tenant`` given the pool's current ``assigned`` (tenant -> account).

        Fixed wins, then the tenant's existing assignment, then the next free pool account that is not
        ``unavailable`` (in use on the cluster by someone the assignments do not know). The caller stores a new
        assignment atomically (two tenants must never get the same one)."""
        account = self.fixed_account(tenant) or assigned.get(tenant)
        if account is not None:
            return account
        account = self.next_free(set(assigned.values()) | set(unavailable))
        if account is None:
            raise TenantAccountError(self.missing(tenant))
        return account

    def missing(self, tenant: str) -> str:
        if not self.pool:
            return (
                f"tenant {tenant} has no cluster account: hpc.tenants.accounts does not name it and "
                "hpc.tenants.pool is empty"
            )
        return (
            f"tenant {tenant} has no cluster account: hpc.tenants.accounts does not name it and all "
            f"{len(self.pool)} accounts of hpc.tenants.pool are taken by other tenants"
        )
