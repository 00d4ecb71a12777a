"""``virtengine-hpc tenants``: which cluster account runs each tenant's jobs (``hpc.tenants``, docs/security.md).

``list`` shows the fixed accounts and the pool's assignments (the assignments file). ``release TENANT`` deletes a
tenant's pool assignment, for when the operator moves that account to another tenant: run it only once the
tenant's jobs have ended and its files under the account are gone, since the account then serves someone else.
It first asks the cluster (as the pool does before it hands out an account: live jobs, and on SLURM jobs in
accounting within ``accounting_lookback``) and refuses while the account has jobs there: a fixed account is
never checked against the cluster, so the next tenant's jobs would run as the uid of the old tenant's running
job, in the same directory. ``--force`` releases it anyway. It then checks the account's job directory
(``<work_dir>/<account>``; the local executor's job directories of the account) and refuses while it holds files:
the last tenant's outputs, which the next would read. ``--clean`` removes them first, as the account, by a fixed
argv (once the tenant has its outputs); ``--keep-files`` releases it with them. Where no trustworthy view of the
directory exists (SSH logins run the account's startup files, slurmrestd and MWS see no files) it refuses until
the operator, having emptied the directory and reset the account's home on the cluster, passes ``--keep-files``.
Every release and refusal is audited (``tenant_account_released``, ``tenant_account_release_refused``), with who
asked (the local account, the one that ran ``sudo``, the host).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import socket
from typing import Any

from activities.audit import AuditLog
from activities.schedulers.base import SchedulerAdapter, files_left_message
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import ConfigError, SchedulerError


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
    p.add_argument(
        "--clean",
        action="store_true",
        help="first remove the files left in the account's job directory, as the account (its tenant has its "
        "outputs)",
    )
    p.add_argument(
        "--keep-files",
        action="store_true",
        help="release it with the files left in its job directory (the next tenant of the account reads them)",
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
    audit = _audit_log(config)
    details: dict[str, Any] = {"tenant": args.tenant, "account": held, "forced": args.force, **_operator()}
    refusal, details["files_removed"] = asyncio.run(_refusal(config, args, held))
    if refusal is not None:
        audit.record(
            AuditEvent.TENANT_ACCOUNT_RELEASE_REFUSED,
            cluster_id=config.hpc.cluster_id,
            success=False,
            severity=3,
            error_msg=refusal,
            details=details,
        )
        raise ConfigError(refusal)
    account = accounts.store.release(args.tenant)
    details["files_kept"] = args.keep_files
    audit.record(AuditEvent.TENANT_ACCOUNT_RELEASED, cluster_id=config.hpc.cluster_id, details=details)
    print(f"released {account} from tenant {args.tenant}")
    return 0


def _operator() -> dict[str, str | None]:
    """Who asks, for the audit record: the local account that runs the command, the one that ran ``sudo`` (if
    any; as root may set it, it is what ``sudo`` said, not proof), and the host."""
    return {
        "released_by": pwd.getpwuid(os.getuid()).pw_name,
        "sudo_user": os.environ.get("SUDO_USER"),
        "host": socket.gethostname(),
    }


def _audit_log(config: Config) -> AuditLog:
    from workers.wiring import anchor_signer

    return AuditLog(config.hpc.audit, anchor_signer=anchor_signer(Secrets.from_env()))


async def _refusal(config: Config, args: argparse.Namespace, account: str) -> tuple[str | None, bool]:
    """Why ``account`` may not leave ``args.tenant`` now (None: it may), and whether its files were removed.

    The cluster must show no job of the account (live, or on SLURM in accounting within ``accounting_lookback``;
    ``--force`` skips this) and its job directory must be empty (``--keep-files`` skips this, ``--clean`` empties
    it first, as the account): the next tenant of the account would otherwise run as the same uid beside those
    jobs, and read (or take for its own) the files the last tenant left."""
    from workers.wiring import build_adapter

    if config.hpc.scheduler_type == "local" and not config.hpc.local.allow_unisolated:
        return None, False  # no local executor runs here: it has no jobs and no files
    if args.force and args.keep_files:
        return None, False
    tenant, cluster = args.tenant, config.hpc.cluster_id
    adapter = build_adapter(config, Secrets.from_env(), cluster)
    try:
        in_use = None if args.force else (await adapter.accounts_in_use([account])).get(account)
        if in_use:
            return (
                f"{account} of tenant {tenant} still has jobs on cluster {cluster} ({in_use}): released now, the "
                "next tenant of the account would run as the same uid beside them; release it once they ended "
                "and the tenant's files under the account are gone, or pass --force"
            ), False
        return await _files_refusal(adapter, args, account, cluster)
    finally:
        await adapter.close()


async def _files_refusal(
    adapter: SchedulerAdapter, args: argparse.Namespace, account: str, cluster: str
) -> tuple[str | None, bool]:
    if args.keep_files:
        return None, False
    try:
        left = await adapter.account_files(account)
    except SchedulerError as exc:  # its last tenant can leave the directory unreadable to the account itself
        if not args.clean:
            return (
                f"{account} of tenant {args.tenant}: its job directory on cluster {cluster} cannot be listed as the "
                f"account ({str(exc)[:200]}): pass --clean to give it back its owner's bits and empty it as the "
                "account (or --keep-files to release it as it is)"
            ), False
        await adapter.remove_account_files(account)
        return None, True
    if left is None:
        return (
            f"the files {account} of tenant {args.tenant} left on cluster {cluster} cannot be checked from here "
            f"({adapter.name}: no view of the account's job directory but through its own login, whose startup "
            "files the tenant wrote): once the tenant has its outputs, empty the directory as the account on the "
            "cluster and reset its home (~/.ssh, shell startup files, crontab), then pass --keep-files"
        ), False
    if left and args.clean:
        await adapter.remove_account_files(account)
        return None, True
    if left:
        return (
            f"{account} of tenant {args.tenant}: {files_left_message(left)} on cluster {cluster}, which the "
            "account's next tenant would read: once the tenant has its outputs, pass --clean to remove them as "
            "the account (or --keep-files to release it with them)"
        ), False
    return None, False
