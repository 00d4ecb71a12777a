"""``virtengine-hpc audit``: check and read the hash-chained audit log.

``audit verify`` walks the whole chain and names the first line that was edited, removed, inserted or
reordered (exit 1), so a log that passes has not been touched since it was written. ``audit show`` prints
events, filtered by job and event type. The file is ``hpc.audit.log_path`` from the config unless ``--file``
says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from activities.audit import EVENTS, read_events, verify_log
from virtengine_hpc.cli.common import config_from_args
from virtengine_hpc.errors import ValidationError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="verify and read the hash-chained audit log",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="audit_command", metavar="COMMAND", required=True)

    p = sub.add_parser("verify", help="check the hash chain; exit 1 at the first tampered line")
    p.add_argument("--file", metavar="F", help="audit log (default: hpc.audit.log_path)")
    p.add_argument(
        "--anchor",
        metavar="HASH",
        help="a head hash printed by an earlier verify; fails if that line is gone (lines cut from the end)",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("show", help="print audit events")
    p.add_argument("--file", metavar="F", help="audit log (default: hpc.audit.log_path)")
    p.add_argument("--job", metavar="ID", help="only events of this job")
    p.add_argument("--event", metavar="TYPE", help="only this event type (e.g. job_lifecycle_event)")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N matching events")
    p.add_argument("--json", action="store_true", help="print the matching lines as JSON lines")
    p.set_defaults(func=cmd_show)


def log_path(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    return Path(config_from_args(args).hpc.audit.log_path)


def cmd_verify(args: argparse.Namespace) -> int:
    path = log_path(args)
    result = verify_log(path)
    if not result.ok:
        where = f" at line {result.bad_line}" if result.bad_line else ""
        print(f"FAIL  {path}{where}: {result.error} ({result.lines} lines verified before it)")
        return 1
    # A chain cannot show that lines were cut from its end; an anchor recorded elsewhere can.
    head: dict[str, Any] = {}
    found_anchor = False
    for entry in read_events(path):
        head = entry
        found_anchor = found_anchor or entry.get("hash") == args.anchor
    if args.anchor and not found_anchor:
        print(f"FAIL  {path}: anchor {args.anchor[:16]}... is not in the chain (lines removed from the end?)")
        return 1
    head_text = f"; head seq {head['seq']} hash {head['hash']}" if head else ""
    print(f"OK    {path}: {result.lines} lines, hash chain intact{head_text}")
    return 0


def _events(path: Path) -> Iterator[dict[str, Any]]:
    """Parsed lines; a line that is not JSON is reported on stderr and skipped (``verify`` judges the
    file)."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise ValidationError(f"cannot read audit log {path}: {exc.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path} line {number} is not JSON; skipped", file=sys.stderr)
                continue
            if isinstance(entry, dict):
                yield entry


def _format(entry: dict[str, Any]) -> str:
    status = "ok  " if entry.get("success", True) else "FAIL"
    severity = entry.get("severity")
    parts = [
        str(entry.get("seq", "?")).rjust(5),
        str(entry.get("timestamp", ""))[:23],
        status,
        str(entry.get("event_type", "")).ljust(28),
        str(entry.get("job_id") or "-"),
        str(entry.get("cluster_id") or "-"),
    ]
    if severity is not None:
        parts.append(f"severity={severity}")
    if entry.get("error_msg"):
        parts.append(f"error={entry['error_msg']!r}")
    if entry.get("details"):
        parts.append(json.dumps(entry["details"], sort_keys=True, separators=(",", ":")))
    return "  ".join(parts)


def cmd_show(args: argparse.Namespace) -> int:
    if args.event and args.event not in EVENTS:
        raise ValidationError(f"unknown event type {args.event!r}; known: {', '.join(sorted(EVENTS))}")
    if args.tail is not None and args.tail < 0:
        raise ValidationError("--tail must not be negative")
    path = log_path(args)
    matching = (
        e
        for e in _events(path)
        if (args.job is None or e.get("job_id") == args.job)
        and (args.event is None or e.get("event_type") == args.event)
    )
    selected = deque(matching, maxlen=args.tail) if args.tail is not None else matching
    for entry in selected:
        print(json.dumps(entry, sort_keys=True, ensure_ascii=False) if args.json else _format(entry))
    return 0
