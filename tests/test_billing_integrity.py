"""Billing inputs come only from the provider's side and are fixed when the job is accepted.

A whole provider in one test (ledger, poller, worker with real activities, the in-memory scheduler): a tenant
who names another cluster's cheap offering, or another provider's free one, is refused before anything runs and
gets the escrow back; a provider who changes an offering's prices while a job runs does not change what that job
is charged.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest
from temporalio.client import Client

from activities.chain.local_ledger import settle_amounts
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import OFFERING, TENANT, Pipeline, running_pipeline
from virtengine_hpc.models import Cluster, Partition, PricedQueue, Pricing
from virtengine_hpc.pricing import rate_usage
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import sum_metrics

OTHER_PROVIDER = "virtengine1provider0other"


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    """This worker's cluster is the expensive one (the pipeline's offering); the provider also has a cheap CPU
    cluster, and another provider offers its cluster for free."""
    config = make_config(tmp_path, hpc={"cluster_id": f"gpu-{uuid.uuid4().hex[:8]}"})
    async with running_pipeline(client, config, key_path, MemoryAdapter(), task_queue) as p:
        partition = (Partition(name="debug", nodes=4, max_nodes=4, max_runtime_seconds=86400),)
        for cluster_id, provider, offering, price in (
            ("cpu-cheap", config.provider.address, "cpu-offering", "0.000001"),
            ("elsewhere", OTHER_PROVIDER, "free-offering", "0"),
        ):
            p.ledger.register_cluster(
                Cluster(cluster_id=cluster_id, provider=provider, name=cluster_id, partitions=partition)
            )
            p.ledger.add_queue(
                PricedQueue(
                    offering_id=offering,
                    cluster_id=cluster_id,
                    partition="debug",
                    pricing=Pricing(node_hour=Decimal(price)),
                )
            )
        yield p


@pytest.mark.parametrize(
    ("offering", "reason"),
    [
        (
            "cpu-offering",
            "offering cpu-offering is priced for cluster cpu-cheap, not for {cluster} where the job",
        ),
        (
            "free-offering",
            f"offering free-offering belongs to {OTHER_PROVIDER} (cluster elsewhere), not to this",
        ),
    ],
    ids=["another-cluster", "another-provider"],
)
async def test_a_job_naming_an_offering_that_does_not_price_its_cluster_is_refused(
    pipe: Pipeline, offering: str, reason: str
) -> None:
    before = pipe.ledger.balance(TENANT)
    job_id = pipe.submit(offering_id=offering, cluster_id=pipe.cluster_id)
    [result] = (await pipe.run_until_done([job_id])).values()
    expected = reason.format(cluster=pipe.cluster_id)
    assert result.state == JobState.FAILED
    assert result.message.startswith(f"validation_failed: {expected}"), result.message
    assert pipe.adapter.submits == 0, "nothing ran"  # type: ignore[attr-defined]
    [audited] = pipe.audit_events("job_validation_failed", job_id)
    assert audited["error_msg"].startswith(expected) and audited["success"] is False
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged == 0 and settlement.refunded == Decimal("100")
    assert pipe.ledger.balance(TENANT) == before


async def test_a_price_change_after_acceptance_does_not_change_the_charge(pipe: Pipeline) -> None:
    adapter: MemoryAdapter = pipe.adapter  # type: ignore[assignment]
    job_id = pipe.submit()
    adapter.scripts[job_id] = Script(
        [(0.0, JobState.QUEUED), (0.2, JobState.RUNNING), (2.0, JobState.COMPLETED)], exit_code=0
    )
    agreed = pipe.ledger.queue(OFFERING)
    assert agreed is not None
    await pipe.wait_started(job_id)
    for _ in range(100):
        if pipe.ledger.job(job_id).state == JobState.RUNNING:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.1)
    # The provider raises its prices a hundredfold while the job runs.
    raised = agreed.pricing.model_copy(
        update={name: value * 100 for name, value in agreed.pricing.model_dump().items()}
    )
    pipe.ledger.add_queue(agreed.model_copy(update={"pricing": raised}))

    [result] = (await pipe.run_until_done([job_id])).values()
    assert result.state == JobState.COMPLETED, result.message
    totals = sum_metrics([r.metrics for r in pipe.ledger.usage_records(job_id)])
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None
    at_agreed, _ = settle_amounts(totals, agreed, settlement.escrow)
    at_raised, _ = settle_amounts(totals, pipe.ledger.queue(OFFERING), settlement.escrow)  # type: ignore[arg-type]
    assert at_agreed < at_raised, "the usage is priced differently at the two prices"
    assert settlement.charged == at_agreed
    fixed = pipe.ledger.job_price(job_id)
    assert fixed is not None and fixed[0] == agreed and fixed[2] == "submitted"
    assert pipe.ledger.charge_breakdown(job_id).rated == rate_usage(totals, agreed.pricing)
