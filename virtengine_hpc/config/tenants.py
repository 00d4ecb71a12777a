"""Which cluster account runs each tenant's jobs (``hpc.tenants``) and the accounts that are never a tenant's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from virtengine_hpc.config.base import ACCOUNT_PATTERN, Section
from virtengine_hpc.models import _ADDRESS_RE as ADDRESS_PATTERN  # the pattern jobs name tenants with

SERVICE_ACCOUNTS = {
    "munge": "MUNGE's own account: it reads munge.key, which forges a Slurm credential for any uid",
    "slurm": "Slurm's own daemon account (SlurmUser): it rules the cluster",
}
"""Accounts that are never a tenant's, by name (others are refused by uid, or as the scheduler says)."""


class TenantsConfig(Section):
    """Which cluster account runs each tenant's jobs (docs/security.md): one unprivileged account per tenant,
    never shared by two tenants, never root, never the provider's own submit account."""

    isolation: Literal["per_tenant", "none"] = Field(
        "per_tenant",
        description="per_tenant: every job runs as its tenant's account (accounts, else one from pool); a tenant "
        "with neither has its jobs refused. none: every job runs as the provider's submit account, so tenants "
        "can read and cancel each other's jobs; only for a single-tenant cluster or a demo, never with root.",
    )
    accounts: dict[str, str] = Field(
        default_factory=dict,
        description="Tenant address -> cluster account, fixed by the operator; wins over the pool. Two tenants "
        "never share an account.",
    )
    pool: list[str] = Field(
        default_factory=list,
        description="Accounts handed out to tenants that accounts does not name, one per tenant, in this order, "
        "on the tenant's first job; the assignment is kept for good in assignments_path, so it survives "
        "restarts and is the same on every worker that shares the file. A pool account the cluster shows jobs "
        "of that no assignment explains is never handed out (SLURM, MOAB).",
    )
    assignments_path: Path | None = Field(
        None,
        description="SQLite file of the pool's assignments; default <state_store_path>/tenant-accounts.db. "
        "Workers and pollers on several hosts must share it (storage with working locks) or use accounts alone; "
        "back it up with the ledger.",
    )

    @field_validator("accounts")
    @classmethod
    def _accounts_ok(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, account in value.items():
            if not ADDRESS_PATTERN.fullmatch(tenant):
                raise ValueError(f"{tenant[:80]!r} is not a tenant address")
            _check_tenant_account(account)
        shared = sorted({a for a in value.values() if list(value.values()).count(a) > 1})
        if shared:
            raise ValueError(
                f"account {shared[0]} is mapped to more than one tenant: tenants never share one"
            )
        return value

    @field_validator("pool")
    @classmethod
    def _pool_ok(cls, value: list[str]) -> list[str]:
        for account in value:
            _check_tenant_account(account)
        twice = sorted({a for a in value if value.count(a) > 1})
        if twice:
            raise ValueError(f"account {twice[0]} is in the pool more than once")
        return value

    @model_validator(mode="after")
    def _pool_apart_from_fixed(self) -> TenantsConfig:
        both = sorted(set(self.pool) & set(self.accounts.values()))
        if both:
            raise ValueError(
                f"account {both[0]} is both in pool and fixed for a tenant in accounts: the pool could hand it to "
                "another tenant"
            )
        return self


def _check_tenant_account(account: str) -> None:
    if not re.fullmatch(ACCOUNT_PATTERN, account):
        raise ValueError(f"{account[:40]!r} is not a valid account name ({ACCOUNT_PATTERN})")
    if account == "root":
        raise ValueError("root can never be a tenant's account: tenant jobs run unprivileged")
    if account in SERVICE_ACCOUNTS:
        raise ValueError(f"{account} can never be a tenant's account: {SERVICE_ACCOUNTS[account]}")
