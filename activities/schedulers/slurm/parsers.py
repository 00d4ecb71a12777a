"""Parsers for what Slurm 22.05 prints (``squeue -O``, ``sacct -P``, ``sstat -P``, ``sbatch --parsable``) and for
slurmrestd's v0.0.38 JSON, into a few plain records that the adapter maps without caring where they came from.

Pitfalls handled here (all seen in ``tests/golden/slurm``): text fields are not escaped, and a job's owner writes its
name and comment (``scontrol update``, ``|`` and newlines included), so status queries ask for neither, and the
queries that need the name use a separator of their own (``new_separator``) and keep only lines of exactly the fields
asked for (captures made by hand keep free text last, split off with a bounded ``split``); times are epoch seconds
because every command runs with ``SLURM_TIME_FORMAT=%s`` (no local-time guessing), but ``Unknown``/``None``/``N/A``
mean "no time"; sizes come with or without a 1024-based suffix; CPU times come as ``[D-][HH:]MM:SS[.mmm]``; job-level MaxRSS/TRES usage are empty
and live on the steps; slurmdbd's JSON reports CPU time with ``microseconds`` that can exceed a million.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from activities.schedulers.slurm.states import exit_code_from_pair, exit_code_from_wait_status
from virtengine_hpc.errors import SchedulerError

# ---- the formats the commands are asked for ------------------------------------------------------------------

#: ``squeue -O`` fields, free text last. With ``:|`` each field is printed unpadded, followed by ``|``.
SQUEUE_FIELDS = (
    "JobID",
    "State",
    "Reason",
    "SubmitTime",
    "StartTime",
    "EndTime",
    "TimeUsed",
    "tres-alloc",
    "UserName",
    "Name",
    "Comment",
)
SQUEUE_FORMAT = ",".join(f"{name}:|" for name in SQUEUE_FIELDS)
#: What a status query asks for: nothing the job's owner can write (name and comment are the owner's to edit with
#: ``scontrol update``, ``|`` and newlines included, and could forge whole rows of another job's status).
SQUEUE_STATUS_FIELDS = tuple(f for f in SQUEUE_FIELDS if f not in ("Name", "Comment"))
#: What a lookup by name asks for: the name too (``-n`` matches it exactly, so it is one of ours), parsed strictly.
SQUEUE_LOOKUP_FIELDS = tuple(f for f in SQUEUE_FIELDS if f != "Comment")

#: ``squeue -O`` fields of the sweep's listing: a lookup's, and the leader of a heterogeneous job's component.
SQUEUE_SWEEP_FIELDS = (*SQUEUE_LOOKUP_FIELDS, "HetJobID")

#: ``sacct -P`` fields (with steps unless ``-X``), free text last.
SACCT_FIELDS = (
    "JobIDRaw",
    "State",
    "ExitCode",
    "ElapsedRaw",
    "TotalCPU",
    "AllocTRES",
    "MaxRSS",
    "TRESUsageInTot",
    "TRESUsageOutTot",
    "ConsumedEnergyRaw",
    "Submit",
    "Start",
    "End",
    "Reason",
    "User",
    "JobName",
    "Comment",
)
SACCT_FORMAT = ",".join(SACCT_FIELDS)
SACCT_STATUS_FIELDS = tuple(f for f in SACCT_FIELDS if f not in ("JobName", "Comment"))
SACCT_LOOKUP_FIELDS = tuple(f for f in SACCT_FIELDS if f != "Comment")


def new_separator() -> str:
    """A field separator for one query, which no job's owner can have written into a field beforehand: every
    line of the answer must then split into exactly the fields asked for, and a field that hides a separator or
    a newline breaks only its own line, which is dropped, never anyone else's."""
    return f"|{secrets.token_hex(8)}|"


def squeue_format(fields: Sequence[str], sep: str) -> str:
    """``squeue -O`` format with ``sep`` after every field."""
    return ",".join(f"{name}:{sep}" for name in fields)


#: ``sstat -P`` fields for the live steps of a running job.
SSTAT_FIELDS = ("JobID", "MaxRSS", "TRESUsageInTot", "TRESUsageOutTot")
SSTAT_FORMAT = ",".join(SSTAT_FIELDS)

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
# re.ASCII: ``\d`` would otherwise match every Unicode digit ("١٢", "²"), which Slurm never prints.
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTPE]?)(?:i?B)?$", re.I | re.ASCII)
_DURATION_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)$", re.ASCII)
_SECONDS_RE = re.compile(r"\d+(\.\d+)?", re.ASCII)
_MAX_DIGITS = 30
"""Longer numbers are not Slurm output (and ``int()`` refuses strings past 4,300 digits)."""
_MAX_NESTING = 4
_NO_VALUE = {"", "Unknown", "None", "N/A", "(null)", "NONE", "INVALID", "UNLIMITED"}


class ParseError(SchedulerError, ValueError):
    """Output that does not look like what the command was asked to print.

    A ``SchedulerError`` (transient), so the activity boundary translates it like any failed query: the watch
    counts it as "no news" and asks again next poll, a usage reading is retried. Every parser here raises only this
    for bad input, never a bare ``ValueError``, ``OverflowError`` or ``TypeError`` from deep inside
    (``tests/test_fuzz_parsers.py``).
    """

    transient = True
    code = "scheduler_output_unparsable"


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` is also true for other scripts' digits (superscripts, Arabic-Indic), which ``int()`` refuses or misreads."""
    return text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS


def _epoch(seconds: int) -> datetime | None:
    if seconds <= 0:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise ParseError(f"time {seconds} is out of range") from None


# ---- records -------------------------------------------------------------------------------------------------


@dataclass
class QueueJob:
    """A job as the controller holds it (``squeue -t all``, ``GET /slurm/.../jobs``)."""

    job_id: str
    state: str
    reason: str = ""
    submit_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    elapsed_seconds: int | None = None
    alloc_tres: dict[str, Decimal] = field(default_factory=dict)
    user: str = ""
    name: str = ""
    comment: str = ""
    exit_code: int | None = None
    """Known from slurmrestd (its raw wait status); ``squeue`` cannot print exit codes."""
    suspend_time: datetime | None = None
    """slurmrestd: when the job was last suspended or resumed (None: never); with ``pre_suspend_seconds``, what
    its run time is derived from (it gives no run time of its own)."""
    pre_suspend_seconds: int = 0
    """slurmrestd: the run time the job had when it was last suspended."""
    het_leader: str | None = None
    """A heterogeneous job's component other than its leader: the leader's id (Slurm cancels the whole job by the
    leader's id only, and refuses a component's: "Operation not permitted on individual component")."""


@dataclass
class AcctStep:
    step_id: str
    state: str = ""
    elapsed_seconds: int = 0
    total_cpu_seconds: Decimal = Decimal(0)
    max_rss_bytes: int | None = None
    usage_in: dict[str, Decimal] = field(default_factory=dict)
    usage_out: dict[str, Decimal] = field(default_factory=dict)


@dataclass
class AcctJob:
    """A job as accounting (slurmdbd) recorded it, with its steps."""

    job_id: str
    state: str
    exit_code: int | None = None
    elapsed_seconds: int = 0
    total_cpu_seconds: Decimal | None = None
    alloc_tres: dict[str, Decimal] = field(default_factory=dict)
    energy_joules: Decimal | None = None
    submit_time: datetime | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None
    reason: str = ""
    user: str = ""
    name: str = ""
    comment: str = ""
    steps: list[AcctStep] = field(default_factory=list)
    earlier_runs: list[AcctJob] = field(default_factory=list)
    """The job's earlier runs, oldest first, each with its own steps: a requeued job (``scontrol requeue``,
    preemption or node failure with requeue) starts over under the same id, and accounting keeps one record per
    run (``sacct --duplicates``; slurmdbd's REST lists them all). This record is the latest run's."""

    @property
    def runs(self) -> list[AcctJob]:
        """Every run of the job, oldest first, this one last."""
        return [*self.earlier_runs, self]


@dataclass
class LiveStep:
    """A running step's usage so far (``sstat``)."""

    step_id: str
    max_rss_bytes: int | None = None
    usage_in: dict[str, Decimal] = field(default_factory=dict)
    usage_out: dict[str, Decimal] = field(default_factory=dict)


# ---- scalar parsers ------------------------------------------------------------------------------------------


def parse_time(value: str | int | None) -> datetime | None:
    """Epoch seconds (``SLURM_TIME_FORMAT=%s``, or slurmrestd's integers); 0 and placeholders mean no time."""
    if value is None:
        return None
    if isinstance(value, int):
        return _epoch(value)
    text = value.strip()
    if text in _NO_VALUE:
        return None
    if not _digits(text):
        # ISO local time: only when SLURM_TIME_FORMAT=%s did not apply (captures made by hand); read as UTC.
        try:
            return datetime.fromisoformat(text).replace(tzinfo=UTC)
        except ValueError:
            return None
    return _epoch(int(text))


def parse_duration(value: str) -> Decimal | None:
    """``[D-][HH:]MM:SS[.mmm]`` (TotalCPU, TimeUsed, Elapsed, TRES cpu) in seconds; placeholders give ``None``."""
    text = value.strip()
    if text in _NO_VALUE:
        return None
    match = _DURATION_RE.match(text) if len(text) <= 2 * _MAX_DIGITS else None
    if match is None:
        if len(text) <= _MAX_DIGITS and _SECONDS_RE.fullmatch(text):
            return Decimal(text)
        raise ParseError(f"not a Slurm duration: {value[:40]!r}")
    days, hours, minutes, seconds = match.groups()
    total = Decimal(seconds) + 60 * int(minutes) + 3600 * int(hours or 0) + 86400 * int(days or 0)
    return total


def parse_size(value: str, default_unit: str = "") -> int | None:
    """A 1024-based size (``156384K``, ``1G``, ``4128768``) in bytes; ``default_unit`` applies without suffix."""
    text = value.strip()
    if text in _NO_VALUE:
        return None
    match = _SIZE_RE.match(text) if len(text) <= _MAX_DIGITS else None
    if match is None:
        raise ParseError(f"not a Slurm size: {value[:40]!r}")
    number, unit = match.groups()
    unit = (unit or default_unit).upper()
    return int(Decimal(number) * (1024 ** _UNITS[unit]))


def parse_tres(value: str, *, usage: bool) -> dict[str, Decimal]:
    """``cpu=1,mem=1G,node=1,gres/gpu=2`` (allocation) or ``cpu=00:00:05,mem=322144K,fs/disk=1690155`` (usage).

    Allocation TRES give counts, with ``mem`` in bytes (a bare number is MiB). Usage TRES give ``cpu`` in seconds
    and every size (mem, vmem, fs/disk, ic/ofed) in bytes (a bare number is bytes). Unknown TRES are kept.
    """
    out: dict[str, Decimal] = {}
    text = value.strip()
    if text in _NO_VALUE:
        return out
    for item in text.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            continue
        raw = raw.strip()
        if usage and key == "cpu":
            seconds = parse_duration(raw)
            if seconds is not None:
                out[key] = seconds
        elif key in ("mem", "vmem") or key.startswith(("fs/", "ic/")):
            size = parse_size(raw, default_unit="" if usage else "M")
            if size is not None:
                out[key] = Decimal(size)
        else:
            try:
                count = Decimal(raw)
            except ArithmeticError:
                continue
            if not count.is_finite() or count < 0:
                # Usage is priced from these: a negative or NaN count would settle below zero.
                raise ParseError(f"not a Slurm TRES count: {item[:40]!r}")
            out[key] = count
    return out


def parse_int(value: str) -> int | None:
    text = value.strip()
    return int(text) if _digits(text) else None


def parse_job_id(value: str) -> str:
    """The id printed by ``sbatch --parsable``: ``123`` or ``123;cluster``."""
    lines = [line.strip() for line in value.strip().splitlines() if line.strip()]
    if not lines:
        raise ParseError("sbatch printed no job id")
    job_id, _, _cluster = lines[-1].partition(";")
    if not _digits(job_id):
        raise ParseError(f"sbatch printed {lines[-1][:80]!r}, not a job id")
    return job_id


def job_record_mismatch(answer: str, job_id: str, account: str, name: str) -> str | None:
    """Why ``scontrol -o show job <job_id>`` (``answer``, as ``JobRecords`` read it) is not a job of ``account``
    named ``name`` (``None``: it is). The name is printed raw and written by the job's owner, so the record must
    begin with exactly ``JobId=<id> JobName=<name> UserId=<account>(`` and hold no other ``UserId=``: a name that
    carries a forged ``UserId=`` fails either way."""
    for echo in (f"scontrol: show job {job_id}\n", f"show job {job_id}\n"):
        if answer.startswith(echo):
            answer = answer[len(echo) :]
            break
    if answer.startswith(f"JobId={job_id} JobName={name} UserId={account}(") and answer.count("UserId=") == 1:
        return None
    if not answer.startswith(f"JobId={job_id} "):
        return "not held by the controller"
    found = re.match(r"JobId=\d+ JobName=(.*?) UserId=([^\s(]*)\(", answer)
    if found is None:
        return "a record that does not read as one job"
    return f"{found.group(1)[:120]!r} of {found.group(2)[:40]}"


# ---- command output ------------------------------------------------------------------------------------------


def _rows(
    text: str, fields: Sequence[str], *, terminated: bool = False, sep: str | None = None
) -> Iterator[dict[str, str]]:
    """Lines as dicts. ``sep`` (a query's own ``new_separator``): every line must split into exactly ``fields``,
    else it is dropped. Without it (captures made with ``|``): the last field is free text and may itself
    contain ``|``.

    ``terminated``: every field is followed by the separator (``squeue -O 'Field:|'``), so lines end with one.
    Lines with too few fields (a ``CLUSTER:`` banner, a header) are skipped.
    """
    split = sep or "|"
    for line in text.splitlines():
        if not line.strip() or line.startswith("CLUSTER:"):
            continue
        if terminated and line.endswith(split):
            line = line[: -len(split)]
        parts = line.split(split) if sep else line.split("|", len(fields) - 1)
        if len(parts) != len(fields) or parts[0] == fields[0]:
            continue
        yield dict(zip(fields, parts, strict=True))


def parse_squeue(
    text: str, fields: Sequence[str] = SQUEUE_FIELDS, *, terminated: bool = True, sep: str | None = None
) -> list[QueueJob]:
    """``squeue -h -O <SQUEUE_FORMAT>`` output (or another field list, e.g. a capture made with ``-o``)."""
    jobs: list[QueueJob] = []
    for row in _rows(text, fields, terminated=terminated, sep=sep):
        job_id = row.get("JobID", "").strip()
        if not _digits(job_id):
            continue  # array tasks (123_4) and heterogeneous components are not ours
        elapsed = parse_duration(row.get("TimeUsed", ""))
        jobs.append(
            QueueJob(
                job_id=job_id,
                state=row.get("State", "").strip(),
                reason=_text(row.get("Reason", "")),
                submit_time=parse_time(row.get("SubmitTime")),
                start_time=parse_time(row.get("StartTime")),
                end_time=parse_time(row.get("EndTime")),
                elapsed_seconds=int(elapsed) if elapsed is not None else None,
                alloc_tres=parse_tres(row.get("tres-alloc", ""), usage=False),
                user=row.get("UserName", "").strip(),
                name=row.get("Name", ""),
                comment=_text(row.get("Comment", "")),
                het_leader=component_of(job_id, row.get("HetJobID", "").strip()),
            )
        )
    return jobs


def component_of(job_id: str, leader: str | None) -> str | None:
    """The leader's id when ``job_id`` is a heterogeneous job's component other than its leader."""
    return leader if leader and _digits(leader) and leader != job_id else None


def parse_sacct(text: str, fields: Sequence[str] = SACCT_FIELDS, *, sep: str | None = None) -> list[AcctJob]:
    """``sacct -P -n -o <fields>`` output: job lines, each followed by its step lines (``123.batch``, ``123.0``);
    with ``--duplicates``, one job line per run of a requeued job (``group_runs``)."""
    order: list[AcctJob] = []
    current: AcctJob | None = None  # the job whose step lines follow
    for row in _rows(text, fields, sep=sep):
        raw_id = (row.get("JobIDRaw") or row.get("JobID") or "").strip()
        job_id, dot, step_id = raw_id.partition(".")
        if not _digits(job_id):
            continue
        cpu = parse_duration(row.get("TotalCPU", ""))
        if "ElapsedRaw" in row:
            elapsed = parse_int(row["ElapsedRaw"]) or 0
        else:
            elapsed = int(parse_duration(row.get("Elapsed", "")) or 0)
        if dot:
            if current is None or current.job_id != job_id:
                continue
            current.steps.append(
                AcctStep(
                    step_id=step_id,
                    state=row.get("State", "").strip(),
                    elapsed_seconds=elapsed,
                    total_cpu_seconds=cpu or Decimal(0),
                    max_rss_bytes=parse_size(row.get("MaxRSS", "")),
                    usage_in=parse_tres(row.get("TRESUsageInTot", ""), usage=True),
                    usage_out=parse_tres(row.get("TRESUsageOutTot", ""), usage=True),
                )
            )
            continue
        joules = parse_int(row.get("ConsumedEnergyRaw", ""))
        job = AcctJob(
            job_id=job_id,
            state=row.get("State", "").strip(),
            exit_code=exit_code_from_pair(row.get("ExitCode", "")),
            elapsed_seconds=elapsed,
            total_cpu_seconds=cpu,
            alloc_tres=parse_tres(row.get("AllocTRES", ""), usage=False),
            energy_joules=Decimal(joules) if joules else None,
            submit_time=parse_time(row.get("Submit")),
            start_time=parse_time(row.get("Start")),
            end_time=parse_time(row.get("End")),
            reason=_text(row.get("Reason", "")),
            user=row.get("User", "").strip(),
            name=row.get("JobName", ""),
            comment=_text(row.get("Comment", "")),
        )
        order.append(job)
        current = job
    return group_runs(order)


#: How a run that the same job followed can have ended: Slurm requeued it (``scontrol requeue``, preemption in
#: requeue mode, a node that failed or did not boot under a job that may be requeued).
_REQUEUED_ENDS = ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL")
#: A requeue ends a run and submits the next one at the same moment (the controller's clock, both times): a run
#: that ended longer than this before the next record's submission was not requeued into it.
_REQUEUE_GAP = timedelta(minutes=5)


def group_runs(records: Sequence[AcctJob]) -> list[AcctJob]:
    """One ``AcctJob`` per job id, the latest run, with the job's earlier runs attached (``earlier_runs``).

    Accounting may hold one id several times: the runs of a requeued job (each run submitted anew), or an id
    reused after the cluster was rebuilt (another job). The latest submission is the job; going back from it, a
    record of the same user is an earlier run while it carries the same name and comment, or ended in a requeue
    right when the record after it was submitted; the first one that does neither was another job, and so is
    everything before it. Name and comment alone do not decide: a job's owner can change both (``scontrol
    update``) in a later run, and its earlier runs held their allocation all the same.
    """
    by_id: dict[str, list[AcctJob]] = {}
    for record in records:
        by_id.setdefault(record.job_id, []).append(record)
    jobs = []
    for same_id in by_id.values():
        ordered = sorted(same_id, key=lambda r: r.submit_time or datetime.min.replace(tzinfo=UTC))
        latest = ordered[-1]
        earlier: list[AcctJob] = []
        following = latest
        for run in reversed(ordered[:-1]):
            same = (run.name, run.comment) == (latest.name, latest.comment)
            if run.user != latest.user or not (same or _requeued_into(run, following)):
                break
            earlier.insert(0, run)
            following = run
        latest.earlier_runs = earlier
        jobs.append(latest)
    return jobs


def _requeued_into(run: AcctJob, following: AcctJob) -> bool:
    """``run`` ended in a requeue that submitted ``following`` (its next run)."""
    if (run.state.split() or [""])[0] not in _REQUEUED_ENDS:
        return False
    if run.end_time is None or following.submit_time is None:
        return True
    return abs(following.submit_time - run.end_time) <= _REQUEUE_GAP


def parse_sstat(text: str, fields: Sequence[str] = SSTAT_FIELDS) -> list[LiveStep]:
    """``sstat -P -n -a -o <fields>``: one line per running step (a header line, if any, is skipped)."""
    steps: list[LiveStep] = []
    for row in _rows(text, fields):
        _, dot, step_id = row.get("JobID", "").strip().partition(".")
        if not dot:
            continue
        steps.append(
            LiveStep(
                step_id=step_id,
                max_rss_bytes=parse_size(row.get("MaxRSS", "")),
                usage_in=parse_tres(row.get("TRESUsageInTot", ""), usage=True),
                usage_out=parse_tres(row.get("TRESUsageOutTot", ""), usage=True),
            )
        )
    return steps


def parse_scontrol_config(text: str) -> dict[str, str]:
    """``scontrol show config``: ``Key = value`` lines."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def _text(value: str) -> str:
    text = value.strip()
    return "" if text in ("(null)", "None") else text


# ---- slurmrestd JSON (v0.0.38; the number shapes of v0.0.39+ are accepted too) -------------------------------


def _number(value: Any, depth: int = 0) -> int | None:
    """An integer, or v0.0.39+'s ``{"set": true, "infinite": false, "number": N}``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, Mapping) and depth < _MAX_NESTING:
        if not value.get("set", True) or value.get("infinite"):
            return None
        return _number(value.get("number"), depth + 1)
    return None


def _state_text(value: Any, depth: int = 0) -> str:
    """``"RUNNING"``, or v0.0.39+'s ``["RUNNING"]`` / ``{"current": ["RUNNING"]}``."""
    if isinstance(value, Mapping):
        return _state_text(value.get("current"), depth + 1) if depth < _MAX_NESTING else ""
    if isinstance(value, list | tuple):
        return _state_text(value[0], depth + 1) if value and depth < _MAX_NESTING else ""
    return str(value or "")[:200]


def _obj(value: Any) -> Mapping[str, Any]:
    """A nested JSON object, or an empty one when slurmrestd sent another shape (treated as absent)."""
    return value if isinstance(value, Mapping) else {}


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _jobs(body: Mapping[str, Any]) -> list[Any]:
    """The ``jobs`` list of an answer; any other shape there means we are not reading what we asked for."""
    jobs = body.get("jobs") if isinstance(body, Mapping) else None
    if jobs is None:
        return []
    if not isinstance(jobs, list):
        raise ParseError(f"slurmrestd answered with 'jobs' of type {type(jobs).__name__}, not a list")
    return jobs


def rest_errors(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in _items(_obj(body).get("errors")) if isinstance(e, dict)]


def rest_error_text(error: Mapping[str, Any]) -> str:
    parts = [str(error.get(k)) for k in ("error", "description") if error.get(k)]
    return ": ".join(dict.fromkeys(parts)) or "unspecified error"


def rest_error_code(error: Mapping[str, Any]) -> int | None:
    for key in ("error_code", "error_number"):
        value = error.get(key)
        if isinstance(value, int):
            return value
    return None


def parse_rest_jobs(body: Mapping[str, Any]) -> list[QueueJob]:
    """``GET /slurm/v0.0.38/jobs`` or ``/job/{id}``."""
    jobs: list[QueueJob] = []
    for raw in _jobs(body):
        if not isinstance(raw, Mapping):
            continue
        job_id = _number(raw.get("job_id"))
        if job_id is None or job_id <= 0:
            continue
        start, end = parse_time(_number(raw.get("start_time"))), parse_time(_number(raw.get("end_time")))
        state = _state_text(raw.get("job_state"))
        jobs.append(
            QueueJob(
                job_id=str(job_id),
                state=state,
                reason=_text(str(raw.get("state_reason") or "")),
                submit_time=parse_time(_number(raw.get("submit_time"))),
                start_time=start,
                end_time=end,
                elapsed_seconds=None,
                alloc_tres=parse_tres(str(raw.get("tres_alloc_str") or ""), usage=False),
                user=str(raw.get("user_name") or ""),
                name=str(raw.get("name") or ""),
                comment=_text(str(raw.get("comment") or "")),
                exit_code=exit_code_from_wait_status(_number(raw.get("exit_code"))),
                suspend_time=parse_time(_number(raw.get("suspend_time"))),
                pre_suspend_seconds=max(0, int(_number(raw.get("pre_sus_time")) or 0)),
                het_leader=component_of(str(job_id), str(_number(raw.get("het_job_id")) or "")),
            )
        )
    return jobs


def _tres_list(items: Any, *, usage: bool) -> dict[str, Decimal]:
    """slurmdbd TRES lists: ``[{"type": "fs", "name": "disk", "count": 44118}, ...]``.

    Usage counts are base units already (cpu in milliseconds, sizes in bytes); allocation ``mem`` is MiB.
    """
    out: dict[str, Decimal] = {}
    for item in _items(items):
        if not isinstance(item, Mapping):
            continue
        kind, name, count = item.get("type"), item.get("name"), _number(item.get("count"))
        if not kind or count is None:
            continue
        if count < 0:
            raise ParseError(f"slurmrestd TRES {str(kind)[:20]!r} has a negative count")
        key = f"{kind}/{name}" if name else str(kind)
        value = Decimal(count)
        if usage and key == "cpu":
            value = value / 1000
        elif not usage and key == "mem":
            value = value * 1024 * 1024
        out[key] = value
    return out


def _seconds(value: Any) -> Decimal:
    """``{"seconds": 2, "microseconds": 1060162}`` (microseconds may exceed a million: Slurm adds user+system)."""
    if not isinstance(value, Mapping):
        return Decimal(0)
    seconds = _number(value.get("seconds")) or 0
    micros = _number(value.get("microseconds")) or 0
    if seconds < 0 or micros < 0:
        raise ParseError("slurmrestd reported a negative CPU time")
    return Decimal(seconds) + Decimal(micros) / Decimal(1_000_000)


def _elapsed(value: Any) -> int:
    seconds = _number(value) or 0
    if seconds < 0:
        raise ParseError("slurmrestd reported a negative elapsed time")
    return seconds


def _db_exit(value: Any) -> int | None:
    if not isinstance(value, Mapping):
        return None
    status = str(value.get("status") or "")
    code = _number(value.get("return_code"))
    signal = value.get("signal")
    signal_id = _number(signal.get("signal_id")) if isinstance(signal, Mapping) else None
    if status == "SIGNALED" and signal_id is not None:
        return exit_code_from_pair(f"{code or 0}:{signal_id}")
    return code


def parse_rest_db_jobs(body: Mapping[str, Any]) -> list[AcctJob]:
    """``GET /slurmdb/v0.0.38/job/{id}`` or ``/jobs``: accounting records with their steps, a requeued job's
    runs grouped (``group_runs``)."""
    jobs: list[AcctJob] = []
    for raw in _jobs(body):
        if not isinstance(raw, Mapping):
            continue
        job_id = _number(raw.get("job_id"))
        if job_id is None or job_id <= 0:
            continue
        times = _obj(raw.get("time"))
        state_obj = raw.get("state") or {}
        state = _state_text(state_obj)
        kill_user = raw.get("kill_request_user")
        if state == "CANCELLED" and kill_user:
            state = f"CANCELLED by {kill_user}"
        steps: list[AcctStep] = []
        energy = Decimal(0)
        for raw_step in _items(raw.get("steps")):
            if not isinstance(raw_step, Mapping):
                continue
            step_ref = raw_step.get("step") or {}
            step_id = str(step_ref.get("id") if isinstance(step_ref, Mapping) else "")[:64]
            step_times = _obj(raw_step.get("time"))
            tres = _obj(raw_step.get("tres"))
            requested = _obj(tres.get("requested"))
            usage_in = _tres_list(requested.get("total"), usage=True)
            usage_in.pop("cpu", None)  # cpu time comes from time.total (microsecond precision)
            maxima = _tres_list(requested.get("max"), usage=True)
            rss = maxima.get("mem")
            steps.append(
                AcctStep(
                    step_id=step_id,
                    state=_state_text(raw_step.get("state")),
                    elapsed_seconds=_elapsed(step_times.get("elapsed")),
                    total_cpu_seconds=_seconds(step_times.get("total")),
                    max_rss_bytes=int(rss) if rss is not None else None,
                    usage_in=usage_in,
                    usage_out=_tres_list(_obj(tres.get("consumed")).get("total"), usage=True),
                )
            )
            statistics = _obj(raw_step.get("statistics"))
            consumed = _number(_obj(statistics.get("energy")).get("consumed"))
            # Unmeasured energy is 0 or a sentinel, never negative use. Steps overlap in time on the same nodes
            # (batch, extern): the largest reading is the job's, a sum would count the same joules twice.
            energy = max(energy, Decimal(max(consumed or 0, 0)))
        exit_code = _db_exit(raw.get("exit_code"))
        if exit_code == 0 and (state.split() or [""])[0] in (
            "FAILED",
            "OUT_OF_MEMORY",
            "NODE_FAIL",
            "BOOT_FAIL",
        ):
            exit_code = None  # slurmdbd v0.0.38 reports "SUCCESS 0" for failed jobs: unknown beats wrong
        comment = raw.get("comment")
        comment_text = str(comment.get("job") or "") if isinstance(comment, Mapping) else str(comment or "")
        reason = state_obj.get("reason") if isinstance(state_obj, Mapping) else ""
        jobs.append(
            AcctJob(
                job_id=str(job_id),
                state=state,
                exit_code=exit_code,
                elapsed_seconds=_elapsed(times.get("elapsed")),
                total_cpu_seconds=sum((s.total_cpu_seconds for s in steps), Decimal(0)),
                alloc_tres=_tres_list(_obj(raw.get("tres")).get("allocated"), usage=False),
                energy_joules=energy or None,
                submit_time=parse_time(_number(times.get("submission"))),
                start_time=parse_time(_number(times.get("start"))),
                end_time=parse_time(_number(times.get("end"))),
                reason=_text(str(reason or "")),
                user=str(raw.get("user") or ""),
                name=str(raw.get("name") or ""),
                comment=_text(comment_text),
                steps=steps,
            )
        )
    return group_runs(jobs)


_ADMIN_LEVELS = {"operator": "Operator", "administrator": "Administrator"}


def parse_admin_levels(text: str) -> dict[str, str]:
    """``sacctmgr -n -P show user format=User,AdminLevel``: the users whose level is above ``None``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        user, sep, level = line.strip().partition("|")
        known = _ADMIN_LEVELS.get(level.strip().lower())
        if sep and user and known:
            out[user] = known
    return out


def parse_rest_admin_levels(body: dict[str, Any]) -> dict[str, str]:
    """slurmdbd's ``users`` answer (``administrator_level`` per user), the same as ``parse_admin_levels``."""
    out: dict[str, str] = {}
    for user in body.get("users") or []:
        if not isinstance(user, dict) or not isinstance(user.get("name"), str):
            continue
        level = user.get("administrator_level")
        levels = level if isinstance(level, list) else [level]
        known = [_ADMIN_LEVELS[str(x).lower()] for x in levels if str(x).lower() in _ADMIN_LEVELS]
        if known:
            out[user["name"]] = known[-1]
    return out
