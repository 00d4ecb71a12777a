"""Prices: what usage costs at a priced queue, what a job may cost at most, and the checks a job must pass.

Queues are priced per hour per partition and job class (``PricedQueue``): node-hours, core-hours, GPU-hours,
memory GB-hours, storage GB-hours, with a minimum charge, and bounded durations. Everything here is ``Decimal``
arithmetic in a 60-digit context; the one rounding (to the ledger's unit, half to even) happens when a charge is
settled. The rules, with examples, are in ``docs/pricing.md``.

The budget rule (checked before a job reaches the scheduler): the tenant's ``max_price`` (its escrow) must cover
the **quote**, the price of the whole requested allocation for the whole walltime (and at least the minimum
charge). A job can then never cost more than it escrowed, whatever it does within its walltime; a job whose
budget is smaller is refused with the quote in the message, and its escrow is refunded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from decimal import ROUND_CEILING, ROUND_HALF_EVEN, Decimal, localcontext

from pydantic import Field

from virtengine_hpc.errors import ValidationError
from virtengine_hpc.models import JobSpec, Model, PricedQueue, Pricing, Resources, UsageMetrics

UNIT = Decimal("0.000001")
"""The chain's smallest amount (six decimal places)."""
HOUR = Decimal(3600)
#: MiB -> GB (10^9 bytes): 1 MiB = 1.048576 MB. Quotes count allocated memory in GB of 10^9 bytes, as the records
#: settlement charges do (``virtengine_hpc/metering.py``), so a quote covers what settlement can charge.
MIB_IN_GB = Decimal("0.001048576")


class PriceLine(Model):
    """One priced quantity: ``amount = quantity x rate`` (unrounded)."""

    item: str
    quantity: Decimal
    unit: str
    rate: Decimal
    amount: Decimal


class Quote(Model):
    """The most a job can cost: its allocation priced over its whole walltime."""

    lines: list[PriceLine] = Field(default_factory=list)
    rated: Decimal
    minimum_charge: Decimal
    total: Decimal = Field(description="max(rated rounded up to the unit, minimum charge).")


@contextmanager
def _exact() -> Iterator[None]:
    with localcontext() as ctx:
        ctx.prec = 60
        yield


def usage_lines(metrics: UsageMetrics, pricing: Pricing) -> list[PriceLine]:
    """The priced quantities of measured usage (what settlement charges), unrounded."""
    with _exact():
        quantities = (
            ("node-hours", metrics.node_hours, "node-h", pricing.node_hour),
            ("core-hours", metrics.cpu_core_seconds / HOUR, "core-h", pricing.core_hour),
            ("GPU-hours", metrics.gpu_seconds / HOUR, "GPU-h", pricing.gpu_hour),
            ("memory", metrics.memory_gb_seconds / HOUR, "GB-h", pricing.memory_gb_hour),
            ("storage", metrics.storage_gb_hours, "GB-h", pricing.storage_gb_hour),
        )
        return [
            PriceLine(item=item, quantity=qty, unit=unit, rate=rate, amount=qty * rate)
            for item, qty, unit, rate in quantities
        ]


def rate_usage(metrics: UsageMetrics, pricing: Pricing) -> Decimal:
    """The price of ``metrics`` before the minimum charge and the escrow cap, unrounded (exact)."""
    with _exact():
        return sum((line.amount for line in usage_lines(metrics, pricing)), Decimal(0))


def round_amount(amount: Decimal) -> Decimal:
    return amount.quantize(UNIT, rounding=ROUND_HALF_EVEN)


def allocation_lines(resources: Resources, walltime_seconds: int, pricing: Pricing) -> list[PriceLine]:
    """The priced quantities of an allocation held for ``walltime_seconds`` (what a quote charges)."""
    with _exact():
        hours = Decimal(walltime_seconds) / HOUR
        nodes = Decimal(resources.nodes)
        quantities = (
            ("node-hours", nodes * hours, "node-h", pricing.node_hour),
            ("core-hours", Decimal(resources.total_cpus) * hours, "core-h", pricing.core_hour),
            ("GPU-hours", Decimal(resources.total_gpus) * hours, "GPU-h", pricing.gpu_hour),
            (
                "memory",
                nodes * Decimal(resources.memory_mb_per_node) * MIB_IN_GB * hours,
                "GB-h",
                pricing.memory_gb_hour,
            ),
            ("storage", Decimal(resources.storage_gb) * hours, "GB-h", pricing.storage_gb_hour),
        )
        return [
            PriceLine(item=item, quantity=qty, unit=unit, rate=rate, amount=qty * rate)
            for item, qty, unit, rate in quantities
        ]


def quote(resources: Resources, walltime_seconds: int, queue: PricedQueue) -> Quote:
    """The most a job with ``resources`` and ``walltime_seconds`` can be charged at ``queue``."""
    lines = allocation_lines(resources, walltime_seconds, queue.pricing)
    with _exact():
        rated = sum((line.amount for line in lines), Decimal(0))
    minimum = round_amount(queue.pricing.minimum_charge)
    total = max(rated.quantize(UNIT, rounding=ROUND_CEILING), minimum)
    return Quote(lines=lines, rated=rated, minimum_charge=minimum, total=total)


def check_job_against_queue(job: JobSpec, queue: PricedQueue) -> Quote:
    """Refuse (``ValidationError``, every problem at once) a job its offering cannot run or its budget cannot pay.

    The job must ask for the queue's partition (or none) and job class, its walltime must be within the queue's
    duration bounds, and its ``max_price`` must cover the quote. Returns the quote.
    """
    problems: list[str] = []
    where = f"offering {queue.offering_id}"
    if job.partition is not None and job.partition != queue.partition:
        problems.append(
            f"{where} is priced for partition {queue.partition}, the job asks for {job.partition}"
        )
    if job.job_class != queue.job_class:
        problems.append(
            f"{where} is priced for job class {queue.job_class}, the job asks for {job.job_class}"
        )
    low, high = queue.min_duration_seconds, queue.max_duration_seconds
    if not low <= job.walltime_seconds <= high:
        problems.append(
            f"walltime {job.walltime_seconds} s is outside the {where} duration bounds {low}..{high} s"
        )
    priced = quote(job.resources, job.walltime_seconds, queue)
    if job.max_price < priced.total:
        problems.append(
            f"budget {_show(job.max_price)} does not cover the most this job can cost at {where}: "
            f"{_show(priced.total)} ({describe(priced)})"
        )
    if problems:
        raise ValidationError("; ".join(problems))
    return priced


def describe(priced: Quote) -> str:
    """``2 node-h x 1 + 32 core-h x 0.05 ...``: the non-zero lines of a quote, for error messages and the CLI."""
    parts = [
        f"{_show(line.quantity)} {line.unit} x {_show(line.rate)}" for line in priced.lines if line.amount > 0
    ]
    if priced.total == priced.minimum_charge and priced.minimum_charge > 0:
        parts.append(f"minimum charge {_show(priced.minimum_charge)}")
    return " + ".join(parts) or "nothing priced"


def _show(value: Decimal) -> str:
    text = format(value.quantize(UNIT, rounding=ROUND_HALF_EVEN).normalize(), "f")
    return "0" if text in ("-0", "") else text
