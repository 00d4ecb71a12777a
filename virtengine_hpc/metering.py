"""One metering path: a scheduler's raw reading of a job in, the quantities of its usage records out.

Every scheduler adapter (local executor, SLURM over any transport, MOAB, Open OnDemand through either) reports the
same thing, a ``Reading``: the job's run time as the scheduler clocked it, the allocation the scheduler says it
holds, and what the scheduler measured it using (CPU time, memory, energy, network and disk bytes), cumulative
since the job started, each figure raw and in the scheduler's base unit (seconds, bytes, joules). ``meter`` alone
turns a reading into a record's metrics, the same way for all of them and in one unit system: seconds, hours, and
GB = 10^9 bytes.

The billing rule (``docs/pricing.md``), the one HPC centres apply: what is priced is the **allocation held for the
run time** (node-hours, core-seconds, GPU-seconds, memory GB-seconds, storage GB-hours), whether or not the job
used it. The allocation priced is the one the job asked for (what its quote priced), lowered to what the scheduler
actually allocated where the scheduler says so: a job is never billed for more than it was quoted, nor for what it
did not get. What the job measurably used is carried beside it, never priced, so that a tenant sees both; each
record says which figure is which (``basis``).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import ROUND_CEILING, Decimal

from pydantic import Field

from virtengine_hpc.models import Allocation, Basis, Model, Resources, UsageMetrics, UsageRecord
from virtengine_hpc.signing import canonical_decimal
from virtengine_hpc.usage import QUANTUM, diff_metrics, normalize_metrics, quantize

GB = Decimal(10**9)
HOUR = Decimal(3600)

#: The priced metrics, each an allocation held for the run time: ``allocation.<field> x seconds / divisor``.
PRICED: dict[str, tuple[str, Decimal]] = {
    "node_hours": ("nodes", HOUR),
    "cpu_core_seconds": ("cpus", Decimal(1)),
    "gpu_seconds": ("gpus", Decimal(1)),
    "memory_gb_seconds": ("memory_bytes", GB),
    "storage_gb_hours": ("storage_gb", HOUR),
}

#: What each metric of a record is: the scheduler's measurement, or the allocation times the run time.
BASIS: dict[str, Basis] = {
    "wall_clock_seconds": "measured",
    "node_hours": "allocated",
    "cpu_core_seconds": "allocated",
    "gpu_seconds": "allocated",
    "memory_gb_seconds": "allocated",
    "storage_gb_hours": "allocated",
    "cpu_time_seconds": "measured",
    "memory_used_gb_seconds": "measured",
    "memory_bytes_max": "measured",
    "energy_joules": "measured",
    "network_bytes_in": "measured",
    "network_bytes_out": "measured",
    "disk_bytes_read": "measured",
    "disk_bytes_written": "measured",
}


class Allocated(Model):
    """The allocation as the scheduler reports it; ``None`` where it does not say (the request then stands)."""

    nodes: int | None = Field(None, ge=0)
    cpus: int | None = Field(None, ge=0)
    gpus: int | None = Field(None, ge=0)
    memory_bytes: int | None = Field(None, ge=0)
    storage_gb: int | None = Field(None, ge=0)


class Reading(Model):
    """A scheduler's cumulative figures for one job, raw, in base units; ``None``: not measured there."""

    wall_clock_seconds: Decimal = Field(
        Decimal(0), ge=0, description="Run time so far as the scheduler clocks it (suspended time excluded)."
    )
    taken_at: datetime | None = Field(
        None, description="The moment the figures describe (a sample's time, a query's, the job's end)."
    )
    allocated: Allocated = Field(default_factory=Allocated)
    cpu_time_seconds: Decimal | None = Field(None, ge=0, description="CPU time used, user + system.")
    memory_byte_seconds: Decimal | None = Field(
        None, ge=0, description="Resident memory integrated over time."
    )
    memory_bytes_max: int | None = Field(None, ge=0, description="Peak resident memory.")
    energy_joules: Decimal | None = Field(None, ge=0)
    network_bytes_in: int | None = Field(None, ge=0)
    network_bytes_out: int | None = Field(None, ge=0)
    disk_bytes_read: int | None = Field(None, ge=0)
    disk_bytes_written: int | None = Field(None, ge=0)


class Metered(Model):
    """A reading metered: cumulative metrics (rounded to micro-units), the allocation they priced, their basis."""

    metrics: UsageMetrics
    allocation: Allocation
    basis: dict[str, Basis]


def priced_allocation(requested: Resources, allocated: Allocated) -> Allocation:
    """What the job asked for, lowered to what the scheduler allocated where it reports an allocation."""
    asked = Allocation.of(requested)
    values = {}
    for name in Allocation.model_fields:
        given = getattr(allocated, name)
        values[name] = getattr(asked, name) if given is None else min(getattr(asked, name), given)
    return Allocation.model_validate(values)


def meter(reading: Reading, requested: Resources) -> Metered:
    """The record metrics of ``reading`` for a job that asked for ``requested`` (``docs/usage-records.md``)."""
    allocation = priced_allocation(requested, reading.allocated)
    wall = reading.wall_clock_seconds
    metrics = UsageMetrics(
        wall_clock_seconds=wall,
        **held(allocation, wall),
        cpu_time_seconds=reading.cpu_time_seconds,
        memory_used_gb_seconds=(
            None if reading.memory_byte_seconds is None else reading.memory_byte_seconds / GB
        ),
        memory_bytes_max=reading.memory_bytes_max,
        energy_joules=reading.energy_joules,
        network_bytes_in=reading.network_bytes_in,
        network_bytes_out=reading.network_bytes_out,
        disk_bytes_read=reading.disk_bytes_read,
        disk_bytes_written=reading.disk_bytes_written,
    )
    return Metered(metrics=normalize_metrics(metrics), allocation=allocation, basis=basis_of(metrics))


def held(allocation: Allocation, seconds: Decimal) -> dict[str, Decimal]:
    """The priced metrics of ``allocation`` held for ``seconds``, exact (not rounded)."""
    return {name: getattr(allocation, field) * seconds / divisor for name, (field, divisor) in PRICED.items()}


def period_metrics(now: Metered, previous: UsageMetrics) -> UsageMetrics:
    """A record's metrics: the cumulative reading ``now`` less what the job's earlier records add up to.

    The earlier records' priced figures are taken as ``now``'s allocation held for the run time they cover, not
    as they were signed: records of format 1 priced CPU and memory on other bases (CPU time used, GiB-seconds),
    and an allocation can change between readings; either way the difference of the priced figures would bill
    earlier periods again, or not bill this one. So every record prices its allocation held for its own run time
    (within a micro-unit: cumulative figures are rounded), and the records of a job, format 1 or 2, add up to
    its final accounting, the sum of what each signed. A measured figure the earlier records do not carry
    (format 1 had no CPU time) is reported in full by the first record that does.
    """
    rebased = {
        name: quantize(value) for name, value in held(now.allocation, previous.wall_clock_seconds).items()
    }
    return diff_metrics(now.metrics, previous.model_copy(update=rebased))


def rule_problems(record: UsageRecord) -> list[str]:
    """Where a format-2 record breaks the format's metering rules: a basis other than the format's, for exactly
    the metrics the record carries; a priced metric other than its allocation held for the record's run time
    (within one micro-unit, the rounding of the cumulative figures it is the difference of). Empty for format 1,
    which had no such rules."""
    if record.version < 2 or record.allocation is None or record.basis is None:
        return []
    problems = []
    expected_basis = basis_of(record.metrics)
    if record.basis != expected_basis:
        wrong = sorted(
            name
            for name in set(record.basis) | set(expected_basis)
            if record.basis.get(name) != expected_basis.get(name)
        )
        problems.append(f"basis does not follow the format for {', '.join(wrong)}")
    wall = record.metrics.wall_clock_seconds
    for name, exact in held(record.allocation, wall).items():
        value = getattr(record.metrics, name)
        if abs(value - exact) > QUANTUM:
            field = PRICED[name][0]
            problems.append(
                f"{name} {canonical_decimal(value)} is not allocation.{field} held for "
                f"{canonical_decimal(wall)} s ({canonical_decimal(quantize(exact))})"
            )
    return problems


def basis_of(metrics: UsageMetrics) -> dict[str, Basis]:
    """The basis of every metric ``metrics`` carries (those not ``None``)."""
    return {name: BASIS[name] for name in BASIS if getattr(metrics, name) is not None}


def period_end(period_start: datetime, wall_clock_seconds: Decimal, taken_at: datetime) -> datetime:
    """Where a record's period ends: when its reading was taken, and never before ``period_start`` plus the run
    time the record claims, so that no record claims more wall-clock time than its period lasts.

    The run time is the scheduler's, the period's bounds ours; the two agree but for rounding (whole seconds) and
    the lag between when a job started and when a poll first saw it, which this absorbs.
    """
    claimed = (wall_clock_seconds * 1_000_000).to_integral_value(rounding=ROUND_CEILING)
    return max(taken_at, period_start + timedelta(microseconds=int(claimed)))


def highest(a: Reading, b: Reading) -> Reading:
    """Field by field the higher of two readings of one running job (the later one's time and allocation).

    A running job's figures never go down, but the sources behind them can for a moment (a step that just ended
    is in neither ``sstat`` nor, for a few seconds, ``sacct``): readings are kept monotone with this.
    """
    values: dict[str, object] = {"taken_at": a.taken_at, "allocated": a.allocated}
    for name in Reading.model_fields:
        if name in values:
            continue
        x, y = getattr(a, name), getattr(b, name)
        values[name] = y if x is None else x if y is None else max(x, y)
    return Reading.model_validate(values)


# ---- reconciliation: a job's records against the scheduler's own accounting ------------------------------------

#: The scheduler's clock ticks in whole seconds: the records' run time may differ from its figure by one tick.
CLOCK_TICK = Decimal(1)
#: Relative tolerance of a measured figure: 1 % of the scheduler's (live samples against final accounting).
MEASURED_TOLERANCE = Decimal("0.01")
#: Absolute floors for measured figures: a second of CPU, a MiB of memory, a joule, a KiB of traffic.
_MEASURED_FLOOR: dict[str, Decimal] = {
    "cpu_time_seconds": Decimal(1),
    "memory_used_gb_seconds": Decimal(2**20) / GB,
    "memory_bytes_max": Decimal(2**20),
    "energy_joules": Decimal(1),
    "network_bytes_in": Decimal(1024),
    "network_bytes_out": Decimal(1024),
    "disk_bytes_read": Decimal(1024),
    "disk_bytes_written": Decimal(1024),
}


class MetricCheck(Model):
    """One metric of a job: what its records add up to, what the scheduler's accounting says, and whether the
    difference is within tolerance (``None`` on either side: not measured there)."""

    metric: str
    records: Decimal | None
    scheduler: Decimal | None
    tolerance: Decimal
    ok: bool

    @property
    def difference(self) -> Decimal | None:
        if self.records is None or self.scheduler is None:
            return None
        return self.records - self.scheduler


def tolerance_of(metric: str, records: UsageMetrics, scheduler: Metered, record_count: int) -> Decimal:
    """How far a job's records may be from the scheduler's figure of ``metric`` (``docs/usage-records.md``).

    The run time: one tick of the scheduler's clock. A priced metric: exactly the scheduler's allocation held for
    the run time the records claim, so only what the run time's difference explains (at most one tick's worth)
    plus one micro-unit of rounding per record. A measured figure: 1 % of the scheduler's, and at least a second
    of CPU, a MiB, a joule, a KiB.
    """
    if metric == "wall_clock_seconds":
        return CLOCK_TICK
    if metric in PRICED:
        drift = min(abs(records.wall_clock_seconds - scheduler.metrics.wall_clock_seconds), CLOCK_TICK)
        explained = held(scheduler.allocation, drift)[metric].quantize(QUANTUM, rounding=ROUND_CEILING)
        return explained + QUANTUM * max(1, record_count)
    theirs = getattr(scheduler.metrics, metric)
    relative = abs(Decimal(theirs or 0)) * MEASURED_TOLERANCE
    return max(_MEASURED_FLOOR.get(metric, Decimal(0)), relative).quantize(QUANTUM, rounding=ROUND_CEILING)


def reconcile(
    records: UsageMetrics,
    scheduler: Metered,
    *,
    record_count: int = 1,
    metrics: tuple[str, ...] = tuple(BASIS),
) -> list[MetricCheck]:
    """Compare what a job's ``record_count`` records add up to with the scheduler's own final accounting, metered
    the same way, metric by metric within ``tolerance_of``. A figure one side has and the other lacks is a
    difference."""
    checks = []
    for name in metrics:
        ours, theirs = getattr(records, name), getattr(scheduler.metrics, name)
        tolerance = tolerance_of(name, records, scheduler, record_count)
        ok = ours is None and theirs is None
        if ours is not None and theirs is not None:
            ok = abs(Decimal(ours) - Decimal(theirs)) <= tolerance
        checks.append(
            MetricCheck(
                metric=name,
                records=None if ours is None else Decimal(ours),
                scheduler=None if theirs is None else Decimal(theirs),
                tolerance=tolerance,
                ok=ok,
            )
        )
    return checks
