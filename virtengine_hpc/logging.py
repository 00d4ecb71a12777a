"""Structured logs: one JSON object per line, with the job, workflow and activity a line is about.

Log collectors (journald, Loki, Elasticsearch) index fields, not sentences; an operator asking "what happened to
JOB-17" filters on ``job_id``. The Temporal SDK's ``workflow.logger`` and ``activity.logger`` put their context
on each record (``temporal_workflow`` / ``temporal_activity``); lines from plain module loggers inside an
activity get the same context from ``activity.info()``. For a job workflow the workflow id *is* the chain job id,
so those lines carry ``job_id`` too. The Temporal core's own log lines are forwarded here as well
(``workers/metrics.make_runtime``), so nothing bypasses the format.

Only messages and ids are logged: no message of this project carries a credential (invariant 8 in docs/architecture.md).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

from temporalio import activity, workflow

from virtengine_hpc.messages import JOB_WORKFLOW_NAME

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is kept.
_STANDARD = set(logging.LogRecord("x", 0, "x", 0, "x", None, None).__dict__) | {"message", "asctime"}
_TEMPORAL = {"temporal_workflow", "temporal_activity", "temporal_log", "__temporal_error_identifier"}
_CONTEXT_KEYS = {
    "workflow_id": "workflow_id",
    "run_id": "run_id",
    "workflow_run_id": "run_id",
    "workflow_type": "workflow_type",
    "activity_id": "activity_id",
    "activity_type": "activity",
    "attempt": "attempt",
    "task_queue": "task_queue",
    "namespace": "namespace",
}


def temporal_context(record: logging.LogRecord) -> dict[str, Any]:
    """The workflow/activity ids of a record: from the SDK's extras, else from the running activity."""
    found: dict[str, Any] = {}
    for attr in ("temporal_workflow", "temporal_activity"):
        data = getattr(record, attr, None)
        if isinstance(data, dict):
            for key, name in _CONTEXT_KEYS.items():
                if data.get(key) is not None:
                    found.setdefault(name, data[key])
    if not found and activity.in_activity():
        info = activity.info()
        found = {
            "workflow_id": info.workflow_id,
            "run_id": info.workflow_run_id,
            "workflow_type": info.workflow_type,
            "activity_id": info.activity_id,
            "activity": info.activity_type,
            "attempt": info.attempt,
            "task_queue": info.task_queue,
        }
    if found.get("workflow_type") == JOB_WORKFLOW_NAME and "workflow_id" in found:
        found["job_id"] = found["workflow_id"]
    return found


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", job_id, workflow_id, activity, ..., "exc"}`` on one line."""

    def __init__(self, *, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(self.static)
        entry.update(temporal_context(record))
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in _TEMPORAL and not key.startswith("_"):
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def setup_logging(
    fmt: Literal["text", "json"] = "text",
    level: str | None = None,
    *,
    static: dict[str, str] | None = None,
    stream: Any = None,
) -> None:
    """Send every log line to ``stream`` (stderr: journald takes it) in ``fmt``; ``level`` None keeps the level
    the command line set. ``static`` fields (the build id, the process role) go on every JSON line."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(static=static))
        # The context is in fields; don't repeat it in the message text.
        workflow.logger.workflow_info_on_message = False
        activity.logger.activity_info_on_message = False
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    if level:
        root.setLevel(level.upper())


__all__ = ["JsonFormatter", "setup_logging", "temporal_context"]
