"""``virtengine-hpc status``: a live view of the provider for an operator at a console.

One screen, refreshed every ``--interval`` seconds (``--once`` prints one frame and exits, ``--json`` one
machine-readable snapshot):

* **jobs by cluster and state**: running job workflows per state, and jobs ended in the last 24 hours per final
  state, counted by Temporal's visibility store (``VeClusterId`` / ``VeJobState`` search attributes), plus how
  many workers poll each cluster's task queue (a cluster nobody serves shows 0 at once);
* **nodes by cluster and state**, from the node registry in the ledger file (when there is one);
* **recent violations**: the newest routing violations, rejected jobs and rejected node requests of the audit log.

Every part is read independently: an unreachable Temporal shows as such while nodes and violations still show.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.cli.common import config_from_args
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, PARKED
from virtengine_hpc.states import JobState

ACTIVE = [*(s.value for s in JobState if not s.final), PARKED]
FINAL = [s.value for s in JobState if s.final]
NODE_STATES = ["pending", "active", "stale", "offline", "draining", "drained", "deregistered"]
VIOLATIONS = {
    AuditEvent.ROUTING_VIOLATION,
    AuditEvent.JOB_ROUTING_REJECTED,
    AuditEvent.JOB_VALIDATION_FAILED,
    AuditEvent.HEARTBEAT_REJECTED,
    AuditEvent.NODE_REGISTRATION_REJECTED,
    AuditEvent.SECURITY_VIOLATION,
    AuditEvent.SIGNATURE_INVALID,
    AuditEvent.TEMPLATE_REJECTED,
}
AUDIT_TAIL_BYTES = 512 * 1024
CLEAR = "\x1b[H\x1b[2J"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "status",
        help="live view: jobs by cluster and state, nodes by state, recent violations",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default 2)")
    parser.add_argument("--violations", type=int, default=10, help="how many recent violations (default 10)")
    parser.set_defaults(func=_run)


@dataclass
class ClusterJobs:
    cluster_id: str
    running: dict[str, int] = field(default_factory=dict)
    ended_24h: dict[str, int] = field(default_factory=dict)
    workers: int | None = None


@dataclass
class Violation:
    at: str
    event: str
    subject: str
    what: str
    severity: int | None = None


@dataclass
class Snapshot:
    provider: str
    temporal: str
    taken_at: str
    clusters: list[ClusterJobs] = field(default_factory=list)
    temporal_error: str | None = None
    nodes: dict[str, dict[str, int]] = field(default_factory=dict)
    nodes_note: str | None = None
    violations: list[Violation] = field(default_factory=list)
    audit_note: str | None = None


# ---- reading ---------------------------------------------------------------------------------------------------


async def _count(client: Any, query: str) -> int:
    return int((await client.count_workflows(query)).count)


async def read_jobs(client: Any, config: Config, now: datetime) -> list[ClusterJobs]:
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    from workers.wiring import task_queue

    since = (now - timedelta(hours=24)).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for cluster in config.cluster_ids():
        base = f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND VeClusterId = '{cluster}'"
        running = [
            _count(client, f"{base} AND ExecutionStatus = 'Running' AND VeJobState = '{s}'") for s in ACTIVE
        ]
        ended = [
            _count(
                client,
                f"{base} AND ExecutionStatus != 'Running' AND CloseTime > '{since}' AND VeJobState = '{s}'",
            )
            for s in FINAL
        ]
        counts = await asyncio.gather(*running, *ended)
        entry = ClusterJobs(
            cluster,
            running=dict(zip(ACTIVE, counts[: len(ACTIVE)], strict=True)),
            ended_24h=dict(zip(FINAL, counts[len(ACTIVE) :], strict=True)),
        )
        request = DescribeTaskQueueRequest(
            namespace=config.temporal.namespace,
            task_queue=TaskQueue(name=task_queue(config, cluster)),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
        answer = await client.workflow_service.describe_task_queue(request)
        entry.workers = len({p.identity for p in answer.pollers})
        out.append(entry)
    return out


def read_nodes(config: Config) -> tuple[dict[str, dict[str, int]], str | None]:
    path = Path(config.ledger_path)
    if not path.exists():
        return {}, f"no node registry ({path} does not exist)"
    from activities.chain.node_ledger import NodeLedger

    ledger = NodeLedger(path)
    try:
        rows = ledger.list_nodes()
    finally:
        ledger.close()
    counts: dict[str, Counter[str]] = {}
    for row in rows:
        counts.setdefault(row.cluster_id, Counter())[row.state.value] += 1
    if not rows:
        return {}, "no node has registered"
    return {cluster: dict(c) for cluster, c in sorted(counts.items())}, None


def read_violations(config: Config, limit: int) -> tuple[list[Violation], str | None]:
    path = Path(config.hpc.audit.log_path)
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - AUDIT_TAIL_BYTES))
            tail = handle.read()
    except FileNotFoundError:
        return [], f"no audit log at {path}"
    except OSError as exc:
        return [], f"cannot read the audit log {path}: {exc.strerror}"
    lines = tail.split(b"\n")
    if size > AUDIT_TAIL_BYTES:
        lines = lines[1:]  # the first one is cut
    found: list[Violation] = []
    for line in reversed(lines):
        if len(found) >= limit:
            break
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("event_type") not in VIOLATIONS:
            continue
        details = event.get("details") or {}
        kind = details.get("violation_type") or details.get("reason") or ""
        subject = event.get("job_id") or details.get("node_id") or event.get("cluster_id") or ""
        what = " ".join(str(x) for x in (kind, event.get("error_msg") or "") if x)
        found.append(
            Violation(
                str(event.get("timestamp", ""))[:19],
                event["event_type"],
                subject,
                what,
                event.get("severity"),
            )
        )
    return found, None


async def snapshot(config: Config, client: Any | None, *, violations: int = 10) -> Snapshot:
    now = datetime.now(UTC)
    snap = Snapshot(
        provider=config.provider.address,
        temporal=f"{config.temporal.address}/{config.temporal.namespace}",
        taken_at=now.strftime("%Y-%m-%d %H:%M:%SZ"),
    )
    if client is None:
        snap.temporal_error = "not connected"
        snap.clusters = [ClusterJobs(c) for c in config.cluster_ids()]
    else:
        try:
            snap.clusters = await read_jobs(client, config, now)
        except Exception as exc:
            snap.temporal_error = (str(exc) or type(exc).__name__)[:200]
            snap.clusters = [ClusterJobs(c) for c in config.cluster_ids()]
    snap.nodes, snap.nodes_note = await asyncio.to_thread(read_nodes, config)
    snap.violations, snap.audit_note = await asyncio.to_thread(read_violations, config, violations)
    return snap


# ---- rendering -------------------------------------------------------------------------------------------------


def render(snap: Snapshot) -> str:
    out = [f"virtengine-hpc status  provider {snap.provider}  Temporal {snap.temporal}  {snap.taken_at}", ""]
    heads = ["CLUSTER", "WORKERS", *ACTIVE, "|", *(f"{s} 24h" for s in FINAL)]
    rows = []
    for c in snap.clusters:
        workers = "-" if c.workers is None else str(c.workers)
        running = [str(c.running.get(s, "-")) for s in ACTIVE]
        ended = [str(c.ended_24h.get(s, "-")) for s in FINAL]
        rows.append([c.cluster_id, workers, *running, "|", *ended])
    out.append("Jobs")
    out += _table(heads, rows)
    if snap.temporal_error:
        out.append(f"  (no job counts: Temporal says: {snap.temporal_error})")
    for c in snap.clusters:
        if c.workers == 0:
            out.append(f"  ! no worker polls the task queue of {c.cluster_id}: its jobs wait")
    out += ["", "Nodes"]
    if snap.nodes:
        out += _table(
            ["CLUSTER", *NODE_STATES],
            [
                [cluster, *(str(counts.get(s, 0)) for s in NODE_STATES)]
                for cluster, counts in snap.nodes.items()
            ],
        )
    else:
        out.append(f"  {snap.nodes_note}")
    out += ["", "Recent violations"]
    if snap.violations:
        for v in snap.violations:
            severity = f"sev {v.severity}" if v.severity is not None else ""
            out.append(f"  {v.at}  {v.event:<26} {v.subject:<22} {severity:<6} {v.what}"[:200])
    else:
        out.append(f"  {snap.audit_note or 'none'}")
    return "\n".join(out) + "\n"


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = [
        "  "
        + "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths, strict=True))
        )
    ]
    for row in rows:
        lines.append(
            "  "
            + "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return lines


# ---- the command -----------------------------------------------------------------------------------------------


async def _connect(config: Config) -> tuple[Any | None, str | None]:
    from workers.wiring import connect

    try:
        return await connect(config), None
    except HPCError as exc:
        return None, str(exc)


async def watch(config: Config, args: argparse.Namespace, out: TextIO) -> int:
    client, error = await _connect(config)
    if args.once or args.json:
        snap = await snapshot(config, client, violations=args.violations)
        if error:
            snap.temporal_error = error
        out.write(json.dumps(asdict(snap), indent=2) + "\n" if args.json else render(snap))
        return 0 if client is not None else 1
    live = out.isatty()
    while True:
        started = time.monotonic()
        if client is None:
            client, error = await _connect(config)
        snap = await snapshot(config, client, violations=args.violations)
        if error and client is None:
            snap.temporal_error = error
        out.write((CLEAR if live else "\n") + render(snap))
        out.flush()
        await asyncio.sleep(max(0.2, args.interval - (time.monotonic() - started)))


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        return asyncio.run(watch(config, args, sys.stdout))
    except KeyboardInterrupt:
        return 0
