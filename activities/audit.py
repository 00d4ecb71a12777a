"""The audit log: append-only JSON lines with a SHA-256 hash chain (DESIGN.md invariant 11).

Each line is a JSON object with ``seq``, ``timestamp``, ``event_type``, ``category``, ``job_id``, ``cluster_id``,
``success``, ``severity``, ``error_msg``, ``details``, ``prev_hash`` and ``hash``, where
``hash = sha256(prev_hash + "\\n" + canonical JSON of the line without "hash")`` and the first line's ``prev_hash`` is
64 zeros. Editing, removing or reordering any line breaks the chain, which ``virtengine-hpc audit verify`` reports
with the first bad line. Several processes (workers, poller, node API) may append to one file: appends take an
exclusive ``flock`` and read the previous hash under it.

Secrets never reach this file: callers pass ids, states and reasons, never credentials; ``details`` values are
scrubbed of anything that looks like a token.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from virtengine_hpc.config import AuditConfig
from virtengine_hpc.files import PRIVATE_MODE, ensure_private

GENESIS_HASH = "0" * 64
_JWT_LIKE = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


class Category(StrEnum):
    JOB = "job"
    SECURITY = "security"
    USAGE = "usage"
    ROUTING = "routing"
    SERVICE = "service"
    NODE = "node"


# Every event name the seeds and the reference use, with its category (which decides the config switch).
EVENTS: dict[str, Category] = {
    "job_submitted": Category.JOB,
    "job_cancelled": Category.JOB,
    "job_lifecycle_event": Category.JOB,
    "job_validation_failed": Category.JOB,
    "job_submission_failed": Category.JOB,
    "job_cancellation_failed": Category.JOB,
    "job_max_retries_exceeded": Category.JOB,
    "job_queue_full": Category.JOB,
    "job_routing_rejected": Category.ROUTING,
    "status_reported": Category.JOB,
    "status_report_failed": Category.JOB,
    "state_recovered": Category.JOB,
    "job_parked": Category.JOB,
    "duplicate_job_cancelled": Category.JOB,  # this project's own: racing submit attempts' extra job
    "usage_reported": Category.USAGE,
    "usage_report_failed": Category.USAGE,
    "accounting_reported": Category.USAGE,
    "accounting_report_failed": Category.USAGE,
    "settlement_completed": Category.USAGE,
    "routing_enforcement_passed": Category.ROUTING,
    "routing_enforcement_failed": Category.ROUTING,
    "routing_enforced": Category.ROUTING,
    "routing_decision_missing": Category.ROUTING,
    "routing_fallback_used": Category.ROUTING,
    "routing_decision_refreshed": Category.ROUTING,
    "routing_stale_decision_allowed": Category.ROUTING,
    "routing_violation": Category.ROUTING,
    "security_violation": Category.SECURITY,
    "signature_invalid": Category.SECURITY,
    "template_rejected": Category.SECURITY,
    "heartbeat_rejected": Category.SECURITY,
    "node_registration_rejected": Category.SECURITY,
    "node_registered": Category.NODE,
    "node_state_changed": Category.NODE,
    "node_drained": Category.NODE,
    "node_resumed": Category.NODE,
    "service_started": Category.SERVICE,
    "service_stopped": Category.SERVICE,
}


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

    def __init__(self, config: AuditConfig, *, fsync: bool = False) -> None:
        """``fsync``: force every line to disk. Off by default: each line is flushed to the OS (it survives a
        crash of the process, not a power loss), because an fsync per event costs milliseconds on the worker's
        event loop for every job transition."""
        self.config = config
        self.fsync = fsync
        self.path = Path(config.log_path)
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
        event_type: str,
        *,
        job_id: str | None = None,
        cluster_id: str | None = None,
        success: bool = True,
        severity: int | None = None,
        error_msg: str | None = None,
        details: Mapping[str, Any] | None = None,
        timestamp: datetime | None = None,
    ) -> dict[str, Any] | None:
        """Append one event; returns the written entry (``None`` when its category is switched off)."""
        category = EVENTS.get(event_type)
        if category is None:
            raise ValueError(f"unknown audit event type {event_type!r}")
        if not self.enabled_for(category):
            return None
        entry: dict[str, Any] = {
            "timestamp": (timestamp or datetime.now(UTC)).isoformat(),
            "event_type": event_type,
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
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return entry


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
