"""Usage records: deterministic ids, metric arithmetic, signing and verification.

A job's records are differences of cumulative readings: record ``n`` covers ``(period_start, period_end]`` and
holds ``cumulative(period_end) - cumulative(period_start)``; the final record (``is_final``) closes the job, so the
records of a job add up exactly to its final accounting. Quantities are ``Decimal`` rounded to micro-units
(``QUANTUM``) before they are signed, so sums are exact.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from virtengine_hpc.models import UsageMetrics, UsageRecord
from virtengine_hpc.signing import USAGE_RECORD_PREFIX, Signer, canonical_bytes, plain, verify

QUANTUM = Decimal("0.000001")
_DECIMAL_FIELDS = (
    "wall_clock_seconds",
    "cpu_core_seconds",
    "memory_gb_seconds",
    "gpu_seconds",
    "node_hours",
    "storage_gb_hours",
)
#: Quantities a scheduler may not measure (``None``), summed like the others where it does.
_OPTIONAL_DECIMALS = ("energy_joules", "cpu_time_seconds", "memory_used_gb_seconds")
_OPTIONAL_COUNTS = ("network_bytes_in", "network_bytes_out", "disk_bytes_read", "disk_bytes_written")
_OPTIONAL = _OPTIONAL_DECIMALS + _OPTIONAL_COUNTS


def record_id(cluster_id: str, job_id: str, sequence: int) -> str:
    return f"{cluster_id}/{job_id}/{sequence}"


def next_report_due(started: datetime | None, last: datetime, interval: timedelta) -> datetime:
    """When the period record after one that ended at ``last`` is due: on the job's own schedule (its start plus
    whole intervals), so a record taken a moment after it was due does not push every later one back by as much."""
    if started is not None and last >= started:
        return started + (1 + (last - started) // interval) * interval
    return last + interval


def quantize(value: Decimal) -> Decimal:
    return value.quantize(QUANTUM, rounding=ROUND_HALF_EVEN)


def normalize_metrics(metrics: UsageMetrics) -> UsageMetrics:
    """Round every decimal quantity to ``QUANTUM`` (done once on cumulative readings, so differences are exact)."""
    updates: dict[str, object] = {name: quantize(getattr(metrics, name)) for name in _DECIMAL_FIELDS}
    for name in _OPTIONAL_DECIMALS:
        value = getattr(metrics, name)
        if value is not None:
            updates[name] = quantize(value)
    return metrics.model_copy(update=updates)


def _opt_op(a: int | Decimal | None, b: int | Decimal | None, sign: int) -> int | Decimal | None:
    if a is None and b is None:
        return None
    return (a or 0) + sign * (b or 0)


def add_metrics(a: UsageMetrics, b: UsageMetrics) -> UsageMetrics:
    values: dict[str, object] = {name: getattr(a, name) + getattr(b, name) for name in _DECIMAL_FIELDS}
    for name in _OPTIONAL:
        values[name] = _opt_op(getattr(a, name), getattr(b, name), 1)
    maxes = [m for m in (a.memory_bytes_max, b.memory_bytes_max) if m is not None]
    values["memory_bytes_max"] = max(maxes) if maxes else None
    return UsageMetrics.model_validate(values)


def diff_metrics(later: UsageMetrics, earlier: UsageMetrics) -> UsageMetrics:
    """``later - earlier`` for cumulative readings; a quantity never goes below zero.

    A scheduler may revise a running estimate down in its final accounting (rare; sstat against sacct): records
    already signed stand, so the difference is clamped at zero and the final accounting is the sum of the records.
    """
    values: dict[str, object] = {
        name: max(Decimal(0), getattr(later, name) - getattr(earlier, name)) for name in _DECIMAL_FIELDS
    }
    for name in _OPTIONAL:
        delta = _opt_op(getattr(later, name), getattr(earlier, name), -1)
        values[name] = None if delta is None else max(type(delta)(0), delta)
    values["memory_bytes_max"] = later.memory_bytes_max
    return UsageMetrics.model_validate(values)


def sum_metrics(items: list[UsageMetrics]) -> UsageMetrics:
    total = UsageMetrics()
    for item in items:
        total = add_metrics(total, item)
    return total


def record_document(record: UsageRecord) -> dict[str, Any]:
    """The record as its format writes it (plain JSON values, signature included).

    Format 1 has no ``version``, ``allocation``, ``basis`` nor the metrics format 2 added: its canonical form is
    exactly what it was when such records were signed, so they verify as they always did.
    """
    document: dict[str, Any] = plain(record)  # the model renders a format-1 record without them
    return document


def record_domain(version: int) -> str:
    """The domain tag a record of format ``version`` is signed under (``.../v1``, ``.../v2``)."""
    return f"{USAGE_RECORD_PREFIX}{version}"


def signing_payload(record: UsageRecord) -> bytes:
    return canonical_bytes(record_document(record), record_domain(record.version))


def sign_record(record: UsageRecord, signer: Signer) -> UsageRecord:
    """Return ``record`` with ``key_id`` set and signed over its canonical form."""
    unsigned = record.model_copy(update={"key_id": signer.key_id, "signature": ""})
    return unsigned.model_copy(update={"signature": signer.sign(signing_payload(unsigned))})


def verify_record(record: UsageRecord, public_key: Ed25519PublicKey) -> bool:
    """True when ``record`` carries a valid signature of ``public_key`` over its canonical form; False for
    anything else, including a record whose canonical form cannot even be built (a non-finite number)."""
    if not record.signature:
        return False
    try:
        payload = signing_payload(record)
    except (TypeError, ValueError):
        return False
    return verify(public_key, payload, record.signature)
