"""``virtengine-hpc usage``: export a job's signed usage records and verify records anyone hands you.

``usage export --job ID`` prints the job's records as the ledger stores them, signatures included, as a JSON
list in canonical form (every decimal and time already written the way it was signed). ``usage verify``
checks every signature against a public key (``--public-key``, ``--key-file``, or the keys the ledger has
registered for the records' provider), that each record id is ``<cluster>/<job>/<sequence>``, that format-2
records follow the metering rules (the format's basis, priced metrics = allocation held for the run time), and,
per job, that sequences run 1, 2, 3, ... without gap or repeat, each period starting where the previous one
ended, and that exactly one record, the last, is final. It prints one line per record and exits 1 if anything
fails. The record format is in ``docs/usage-records.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.cli.common import config_from_args
from virtengine_hpc.config import Config, Secrets, parse_duration
from virtengine_hpc.errors import HPCError, SecurityError, ValidationError
from virtengine_hpc.metering import BASIS, MetricCheck, meter, reconcile, rule_problems
from virtengine_hpc.models import Resources, UsageRecord
from virtengine_hpc.signing import canonical_decimal, key_id, load_private_key, public_key_from_b64
from virtengine_hpc.usage import record_document, record_id, sum_metrics, verify_record
from virtengine_hpc.usage_format import form_problems, load_json

if TYPE_CHECKING:
    from activities.chain.local_ledger import LocalLedger
    from activities.schedulers.base import Accounting, SchedulerAdapter

KeyLookup = Callable[[UsageRecord], "Ed25519PublicKey | str"]
"""Returns the key to verify a record with, or a reason why there is none."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "usage",
        help="export and verify signed usage records",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="usage_command", metavar="COMMAND", required=True)

    p = sub.add_parser("export", help="a job's usage records as stored on the ledger (JSON list)")
    p.add_argument("--job", required=True, metavar="ID")
    p.add_argument("--output", "-o", metavar="F", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="verify signatures, sequences and the final record")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", metavar="F", help="records from a file (JSON list, object or JSON lines)")
    source.add_argument("--job", metavar="ID", help="records of this job from the ledger")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--public-key", metavar="B64", help="the provider's raw Ed25519 public key, base64")
    key.add_argument("--key-file", metavar="PEM", help="the provider's public (or private) key file")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "reconcile",
        help="compare jobs' records with the scheduler's own accounting, metric by metric",
        description="Compare what a job's usage records add up to with the scheduler's own final accounting "
        "(sacct for SLURM, checkjob for MOAB, the local executor's status), metered by the same rule, metric by "
        "metric. The run time agrees within one second (the scheduler's clock), a priced metric exactly as the "
        "allocation held for that run time (to a micro-unit per record), a measured figure within 1 %%. "
        "Exit 1 when any job differs beyond that or cannot be reconciled; jobs still running are skipped.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--job", metavar="ID", help="one job")
    source.add_argument(
        "--since",
        metavar="TIME",
        help="every job a scheduler held, or with records, at or after TIME",
    )
    p.add_argument(
        "--until", metavar="TIME", help="with --since: and starting at or before TIME (default now)"
    )
    p.set_defaults(func=cmd_reconcile)


# ---- keys --------------------------------------------------------------------------------------------------


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a file: public PEM, private PEM or raw seed (0600), or base64 of the raw
    key."""
    target = Path(path)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise SecurityError(f"key file {target}: {exc.strerror}") from None
    if b"PRIVATE KEY" in data or len(data) == 32:  # 32 bytes is a raw seed (a base64 public key has 44)
        return load_private_key(target).public_key()
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError as exc:
            raise SecurityError(f"key file {target} is not a readable public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SecurityError(f"key file {target} does not hold an Ed25519 key")
        return key
    return public_key_from_b64(data.decode(errors="replace").strip())


def _fixed_key(key: Ed25519PublicKey) -> KeyLookup:
    return lambda _record: key


def _ledger_keys(args: argparse.Namespace) -> KeyLookup:
    from virtengine_hpc.cli.ledger import open_ledger

    ledger = open_ledger(args)
    cache: dict[str, dict[str, str]] = {}

    def lookup(record: UsageRecord) -> Ed25519PublicKey | str:
        if record.provider not in cache:
            cache[record.provider] = ledger.provider_keys(record.provider)
        found = cache[record.provider].get(record.key_id)
        if found is None:
            return f"key {record.key_id[:16]}... is not registered on the ledger for {record.provider}"
        return public_key_from_b64(found)

    return lookup


# ---- verification ------------------------------------------------------------------------------------------


@dataclass
class RecordCheck:
    label: str
    record: UsageRecord | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Verification:
    records: list[RecordCheck]
    jobs: dict[str, list[str]]
    """Per job: the problems of its record sequence (empty when it is whole)."""

    @property
    def ok(self) -> bool:
        return bool(self.records) and all(r.ok for r in self.records) and not any(self.jobs.values())


def read_record(item: Any) -> UsageRecord | list[str]:
    """The record ``item`` (as JSON gives it) holds, or what makes it malformed: anything the documented form
    forbids (``usage_format``), then anything the model refuses (a negative quantity, an unknown state)."""
    problems = form_problems(item)
    if problems:
        return [f"malformed record: {'; '.join(problems[:5])}"]
    try:
        return UsageRecord.model_validate(item)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return [f"malformed record: {where}: {first['msg']}"]


def verify_records(items: list[Any], lookup: KeyLookup) -> Verification:
    """Check each record's form and signature, then each job's sequence (gapless from 1, one final, last)."""
    checks: list[RecordCheck] = []
    for number, item in enumerate(items, start=1):
        label = f"#{number}"
        if isinstance(item, dict) and isinstance(item.get("record_id"), str):
            label = item["record_id"]
        read = read_record(item)
        if isinstance(read, list):
            checks.append(RecordCheck(label, None, read))
            continue
        checks.append(RecordCheck(label, read, _record_problems(read, lookup)))
    by_job: dict[str, list[UsageRecord]] = {}
    for check in checks:
        if check.record is not None:
            by_job.setdefault(check.record.job_id, []).append(check.record)
    return Verification(checks, {job: _sequence_problems(recs) for job, recs in by_job.items()})


def _record_problems(record: UsageRecord, lookup: KeyLookup) -> list[str]:
    problems = []
    expected = record_id(record.cluster_id, record.job_id, record.sequence)
    if record.record_id != expected:
        problems.append(f"record id should be {expected}")
    span = record.period_end - record.period_start
    period = Decimal(span.days * 86400 + span.seconds) + Decimal(span.microseconds) / 1_000_000
    if period < 0:
        problems.append("its period ends before it starts")
    elif record.version >= 2 and record.metrics.wall_clock_seconds > period:
        problems.append(
            f"claims {canonical_decimal(record.metrics.wall_clock_seconds)} s of run time in a "
            f"{canonical_decimal(period)} s period"
        )
    problems += rule_problems(record)
    key = lookup(record)
    if isinstance(key, str):
        problems.append(key)
    else:
        if key_id(key) != record.key_id:
            problems.append(f"key_id {record.key_id[:16]}... is not the given key ({key_id(key)[:16]}...)")
        if not verify_record(record, key):
            problems.append("signature does not verify")
    return problems


def _sequence_problems(records: list[UsageRecord]) -> list[str]:
    problems = []
    sequences = sorted(r.sequence for r in records)
    repeated = sorted({s for s in sequences if sequences.count(s) > 1})
    if repeated:
        problems.append(f"sequence repeated: {', '.join(map(str, repeated))}")
    missing = sorted(set(range(1, max(sequences) + 1)) - set(sequences))
    if missing:
        problems.append(f"sequence gap: missing {', '.join(map(str, missing))}")
    ordered = sorted(records, key=lambda r: r.sequence)
    for earlier, later in itertools.pairwise(ordered):
        if later.sequence == earlier.sequence + 1 and later.period_start != earlier.period_end:
            problems.append(
                f"record {later.sequence}'s period starts at {_moment(later.period_start)}, not where record "
                f"{earlier.sequence}'s ended ({_moment(earlier.period_end)})"
            )
    finals = [r.sequence for r in records if r.is_final]
    if not finals:
        problems.append("no final record")
    elif len(finals) > 1:
        problems.append(f"{len(finals)} final records (sequences {', '.join(map(str, sorted(finals)))})")
    elif finals[0] != max(sequences):
        problems.append(f"records follow the final record (sequence {finals[0]})")
    return problems


def _moment(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _read_records(path: str) -> list[Any]:
    try:
        text = Path(path).read_text() if path != "-" else sys.stdin.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{path}: {exc}") from None
    try:
        data = load_json(text)
    except json.JSONDecodeError:
        try:
            data = [load_json(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{path} is neither JSON nor JSON lines: {exc}") from None
    return data if isinstance(data, list) else [data]


def _stored(text: str) -> Any:
    """A record the ledger stored (in its own rendering), in the documented form; a row that cannot be read is
    returned as what is left of it, which ``read_record`` then reports as malformed."""
    try:
        return record_document(UsageRecord.model_validate_json(text))
    except (PydanticValidationError, ValueError):
        pass
    try:
        return load_json(text)
    except json.JSONDecodeError:
        return text


def wire_form(record: UsageRecord) -> dict[str, Any]:
    """The record as a JSON object with every value already canonical (decimals, times), signature included.

    Dropping ``signature`` and dumping the rest with sorted keys and no whitespace gives exactly the signed
    body, so a verifier needs nothing but a JSON and an Ed25519 library (``docs/usage-records.md``).
    """
    return record_document(record)


# ---- commands ----------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from virtengine_hpc.cli.ledger import open_ledger

    ledger = open_ledger(args)
    if ledger.job(args.job) is None:
        raise ValidationError(f"unknown job {args.job}")
    exported, damaged = [], []
    for rid, stored in ledger.usage_record_texts(args.job):
        read = read_record(_stored(stored))
        if isinstance(read, list):
            damaged.append(f"{rid}: {'; '.join(read)}")
        else:
            exported.append(wire_form(read))
    text = json.dumps(exported, indent=2, ensure_ascii=False)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    for line in damaged:
        print(f"error: stored record {line} (not exported)", file=sys.stderr)
    return 1 if damaged else 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.public_key:
        lookup = _fixed_key(public_key_from_b64(args.public_key))
    elif args.key_file:
        lookup = _fixed_key(load_public_key(args.key_file))
    else:
        config_from_args(args)  # a bad config is reported as such, before the ledger
        lookup = _ledger_keys(args)
    if args.job:
        from virtengine_hpc.cli.ledger import open_ledger

        items: list[Any] = [_stored(text) for _, text in open_ledger(args).usage_record_texts(args.job)]
    else:
        items = _read_records(args.file)
    result = verify_records(items, lookup)
    for check in result.records:
        record = check.record
        detail = ""
        if record is not None:
            detail = (
                f"seq {record.sequence:<4} {record.job_state.value:<10}{' final' if record.is_final else ''}"
            )
        status = "OK  " if check.ok else "FAIL"
        print(
            f"{status}  {check.label}  {detail}{'  ' + '; '.join(check.problems) if check.problems else ''}"
        )
    for job, problems in result.jobs.items():
        count = sum(1 for c in result.records if c.record and c.record.job_id == job)
        if problems:
            print(f"FAIL  job {job}: {'; '.join(problems)}")
        else:
            print(f"OK    job {job}: {count} records, sequences 1..{count} gapless, one final record")
    failed = sum(1 for c in result.records if not c.ok)
    if not result.records:
        print("FAIL  no records to verify")
    print(f"{len(result.records)} records: {len(result.records) - failed} ok, {failed} failed")
    return 0 if result.ok else 1


# ---- reconcile ---------------------------------------------------------------------------------------------


def _when(text: str) -> datetime:
    """A time on the command line: RFC 3339 (a time without a zone is UTC) or a duration ago (``24h``)."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            return datetime.now(UTC) - parse_duration(text)
        except ValueError:
            raise ValidationError(
                f"{text!r} is neither a time (2026-11-30T12:00:00Z) nor a duration (24h)"
            ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def cmd_reconcile(args: argparse.Namespace) -> int:
    from virtengine_hpc.cli.ledger import open_ledger

    config = config_from_args(args)
    ledger = open_ledger(args)
    if args.job:
        if ledger.job(args.job) is None:
            raise ValidationError(f"unknown job {args.job}")
        job_ids = [args.job]
    else:
        until = _when(args.until) if args.until else datetime.now(UTC)
        job_ids = ledger.jobs_between(_when(args.since), until)
    return asyncio.run(_reconcile_jobs(config, ledger, job_ids))


@dataclass
class _Reconciled:
    outcome: str
    """``OK``, ``DIFF`` (beyond tolerance), ``FAIL`` (cannot be reconciled) or ``SKIP`` (still running)."""
    summary: str
    checks: list[MetricCheck] = field(default_factory=list)


async def _reconcile_jobs(config: Config, ledger: LocalLedger, job_ids: list[str]) -> int:
    from workers.wiring import build_adapter

    secrets = Secrets.from_env()
    adapters: dict[str, SchedulerAdapter] = {}

    def adapter_of(cluster_id: str) -> SchedulerAdapter:
        if cluster_id not in adapters:
            adapters[cluster_id] = build_adapter(config, secrets, cluster_id)
        return adapters[cluster_id]

    counts: Counter[str] = Counter()
    try:
        for job_id in job_ids:
            result = await _reconcile_job(ledger, job_id, adapter_of)
            counts[result.outcome] += 1
            _print_reconciled(job_id, result)
    finally:
        for adapter in adapters.values():
            await adapter.close()
    print(
        f"{len(job_ids)} jobs: {counts['OK']} agree, {counts['DIFF']} differ, {counts['FAIL']} cannot be "
        f"reconciled, {counts['SKIP']} still running"
    )
    return 1 if counts["DIFF"] or counts["FAIL"] else 0


async def _reconcile_job(
    ledger: LocalLedger, job_id: str, adapter_of: Callable[[str], SchedulerAdapter]
) -> _Reconciled:
    job = ledger.job(job_id)
    assert job is not None
    records: list[UsageRecord] = []
    for rid, stored in ledger.usage_record_texts(job_id):
        read = read_record(_stored(stored))
        if isinstance(read, list):
            return _Reconciled("FAIL", f"stored record {rid} is damaged: {'; '.join(read)}")
        records.append(read)
    scheduler_job_id = records[-1].scheduler_job_id if records else job.scheduler_job_id
    cluster_id = records[-1].cluster_id if records else job.cluster_id
    if not scheduler_job_id or not cluster_id:
        return _Reconciled("OK", "never reached a scheduler: nothing used, nothing recorded")
    where = f"{scheduler_job_id} on {cluster_id}"
    try:
        accounting = await adapter_of(cluster_id).usage(scheduler_job_id)
    except HPCError as exc:
        return _Reconciled("FAIL", f"the scheduler's accounting of {where} cannot be read: {exc}")
    if not accounting.final or (not any(r.is_final for r in records) and job.state.active):
        return _Reconciled("SKIP", f"{where} is still running; its accounting is not final")
    if not records:
        return _unrecorded(where, accounting)
    resources = Resources.model_validate(job.raw_spec.get("resources") or {})
    theirs = meter(accounting.reading, resources)
    ours = sum_metrics([r.metrics for r in records])
    formats = sorted({r.version for r in records})
    # Format-1 records priced CPU and memory on other bases: only the run time compares with them.
    compared = tuple(BASIS) if formats == [2] else ("wall_clock_seconds",)
    checks = reconcile(ours, theirs, record_count=len(records), metrics=compared)
    differ = [c.metric for c in checks if not c.ok]
    gaps = _sequence_problems(records)
    summary = (
        f"{where}, {len(records)} records (format {', '.join(map(str, formats))}), "
        f"{'differs in ' + ', '.join(differ) if differ else 'every metric within tolerance'}"
        f"{'; ' + '; '.join(gaps) if gaps else ''}"
    )
    return _Reconciled("DIFF" if differ or gaps else "OK", summary, checks)


def _unrecorded(where: str, accounting: Accounting) -> _Reconciled:
    """A job that ended on its scheduler and has no record on chain: right if it never ran, a finding if it did
    (it ran, so it used its allocation, and nothing billed it)."""
    seconds = accounting.reading.wall_clock_seconds
    if accounting.start_time is None and seconds == 0:
        return _Reconciled("OK", f"{where} never ran: nothing used, nothing recorded")
    return _Reconciled(
        "DIFF", f"{where} ran ({canonical_decimal(seconds)} s) but the chain holds no usage record of it"
    )


def _show(value: Decimal | None) -> str:
    return "-" if value is None else canonical_decimal(value)


def _print_reconciled(job_id: str, result: _Reconciled) -> None:
    print(f"{result.outcome:<5} job {job_id}: {result.summary}")
    if not result.checks:
        return
    rows = [("metric", "records", "scheduler", "difference", "tolerance", "")]
    for c in result.checks:
        rows.append(
            (
                c.metric,
                _show(c.records),
                _show(c.scheduler),
                _show(c.difference),
                _show(c.tolerance),
                "ok" if c.ok else "DIFF",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("      " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
