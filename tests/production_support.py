"""Helpers of the production tests: multi-cluster configs, a provider ledger with several clusters, waiting for
a job's workflow, scraping Prometheus text."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from activities.chain.local_ledger import LocalLedger
from tests.conftest import make_config
from tests.pipeline_harness import TENANT, setup_ledger
from virtengine_hpc.config import Config
from virtengine_hpc.messages import JobResult
from virtengine_hpc.models import Cluster, Partition
from virtengine_hpc.signing import Signer


def cluster_config(
    tmp_path: Path, clusters: Iterable[str], *, serve: Iterable[str] | None = None, **sections: Any
) -> Config:
    """A provider config listing ``clusters`` (this worker serves ``serve``, default all) on a test-unique set
    of task queues ``tq-<uuid>.<cluster>``."""
    served = set(clusters if serve is None else serve)
    clusters = list(clusters)
    entries = [{"cluster_id": c, "serve": c in served} for c in clusters]
    hpc = {"cluster_id": clusters[0], "clusters": entries, **sections.pop("hpc", {})}
    temporal = {"task_queue": f"tq-{uuid.uuid4().hex[:10]}", **sections.pop("temporal", {})}
    return make_config(tmp_path, hpc=hpc, temporal=temporal, **sections)


def provider_ledger(config: Config, key_path: Path) -> LocalLedger:
    """The ledger of ``setup_ledger`` (first cluster, its priced queue, the provider key, a funded tenant) plus
    every other cluster of the config, active with room."""
    ledger = setup_ledger(config, Signer.from_file(key_path))
    for cluster_id in config.cluster_ids():
        if ledger.cluster(cluster_id) is None:
            ledger.register_cluster(
                Cluster(
                    cluster_id=cluster_id,
                    provider=config.provider.address,
                    name=cluster_id,
                    scheduler_type="local",
                    partitions=(Partition(name="debug", nodes=4, max_nodes=4, max_runtime_seconds=86400),),
                    total_nodes=4,
                    available_nodes=4,
                )
            )
    return ledger


def submit(ledger: LocalLedger, config: Config, *, decide: str | None = None, **spec: Any) -> str:
    raw: dict[str, Any] = {
        "job_id": f"JOB-{uuid.uuid4().hex[:10]}",
        "tenant": TENANT,
        "provider": config.provider.address,
        "offering_id": "offering-standard",
        "script": "#!/bin/bash\necho hello\n",
        "walltime_seconds": 600,
        "max_price": "100",
        **spec,
    }
    job_id = ledger.submit_job(raw)
    if decide:
        ledger.create_decision(job_id, decide)
    return job_id


async def wait_result(client: Client, job_id: str, timeout: float = 60) -> JobResult:
    """The job workflow's result, once a poller has started it and it finished."""
    handle = client.get_workflow_handle(job_id, result_type=JobResult)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(RPCError):
            desc = await handle.describe()
            if desc.status != WorkflowExecutionStatus.RUNNING:
                return await handle.result()
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text as {(sample name, labels): value}."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (a counter never incremented)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
