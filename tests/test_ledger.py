"""LocalLedger: the embedded chain. Escrow, decisions and heights, the job state machine, usage records,
settlement, refunds, several processes at once, and the ``virtengine-hpc ledger`` commands."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from activities.chain.client import AccountingReport, ChainClient, StatusReport
from activities.chain.local_ledger import LocalLedger, settle_amounts
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.errors import ChainError, ChainUnavailable, IllegalTransition, SecurityError
from virtengine_hpc.models import Cluster, PricedQueue, Pricing, UsageMetrics, UsageRecord
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import record_id, sign_record, sum_metrics

REPO = Path(__file__).resolve().parents[1]
PROVIDER = "virtengine1provider0test"
TENANT = "virtengine1tenant0alice"
OFFERING = "c1-standard"
GENESIS = datetime(2026, 1, 1, tzinfo=UTC)
PRICING = Pricing(
    node_hour=Decimal("2"),
    core_hour=Decimal("0.1"),
    gpu_hour=Decimal("3"),
    memory_gb_hour=Decimal("0.01"),
    storage_gb_hour=Decimal("0.001"),
    minimum_charge=Decimal("0.5"),
)


class Clock:
    """A settable clock: block heights and decision ages follow it."""

    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock(GENESIS + timedelta(seconds=60))


@pytest.fixture
def signer() -> Signer:
    return Signer.generate()


@pytest.fixture
def ledger(tmp_path: Path, clock: Clock, signer: Signer) -> LocalLedger:
    ledger = LocalLedger(tmp_path / "ledger.db", seconds_per_block=6, genesis_time=GENESIS, clock=clock)
    for cluster_id in ("c1", "c2"):
        ledger.register_cluster(
            Cluster(
                cluster_id=cluster_id, provider=PROVIDER, name=cluster_id, total_nodes=4, available_nodes=4
            )
        )
    ledger.add_queue(PricedQueue(offering_id=OFFERING, cluster_id="c1", partition="debug", pricing=PRICING))
    ledger.register_provider_key(PROVIDER, public_key_b64(signer.public_key))
    ledger.fund(TENANT, "1000")
    return ledger


def spec(**extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "tenant": TENANT,
        "provider": PROVIDER,
        "offering_id": OFFERING,
        "script": "#!/bin/bash\necho hi\n",
        "max_price": "10",
    }
    raw.update(extra)
    return raw


def record(
    signer: Signer,
    job_id: str,
    sequence: int,
    *,
    final: bool = False,
    cluster_id: str = "c1",
    provider: str = PROVIDER,
    **metrics: Any,
) -> UsageRecord:
    now = GENESIS + timedelta(minutes=sequence)
    unsigned = UsageRecord(
        record_id=record_id(cluster_id, job_id, sequence),
        job_id=job_id,
        cluster_id=cluster_id,
        scheduler_job_id="42",
        provider=provider,
        tenant=TENANT,
        sequence=sequence,
        period_start=now - timedelta(minutes=1),
        period_end=now,
        job_state=JobState.COMPLETED if final else JobState.RUNNING,
        is_final=final,
        metrics=UsageMetrics(**{k: Decimal(str(v)) for k, v in metrics.items()}),
        created_at=now,
        key_id="",
    )
    return sign_record(unsigned, signer)


async def run_job(ledger: LocalLedger, job_id: str) -> None:
    for state in (JobState.QUEUED, JobState.RUNNING):
        await ledger.report_status(StatusReport(job_id=job_id, state=state, cluster_id="c1"))


def accounting(job_id: str, records: list[UsageRecord]) -> AccountingReport:
    return AccountingReport(
        job_id=job_id,
        cluster_id=records[-1].cluster_id,
        totals=sum_metrics([r.metrics for r in records]),
        final_record_id=records[-1].record_id,
        record_count=len(records),
    )


def total_money(ledger: LocalLedger, accounts: list[str]) -> Decimal:
    """Balances plus escrow still held by unsettled jobs: must equal everything ever funded."""
    held = sum((j.escrow for j in ledger.jobs() if ledger.settlement(j.job_id) is None), Decimal(0))
    return sum((ledger.balance(a) for a in accounts), Decimal(0)) + held


# ---- the interface -----------------------------------------------------------------------------------------


def test_ledger_is_a_chain_client(ledger: LocalLedger) -> None:
    assert isinstance(ledger, ChainClient)


# ---- tenant submission and escrow --------------------------------------------------------------------------


def test_submit_job_escrows_max_price_and_numbers_jobs(ledger: LocalLedger) -> None:
    first = ledger.submit_job(spec(max_price="12.5"))
    second = ledger.submit_job(spec(), escrow=Decimal("0.000001"))
    assert (first, second) == ("JOB-1", "JOB-2")
    assert ledger.balance(TENANT) == Decimal("1000") - Decimal("12.5") - Decimal("0.000001")
    job = ledger.job(first)
    assert job is not None
    assert job.state == JobState.PENDING and job.escrow == Decimal("12.5")
    assert job.target_cluster_id == "c1"  # from the offering
    assert job.raw_spec["job_id"] == "JOB-1"
    kinds = [(t.kind, t.amount) for t in ledger.transfers(job_id=first)]
    assert kinds == [("escrow", Decimal("-12.5"))]


def test_insufficient_funds_stores_nothing(ledger: LocalLedger) -> None:
    with pytest.raises(ChainError, match="insufficient funds"):
        ledger.submit_job(spec(max_price="1000.000001"))
    assert ledger.jobs() == []
    assert ledger.balance(TENANT) == Decimal("1000")


def test_ledger_is_permissive_like_a_chain_but_needs_the_parties(ledger: LocalLedger) -> None:
    # Our JobSpec would reject all of this; the chain stores it and the provider must reject it itself.
    hostile = spec(name="$(rm -rf /)", resources={"nodes": -5}, partition="a;b", job_id="JOB-hostile")
    assert ledger.submit_job(hostile) == "JOB-hostile"
    assert ledger.job("JOB-hostile").raw_spec["name"] == "$(rm -rf /)"  # type: ignore[union-attr]
    with pytest.raises(ChainError, match="tenant"):
        ledger.submit_job({"provider": PROVIDER, "offering_id": OFFERING})
    with pytest.raises(ChainError, match="job_id"):
        ledger.submit_job(spec(job_id="../../etc"))
    with pytest.raises(ChainError, match="already exists"):
        ledger.submit_job(spec(job_id="JOB-hostile"))
    with pytest.raises(ChainError, match="six decimal places"):
        ledger.submit_job(spec(max_price="0.0000001"))
    with pytest.raises(ChainError, match="non-negative"):
        ledger.submit_job(spec(max_price="-1"))
    with pytest.raises(ChainError, match="larger than"):
        ledger.submit_job(spec(script="x" * (3 * 1024 * 1024)))


def test_generated_ids_skip_ids_a_tenant_already_used(ledger: LocalLedger) -> None:
    ledger.submit_job(spec(job_id="JOB-1"))
    assert ledger.submit_job(spec()) == "JOB-2"


# ---- block height and scheduling decisions -----------------------------------------------------------------


async def test_block_height_advances_with_time(ledger: LocalLedger, clock: Clock) -> None:
    clock.now = GENESIS
    assert await ledger.current_height() == 1
    clock.advance(5.999)
    assert await ledger.current_height() == 1
    clock.advance(0.001)
    assert await ledger.current_height() == 2
    clock.advance(600)
    assert await ledger.current_height() == 102


def test_block_time_is_the_files_own(tmp_path: Path, clock: Clock) -> None:
    LocalLedger(tmp_path / "l.db", seconds_per_block=2, genesis_time=GENESIS, clock=clock)
    again = LocalLedger(tmp_path / "l.db", seconds_per_block=6, clock=clock)
    assert again.seconds_per_block == 2 and again.genesis_time == GENESIS
    assert again.height() == 31  # 60 s after genesis at 2 s per block


async def test_decisions_latest_wins_and_old_heights_are_dated_back(
    ledger: LocalLedger, clock: Clock
) -> None:
    job_id = ledger.submit_job(spec())
    assert await ledger.get_decision(job_id) is None
    clock.advance(6000)  # height 1011
    old = ledger.create_decision(job_id, "c2", block_height=5)
    assert old.created_at == GENESIS + timedelta(seconds=24)
    new = ledger.create_decision(job_id, "c1", is_fallback=True, fallback_reason="c2 drained")
    assert new.block_height == await ledger.current_height() == 1011
    latest = await ledger.get_decision(job_id)
    assert latest == new and latest.decision_id != old.decision_id
    with pytest.raises(ChainError, match="unknown job"):
        ledger.create_decision("JOB-404", "c1")


async def test_request_scheduling_prefers_the_requested_cluster_and_records_fallbacks(
    ledger: LocalLedger,
) -> None:
    job_id = ledger.submit_job(spec(cluster_id="c2", resources={"nodes": 2}))
    decision = await ledger.request_scheduling(job_id, "decision missing")
    assert decision.selected_cluster_id == "c2" and not decision.is_fallback
    assert decision.decision_reason == "decision missing"

    ledger.set_cluster_state("c2", "offline")
    fallback = await ledger.request_scheduling(job_id, "cluster offline")
    assert fallback.selected_cluster_id == "c1" and fallback.is_fallback
    assert "c2" in (fallback.fallback_reason or "")

    ledger.set_cluster_state("c1", "active", available_nodes=1)  # too small for 2 nodes
    with pytest.raises(ChainError, match="no active cluster"):
        await ledger.request_scheduling(job_id, "again")


# ---- pending jobs and cancellation -------------------------------------------------------------------------


async def test_pending_jobs_oldest_first_per_provider_and_cluster(ledger: LocalLedger) -> None:
    a = ledger.submit_job(spec())  # offering's cluster c1
    b = ledger.submit_job(spec(cluster_id="c2"))
    c = ledger.submit_job(spec(offering_id="unknown-offering"))  # no cluster: offered to every cluster
    d = ledger.submit_job(spec())
    ledger.submit_job(spec(provider="someone-else"))
    listed = [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 10)]
    assert listed == [a, c, d]
    assert [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 2)] == [a, c]
    assert [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 2, after=c)] == [d]
    assert [j.job_id for j in await ledger.pending_jobs("c2", PROVIDER, 10)] == [b, c]

    # A pending job stays listed until its workflow reports something (or the poller marks it taken).
    await ledger.report_status(StatusReport(job_id=a, state=JobState.PENDING))
    await ledger.mark_taken(d)
    await ledger.mark_taken(d)
    assert [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 10)] == [c]


async def test_a_job_is_listed_for_the_cluster_its_decision_selects(ledger: LocalLedger) -> None:
    """Asked for c1, decided for c2: c2's poller takes it (and forwards its cancel), so that c2's limit counts it.
    A decision for a cluster that is not the provider's, or that is offline, leaves the job with the cluster it
    asked for (whose workflow refuses the decision or falls back), and a report of where it runs wins."""
    moved = ledger.submit_job(spec(cluster_id="c1"))
    elsewhere = ledger.submit_job(spec(cluster_id="c1"))
    ledger.create_decision(moved, "c1")
    ledger.create_decision(moved, "c2")  # the latest decision wins
    ledger.create_decision(elsewhere, "cluster-of-another-provider")
    ledger.request_cancel(moved)

    assert [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 10)] == [elsewhere]
    assert [j.job_id for j in await ledger.pending_jobs("c2", PROVIDER, 10)] == [moved]
    assert (
        await ledger.count_pending_jobs("c1", PROVIDER),
        await ledger.count_pending_jobs("c2", PROVIDER),
    ) == (
        1,
        1,
    )
    assert await ledger.cancel_requested_jobs("c2", PROVIDER, 100) == [moved]
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 100) == []
    assert [j.job_id for j in await ledger.open_jobs("c2", PROVIDER, 10)] == [moved]
    ledger.set_cluster_state("c2", "offline")
    assert [j.job_id for j in await ledger.pending_jobs("c1", PROVIDER, 10)] == [moved, elsewhere]
    ledger.set_cluster_state("c2", "active")

    await ledger.report_status(StatusReport(job_id=moved, state=JobState.QUEUED, cluster_id="c1"))
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 100) == [moved], "it runs on c1 after all"


async def test_open_jobs_are_the_non_final_ones_oldest_first_in_pages(ledger: LocalLedger) -> None:
    a = ledger.submit_job(spec())
    b = ledger.submit_job(spec(cluster_id="c2"))
    c = ledger.submit_job(spec(offering_id="unknown-offering"))  # no cluster: every cluster's
    d = ledger.submit_job(spec())
    e = ledger.submit_job(spec())
    ledger.submit_job(spec(provider="someone-else"))
    for state in (JobState.QUEUED, JobState.RUNNING):  # running on c1, with a scheduler job
        await ledger.report_status(
            StatusReport(job_id=a, state=state, cluster_id="c1", scheduler_job_id="4242")
        )
    await ledger.report_status(StatusReport(job_id=d, state=JobState.COMPLETED, cluster_id="c1"))
    await ledger.mark_taken(e)  # taken but still pending: not final, so still open

    listed = await ledger.open_jobs("c1", PROVIDER, 10)
    assert [j.job_id for j in listed] == [a, c, e]
    assert [(j.state, j.scheduler_job_id) for j in listed[:2]] == [
        (JobState.RUNNING, "4242"),
        (JobState.PENDING, None),
    ]
    assert [j.job_id for j in await ledger.open_jobs("c2", PROVIDER, 10)] == [b, c]
    first = await ledger.open_jobs("c1", PROVIDER, 2)
    assert [j.job_id for j in first] == [a, c]
    assert [j.job_id for j in await ledger.open_jobs("c1", PROVIDER, 2, after=first[-1].job_id)] == [e]
    assert await ledger.open_jobs("c1", PROVIDER, 2, after=e) == []


async def test_tenant_cancel_is_listed_until_the_job_is_final(ledger: LocalLedger) -> None:
    job_id = ledger.submit_job(spec())
    other = ledger.submit_job(spec())
    assert ledger.request_cancel(job_id, tenant=TENANT)
    with pytest.raises(ChainError, match="does not belong"):
        ledger.request_cancel(other, tenant="mallory")
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 100) == [job_id]
    assert await ledger.cancel_requested_jobs("c2", PROVIDER, 100) == []
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.CANCELLED))
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 100) == []
    assert not ledger.request_cancel(job_id)


async def test_cancel_requests_are_listed_in_turns_by_tenant(ledger: LocalLedger) -> None:
    """A tenant that cancels many jobs does not push another tenant's cancel to the end of the list, nor does a
    flood of cancels of pending jobs push back the cancel of a job that runs."""
    ledger.fund("mallory", "100")
    flood = [ledger.submit_job(spec(tenant="mallory", max_price="1")) for _ in range(4)]
    mine = [ledger.submit_job(spec()) for _ in range(2)]
    for job_id in flood + mine:
        ledger.request_cancel(job_id)
    listed = await ledger.cancel_requested_jobs("c1", PROVIDER, 100)
    assert listed == [flood[0], mine[0], flood[1], mine[1], flood[2], flood[3]]
    # A job its workflow has taken (it may run, and be billed) comes before every job still waiting to be taken.
    await ledger.report_status(StatusReport(job_id=flood[3], state=JobState.RUNNING))
    listed = await ledger.cancel_requested_jobs("c1", PROVIDER, 100)
    assert listed == [flood[3], flood[0], mine[0], flood[1], mine[1], flood[2]]


async def test_cancel_requests_are_read_a_page_at_a_time_in_the_same_order(ledger: LocalLedger) -> None:
    """However many requests are on chain, one reading returns at most ``limit``; reading on after the last one
    read gives the rest, in the same order as one reading of the whole list. An ``after`` that is no longer listed
    (its job ended) starts from the first again, so no request is skipped."""
    ledger.fund("mallory", "100")
    flood = [ledger.submit_job(spec(tenant="mallory", max_price="1")) for _ in range(5)]
    mine = [ledger.submit_job(spec()) for _ in range(3)]
    for job_id in flood + mine:
        ledger.request_cancel(job_id)
    whole = await ledger.cancel_requested_jobs("c1", PROVIDER, 100)
    assert len(whole) == 8
    pages: list[list[str]] = []
    after: str | None = None
    while page := await ledger.cancel_requested_jobs("c1", PROVIDER, 3, after=after):
        pages.append(page)
        after = page[-1]
    assert [len(page) for page in pages] == [3, 3, 2]
    assert [job_id for page in pages for job_id in page] == whole
    await ledger.report_status(StatusReport(job_id=whole[2], state=JobState.CANCELLED))
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 2, after=whole[2]) == [whole[0], whole[1]]
    assert await ledger.cancel_requested_jobs("c1", PROVIDER, 0) == []


# ---- the job state machine ---------------------------------------------------------------------------------


async def test_status_reports_follow_the_state_machine(ledger: LocalLedger, clock: Clock) -> None:
    job_id = ledger.submit_job(spec())
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.QUEUED, scheduler_job_id="77"))
    clock.advance(60)
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.RUNNING, cluster_id="c1"))
    # Periodic reports while running repeat the state: a no-op, never rejected (the reference's bug).
    for _ in range(3):
        await ledger.report_status(
            StatusReport(job_id=job_id, state=JobState.RUNNING, message="still running")
        )
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.SUSPENDED))
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.RUNNING))
    await ledger.report_status(
        StatusReport(job_id=job_id, state=JobState.COMPLETED, exit_code=0, message="ok")
    )

    history = ledger.history(job_id)
    assert [(h.from_state, h.to_state) for h in history] == [
        (None, JobState.PENDING),
        (JobState.PENDING, JobState.QUEUED),
        (JobState.QUEUED, JobState.RUNNING),
        (JobState.RUNNING, JobState.SUSPENDED),
        (JobState.SUSPENDED, JobState.RUNNING),
        (JobState.RUNNING, JobState.COMPLETED),
    ]
    assert history[2].at == GENESIS + timedelta(seconds=120) and history[2].block_height == 21
    job = ledger.job(job_id)
    assert job is not None
    assert (job.state, job.exit_code, job.scheduler_job_id, job.cluster_id) == (
        JobState.COMPLETED,
        0,
        "77",
        "c1",
    )

    for illegal in (JobState.RUNNING, JobState.FAILED, JobState.PENDING):
        with pytest.raises(IllegalTransition, match="completed -> "):
            await ledger.report_status(StatusReport(job_id=job_id, state=illegal))
    assert len(ledger.history(job_id)) == len(history)


async def test_backward_moves_are_illegal_but_a_requeue_is_not(ledger: LocalLedger) -> None:
    job_id = ledger.submit_job(spec())
    await run_job(ledger, job_id)
    with pytest.raises(IllegalTransition, match="running -> pending"):
        await ledger.report_status(StatusReport(job_id=job_id, state=JobState.PENDING))
    with pytest.raises(IllegalTransition, match="running -> starting"):
        await ledger.report_status(StatusReport(job_id=job_id, state=JobState.STARTING))
    await ledger.report_status(
        StatusReport(job_id=job_id, state=JobState.QUEUED, message="preempted, requeued")
    )
    assert ledger.job(job_id).state == JobState.QUEUED  # type: ignore[union-attr]
    with pytest.raises(ChainError, match="unknown job"):
        await ledger.report_status(StatusReport(job_id="JOB-404", state=JobState.QUEUED))


async def test_a_skipped_state_is_filled_in(ledger: LocalLedger) -> None:
    job_id = ledger.submit_job(spec())
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.QUEUED))
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.COMPLETED, exit_code=0))
    history = ledger.history(job_id)
    assert [h.to_state for h in history][-2:] == [JobState.RUNNING, JobState.COMPLETED]
    assert "implied" in history[-2].message


# ---- usage records -----------------------------------------------------------------------------------------


async def test_usage_records_are_stored_and_duplicates_ignored(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec())
    await run_job(ledger, job_id)
    r1, r2 = record(signer, job_id, 1, cpu_core_seconds=60), record(signer, job_id, 2, cpu_core_seconds=30)
    result = await ledger.submit_usage([r2, r1])  # order within a batch does not matter
    assert result.accepted == [r2.record_id, r1.record_id] and result.duplicates == []
    # A retried activity re-sends (perhaps re-signed at another time): same id, ignored.
    resigned = sign_record(r2.model_copy(update={"created_at": datetime.now(UTC)}), signer)
    again = await ledger.submit_usage([r1, resigned, record(signer, job_id, 3)])
    assert again.accepted == [record_id("c1", job_id, 3)]
    assert again.duplicates == [r1.record_id, r2.record_id]
    stored = ledger.usage_records(job_id)
    assert [r.sequence for r in stored] == [1, 2, 3]
    assert stored[1] == r2  # the first one received stands
    assert await ledger.get_usage_record(r1.record_id) == r1
    assert await ledger.get_usage_record("c1/JOB-404/1") is None


async def test_forged_record_rejects_the_batch_and_stores_nothing(
    ledger: LocalLedger, signer: Signer
) -> None:
    job_id = ledger.submit_job(spec())
    await run_job(ledger, job_id)
    good = record(signer, job_id, 1, cpu_core_seconds=60)
    inflated = record(signer, job_id, 2, cpu_core_seconds=60)
    inflated = inflated.model_copy(
        update={"metrics": inflated.metrics.model_copy(update={"cpu_core_seconds": Decimal(6000)})}
    )
    with pytest.raises(SecurityError, match=rf"usage record {inflated.record_id}: signature does not verify"):
        await ledger.submit_usage([good, inflated])
    assert ledger.usage_records(job_id) == []

    stranger = Signer.generate()  # a key nobody registered
    with pytest.raises(SecurityError, match="not a registered key"):
        await ledger.submit_usage([record(stranger, job_id, 1)])
    with pytest.raises(SecurityError, match="no registered signing key"):
        await ledger.submit_usage([record(stranger, job_id, 1, provider="virtengine1provider0other")])
    unsigned = good.model_copy(update={"signature": ""})
    with pytest.raises(SecurityError, match="signature does not verify"):
        await ledger.submit_usage([unsigned])
    assert ledger.usage_records(job_id) == []


async def test_a_provider_cannot_report_usage_for_another_providers_job(ledger: LocalLedger) -> None:
    other = Signer.generate()
    ledger.register_provider_key("virtengine1provider0other", public_key_b64(other.public_key))
    job_id = ledger.submit_job(spec())
    with pytest.raises(SecurityError, match="another provider"):
        await ledger.submit_usage([record(other, job_id, 1, provider="virtengine1provider0other")])


async def test_usage_sequences_are_gapless_with_one_final(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec())
    await run_job(ledger, job_id)
    with pytest.raises(ChainError, match="sequence 2 leaves a gap, expected 1"):
        await ledger.submit_usage([record(signer, job_id, 2)])
    await ledger.submit_usage([record(signer, job_id, 1)])
    with pytest.raises(ChainError, match="sequence 3 leaves a gap, expected 2"):
        await ledger.submit_usage([record(signer, job_id, 3)])
    # Nothing of a batch is stored when one of its records is refused.
    with pytest.raises(ChainError, match="gap"):
        await ledger.submit_usage([record(signer, job_id, 2), record(signer, job_id, 4)])
    assert len(ledger.usage_records(job_id)) == 1
    await ledger.submit_usage([record(signer, job_id, 2, final=True)])
    with pytest.raises(ChainError, match="already has its final record"):
        await ledger.submit_usage([record(signer, job_id, 3, final=True)])
    with pytest.raises(ChainError, match="already has its final record"):
        await ledger.submit_usage([record(signer, job_id, 3)])
    assert [r.is_final for r in ledger.usage_records(job_id)] == [False, True]
    with pytest.raises(ChainError, match="unknown job"):
        await ledger.submit_usage([record(signer, "JOB-404", 1)])
    with pytest.raises(ChainError, match="earlier records came from cluster c1"):
        other = ledger.submit_job(spec())
        await ledger.submit_usage([record(signer, other, 1)])
        await ledger.submit_usage([record(signer, other, 2, cluster_id="c2")])


# ---- settlement --------------------------------------------------------------------------------------------


def test_charge_arithmetic_is_exact() -> None:
    queue = PricedQueue(offering_id="o", cluster_id="c", partition="p", pricing=PRICING)
    metrics = UsageMetrics(
        wall_clock_seconds=Decimal(5400),
        node_hours=Decimal("1.5"),  # 2 * 1.5 = 3
        cpu_core_seconds=Decimal(10800),  # 0.1 * 3 h = 0.3
        gpu_seconds=Decimal(1800),  # 3 * 0.5 h = 1.5
        memory_gb_seconds=Decimal(36000),  # 0.01 * 10 = 0.1
        storage_gb_hours=Decimal(7),  # 0.001 * 7 = 0.007
    )
    assert settle_amounts(metrics, queue, Decimal(10)) == (Decimal("4.907"), Decimal("5.093"))
    # Capped at the escrow: the tenant never pays more than it escrowed.
    assert settle_amounts(metrics, queue, Decimal(4)) == (Decimal(4), Decimal(0))
    # The minimum charge applies to a job that used anything ...
    tiny = UsageMetrics(wall_clock_seconds=Decimal(1), cpu_core_seconds=Decimal(1))
    assert settle_amounts(tiny, queue, Decimal(10)) == (Decimal("0.5"), Decimal("9.5"))
    # ... not to one that used nothing.
    assert settle_amounts(UsageMetrics(), queue, Decimal(10)) == (Decimal(0), Decimal(10))
    # Rounded to six places, half to even: 1 core-second at 0.1/h = 0.0000277...
    cheap = queue.model_copy(update={"pricing": Pricing(core_hour=Decimal("0.1"))})
    assert settle_amounts(tiny, cheap, Decimal(1))[0] == Decimal("0.000028")
    half = queue.model_copy(
        update={"pricing": Pricing(core_hour=Decimal("0.0018"))}
    )  # 0.0000005 per core-second
    assert settle_amounts(tiny, half, Decimal(1))[0] == Decimal("0")  # half to even: 0.0000005 -> 0.000000
    three = UsageMetrics(cpu_core_seconds=Decimal(3))  # 0.0000015 -> 0.000002
    assert settle_amounts(three, half, Decimal(1))[0] == Decimal("0.000002")


async def test_settlement_pays_the_provider_and_refunds_the_rest(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec(max_price="10"))
    await run_job(ledger, job_id)
    records = [
        record(signer, job_id, 1, wall_clock_seconds=1800, node_hours="0.5", cpu_core_seconds="3600.5"),
        record(
            signer, job_id, 2, final=True, wall_clock_seconds=900, node_hours="0.25", cpu_core_seconds=1799.5
        ),
    ]
    await ledger.submit_usage(records)
    report = accounting(job_id, records)
    settlement = await ledger.report_accounting(report)
    # node 2 * 0.75 = 1.5; cores 0.1 * 5400/3600 = 0.15
    assert (settlement.charged, settlement.refunded, settlement.escrow) == (
        Decimal("1.65"),
        Decimal("8.35"),
        Decimal("10"),
    )
    assert ledger.balance(PROVIDER) == Decimal("1.65")
    assert ledger.balance(TENANT) == Decimal("998.35")
    assert await ledger.report_accounting(report) == settlement  # once per job
    assert ledger.settlement(job_id) == settlement
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.COMPLETED))
    assert ledger.balance(PROVIDER) == Decimal("1.65")  # the final status moves no money
    assert total_money(ledger, [TENANT, PROVIDER]) == Decimal("1000")


async def test_accounting_must_match_the_stored_records(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec())
    await run_job(ledger, job_id)
    first = record(signer, job_id, 1, cpu_core_seconds=60)
    await ledger.submit_usage([first])
    with pytest.raises(ChainError, match="before its final usage record"):
        await ledger.report_accounting(accounting(job_id, [first]))
    final = record(signer, job_id, 2, final=True, cpu_core_seconds=30)
    await ledger.submit_usage([final])
    good = accounting(job_id, [first, final])
    inflated = good.model_copy(
        update={"totals": good.totals.model_copy(update={"cpu_core_seconds": Decimal(91)})}
    )
    with pytest.raises(ChainError, match="differ from the sum of its usage records in cpu_core_seconds"):
        await ledger.report_accounting(inflated)
    with pytest.raises(ChainError, match="counts 1 records, the ledger holds 2"):
        await ledger.report_accounting(good.model_copy(update={"record_count": 1}))
    with pytest.raises(ChainError, match="names final record"):
        await ledger.report_accounting(good.model_copy(update={"final_record_id": first.record_id}))
    assert ledger.settlement(job_id) is None
    assert ledger.balance(TENANT) == Decimal("990")


async def test_min_charge_and_escrow_cap_through_the_ledger(ledger: LocalLedger, signer: Signer) -> None:
    small = ledger.submit_job(spec(max_price="3"))
    big = ledger.submit_job(spec(max_price="3"))
    for job_id, hours in ((small, "0.001"), (big, "10")):
        await run_job(ledger, job_id)
        final = record(signer, job_id, 1, final=True, wall_clock_seconds=10, node_hours=hours)
        await ledger.submit_usage([final])
        await ledger.report_accounting(accounting(job_id, [final]))
    assert ledger.settlement(small).charged == Decimal("0.5")  # type: ignore[union-attr]  # 0.002 < minimum
    assert ledger.settlement(big).charged == Decimal("3")  # type: ignore[union-attr]  # 20 capped at escrow
    assert ledger.settlement(big).refunded == Decimal("0")  # type: ignore[union-attr]
    assert ledger.balance(PROVIDER) == Decimal("3.5")
    assert total_money(ledger, [TENANT, PROVIDER]) == Decimal("1000")


async def test_accounting_without_a_priced_queue_is_refused(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec(offering_id="gone"))
    final = record(signer, job_id, 1, final=True, wall_clock_seconds=1)
    await ledger.submit_usage([final])
    with pytest.raises(ChainError, match="no priced queue"):
        await ledger.report_accounting(accounting(job_id, [final]))


async def test_the_price_is_fixed_at_submission_or_when_the_provider_takes_the_job(
    ledger: LocalLedger, signer: Signer, clock: Clock
) -> None:
    agreed = ledger.submit_job(spec(max_price="100"))
    early = ledger.submit_job(spec(max_price="100", offering_id="later"))  # its offering is not there yet
    ledger.add_queue(PricedQueue(offering_id="later", cluster_id="c1", partition="debug", pricing=PRICING))
    clock.advance(60)
    await ledger.mark_taken(early)
    dearer = PRICING.model_copy(update={"node_hour": PRICING.node_hour * 10})
    for offering in (OFFERING, "later"):
        ledger.add_queue(
            PricedQueue(offering_id=offering, cluster_id="c1", partition="debug", pricing=dearer)
        )
    for job_id in (agreed, early):
        await run_job(ledger, job_id)
        final = record(signer, job_id, 1, final=True, wall_clock_seconds=3600, node_hours=1)
        await ledger.submit_usage([final])
        settlement = await ledger.report_accounting(accounting(job_id, [final]))
        assert settlement.charged == PRICING.node_hour, "the price of the day it was accepted, not today's"
    fixed_agreed, fixed_early = ledger.job_price(agreed), ledger.job_price(early)
    assert fixed_agreed is not None and fixed_early is not None
    assert (fixed_agreed[2], fixed_early[2]) == ("submitted", "taken")
    assert fixed_early[1] - fixed_agreed[1] == timedelta(seconds=60)


async def test_accounting_from_a_cluster_the_offering_does_not_price_is_refused(
    ledger: LocalLedger, signer: Signer
) -> None:
    job_id = ledger.submit_job(spec())  # the offering prices c1
    await run_job(ledger, job_id)
    final = record(signer, job_id, 1, final=True, cluster_id="c2", wall_clock_seconds=60, node_hours="0.1")
    await ledger.submit_usage([final])
    with pytest.raises(ChainError, match="prices cluster c1, the accounting comes from c2"):
        await ledger.report_accounting(accounting(job_id, [final]))
    assert ledger.settlement(job_id) is None


# ---- refunds of jobs that never ran ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        [JobState.FAILED],  # failed validation before submission
        [JobState.CANCELLED],  # cancelled while pending
        [JobState.QUEUED, JobState.CANCELLED],  # cancelled while queued
        [JobState.QUEUED, JobState.FAILED],  # rejected by the scheduler
    ],
)
async def test_a_job_that_never_ran_is_refunded_when_it_ends(
    ledger: LocalLedger, path: list[JobState]
) -> None:
    job_id = ledger.submit_job(spec(max_price="7.25"))
    assert ledger.balance(TENANT) == Decimal("992.75")
    for state in path:
        await ledger.report_status(StatusReport(job_id=job_id, state=state))
    settlement = ledger.settlement(job_id)
    assert settlement is not None
    assert (settlement.charged, settlement.refunded) == (Decimal(0), Decimal("7.25"))
    assert ledger.balance(TENANT) == Decimal("1000")
    assert ledger.balance(PROVIDER) == Decimal(0)


async def test_a_job_that_ran_waits_for_its_accounting(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec(max_price="5"))
    await run_job(ledger, job_id)
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.FAILED, exit_code=3))
    assert ledger.settlement(job_id) is None  # usage may still arrive; no automatic refund
    final = record(signer, job_id, 1, final=True, wall_clock_seconds=60, node_hours="0.5")
    await ledger.submit_usage([final])
    settlement = await ledger.report_accounting(accounting(job_id, [final]))
    assert settlement.charged == Decimal(1)
    with pytest.raises(ChainError, match="usage records"):
        other = ledger.submit_job(spec())
        await run_job(ledger, other)
        await ledger.submit_usage([record(signer, other, 1, wall_clock_seconds=5)])
        await ledger.report_status(StatusReport(job_id=other, state=JobState.FAILED))
        ledger.refund_unstarted(other)


async def test_refund_unstarted_is_the_operators_way_out(ledger: LocalLedger, signer: Signer) -> None:
    job_id = ledger.submit_job(spec(max_price="5"))
    with pytest.raises(ChainError, match="only a finished job"):
        ledger.refund_unstarted(job_id)
    await run_job(ledger, job_id)
    await ledger.report_status(
        StatusReport(job_id=job_id, state=JobState.FAILED)
    )  # ran, but no usage reported
    refund = ledger.refund_unstarted(job_id)
    assert refund.refunded == Decimal(5) and ledger.refund_unstarted(job_id) == refund
    assert ledger.balance(TENANT) == Decimal(1000)
    # Usage arriving after a refund can only settle at zero.
    final = record(signer, job_id, 1, final=True, wall_clock_seconds=60, node_hours=1)
    await ledger.submit_usage([final])
    with pytest.raises(ChainError, match="already refunded"):
        await ledger.report_accounting(accounting(job_id, [final]))


async def test_a_zero_usage_final_record_after_a_refund_keeps_the_refund(
    ledger: LocalLedger, signer: Signer
) -> None:
    job_id = ledger.submit_job(spec(max_price="5"))
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.CANCELLED))
    final = record(signer, job_id, 1, final=True)
    await ledger.submit_usage([final])
    settlement = await ledger.report_accounting(accounting(job_id, [final]))
    assert (settlement.charged, settlement.refunded) == (Decimal(0), Decimal(5))
    assert ledger.balance(TENANT) == Decimal(1000)


# ---- several processes at once -----------------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from decimal import Decimal
    from activities.chain.client import StatusReport
    from activities.chain.local_ledger import LocalLedger
    from virtengine_hpc.states import JobState

    path, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ledger = LocalLedger(path, busy_timeout=60)
    print("ready", flush=True)
    sys.stdin.readline()  # start together with the other writer

    async def main():
        for i in range(rounds):
            ledger.fund("shared", "0.000001")
            ledger.fund(name, "1")
            job_id = ledger.submit_job(
                {"tenant": name, "provider": "p", "offering_id": "o", "max_price": "0.5"}
            )
            await ledger.report_status(StatusReport(job_id=job_id, state=JobState.QUEUED))
            await ledger.report_status(StatusReport(job_id=job_id, state=JobState.FAILED))

    asyncio.run(main())
    print("done")
    """
)


def test_two_processes_writing_at_once_do_not_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    LocalLedger(path)
    rounds = 100
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), name, str(rounds)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("alice", "bob")
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip() == "done"
    ledger = LocalLedger(path)
    assert ledger.balance("shared") == Decimal("0.000200")
    # Each job escrowed 0.5 and was refunded when it failed unstarted: every tenant keeps what it was given.
    assert ledger.balance("alice") == ledger.balance("bob") == Decimal(rounds)
    jobs = ledger.jobs()
    assert len(jobs) == 2 * rounds == len({j.job_id for j in jobs})
    assert {j.state for j in jobs} == {JobState.FAILED}
    assert all(len(ledger.history(j.job_id)) == 3 for j in jobs)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_ledger_held_too_long_by_another_writer_is_a_transient_error(tmp_path: Path) -> None:
    path = tmp_path / "busy.db"
    ledger = LocalLedger(path, busy_timeout=0.2)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        assert ledger.balance("alice") == 0  # readers never wait in WAL mode
        with pytest.raises(ChainUnavailable, match="busy") as caught:
            ledger.fund("alice", 1)
        assert caught.value.transient
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert ledger.fund("alice", 1) == 1


def test_a_thread_that_ended_leaves_no_connection_open(tmp_path: Path) -> None:
    """Each thread has its own connection; it goes with its thread, so a worker's short-lived threads do not pile
    up open files. Here every connection is a thread's: once they ended, none holds the file (the last one to
    close removed the WAL file), while the ledger itself lives on."""
    path = tmp_path / "threads.db"
    opened: list[LocalLedger] = []

    def open_and_use() -> None:
        ledger = LocalLedger(path)
        ledger.fund("alice", 1)
        opened.append(ledger)

    def use() -> None:
        opened[0].fund("alice", 1)

    for target in (open_and_use, use, use):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert not Path(f"{path}-wal").exists()
    assert opened[0].balance("alice") == 3


def test_a_file_that_is_not_a_ledger_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.db"
    bogus.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ChainError, match="not a usable SQLite database"):
        LocalLedger(bogus)


# ---- the ledger CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "hpc": {
                    "cluster_id": "local-cluster",
                    "job_service": {"state_store_path": str(tmp_path / "state")},
                    "audit": {"log_path": str(tmp_path / "audit.log")},
                },
                "provider": {"address": PROVIDER},
            }
        )
    )

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli_main(["--config", str(config), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_ledger_end_to_end(cli: Callable[..., tuple[int, str, str]], tmp_path: Path) -> None:
    code, out, err = cli("ledger", "show", "JOB-1")
    assert code == 2 and "ledger init" in err

    key = tmp_path / "keys" / "provider.key"
    code, out, _ = cli("ledger", "init", "--generate-key", str(key))
    assert code == 0 and "local-cluster" in out and "key" in out
    assert key.stat().st_mode & 0o777 == 0o600
    assert cli("ledger", "init")[0] == 0  # idempotent

    code, out, _ = cli("ledger", "clusters")
    assert code == 0 and "local-cluster" in out and "active" in out
    code, out, _ = cli("ledger", "queues", "--json")
    queues = json.loads(out)
    assert queues[0]["offering_id"] == "local-cluster-standard"

    assert cli("ledger", "fund", TENANT, "50")[1].strip() == f"{TENANT}: 50.000000"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\necho hello\n")
    code, out, _ = cli(
        "ledger", "submit-job", "--tenant", TENANT, "--script-file", str(script), "--nodes", "1",
        "--cpus", "2", "--memory-mb", "512", "--walltime", "1h30m", "--max-price", "12.5",
        "--env", "GREETING=hi there", "--partition", "local",
    )  # fmt: skip
    assert code == 0
    job_id = out.strip()
    assert job_id == "JOB-1"
    code, out, _ = cli(
        "ledger", "submit-job", "--tenant", TENANT, "--template", "mpi-standard", "--param", "ranks=4",
        "--param", "verbose=true", "--max-price", "1", "--job-id", "JOB-tmpl",
    )  # fmt: skip
    assert code == 0 and out.strip() == "JOB-tmpl"
    assert cli("ledger", "balance", TENANT)[1].strip() == f"{TENANT}: 36.500000"

    code, out, _ = cli("ledger", "show", job_id)
    shown = json.loads(out)
    raw = shown["job"]["raw_spec"]
    assert raw["script"] == "#!/bin/bash\necho hello\n" and raw["walltime_seconds"] == 5400
    assert raw["resources"] == {"nodes": 1, "cpus_per_task": 2, "memory_mb_per_node": 512}
    assert raw["environment"] == {"GREETING": "hi there"} and raw["max_price"] == "12.5"
    assert raw["offering_id"] == "local-cluster-standard" and raw["provider"] == PROVIDER
    tmpl = json.loads(cli("ledger", "show", "JOB-tmpl")[1])["job"]["raw_spec"]
    assert tmpl["template_id"] == "mpi-standard" and tmpl["template_parameters"] == {
        "ranks": 4,
        "verbose": True,
    }

    code, out, _ = cli("ledger", "decide", job_id, "--cluster", "local-cluster", "--height", "3")
    assert code == 0 and json.loads(out)["block_height"] == 3
    shown = json.loads(cli("ledger", "show", job_id)[1])
    assert [d["block_height"] for d in shown["decisions"]] == [3]

    code, out, _ = cli("ledger", "jobs", "--state", "pending")
    assert code == 0 and job_id in out and "JOB-tmpl" in out
    assert cli("ledger", "cancel", job_id)[0] == 0
    assert json.loads(cli("ledger", "show", job_id)[1])["job"]["cancel_requested"] is True
    code, out, _ = cli("ledger", "jobs", "--state", "completed")
    assert code == 0 and job_id not in out

    code, out, err = cli("ledger", "settlement", job_id)
    assert code == 1 and "no settlement" in err
    code, _, err = cli("ledger", "fund", TENANT, "1.0000001")
    assert code == 2 and "six decimal places" in err
    code, _, err = cli("ledger", "submit-job", "--tenant", TENANT, "--walltime", "soon", "--template", "x")
    assert code == 2 and "walltime" in err


async def test_cli_settlement_and_refund(cli: Callable[..., tuple[int, str, str]], tmp_path: Path) -> None:
    assert cli("ledger", "init", "--no-defaults")[0] == 0
    ledger = LocalLedger(tmp_path / "state" / "ledger.db")
    assert ledger.clusters() == []
    ledger.register_cluster(Cluster(cluster_id="c1", provider=PROVIDER, name="c1"))
    ledger.add_queue(PricedQueue(offering_id=OFFERING, cluster_id="c1", partition="debug", pricing=PRICING))
    ledger.fund(TENANT, "10")
    job_id = ledger.submit_job(spec(max_price="4"))
    await run_job(ledger, job_id)
    await ledger.report_status(StatusReport(job_id=job_id, state=JobState.FAILED))
    code, out, _ = cli("ledger", "refund", job_id)
    assert code == 0 and json.loads(out)["refunded"] == "4"
    code, out, _ = cli("ledger", "settlement", job_id)
    assert code == 0 and json.loads(out)["charged"] == "0"
    assert cli("ledger", "balance", TENANT)[1].strip() == f"{TENANT}: 10.000000"
