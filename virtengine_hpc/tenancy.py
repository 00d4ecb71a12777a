"""Which cluster account runs a tenant's jobs: the rules, without I/O.

Tenants are adversaries: each tenant's jobs run as that tenant's own unprivileged account, never as the
provider's submit account and never as root (invariant 15 in docs/architecture.md). ``hpc.tenants`` says how:

* ``accounts`` fixes an account for a tenant; it wins.
* ``pool`` lists accounts handed out to the other tenants, one per tenant, in order, on a tenant's first job.
  The assignment is kept for good (``activities/tenant_accounts.py`` stores it), so a tenant keeps its account
  across restarts and on every worker that shares the store, and two tenants never share one.
* ``isolation: none`` is the explicit opt-out: every job runs as the provider's submit account.

A tenant with no account gets ``TenantAccountError`` (non-retryable): its job is refused with that reason on
chain and in the audit log, and nothing else stops. An account that is root or the submit account itself is
refused the same way, wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from virtengine_hpc.config import TenantsConfig
from virtengine_hpc.errors import HPCError

ROOT = "root"


class TenantAccountError(HPCError):
    """A tenant's job cannot run: it has no cluster account, or the one it would get is privileged.

    Never transient: trying again the same way cannot help, the operator must change ``hpc.tenants``.
    """

    transient = False
    code = "tenant_account_missing"


def check_account(account: str, *, submit_account: str | None, uid: int | None = None) -> str:
    """``account`` if a tenant's job may run as it: never root (by name or uid 0), never the submit account."""
    if account == ROOT or uid == 0:
        raise TenantAccountError(
            f"refusing to run a tenant's job as {account} (uid 0): tenant jobs run unprivileged",
            code="tenant_account_refused",
        )
    if submit_account is not None and account == submit_account:
        raise TenantAccountError(
            f"refusing to run a tenant's job as {account}, the provider's own submit account: each tenant "
            "needs an account of its own (hpc.tenants)",
            code="tenant_account_refused",
        )
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

    def choose(self, tenant: str, assigned: Mapping[str, str]) -> str:
        """The account of ``tenant`` given the pool's current ``assigned`` (tenant -> account).

        Fixed wins, then the tenant's existing assignment, then the next free pool account. The caller stores a
        new assignment atomically (two tenants must never get the same one)."""
        account = self.fixed_account(tenant) or assigned.get(tenant)
        if account is not None:
            return account
        account = self.next_free(set(assigned.values()))
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
