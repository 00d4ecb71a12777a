"""``virtengine-hpc audit``: check and read the hash-chained audit log.

``audit verify`` walks the whole chain and names the first line that was edited, removed, inserted or
reordered (exit 1), then checks the signed anchor beside the log (``<log>.anchor``): its signature must be the
provider's and the line it anchors must still be in the log with the anchored hash, so lines cut from the end
and a log rewritten with every hash recomputed fail too. The provider's key comes from ``--public-key`` or
``--key-file``, else from the keys the ledger has registered for ``provider.address``. ``audit show`` prints
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

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from activities.audit import EVENTS, KeyLookup, check_anchor, read_events, verify_log
from virtengine_hpc.cli.common import config_from_args
from virtengine_hpc.errors import HPCError, ValidationError
from virtengine_hpc.signing import public_key_from_b64


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
    key = p.add_mutually_exclusive_group()
    key.add_argument("--public-key", metavar="B64", help="the provider's raw Ed25519 public key, base64")
    key.add_argument("--key-file", metavar="PEM", help="the provider's public (or private) key file")
    key.add_argument(
        "--unanchored",
        action="store_true",
        help="check the hash chain only (a log written by processes without the provider's key)",
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
    anchor_text = ""
    if not args.unanchored and head:
        anchored = check_anchor(path, _key_lookup(args))
        if not anchored.ok:
            print(f"FAIL  {path}: {anchored.error} ({result.lines} lines, hash chain intact)")
            return 1
        anchor_text = (
            f"; signed anchor at seq {anchored.seq} ({anchored.anchored_at}, key {anchored.key_id[:16]}...)"
        )
        if anchored.unanchored:
            anchor_text += f", {anchored.unanchored} later lines not anchored yet"
    print(f"OK    {path}: {result.lines} lines, hash chain intact{head_text}{anchor_text}")
    return 0


def _key_lookup(args: argparse.Namespace) -> KeyLookup:
    """The provider's key for the anchor: given on the command line, else registered on the ledger."""
    if args.public_key:
        given = public_key_from_b64(args.public_key)
        return lambda _kid: given
    if args.key_file:
        from virtengine_hpc.cli.usage import load_public_key

        loaded = load_public_key(args.key_file)
        return lambda _kid: loaded
    from virtengine_hpc.cli.ledger import open_ledger

    config = config_from_args(args)
    try:
        keys = open_ledger(args).provider_keys(config.provider.address)
    except HPCError as exc:
        raise ValidationError(
            f"cannot check the signed anchor: {exc}; pass --public-key or --key-file (or --unanchored)"
        ) from None

    def lookup(kid: str) -> Ed25519PublicKey | str:
        found = keys.get(kid)
        if found is None:
            return f"key {kid[:16]}... is not registered on the ledger for {config.provider.address}"
        return public_key_from_b64(found)

    return lookup


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
