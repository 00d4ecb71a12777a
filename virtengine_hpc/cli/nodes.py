"""``virtengine-hpc nodes``: the provider's side of the node agents.

``allow`` puts a node's public key on the allow-list (only allowed keys may register); ``list``, ``show`` and
``capacity`` read the node registry; ``drain``, ``resume`` and ``deregister`` are sent to the node's
``NodeWorkflow`` as updates and print the node's status once the command took effect; ``serve`` runs the node
API. The registry lives in the config's ``chain.ledger_path``. See ``docs/node-agent.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from activities.chain.node_ledger import NodeLedger
from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError, ValidationError
from virtengine_hpc.node.lifecycle import NodeCommand, NodeState, NodeStatus, workflow_id


class NoLifecycle(HPCError):
    """The node has no running workflow (it never registered, or it is deregistered)."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "nodes",
        help="node agents: allow keys, list, drain/resume/deregister, serve the node API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="nodes_command", metavar="COMMAND", required=True)

    def node_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("node_id", metavar="NODE_ID")
        p.add_argument("--cluster", help="cluster id (default: hpc.cluster_id)")

    p = sub.add_parser("allow", help="allow a node's Ed25519 public key (printed by hpc-node-agent init)")
    node_args(p)
    p.add_argument("--public-key", required=True, metavar="B64", help="base64 of the raw 32-byte public key")
    p.add_argument(
        "--scheduler-node", metavar="NAME", help="the node's name in the scheduler (default NODE_ID)"
    )
    p.set_defaults(func=cmd_allow)

    p = sub.add_parser("list", help="registered and allowed nodes with their state")
    p.add_argument("--cluster", help="only this cluster")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="one node: registry row, live workflow status, recent metadata updates")
    node_args(p)
    p.set_defaults(func=cmd_show)

    for action, text in (
        ("drain", "stop new jobs on the node; it becomes drained when none is left"),
        ("resume", "undo a drain"),
        ("deregister", "remove the node for good (its key is revoked; terminal)"),
    ):
        p = sub.add_parser(action, help=text)
        node_args(p)
        p.add_argument("--reason", default="", help="recorded in the audit log and the scheduler")
        if action == "drain":
            p.add_argument("--wait", action="store_true", help="wait until the node is drained")
            p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (with --wait)")
        p.set_defaults(func=cmd_command, action=action)

    p = sub.add_parser("capacity", help="a cluster's capacity from its active nodes (what routing counts on)")
    p.add_argument("--cluster", help="cluster id (default: hpc.cluster_id)")
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser("serve", help="run the node API (default 127.0.0.1:8081)")
    p.add_argument("--host", help="bind address (default nodes.listen_host)")
    p.add_argument("--port", type=int, help="port (default nodes.listen_port)")
    p.set_defaults(func=cmd_serve)


def _ledger(config: Config) -> NodeLedger:
    return NodeLedger(config.ledger_path)


def _cluster(args: argparse.Namespace, config: Config) -> str:
    return str(getattr(args, "cluster", None) or config.hpc.cluster_id)


def cmd_allow(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    ledger = _ledger(config)
    allowed = ledger.allow(_cluster(args, config), args.node_id, args.public_key, args.scheduler_node)
    print_json(allowed)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    ledger = _ledger(config)
    rows = {(r.cluster_id, r.node_id): r for r in ledger.list_nodes(args.cluster)}
    allowed = {(a.cluster_id, a.node_id): a for a in ledger.list_allowed(args.cluster)}
    entries = []
    for key in sorted(set(rows) | set(allowed)):
        row, allow = rows.get(key), allowed.get(key)
        state = row.state.value if row else ("allowed" if allow and allow.active else "revoked")
        entries.append(
            {
                "cluster_id": key[0],
                "node_id": key[1],
                "state": state,
                "last_heartbeat_at": row.last_heartbeat_at.isoformat()
                if row and row.last_heartbeat_at
                else None,
                "last_sequence": row.last_sequence if row else 0,
                "cpus": row.capacity.cpu_cores_total if row and row.capacity else None,
                "memory_mb": row.capacity.memory_mb_total if row and row.capacity else None,
                "gpus": row.capacity.gpus_total if row and row.capacity else None,
            }
        )
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    row_format = "{:<16} {:<20} {:<13} {:>8} {:>5} {:>8} {:>4}  {}"
    print(row_format.format("CLUSTER", "NODE", "STATE", "SEQ", "CPUS", "MEM_MB", "GPUS", "LAST HEARTBEAT"))
    for e in entries:
        fields = (
            "cluster_id",
            "node_id",
            "state",
            "last_sequence",
            "cpus",
            "memory_mb",
            "gpus",
            "last_heartbeat_at",
        )
        print(row_format.format(*(_dash(e[name]) for name in fields)))
    return 0


def _silence(last: datetime | None) -> float | None:
    """Seconds since the provider last accepted a heartbeat of the node, now."""
    return round((datetime.now(UTC) - last).total_seconds(), 1) if last else None


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


async def _workflow_status(config: Config, cluster: str, node: str) -> NodeStatus | None:
    from temporalio.service import RPCError

    from workers.node_api import running_node_workflow
    from workers.wiring import connect

    client = await connect(config)
    try:
        wf_id = await running_node_workflow(client, cluster, node) or workflow_id(cluster, node)
        return await client.get_workflow_handle(wf_id).query(
            "status", result_type=NodeStatus, rpc_timeout=timedelta(seconds=5)
        )
    except RPCError:
        return None


def cmd_show(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    cluster = _cluster(args, config)
    ledger = _ledger(config)
    row = ledger.get(cluster, args.node_id)
    allowed = ledger.allowed(cluster, args.node_id)
    if row is None and allowed is None:
        raise ValidationError(f"no node {args.node_id} in cluster {cluster}")
    try:
        status = asyncio.run(_workflow_status(config, cluster, args.node_id))
    except (HPCError, OSError, RuntimeError) as exc:  # Temporal unreachable: the ledger still answers
        status = None
        print(f"# workflow status unavailable: {exc}", file=sys.stderr)
    report = {
        "allowed": allowed.model_dump(mode="json") if allowed else None,
        "registry": row.model_dump(mode="json") if row else None,
        "workflow": status.model_dump(mode="json") if status else None,
        "silent_for_seconds": _silence(row.last_heartbeat_at if row else None),
        "recent_updates": [
            {k: v for k, v in u.model_dump(mode="json").items() if k != "payload"}
            for u in ledger.updates(cluster, args.node_id, limit=10)
        ],
    }
    print(json.dumps(report, indent=2))
    return 0


async def _command(
    config: Config, cluster: str, node: str, command: NodeCommand, wait: float | None
) -> NodeStatus:
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError, RPCStatusCode

    from workers.node_api import running_node_workflow
    from workers.wiring import connect

    client = await connect(config)
    try:
        wf_id = await running_node_workflow(client, cluster, node)
    except RPCError as exc:
        raise HPCError(f"cannot reach Temporal: {exc}", transient=True) from None
    if wf_id is None:
        raise NoLifecycle(f"node {node} of cluster {cluster} has no running lifecycle")
    handle = client.get_workflow_handle(wf_id)
    try:
        status: NodeStatus = await handle.execute_update("command", command, result_type=NodeStatus)
    except WorkflowUpdateFailedError as exc:
        raise ValidationError(f"node {node}: {exc.cause or exc}") from None
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise NoLifecycle(f"node {node} of cluster {cluster} has no running lifecycle") from None
        raise HPCError(f"cannot reach Temporal: {exc}", transient=True) from None
    deadline = time.monotonic() + (wait or 0)
    while wait and status.state is NodeState.DRAINING and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        status = await handle.query("status", result_type=NodeStatus)
    return status


def cmd_command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    cluster = _cluster(args, config)
    command = NodeCommand(action=args.action, reason=args.reason, requested_by="virtengine-hpc nodes")
    ledger = _ledger(config)
    try:
        status = asyncio.run(
            _command(
                config, cluster, args.node_id, command, args.timeout if getattr(args, "wait", False) else None
            )
        )
    except NoLifecycle:
        # A node that never registered has no workflow: deregistering it only revokes its key.
        if args.action == "deregister" and ledger.deregister_unregistered(cluster, args.node_id):
            print(json.dumps({"node_id": args.node_id, "cluster_id": cluster, "state": "deregistered"}))
            return 0
        raise
    print_json(status)
    if getattr(args, "wait", False) and status.state is not NodeState.DRAINED:
        print(f"# still {status.state.value} after {args.timeout:.0f} s")
        return 1
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    print_json(_ledger(config).cluster_capacity(_cluster(args, config)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from workers.node_api import serve

    config = config_from_args(args)
    asyncio.run(serve(config, host=args.host, port=args.port))
    return 0
