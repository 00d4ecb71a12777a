"""The audit log: append-only JSON lines with a SHA-256 hash chain (invariant 11 in docs/architecture.md).

Each line is a JSON object with ``seq``, ``timestamp``, ``event_type``, ``category``, ``job_id``, ``cluster_id``,
``success``, ``severity``, ``error_msg``, ``details``, ``prev_hash`` and ``hash``, where
``hash = sha256(prev_hash + "\\n" + canonical JSON of the line without "hash")`` and the first line's ``prev_hash`` is
64 zeros. Editing, removing or reordering any line breaks the chain, which ``virtengine-hpc audit verify`` reports
with the first bad line. Several processes (workers, poller, node API) may append to one file: appends take an
exclusive ``flock`` and read the previous hash under it.

A chain alone cannot show that its last lines were cut off, or that someone edited a line and recomputed every
hash after it. So a process that holds the provider's signing key also signs the head after every line it
appends: ``<log>.anchor`` holds ``{seq, hash, anchored_at, key_id, signature}``, an Ed25519 signature over the
canonical form (``virtengine_hpc.signing``) under the domain ``virtengine-hpc/audit-anchor/v1``. ``audit verify``
checks that the anchored line is still in the log with that very hash, and that the signature is the provider's.
The anchor is overwritten in place (one ``pwrite`` of a fixed-size block, no new file per line).

Secrets never reach this file: callers pass ids, states and reasons, never credentials; ``details`` values are
scrubbed of anything that looks like a token.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from virtengine_hpc.audit_events import AuditEvent, Category
from virtengine_hpc.config import AuditConfig
from virtengine_hpc.files import PRIVATE_MODE, ensure_private
from virtengine_hpc.signing import Signer, canonical_bytes, canonical_time, key_id, verify

log = logging.getLogger(__name__)
GENESIS_HASH = "0" * 64
ANCHOR_DOMAIN = "virtengine-hpc/audit-anchor/v1"
ANCHOR_BLOCK = 1024
"""Size of the anchor file: every anchor overwrites the whole block, so no byte of an older one survives."""
_JWT_LIKE = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


# Every event name, with its category (which decides the config switch): ``AuditEvent`` defines them.
EVENTS: dict[str, Category] = {event.value: event.category for event in AuditEvent}


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _JWT_LIKE.sub("[redacted]", value)
    if isinstance(value, Mapping):
        return {str(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    if isinstance(value, int | float | bool) or value is None:
        return value
    return _scrub(str(value))


def _line_hash(prev_hash: str, entry: Mapping[str, Any]) -> str:
    body = json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((prev_hash + "\n" + body).encode()).hexdigest()


def _last_line(handle: Any) -> bytes | None:
    handle.seek(0, os.SEEK_END)
    end = handle.tell()
    if end == 0:
        return None
    block = 4096
    pos = end
    data = b""
    while pos > 0:
        step = min(block, pos)
        pos -= step
        handle.seek(pos)
        data = handle.read(step) + data
        stripped = data.rstrip(b"\n")
        if b"\n" in stripped:
            return stripped.rsplit(b"\n", 1)[1]
    return data.rstrip(b"\n") or None


def _open_append(path: Path) -> Any:
    """The log opened for appending; a log rotated away meanwhile is created again with mode 0600."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, PRIVATE_MODE)
    return os.fdopen(fd, "a+b")


class AuditLog:
    """Appends hash-chained audit events; honours the ``hpc.audit`` switches."""

    def __init__(
        self, config: AuditConfig, *, fsync: bool = False, anchor_signer: Signer | None = None
    ) -> None:
        """``fsync``: force every line to disk. Off by default: each line is flushed to the OS (it survives a
        crash of the process, not a power loss), because an fsync per event costs milliseconds on the worker's
        event loop for every job transition. ``anchor_signer``: the provider's key, which signs the head after
        each line this process appends (``anchor_path``)."""
        self.config = config
        self.fsync = fsync
        self.anchor_signer = anchor_signer
        self.path = Path(config.log_path)
        self.anchor_path = anchor_path(self.path)
        self._lock = threading.Lock()
        if config.enabled:
            # Job ids, tenants and reasons of every job: private to the provider's account.
            ensure_private(self.path)

    def enabled_for(self, category: Category) -> bool:
        if not self.config.enabled:
            return False
        if category == Category.JOB:
            return self.config.log_job_events
        if category in (Category.SECURITY, Category.ROUTING, Category.NODE):
            return self.config.log_security_events
        if category == Category.USAGE:
            return self.config.log_usage_reports
        return True

    def record(
        self,
        event_type: AuditEvent,
        *,
        job_id: str | None = None,
        cluster_id: str | None = None,
        success: bool = True,
        severity: int | None = None,
        error_msg: str | None = None,
        details: Mapping[str, Any] | None = None,
        timestamp: datetime | None = None,
    ) -> dict[str, Any] | None:
        """Append one event; returns the written entry (``None`` when its category is switched off).

        ``event_type`` is written as the plain string of its name (a string with a known name is taken too)."""
        category = EVENTS.get(event_type)
        if category is None:
            raise ValueError(f"unknown audit event type {event_type!r}")
        if not self.enabled_for(category):
            return None
        entry: dict[str, Any] = {
            "timestamp": (timestamp or datetime.now(UTC)).isoformat(),
            "event_type": str(event_type),
            "category": category.value,
            "job_id": job_id,
            "cluster_id": cluster_id,
            "success": success,
            "severity": severity,
            "error_msg": _scrub(error_msg) if error_msg else None,
            "details": _scrub(dict(details or {})),
        }
        with self._lock, _open_append(self.path) as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                last = _last_line(handle)
                if last:
                    previous = json.loads(last)
                    entry["seq"] = int(previous["seq"]) + 1
                    entry["prev_hash"] = previous["hash"]
                else:
                    entry["seq"] = 1
                    entry["prev_hash"] = GENESIS_HASH
                entry["hash"] = _line_hash(entry["prev_hash"], entry)
                handle.seek(0, os.SEEK_END)
                handle.write(json.dumps(entry, sort_keys=True, ensure_ascii=False).encode() + b"\n")
                handle.flush()
                if self.fsync:
                    os.fsync(handle.fileno())
                if self.anchor_signer is not None:
                    self._anchor(entry["seq"], entry["hash"], self.anchor_signer)
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return entry

    def _anchor(self, seq: int, head: str, signer: Signer) -> None:
        """Sign the head just written (under the log's lock, so anchors follow the chain's order). A failure is
        logged and the line stays: the next anchor covers it, and ``audit verify`` reports the unanchored tail."""
        try:
            block = anchor_block(seq, head, signer)
            fd = os.open(self.anchor_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, PRIVATE_MODE)
            try:
                os.pwrite(fd, block, 0)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot write the audit anchor %s: %s", self.anchor_path, exc)


def anchor_path(log_path: str | os.PathLike[str]) -> Path:
    """Where the signed head of ``log_path`` is kept: beside it, ``<log>.anchor``."""
    path = Path(log_path)
    return path.with_name(path.name + ".anchor")


def anchor_block(seq: int, head: str, signer: Signer, *, at: datetime | None = None) -> bytes:
    """The anchor file's content: the signed document, padded to ``ANCHOR_BLOCK`` bytes."""
    document: dict[str, Any] = {
        "seq": seq,
        "hash": head,
        "anchored_at": canonical_time(at or datetime.now(UTC)),
        "key_id": signer.key_id,
    }
    document["signature"] = signer.sign(canonical_bytes(document, ANCHOR_DOMAIN))
    text = json.dumps(document, sort_keys=True).encode()
    return text.ljust(ANCHOR_BLOCK - 1) + b"\n"


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    lines: int
    error: str | None = None
    bad_line: int | None = None


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def events_since(
    path: str | os.PathLike[str], since: datetime, event_types: Collection[str], *, block: int = 1 << 16
) -> list[dict[str, Any]]:
    """The events of these types appended at or after ``since``, newest first: the log is read backwards from its
    end and only as far as ``since`` (lines are appended in time order), so the cost follows the span asked for,
    not the log's size. A missing log has none."""
    out: list[dict[str, Any]] = []
    try:
        handle = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return out
    with handle:
        pos = handle.seek(0, os.SEEK_END)
        tail = b""
        while pos > 0:
            step = min(block, pos)
            pos -= step
            handle.seek(pos)
            lines = (handle.read(step) + tail).split(b"\n")
            tail = lines.pop(0) if pos > 0 else b""  # may be cut: completed by the next block
            for line in reversed(lines):
                try:
                    entry = json.loads(line)
                    at = datetime.fromisoformat(entry["timestamp"])
                except (ValueError, KeyError, TypeError):
                    continue  # blank, or cut short by a crash: audit verify reports it, this reads on
                if at < since:
                    return out
                if entry.get("event_type") in event_types:
                    out.append(entry)
    return out


def verify_log(path: str | os.PathLike[str]) -> VerifyResult:
    """Check the whole hash chain; reports the first line that was edited, removed, inserted or reordered."""
    prev = GENESIS_HASH
    count = 0
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        return VerifyResult(False, 0, f"cannot read {path}: {exc.strerror}")
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                return VerifyResult(False, count, "blank line in the log", number)
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                return VerifyResult(False, count, "line is not valid JSON", number)
            if not isinstance(entry, dict) or "hash" not in entry:
                return VerifyResult(False, count, "line has no hash", number)
            claimed = entry.pop("hash")
            if entry.get("prev_hash") != prev or entry.get("seq") != number:
                return VerifyResult(
                    False, count, "chain broken: a line was removed, inserted or reordered", number
                )
            if _line_hash(prev, entry) != claimed:
                return VerifyResult(False, count, "line content does not match its hash (edited)", number)
            prev = claimed
            count += 1
    return VerifyResult(True, count)


@dataclass(frozen=True)
class AnchorCheck:
    """What ``check_anchor`` found: ``ok``, the anchored ``seq`` and time, and lines written after it."""

    ok: bool
    error: str | None = None
    seq: int = 0
    anchored_at: str = ""
    key_id: str = ""
    unanchored: int = 0


KeyLookup = Callable[[str], Ed25519PublicKey | str]
"""Returns the public key with a key id, or why there is none."""


def read_anchor(path: str | os.PathLike[str]) -> dict[str, Any] | str:
    """The anchor document beside the log ``path``, or why it cannot be read."""
    where = anchor_path(path)
    try:
        raw = where.read_bytes()
    except FileNotFoundError:
        return (
            f"no signed anchor {where} (written without the provider's key, or removed; --unanchored checks the "
            "chain alone)"
        )
    except OSError as exc:
        return f"cannot read the anchor {where}: {exc.strerror}"
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"the anchor {where} is damaged (not JSON)"
    fields = {"seq": int, "hash": str, "anchored_at": str, "key_id": str, "signature": str}
    if not isinstance(document, dict) or set(document) != set(fields):
        return f"the anchor {where} is damaged (unexpected fields)"
    if any(not isinstance(document[k], t) or isinstance(document[k], bool) for k, t in fields.items()):
        return f"the anchor {where} is damaged (a field has the wrong type)"
    return document


def check_anchor(path: str | os.PathLike[str], lookup: KeyLookup) -> AnchorCheck:
    """Check the signed head against a log whose chain ``verify_log`` found intact: the signature is the
    provider's and the anchored line is still in the log with the anchored hash."""
    document = read_anchor(path)
    if isinstance(document, str):
        return AnchorCheck(False, document)
    key = lookup(document["key_id"])
    if isinstance(key, str):
        return AnchorCheck(False, f"anchor: {key}")
    if key_id(key) != document["key_id"] or not verify(
        key, canonical_bytes(document, ANCHOR_DOMAIN), document["signature"]
    ):
        return AnchorCheck(False, "the anchor's signature does not verify with the provider's key")
    seq, head = document["seq"], document["hash"]
    found: dict[str, Any] | None = None
    count = 0
    for count, entry in enumerate(read_events(path), start=1):
        if count == seq:
            found = entry
    check = AnchorCheck(True, None, seq, document["anchored_at"], document["key_id"], max(0, count - seq))
    if found is None:
        return replace(
            check,
            ok=False,
            error=f"the anchored line {seq} is gone: the log ends at line {count} (lines cut off)",
        )
    if found.get("hash") != head:
        return replace(
            check,
            ok=False,
            error=f"line {seq} does not have the anchored hash {head[:16]}...: the log was rewritten",
        )
    return check
