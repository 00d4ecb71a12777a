"""Parsers of MOAB's output: ``showq --xml``, ``checkjob --xml``, ``msub`` and MOAB Web Services (API v3) job JSON.

Both transports parse into the same record, ``MoabJob``, so the adapter's meaning (state map, usage arithmetic)
never depends on how the answer arrived. The XML layout is MOAB's own (``MUIQueueShow``/``MJobBaseToXML``):

```
<Data><Object>queue</Object><cluster time="..." .../>
  <queue option="active" count="1"><job JobID="Moab.12" JobName="vehpc-JOB-1" State="Running" User="alice"
       StartTime="1764511200" SubmissionTime="1764511190" ReqAWDuration="600" AWDuration="12" ReqProcs="2"
       StatPSUtl="11.2" .../></queue>
  <queue option="eligible" count="0"/><queue option="blocked" count="0"/></Data>
```

``showq -c --xml`` lists the completed queue (``option="completed"``) whose jobs carry ``CompletionCode`` and
``CompletionTime``. ``checkjob --xml <id>`` answers ``<Data><job .../></Data>`` with the job's attributes and one
``<req>`` child per requirement (``AllocNodeList``, ``ReqMemPerTask``, ``TaskCount``, ``UtilMem``, ``GPUS``).
XML is parsed with ``defusedxml`` (no entity expansion): the output can carry tenant-chosen strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any
from xml.etree.ElementTree import Element

from defusedxml import ElementTree as SafeET

from activities.schedulers.moab.states import Completion

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MSUB_ERROR = re.compile(r"^\s*ERROR:", re.I | re.M)


class ParseError(ValueError):
    """MOAB answered something that is not what its documentation describes."""


_MAX_DIGITS = 30
"""Longer numbers are not MOAB output (and ``int()`` refuses strings past 4,300 digits)."""


@dataclass
class MoabJob:
    """One job as MOAB reports it (either transport)."""

    job_id: str
    name: str = ""
    user: str = ""
    state: str = ""
    queue: str = ""
    """Which queue listed it: ``active``, ``eligible``, ``blocked`` or ``completed`` (MWS ``queueStatus``)."""
    completion: Completion | None = None
    hold_reason: str = ""
    submit_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    walltime_limit: int | None = None
    wall_seconds: int | None = None
    cpu_seconds: Decimal | None = None
    procs: int | None = None
    nodes: int | None = None
    mem_mb: int | None = None
    util_mem_mb: int | None = None
    gpus: int = 0
    message: str = ""

    @property
    def started(self) -> bool:
        return self.start_time is not None

    @property
    def walltime_reached(self) -> bool:
        """Ran at least as long as it asked for: a removal at that point is the walltime limit."""
        return bool(
            self.walltime_limit and self.wall_seconds is not None and self.wall_seconds >= self.walltime_limit
        )


def is_job_id(value: str) -> bool:
    return bool(_JOB_ID.fullmatch(value))


def _epoch(value: str | None) -> datetime | None:
    seconds = _int(value)
    if seconds is None or seconds <= 0:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):  # beyond what a clock holds: garbage, not a time
        return None


def _int(value: Any) -> int | None:
    """An integer MOAB printed (``"600"``, ``"97.50"``, ``600``); ``None`` for anything else. Lenient on purpose
    (an attribute MOAB left out or garbled is unknown, not fatal), but never an ``OverflowError`` from ``inf``
    or ``1e400`` nor a ``ValueError`` from a 5,000-digit string (``tests/test_fuzz_moab_parsers.py``)."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    if isinstance(value, str) and len(value.strip()) > _MAX_DIGITS:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if number != number or number in (float("inf"), float("-inf")):
        return None
    return int(value) if isinstance(value, int) else int(number)


def _count(value: Any) -> int | None:
    """A quantity (seconds, processors, MiB): never negative, since usage is priced from it."""
    number = _int(value)
    return number if number is not None and number >= 0 else None


def _decimal(value: Any) -> Decimal | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        number = Decimal(str(value)[:_MAX_DIGITS])
    except InvalidOperation:
        return None
    return number if number.is_finite() and number >= 0 else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def duration_seconds(text: str | None) -> int | None:
    """MOAB durations: seconds (``600``) or ``[[DD:]HH:]MM:SS`` (``ReqAWDuration`` in some versions)."""
    if not text:
        return None
    value = text.strip()
    if len(value) > _MAX_DIGITS:
        return None
    if value.isascii() and value.isdigit():
        return int(value)
    parts = value.split(":")
    if not all(p.isascii() and p.isdigit() for p in parts) or len(parts) > 4:
        return None
    seconds = 0
    for part, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False):
        seconds += int(part) * unit
    return seconds


def _xml(text: str, what: str) -> Element:
    try:
        root: Element = SafeET.fromstring(text.strip())
    except Exception as exc:  # defusedxml raises ParseError or its own DefusedXmlException
        raise ParseError(f"{what}: not the documented XML ({exc}): {text.strip()[:200]!r}") from None
    return root


def _job_from_xml(job: Element, queue: str) -> MoabJob:
    a = job.attrib
    reqs = job.findall("req")
    mem_per_task = sum(
        (_count(r.get("ReqMemPerTask")) or 0) * (_count(r.get("TaskCount")) or 1) for r in reqs
    )
    util_mem = [u for u in (_count(r.get("UtilMem")) for r in reqs) if u is not None]
    gpus = sum(_count(r.get("GPUS")) or 0 for r in reqs)
    alloc_nodes = {n for r in reqs for n in (r.get("AllocNodeList") or "").replace(",", " ").split() if n}
    completion = Completion.parse(a.get("CompletionCode")) if "CompletionCode" in a else None
    return MoabJob(
        job_id=a.get("JobID", ""),
        name=a.get("JobName", ""),
        user=a.get("User", ""),
        state=a.get("State", ""),
        queue=queue,
        completion=completion,
        hold_reason=a.get("HoldReason", ""),
        submit_time=_epoch(a.get("SubmissionTime")),
        start_time=_epoch(a.get("StartTime")),
        end_time=_epoch(a.get("CompletionTime")),
        walltime_limit=duration_seconds(a.get("ReqAWDuration")),
        wall_seconds=_count(a.get("AWDuration")),
        cpu_seconds=_decimal(a.get("StatPSUtl")),
        procs=_count(a.get("ReqProcs")),
        nodes=len(alloc_nodes) or _count(a.get("ReqNodes")),
        mem_mb=mem_per_task or _count(a.get("ReqMem")),
        util_mem_mb=max(util_mem) if util_mem else None,
        gpus=gpus,
    )


def parse_showq(text: str) -> list[MoabJob]:
    """Every job of every ``<queue option=...>`` section of ``showq --xml`` / ``showq -c --xml``."""
    root = _xml(text, "showq --xml")
    jobs: list[MoabJob] = []
    for queue in root.iter("queue"):
        option = queue.get("option", "")
        jobs.extend(_job_from_xml(job, option) for job in queue.findall("job"))
    return [job for job in jobs if is_job_id(job.job_id)]  # an id MOAB never issues is not a job of ours


def parse_checkjob(text: str) -> list[MoabJob]:
    """The job(s) of ``checkjob --xml``; the queue is inferred from the state (checkjob does not say)."""
    root = _xml(text, "checkjob --xml")
    out = []
    for job in root.iter("job"):
        parsed = _job_from_xml(job, "")
        parsed.queue = "completed" if parsed.completion is not None else "active"
        if is_job_id(parsed.job_id):
            out.append(parsed)
    return out


def parse_msub(stdout: str) -> str:
    """The job id ``msub`` prints (after an empty line, as MOAB does)."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines or _MSUB_ERROR.search(stdout) or not is_job_id(lines[-1]):
        raise ParseError(f"msub printed no job id: {stdout.strip()[:200]!r}")
    return lines[-1]


# ---- MOAB Web Services (API v3) -----------------------------------------------------------------------------

_MWS_DATE_FORMATS = ("%Y-%m-%d %H:%M:%S %Z", "%Y-%m-%d %H:%M:%S UTC", "%Y-%m-%dT%H:%M:%SZ")


def _mws_date(value: Any) -> datetime | None:
    if not value or not isinstance(value, str):
        return None
    text = value.strip()
    for fmt in _MWS_DATE_FORMATS:
        try:
            parsed = datetime.strptime(text, fmt)
        except ValueError:
            continue
        return parsed.replace(tzinfo=UTC)
    return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def parse_mws_job(body: dict[str, Any]) -> MoabJob:
    """One job object of MWS API v3 (``GET /rest/jobs/<name>`` or an element of ``results``)."""
    if not isinstance(body, dict):
        raise ParseError(f"MWS job is not an object: {str(body)[:200]}")
    name = body.get("name") or body.get("id")
    if not isinstance(name, str) or not is_job_id(name):
        raise ParseError(f"MWS job without a valid name: {str(body)[:200]}")
    states = _dict(body.get("states"))
    credentials = _dict(body.get("credentials"))
    dates = _dict(body.get("dates"))
    reqs = [r for r in _list(body.get("requirements")) if isinstance(r, dict)]
    holds = [str(h) for h in _list(body.get("holds"))]
    blocks = [b for b in _list(body.get("blocks")) if isinstance(b, dict)]
    state = str(states.get("state") or "")
    if holds and state.lower() in ("idle", "hold", ""):
        state = {"USER": "UserHold", "SYSTEM": "SystemHold", "BATCH": "BatchHold"}.get(
            holds[0].upper(), "Hold"
        )
    completion = None
    if body.get("completionCode") is not None or str(body.get("queueStatus", "")).lower() == "completed":
        completion = Completion(_int(body.get("completionCode")), cancelled=bool(body.get("cancelled")))
    mem = sum(
        (_count(_dict(_dict(r.get("resourcesPerTask")).get("MEM")).get("dedicated")) or 0)
        * (_count(r.get("taskCount")) or 1)
        for r in reqs
    )
    return MoabJob(
        job_id=name,
        name=str(body.get("customName") or ""),
        user=str(credentials.get("user") or ""),
        state=state,
        queue=str(body.get("queueStatus") or ""),
        completion=completion,
        hold_reason=str(blocks[0].get("category", "")) if blocks and holds else "",
        submit_time=_mws_date(dates.get("submitDate")),
        start_time=_mws_date(dates.get("startDate")),
        end_time=_mws_date(dates.get("completionDate")),
        walltime_limit=_count(body.get("duration")),
        wall_seconds=_count(body.get("durationActive")),
        cpu_seconds=_decimal(body.get("cpuTime")),
        procs=sum(_count(r.get("requiredProcessorCountMinimum")) or 0 for r in reqs) or None,
        nodes=sum(_count(r.get("requiredNodeCountMinimum")) or 0 for r in reqs) or None,
        mem_mb=mem or None,
        util_mem_mb=_count(body.get("memoryUtilizedMaximum")),
        gpus=sum(_count(r.get("gpus")) or 0 for r in reqs),
        message="; ".join(str(m) for m in _list(body.get("messages")) if m)[:500],
    )


def parse_mws_jobs(body: dict[str, Any]) -> list[MoabJob]:
    """``GET /rest/jobs?api-version=3``: ``{"totalCount": n, "resultCount": n, "results": [...]}``."""
    results = body.get("results")
    if not isinstance(results, list):
        raise ParseError(f"MWS jobs answer without results: {str(body)[:200]}")
    return [parse_mws_job(job) for job in results if isinstance(job, dict) and _named(job)]


def _named(job: dict[str, Any]) -> bool:
    """A job object whose name is an id MOAB issues; any other is not a job of ours."""
    name = job.get("name") or job.get("id")
    return isinstance(name, str) and is_job_id(name)


def mws_messages(body: Any) -> str:
    """MWS error bodies carry ``{"messages": [...]}``."""
    if isinstance(body, dict):
        messages = body.get("messages")
        if isinstance(messages, list):
            return "; ".join(str(m) for m in messages)[:500]
    return str(body)[:500]
