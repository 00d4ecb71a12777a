"""``virtengine-hpc tenants``: which cluster account runs each tenant's jobs (``hpc.tenants``, docs/security.md).

``list`` shows the fixed accounts and the pool's assignments (the assignments file). ``release TENANT`` deletes a
tenant's pool assignment, for when the operator moves that account to another tenant: run it only once the
tenant's jobs have ended and its files under the account are gone, since the account then serves someone else.
"""

from __future__ import annotations

import argparse
from typing import Any

from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.cli.common import config_from_args, print_json
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
    accounts = _accounts(args)
    if accounts.store is None or accounts.store.get(args.tenant) is None:
        raise ConfigError(f"tenant {args.tenant} holds no pool account")
    account = accounts.store.release(args.tenant)
    print(f"released {account} from tenant {args.tenant}")
    return 0
