"""The ``ChainClient`` contract: what the provider side relies on from a chain client, whichever chain it talks to.

Every case speaks to the client under test only through the 16 methods of ``ChainClient``
(``activities/chain/client.py``). What the chain's other parties do (a tenant submits or cancels a job, the
chain's scheduler decides, governance approves a template, the provider registers its keys and offerings) goes
through a ``ChainWorld``: one per client. Today the suite runs against the ``LocalLedger``; a client for a real
chain passes when a ``ChainWorld`` for it (its test network and transactions) makes these cases pass unchanged:
add it to ``WORLDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import pytest

from activities.chain.client import AccountingReport, ChainClient, StatusReport
from activities.chain.local_ledger import LocalLedger
from virtengine_hpc.errors import ChainError, IllegalTransition, SecurityError
from virtengine_hpc.models import Cluster, PricedQueue, Pricing, UsageMetrics, UsageRecord
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from virtengine_hpc.templates import WorkloadTemplate, sign_template
from virtengine_hpc.usage import record_id, sign_record, sum_metrics

PROVIDER = "virtengine1provider0contract"
OTHER_PROVIDER = "virtengine1provider0other"
ALICE = "virtengine1tenant0alice"
BOB = "virtengine1tenant0bob"
PUBLISHER = "virtengine1publisher0carol"
PRICING = Pricing(node_hour=Decimal("2"), core_hour=Decimal("0.1"), minimum_charge=Decimal("0.5"))


class ChainWorld(Protocol):
    """The chain's other parties, for one client under test."""

    client: ChainClient
    signer: Signer
    """The provider's usage-signing key, registered on the chain."""

    def add_cluster(self, cluster_id: str, *, provider: str = PROVIDER, state: str = "active") -> None:
        """The provider registers a cluster (4 nodes free) and an offering ``<cluster_id>-std`` on it."""
        ...

    def submit(self, tenant: str = ALICE, *, offering: str = "c1-std", **spec: Any) -> str:
        """A tenant submits a job with escrow 10 (fields of ``spec`` added to it); returns the job id."""
        ...

    def cancel(self, job_id: str, tenant: str = ALICE) -> None: ...

    def decide(self, job_id: str, cluster_id: str) -> None:
        """The chain's scheduler records a decision for ``job_id``, selecting ``cluster_id``."""
        ...

    def publish_template(self, template_id: str, *, approve: bool) -> None: ...


class LedgerWorld:
    """The ``LocalLedger``: the other parties call its admin and tenant methods."""

    def __init__(self, path: Path) -> None:
        self.ledger = LocalLedger(path)
        self.client: ChainClient = self.ledger
        self.signer = Signer.generate()
        self.ledger.register_provider_key(PROVIDER, public_key_b64(self.signer.public_key))
        for tenant in (ALICE, BOB):
            self.ledger.fund(tenant, "1000")

    def add_cluster(self, cluster_id: str, *, provider: str = PROVIDER, state: str = "active") -> None:
        cluster = Cluster(
            cluster_id=cluster_id,
            provider=provider,
            name=cluster_id,
            state=state,
            total_nodes=4,
            available_nodes=4,
        )
        self.ledger.register_cluster(cluster)
        queue = PricedQueue(
            offering_id=f"{cluster_id}-std", cluster_id=cluster_id, partition="p", pricing=PRICING
        )
        self.ledger.add_queue(queue)

    def submit(self, tenant: str = ALICE, *, offering: str = "c1-std", **spec: Any) -> str:
        raw = {
            "tenant": tenant,
            "provider": PROVIDER,
            "offering_id": offering,
            "script": "true\n",
            "max_price": "10",
        }
        return self.ledger.submit_job({**raw, **spec})

    def cancel(self, job_id: str, tenant: str = ALICE) -> None:
        self.ledger.request_cancel(job_id, tenant=tenant)

    def decide(self, job_id: str, cluster_id: str) -> None:
        self.ledger.create_decision(job_id, cluster_id)

    def publish_template(self, template_id: str, *, approve: bool) -> None:
        publisher = Signer.generate()
        self.ledger.register_publisher_key(PUBLISHER, public_key_b64(publisher.public_key))
        self.ledger.publish_template(
            sign_template(WorkloadTemplate.model_validate(template(template_id)), publisher)
        )
        if approve:
            self.ledger.approve_template(template_id)


WORLDS: dict[str, Callable[[Path], ChainWorld]] = {"local_ledger": LedgerWorld}


@pytest.fixture(params=sorted(WORLDS))
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChainWorld]:
    made = WORLDS[request.param](tmp_path / "chain")
    made.add_cluster("c1")
    made.add_cluster("c2")
    yield made


def template(template_id: str) -> dict[str, Any]:
    return {
        "template_id": template_id,
        "name": "Echo",
        "version": "1.0.0",
        "description": "prints its words",
        "type": "custom",
        "publisher": PUBLISHER,
        "resources": {
            "nodes": {"min": 1, "max": 2, "default": 1},
            "cpus_per_node": {"min": 1, "max": 4, "default": 1},
            "memory_mb_per_node": {"min": 64, "max": 4096, "default": 512},
            "runtime_minutes": {"min": 1, "max": 60, "default": 10},
        },
        "entrypoint": {"launcher": "direct", "command": ["printf", "%s\\n", "{words}"]},
        "parameters": {"words": {"type": "argv", "required": True}},
    }


def usage(
    world: ChainWorld, job_id: str, sequence: int, *, final: bool = False, signer: Signer | None = None
) -> UsageRecord:
    start = datetime(2026, 12, 1, tzinfo=UTC) + timedelta(minutes=sequence)
    unsigned = UsageRecord(
        record_id=record_id("c1", job_id, sequence),
        job_id=job_id,
        cluster_id="c1",
        scheduler_job_id="42",
        provider=PROVIDER,
        tenant=ALICE,
        sequence=sequence,
        period_start=start,
        period_end=start + timedelta(minutes=1),
        job_state=JobState.COMPLETED if final else JobState.RUNNING,
        is_final=final,
        metrics=UsageMetrics(
            wall_clock_seconds=Decimal(60), cpu_core_seconds=Decimal(60), node_hours=Decimal("0.5")
        ),
        created_at=start + timedelta(minutes=1),
        key_id="",
    )
    return sign_record(unsigned, signer or world.signer)


async def report(world: ChainWorld, job_id: str, state: JobState, **fields: Any) -> None:
    await world.client.report_status(StatusReport(job_id=job_id, state=state, **fields))


async def pending(world: ChainWorld, cluster_id: str = "c1", **kwargs: Any) -> list[str]:
    return [job.job_id for job in await world.client.pending_jobs(cluster_id, PROVIDER, 100, **kwargs)]


# ---- reads ----------------------------------------------------------------------------------------------------


async def test_the_client_is_a_chain_client_with_a_block_height(world: ChainWorld) -> None:
    assert isinstance(world.client, ChainClient)
    first = await world.client.current_height()
    assert first >= 1 and await world.client.current_height() >= first


async def test_what_the_chain_does_not_hold_is_none(world: ChainWorld) -> None:
    assert await world.client.get_job("JOB-none") is None
    assert await world.client.get_cluster("c-none") is None
    assert await world.client.get_queue("q-none") is None
    assert await world.client.get_decision("JOB-none") is None
    assert await world.client.get_usage_record("c1/JOB-none/1") is None
    assert await world.client.job_usage_records("JOB-none") == []
    assert await world.client.get_template("nobody-echo") is None


async def test_clusters_queues_and_jobs_read_back_as_registered_and_submitted(world: ChainWorld) -> None:
    cluster = await world.client.get_cluster("c1")
    queue = await world.client.get_queue("c1-std")
    assert cluster is not None and (cluster.provider, cluster.state, cluster.available_nodes) == (
        PROVIDER,
        "active",
        4,
    )
    assert queue is not None and (queue.cluster_id, queue.pricing) == ("c1", PRICING)
    job_id = world.submit(words="hi")
    job = await world.client.get_job(job_id)
    assert job is not None
    assert (job.state, job.escrow, job.cancel_requested, job.scheduler_job_id) == (
        JobState.PENDING,
        Decimal(10),
        False,
        None,
    )
    assert job.raw_spec["words"] == "hi" and job.raw_spec["tenant"] == ALICE


# ---- the poller's lists ---------------------------------------------------------------------------------------


async def test_pending_jobs_oldest_first_by_page_and_counted(world: ChainWorld) -> None:
    jobs = [world.submit() for _ in range(5)]
    assert await pending(world) == jobs
    first_page = await world.client.pending_jobs("c1", PROVIDER, 2)
    assert [j.job_id for j in first_page] == jobs[:2]
    assert await pending(world, after=jobs[1]) == jobs[2:]
    assert await world.client.count_pending_jobs("c1", PROVIDER) == 5
    assert await world.client.count_pending_jobs("c1", PROVIDER, after=jobs[3]) == 1
    assert await world.client.pending_jobs("c1", OTHER_PROVIDER, 100) == []


async def test_a_pending_job_is_listed_for_the_cluster_it_is_to_run_on(world: ChainWorld) -> None:
    # A job whose offering the provider never listed names no cluster: every cluster of its provider may take it.
    on_c1, on_c2, anywhere = (
        world.submit(),
        world.submit(offering="c2-std"),
        world.submit(offering="unlisted"),
    )
    assert await pending(world, "c1") == [on_c1, anywhere]
    assert await pending(world, "c2") == [on_c2, anywhere]
    world.decide(on_c1, "c2")  # the chain's scheduler moved it
    assert await pending(world, "c1") == [anywhere]
    assert await pending(world, "c2") == [on_c1, on_c2, anywhere]


async def test_a_status_report_takes_a_job_off_the_pending_list(world: ChainWorld) -> None:
    taken, waiting = world.submit(), world.submit()
    await report(world, taken, JobState.QUEUED, scheduler_job_id="17", cluster_id="c1")
    assert await pending(world) == [waiting]
    job = await world.client.get_job(taken)
    assert job is not None and (job.state, job.scheduler_job_id) == (JobState.QUEUED, "17")


async def test_open_jobs_are_the_non_final_ones_oldest_first_by_page(world: ChainWorld) -> None:
    jobs = [world.submit() for _ in range(4)]
    await report(world, jobs[0], JobState.RUNNING)
    await report(world, jobs[1], JobState.COMPLETED)
    listed = [j.job_id for j in await world.client.open_jobs("c1", PROVIDER, 100)]
    assert listed == [jobs[0], jobs[2], jobs[3]]
    assert [j.job_id for j in await world.client.open_jobs("c1", PROVIDER, 1, after=jobs[0])] == [jobs[2]]


async def test_cancel_requests_taken_jobs_first_then_in_turns_by_tenant(world: ChainWorld) -> None:
    a1, a2, a3 = world.submit(ALICE), world.submit(ALICE), world.submit(ALICE)
    b1 = world.submit(BOB)
    running = world.submit(BOB)
    await report(world, running, JobState.RUNNING)
    for job_id, tenant in ((a1, ALICE), (a2, ALICE), (a3, ALICE), (b1, BOB), (running, BOB)):
        world.cancel(job_id, tenant)
    expected = [running, a1, b1, a2, a3]
    assert await world.client.cancel_requested_jobs("c1", PROVIDER, 100) == expected
    assert await world.client.cancel_requested_jobs("c1", PROVIDER, 2, after=a1) == [b1, a2]
    assert await world.client.cancel_requested_jobs("c1", PROVIDER, 2, after="JOB-none") == expected[:2]
    job = await world.client.get_job(a1)
    assert job is not None and job.cancel_requested
    await report(world, running, JobState.CANCELLED)
    assert running not in await world.client.cancel_requested_jobs("c1", PROVIDER, 100)


# ---- decisions and status reports -----------------------------------------------------------------------------


async def test_the_latest_decision_is_the_one_read(world: ChainWorld) -> None:
    job_id = world.submit()
    world.decide(job_id, "c2")
    world.decide(job_id, "c1")
    decision = await world.client.get_decision(job_id)
    assert decision is not None and (decision.job_id, decision.selected_cluster_id) == (job_id, "c1")


async def test_request_scheduling_records_a_decision_for_an_active_cluster(world: ChainWorld) -> None:
    world.add_cluster("c3", state="offline")
    job_id = world.submit(offering="c3-std")
    decision = await world.client.request_scheduling(job_id, "missing decision")
    assert decision.job_id == job_id and decision.selected_cluster_id in ("c1", "c2")
    assert decision.is_fallback and decision.fallback_reason
    assert await world.client.get_decision(job_id) == decision


async def test_status_reports_follow_the_state_machine(world: ChainWorld) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.RUNNING, cluster_id="c1")
    await report(world, job_id, JobState.RUNNING, message="still running")  # a repeat is a no-op
    with pytest.raises(IllegalTransition):
        await report(world, job_id, JobState.STARTING)  # backwards (only a requeue, to queued, may go back)
    await report(world, job_id, JobState.COMPLETED, exit_code=0)
    with pytest.raises(IllegalTransition):
        await report(world, job_id, JobState.RUNNING)
    job = await world.client.get_job(job_id)
    assert job is not None and job.state is JobState.COMPLETED


async def test_a_report_may_skip_states_the_job_went_through_between_polls(world: ChainWorld) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.QUEUED)
    await report(world, job_id, JobState.COMPLETED, exit_code=0)
    job = await world.client.get_job(job_id)
    assert job is not None and job.state is JobState.COMPLETED


# ---- usage records and settlement -----------------------------------------------------------------------------


async def test_usage_records_are_stored_once_and_read_back_in_sequence(world: ChainWorld) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.RUNNING, cluster_id="c1")
    first, second = usage(world, job_id, 1), usage(world, job_id, 2)
    result = await world.client.submit_usage([second, first])
    assert (result.accepted, result.duplicates) == ([second.record_id, first.record_id], [])
    again = await world.client.submit_usage([first, usage(world, job_id, 3)])
    assert again.duplicates == [first.record_id] and again.accepted == [record_id("c1", job_id, 3)]
    stored = await world.client.job_usage_records(job_id)
    assert [r.sequence for r in stored] == [1, 2, 3]
    assert await world.client.get_usage_record(first.record_id) == first  # signature and all


async def test_a_record_not_signed_by_the_providers_key_stores_nothing_of_its_batch(
    world: ChainWorld,
) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.RUNNING, cluster_id="c1")
    forged = usage(world, job_id, 2, signer=Signer.generate())
    with pytest.raises(SecurityError, match=forged.record_id):
        await world.client.submit_usage([usage(world, job_id, 1), forged])
    assert await world.client.job_usage_records(job_id) == []


async def test_a_gap_in_a_jobs_sequence_is_refused(world: ChainWorld) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.RUNNING, cluster_id="c1")
    with pytest.raises(ChainError, match="gap"):
        await world.client.submit_usage([usage(world, job_id, 2)])


async def test_accounting_settles_a_job_once_from_its_escrow(world: ChainWorld) -> None:
    job_id = world.submit()
    await report(world, job_id, JobState.RUNNING, cluster_id="c1")
    records = [usage(world, job_id, 1), usage(world, job_id, 2, final=True)]
    await world.client.submit_usage(records)
    await report(world, job_id, JobState.COMPLETED, exit_code=0)
    totals = sum_metrics([r.metrics for r in records])
    wrong = AccountingReport(
        job_id=job_id,
        cluster_id="c1",
        totals=totals.model_copy(update={"node_hours": Decimal(5)}),
        final_record_id=records[-1].record_id,
        record_count=2,
    )
    with pytest.raises(ChainError, match="totals differ"):
        await world.client.report_accounting(wrong)
    right = wrong.model_copy(update={"totals": totals})
    settlement = await world.client.report_accounting(right)
    assert (settlement.job_id, settlement.provider, settlement.tenant) == (job_id, PROVIDER, ALICE)
    # 1 node-hour at 2 + 120 core-seconds (1/30 core-hour) at 0.1, to the ledger's unit of 0.000001
    assert settlement.charged == Decimal("2.003333")
    assert settlement.charged + settlement.refunded == settlement.escrow == Decimal(10)
    assert await world.client.report_accounting(right) == settlement  # a repeat settles nothing more


# ---- templates ------------------------------------------------------------------------------------------------


async def test_a_custom_template_reads_back_with_governances_decision(world: ChainWorld) -> None:
    world.publish_template("carol-pending", approve=False)
    world.publish_template("carol-echo", approve=True)
    waiting = await world.client.get_template("carol-pending")
    approved = await world.client.get_template("carol-echo")
    assert waiting is not None and waiting.status == "pending"
    assert (
        approved is not None and approved.status == "approved" and approved.approved_digest == approved.digest
    )
