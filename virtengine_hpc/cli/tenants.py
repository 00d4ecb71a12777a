"""``virtengine-hpc tenants``: which cluster account runs each tenant's jobs (``hpc.tenants``, docs/security.md).

``list`` shows the fixed accounts and the pool's assignments (the assignments file). ``release TENANT`` deletes a
tenant's pool assignment, for when the operator moves that account to another tenant: run it only once the
tenant's jobs have ended and its files under the account are gone, since the account then serves someone else.
It first asks the cluster (as the pool does before it hands out an account: live jobs, and on SLURM jobs in
accounting within ``accounting_lookback``) and refuses while the account has jobs there: a fixed account is
never checked against the cluster, so the next tenant's jobs would run as the uid of the old tenant's running
job, in the same directory. ``--force`` releases it anyway.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tenants",
        help="tenant accounts: list the mapping, release a pool assignment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="tenants_command", metavar="COMMAND", required=True)
    p = sub.add_parser("list", help="fixed accounts and the pool's assignments")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("release", help="delete a tenant's pool assignment (its jobs ended, its files gone)")
    p.add_argument("tenant")
    p.add_argument(
        "--force", action="store_true", help="release it even while the cluster shows jobs of the account"
    )
    p.set_defaults(func=cmd_release)


def _accounts(args: argparse.Namespace) -> TenantAccounts:
    # Not from_config: a configuration that start refuses (two tenants on one account) is what this repairs.
    return TenantAccounts.unchecked(config_from_args(args))


def cmd_list(args: argparse.Namespace) -> int:
    accounts = _accounts(args)
    rows = [
        {"tenant": t, "account": a, "source": "accounts"} for t, a in sorted(accounts.rules.fixed.items())
    ]
    assigned = accounts.store.all() if accounts.store is not None else {}
    rows += [{"tenant": t, "account": a, "source": "pool"} for t, a in sorted(assigned.items())]
    if args.json:
        print_json(rows)
        return 0
    for row in rows:
        print(f"{row['tenant']}\t{row['account']}\t{row['source']}")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    accounts = TenantAccounts.unchecked(config)
    held = accounts.store.get(args.tenant) if accounts.store is not None else None
    if accounts.store is None or held is None:
        raise ConfigError(f"tenant {args.tenant} holds no pool account")
    if not args.force:
        in_use = asyncio.run(_in_use(config, held))
        if in_use:
            raise ConfigError(
                f"{held} of tenant {args.tenant} still has jobs on cluster {config.hpc.cluster_id} ({in_use}): "
                "released now, the next tenant of the account would run as the same uid beside them; release it "
                "once they ended and the tenant's files under the account are gone, or pass --force"
            )
    account = accounts.store.release(args.tenant)
    print(f"released {account} from tenant {args.tenant}")
    return 0


async def _in_use(config: Config, account: str) -> str | None:
    """What the cluster shows of ``account``'s jobs, None if nothing (or no cluster this configuration reaches)."""
    from workers.wiring import build_adapter

    if config.hpc.scheduler_type not in ("slurm", "moab"):
        return None
    adapter = build_adapter(config, Secrets.from_env(), config.hpc.cluster_id)
    try:
        return (await adapter.accounts_in_use([account])).get(account)
    finally:
        await adapter.close()
