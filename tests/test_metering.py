"""The reconciliation rule of ``virtengine_hpc/metering.py``: a job's records against its scheduler's accounting.

What a provider would notice before a dispute: a priced figure that the run time does not explain is a difference,
however small; the run time may be off by one tick of the scheduler's clock, and a priced figure by what that tick
is worth; a measured figure may be off by 1 %.
"""

from __future__ import annotations

from decimal import Decimal

from virtengine_hpc.metering import Allocated, MetricCheck, Reading, meter, reconcile
from virtengine_hpc.models import Resources, UsageMetrics

#: 2 cores, 1 GiB, 10 GB of storage on one node; the scheduler clocked 1000 s and 1500 s of CPU.
ASKED = Resources(tasks_per_node=2, memory_mb_per_node=1024, storage_gb=10)
SCHEDULER = meter(
    Reading(wall_clock_seconds=Decimal(1000), cpu_time_seconds=Decimal(1500), allocated=Allocated(cpus=2)),
    ASKED,
)


def checks(records: UsageMetrics, record_count: int = 1) -> dict[str, MetricCheck]:
    return {c.metric: c for c in reconcile(records, SCHEDULER, record_count=record_count)}


def billed(seconds: Decimal, **update: Decimal) -> UsageMetrics:
    """What records billing ``seconds`` of the scheduler's allocation add up to (with 1500 s of CPU)."""
    return meter(
        Reading(wall_clock_seconds=seconds, cpu_time_seconds=Decimal(1500)), ASKED
    ).metrics.model_copy(update=update)


def differing(result: dict[str, MetricCheck]) -> list[str]:
    return sorted(name for name, check in result.items() if not check.ok)


def test_records_that_add_up_to_the_accounting_agree_on_every_metric() -> None:
    assert differing(checks(billed(Decimal(1000)))) == []


def test_a_priced_metric_that_the_run_time_does_not_explain_differs_however_small() -> None:
    """0.5 % more core-seconds than 2 cores x 1000 s (the old 1 % tolerance let it through)."""
    result = checks(billed(Decimal(1000), cpu_core_seconds=Decimal(2010)))
    assert differing(result) == ["cpu_core_seconds"]
    assert result["cpu_core_seconds"].tolerance == Decimal("0.000001")
    assert differing(checks(billed(Decimal(1000), memory_gb_seconds=Decimal("1074.8")))) == [
        "memory_gb_seconds"
    ]


def test_one_tick_of_the_schedulers_clock_and_what_it_is_worth_agree() -> None:
    result = checks(billed(Decimal(1001)))
    assert differing(result) == []
    assert result["cpu_core_seconds"].difference == 2 and result["cpu_core_seconds"].tolerance == Decimal(
        "2.000001"
    )
    # Two ticks: the run time differs, and so does everything priced on it.
    assert differing(checks(billed(Decimal(1002)))) == [
        "cpu_core_seconds",
        "memory_gb_seconds",
        "node_hours",
        "storage_gb_hours",
        "wall_clock_seconds",
    ]


def test_rounding_is_one_micro_unit_per_record() -> None:
    """Each record's figures are rounded to micro-units: three records may sum 3 micro-units from the total."""
    off = billed(Decimal(1000)).node_hours + Decimal("0.000003")
    assert differing(checks(billed(Decimal(1000), node_hours=off), record_count=3)) == []
    assert differing(checks(billed(Decimal(1000), node_hours=off), record_count=2)) == ["node_hours"]


def test_measured_figures_agree_within_one_percent() -> None:
    assert differing(checks(billed(Decimal(1000), cpu_time_seconds=Decimal(1514)))) == []
    assert differing(checks(billed(Decimal(1000), cpu_time_seconds=Decimal(1520)))) == ["cpu_time_seconds"]
    assert differing(checks(billed(Decimal(1000), cpu_time_seconds=None))) == ["cpu_time_seconds"]
