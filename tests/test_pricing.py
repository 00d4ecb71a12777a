"""Pricing and settlement: quotes and the budget rule, duration and offering bounds, exact escrow arithmetic,
refunds, charges and earnings (ledger and CLI), and usage records batched to the chain."""

from __future__ import annotations

import asyncio
import math
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

import pytest

from activities.chain.client import AccountingReport, StatusReport, UsageSubmitResult
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SubmitRequest
from activities.usage_batcher import UsageBatcher
from tests.conftest import make_config
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.errors import ChainError, ChainUnavailable, ValidationError
from virtengine_hpc.models import Cluster, JobSpec, PricedQueue, Pricing, Resources, UsageMetrics, UsageRecord
from virtengine_hpc.pricing import check_job_against_queue, quote, rate_usage
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import record_id, sign_record

PROVIDER = "virtengine1provider0test"
TENANT = "virtengine1tenant0alice"
PRICING = Pricing(
    node_hour=Decimal("2"),
    core_hour=Decimal("0.1"),
    gpu_hour=Decimal("3"),
    memory_gb_hour=Decimal("0.01"),
    storage_gb_hour=Decimal("0.001"),
    minimum_charge=Decimal("0.5"),
)
QUEUE = PricedQueue(
    offering_id="c1-gpu",
    cluster_id="c1",
    partition="gpu",
    job_class="standard",
    pricing=PRICING,
    min_duration_seconds=300,
    max_duration_seconds=4 * 3600,
)


def spec(**extra: Any) -> JobSpec:
    data: dict[str, Any] = {
        "job_id": "JOB-1",
        "tenant": TENANT,
        "provider": PROVIDER,
        "offering_id": "c1-gpu",
        "script": "true",
        "walltime_seconds": 7200,
        "max_price": "1000",
    }
    data.update(extra)
    return JobSpec.model_validate(data)


# ---- quotes and the budget rule --------------------------------------------------------------------------------


def test_quote_prices_the_whole_allocation_for_the_whole_walltime_exactly() -> None:
    resources = Resources(
        nodes=2, tasks_per_node=4, cpus_per_task=2, memory_mb_per_node=1000, gpus_per_node=1, storage_gb=50
    )
    priced = quote(resources, 7200, QUEUE)
    amounts = {line.item: line.amount for line in priced.lines}
    assert amounts == {
        "node-hours": Decimal(8),  # 2 nodes x 2 h x 2
        "core-hours": Decimal("3.2"),  # 16 cores x 2 h x 0.1
        "GPU-hours": Decimal(12),  # 2 GPUs x 2 h x 3
        "memory": Decimal("0.04194304"),  # 2 x 1000 MiB = 2.097152 GB, x 2 h x 0.01
        "storage": Decimal("0.1"),  # 50 GB x 2 h x 0.001
    }
    assert priced.rated == Decimal("23.34194304")
    assert priced.total == Decimal("23.341944"), "rounded up to the unit: a quote never undercounts"
    tiny = quote(Resources(memory_mb_per_node=1), 300, QUEUE)
    assert tiny.total == Decimal("0.5"), "at least the minimum charge"


def test_a_job_whose_budget_cannot_cover_its_quote_is_refused_with_the_quote() -> None:
    resources = {"nodes": 1, "gpus_per_node": 1, "memory_mb_per_node": 1024}
    enough = spec(resources=resources, max_price="10.2")  # 4 + 0.2 + 6 + 0.02147... = 10.221...
    with pytest.raises(ValidationError) as err:
        check_job_against_queue(enough, QUEUE)
    message = str(err.value)
    assert "budget 10.2 does not cover the most this job can cost at offering c1-gpu: 10.221475" in message
    assert "2 node-h x 2" in message and "2 GPU-h x 3" in message
    assert check_job_against_queue(spec(resources=resources, max_price="10.221475"), QUEUE).total == Decimal(
        "10.221475"
    )


def test_duration_partition_and_job_class_of_the_offering_are_enforced() -> None:
    with pytest.raises(
        ValidationError,
        match=re.escape("walltime 60 s is outside the offering c1-gpu duration bounds 300..14400 s"),
    ):
        check_job_against_queue(spec(walltime_seconds=60), QUEUE)
    with pytest.raises(ValidationError, match="walltime 14460 s is outside"):
        check_job_against_queue(spec(walltime_seconds=14460), QUEUE)
    with pytest.raises(ValidationError) as err:
        check_job_against_queue(spec(partition="debug", job_class="premium"), QUEUE)
    assert "priced for partition gpu, the job asks for debug" in str(err.value)
    assert "priced for job class standard, the job asks for premium" in str(err.value)
    check_job_against_queue(spec(partition="gpu"), QUEUE)  # its own partition is fine


def test_usage_is_rated_exactly_without_float_drift() -> None:
    # 0.1 core-hour three times is exactly 0.3 (a float would give 0.30000000000000004).
    metrics = UsageMetrics(cpu_core_seconds=Decimal(3 * 360))
    assert rate_usage(metrics, Pricing(core_hour=Decimal(1))) == Decimal("0.3")
    thirds = UsageMetrics(cpu_core_seconds=Decimal(1200))
    assert rate_usage(thirds, Pricing(core_hour=Decimal(1))) * 3 == Decimal(1)


# ---- settlement on the ledger ---------------------------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path: Path) -> tuple[LocalLedger, Signer]:
    signer = Signer.generate()
    ledger = LocalLedger(tmp_path / "ledger.db")
    ledger.register_cluster(Cluster(cluster_id="c1", provider=PROVIDER, name="c1"))
    ledger.add_queue(QUEUE)
    ledger.register_provider_key(PROVIDER, public_key_b64(signer.public_key))
    ledger.fund(TENANT, Decimal("100"))
    return ledger, signer


def finish(ledger: LocalLedger, signer: Signer, job_id: str, periods: list[UsageMetrics]) -> None:
    """Run a job on the ledger: running, one signed record per period (the last final), accounting."""
    ledger.apply_status(StatusReport(job_id=job_id, state=JobState.RUNNING))
    start = datetime(2026, 1, 1, tzinfo=UTC)
    records = [
        sign_record(
            UsageRecord(
                record_id=record_id("c1", job_id, n),
                job_id=job_id,
                cluster_id="c1",
                scheduler_job_id="42",
                provider=PROVIDER,
                tenant=TENANT,
                sequence=n,
                period_start=start + timedelta(minutes=n - 1),
                period_end=start + timedelta(minutes=n),
                job_state=JobState.COMPLETED if n == len(periods) else JobState.RUNNING,
                is_final=n == len(periods),
                metrics=metrics,
                created_at=start,
                key_id=signer.key_id,
            ),
            signer,
        )
        for n, metrics in enumerate(periods, start=1)
    ]
    ledger.store_usage(records)
    totals = UsageMetrics(
        **{
            name: sum((getattr(m, name) for m in periods), Decimal(0))
            for name in (
                "wall_clock_seconds",
                "cpu_core_seconds",
                "node_hours",
                "gpu_seconds",
                "memory_gb_seconds",
            )
        }
    )
    ledger.settle(
        AccountingReport(
            job_id=job_id,
            cluster_id="c1",
            totals=totals,
            final_record_id=records[-1].record_id,
            record_count=len(records),
        )
    )
    ledger.apply_status(StatusReport(job_id=job_id, state=JobState.COMPLETED))


def test_escrow_is_split_exactly_into_charge_and_refund(ledger: tuple[LocalLedger, Signer]) -> None:
    chain, signer = ledger
    job_id = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "10"}
    )
    third = UsageMetrics(
        wall_clock_seconds=Decimal(1200),
        node_hours=Decimal(1) / Decimal(3),  # not a finite decimal: rounding happens once, at settlement
        cpu_core_seconds=Decimal("1200.000001"),
        gpu_seconds=Decimal(1200),
    )
    finish(chain, signer, job_id, [third, third, third])
    settlement = chain.settlement(job_id)
    assert settlement is not None
    # node 2 x 1 h + core 0.1 x 3600.000003/3600 + GPU 3 x 1 h = 2 + 0.100000000083... + 3 -> 5.1 (half even)
    assert (settlement.charged, settlement.refunded) == (Decimal("5.1"), Decimal("4.9"))
    assert chain.balance(TENANT) == Decimal("94.9") and chain.balance(PROVIDER) == Decimal("5.1")
    breakdown = chain.charge_breakdown(job_id)
    with localcontext() as ctx:
        ctx.prec = 60
        assert sum(line.amount for line in breakdown.lines) == breakdown.rated
    assert breakdown.rounded == settlement.charged and not breakdown.minimum_applied


def test_minimum_charge_cap_at_escrow_and_refund_of_a_job_that_never_ran(
    ledger: tuple[LocalLedger, Signer],
) -> None:
    chain, signer = ledger
    small = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "3"}
    )
    finish(chain, signer, small, [UsageMetrics(wall_clock_seconds=Decimal(1), cpu_core_seconds=Decimal(1))])
    assert chain.settlement(small).charged == Decimal("0.5")  # type: ignore[union-attr]
    assert chain.charge_breakdown(small).minimum_applied
    over = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "1"}
    )
    finish(chain, signer, over, [UsageMetrics(wall_clock_seconds=Decimal(3600), node_hours=Decimal(1))])
    assert (chain.settlement(over).charged, chain.settlement(over).refunded) == (Decimal(1), Decimal(0))  # type: ignore[union-attr]
    assert chain.charge_breakdown(over).capped_at_escrow
    never = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "7"}
    )
    chain.apply_status(StatusReport(job_id=never, state=JobState.FAILED, message="validation_failed: budget"))
    pending = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "2"}
    )
    charges = {c.job_id: c for c in chain.charges(tenant=TENANT)}
    assert (charges[never].kind, charges[never].refunded) == ("refund", Decimal(7))
    assert not charges[pending].settled and charges[pending].escrow == Decimal(2)
    assert chain.balance(TENANT) == Decimal(100) - Decimal("0.5") - Decimal(1) - Decimal(2)
    earned = chain.charges(provider=PROVIDER)
    assert sum(c.charged for c in earned) == chain.balance(PROVIDER) == Decimal("1.5")
    with pytest.raises(ChainError, match="name a tenant or a provider"):
        chain.charges()


def test_ledger_commands_show_charges_earnings_and_quotes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path, hpc={"cluster_id": "c1"}, provider={"address": PROVIDER})
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json(exclude_defaults=True))
    signer = Signer.generate()
    chain = LocalLedger(config.ledger_path)
    chain.register_cluster(Cluster(cluster_id="c1", provider=PROVIDER, name="c1"))
    chain.add_queue(QUEUE)
    chain.register_provider_key(PROVIDER, public_key_b64(signer.public_key))
    chain.fund(TENANT, Decimal("100"))
    job_id = chain.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "10"}
    )
    finish(chain, signer, job_id, [UsageMetrics(wall_clock_seconds=Decimal(1800), node_hours=Decimal("0.5"))])
    chain.submit_job({"tenant": TENANT, "provider": PROVIDER, "offering_id": "c1-gpu", "max_price": "4"})

    def run(*argv: str) -> str:
        assert cli_main(["--config", str(config_file), "ledger", *argv]) == 0
        return capsys.readouterr().out

    out = run("charges", "--tenant", TENANT)
    assert (
        job_id in out
        and "charged 1.000000, refunded 9.000000 over 1 settled job(s); 4.000000 held in escrow" in out
    )
    out = run("charges", "--tenant", TENANT, "--job", job_id)
    [node_line] = [line.split() for line in out.splitlines() if line.startswith("node-hours")]
    assert node_line == ["node-hours", "0.5", "node-h", "2", "1"]
    assert "charged 1.000000, refunded 9.000000 (accounting)" in out
    out = run("earnings", "--provider", PROVIDER)
    assert "earned 1.000000 from 1 settled job(s); 4.000000 still in escrow" in out
    out = run("quote", "--offering", "c1-gpu", "--nodes", "2", "--gpus", "1", "--walltime", "1h")
    assert out.startswith("10.") and "2 GPU-h x 3" in out
    assert (
        cli_main(["--config", str(config_file), "ledger", "charges", "--tenant", "someone", "--job", job_id])
        == 2
    )


# ---- batched usage submission -----------------------------------------------------------------------------------


class CountingChain:
    """Counts submit_usage calls; refuses records named in ``bad`` (all or nothing, like the ledger)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.bad: set[str] = set()
        self.unavailable = False

    async def submit_usage(self, records: list[UsageRecord]) -> UsageSubmitResult:
        self.calls.append([r.record_id for r in records])
        await asyncio.sleep(0.01)
        if self.unavailable:
            raise ChainUnavailable("ledger busy")
        if any(r.record_id in self.bad for r in records):
            raise ChainError("sequence gap")
        return UsageSubmitResult(accepted=[r.record_id for r in records])


def record(n: int) -> UsageRecord:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return UsageRecord(
        record_id=record_id("c1", f"JOB-{n}", 1),
        job_id=f"JOB-{n}",
        cluster_id="c1",
        scheduler_job_id="1",
        provider=PROVIDER,
        tenant=TENANT,
        sequence=1,
        period_start=at,
        period_end=at,
        job_state=JobState.RUNNING,
        is_final=False,
        metrics=UsageMetrics(),
        created_at=at,
        key_id="k",
    )


@pytest.mark.parametrize(("count", "batch_size"), [(1, 50), (7, 3), (50, 50), (101, 50), (12, 1)])
async def test_concurrent_records_go_in_ceil_n_over_batch_size_calls(count: int, batch_size: int) -> None:
    chain = CountingChain()
    batcher = UsageBatcher(chain, batch_size)  # type: ignore[arg-type]
    results = await asyncio.gather(*(batcher.submit(record(n)) for n in range(count)))
    assert len(chain.calls) == math.ceil(count / batch_size)
    assert all(len(call) <= batch_size for call in chain.calls)
    assert sorted(rid for call in chain.calls for rid in call) == sorted(
        record(n).record_id for n in range(count)
    )
    assert [r.accepted for r in results] == [[record(n).record_id] for n in range(count)]


async def test_one_bad_record_fails_only_its_own_activity() -> None:
    chain = CountingChain()
    chain.bad = {record(2).record_id}
    batcher = UsageBatcher(chain, 10)  # type: ignore[arg-type]
    results = await asyncio.gather(*(batcher.submit(record(n)) for n in range(5)), return_exceptions=True)
    assert isinstance(results[2], ChainError)
    assert all(isinstance(r, UsageSubmitResult) and r.accepted for i, r in enumerate(results) if i != 2)
    assert len(chain.calls) == 1 + 5, "the refused batch, then each record alone"


async def test_a_transient_chain_error_reaches_every_waiter_for_retry() -> None:
    chain = CountingChain()
    chain.unavailable = True
    batcher = UsageBatcher(chain, 10)  # type: ignore[arg-type]
    results = await asyncio.gather(*(batcher.submit(record(n)) for n in range(4)), return_exceptions=True)
    assert all(isinstance(r, ChainUnavailable) for r in results)
    assert len(chain.calls) == 1
    chain.unavailable = False
    assert (await batcher.submit(record(0))).accepted == [record(0).record_id], "the retry goes through"


async def test_report_usage_activities_share_batched_chain_calls(tmp_path: Path, key_path: Path) -> None:
    """Seven jobs report usage at once through the real activity: ceil(7 / 3) = 3 chain calls, every record kept."""
    from temporalio.testing import ActivityEnvironment

    from tests.memory_adapter import MemoryAdapter
    from tests.pipeline_harness import OFFERING, setup_ledger
    from virtengine_hpc.config import Secrets
    from virtengine_hpc.messages import UsageInput
    from workers.wiring import build_worker_deps

    config = make_config(tmp_path, hpc={"usage_reporting": {"batch_size": 3}})
    chain = setup_ledger(config, Signer.from_file(key_path))
    adapter = MemoryAdapter()
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=chain,
        adapters={config.hpc.cluster_id: adapter},
        nodes=False,
    )
    calls: list[int] = []
    submit_usage = chain.submit_usage

    async def counting(records: list[UsageRecord]) -> UsageSubmitResult:
        calls.append(len(records))
        return await submit_usage(records)

    chain.submit_usage = counting  # type: ignore[method-assign]
    inputs = []
    for n in range(7):
        job_id = chain.submit_job(
            {
                "job_id": f"JOB-b{n}",
                "tenant": TENANT,
                "provider": PROVIDER,
                "offering_id": OFFERING,
                "script": "x",
            }
        )
        chain.apply_status(StatusReport(job_id=job_id, state=JobState.RUNNING))
        spec = JobSpec.model_validate(chain.job(job_id).raw_spec)  # type: ignore[union-attr]
        submitted = await adapter.submit(SubmitRequest(workflow_id=job_id, job=spec, body="x"))
        inputs.append(
            UsageInput(
                job_id=spec.job_id,
                tenant=spec.tenant,
                provider=spec.provider,
                cluster_id=config.hpc.cluster_id,
                scheduler_job_id=submitted.scheduler_job_id,
                sequence=1,
                period_start=datetime.now(UTC) - timedelta(seconds=1),
                previous_cumulative=UsageMetrics(),
                job_state=JobState.RUNNING,
            )
        )
    await asyncio.sleep(0.5)  # the in-memory jobs are running and have used something
    outputs = await asyncio.gather(
        *(ActivityEnvironment().run(deps.activities.report_usage, i) for i in inputs)
    )
    assert sorted(calls) == [1, 3, 3]
    assert [o.record_id for o in outputs] == [
        record_id(config.hpc.cluster_id, f"JOB-b{n}", 1) for n in range(7)
    ]
    assert all(chain.usage_records(f"JOB-b{n}") for n in range(7))
    await deps.close()
