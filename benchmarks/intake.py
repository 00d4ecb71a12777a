"""Benchmark of the chain poller's intake on the LocalLedger: today's poller beside the one it replaced, in one run.

Run::

    .venv/bin/python -m benchmarks.intake [--jobs 10000] [--churn-jobs 600] [--churn-limit 100]
        [--churn-seconds 30] [--cancel-flood 1000] [--only-cancels]

Dev servers are started for the run (in-memory SQLite, the job workflow's search attributes): one for each backlog
run, so neither poller pays for the other's workflows, and one for the churn part. Workflows are started on a task
queue no worker polls: they stay open and hold their slot, so the figures are the intake's own, not the jobs'.

* **Intake of a backlog**: ``--jobs`` pending chain jobs, ``max_concurrent_jobs`` above that; each poller polls
  back to back until every job has a workflow. Printed: time to the first start, time to the last, starts per
  second, polls; then one more poll with every job running and one new job pending (the cost of a poll when the
  cluster is full: the old poller lists every running workflow, today's counts them).
* **max_concurrent_jobs across two pollers**: two pollers of one cluster run their loops side by side (0.2 s
  interval) over ``--churn-jobs`` pending jobs with ``max_concurrent_jobs`` = ``--churn-limit``, while jobs end
  at random (a churn task fails a running job on chain and terminates its workflow every 50 ms), so slots keep
  freeing up. The benchmark wraps the client to count every workflow start that succeeds and every job it ends:
  running = started - ended, exact. Printed: the most that ran at once, and the overshoot above the limit.

* **A flood of cancels**: one tenant cancels ``--cancel-flood`` of its pending jobs (no workflow yet: each cancel
  is a signal answered "not found", a lookup, a start with the cancel in it and an audit record), then another
  tenant cancels its job whose workflow runs; once 100 workflows have been signalled, a third cancel (of another
  running job) is requested. One round of the cancellation loop; printed: how many cancels were forwarded before
  the other tenant's, how long it waited, how long after its request the third cancel was forwarded in that round
  (null: not in the round at all), and how long the whole round took. ``OneReading`` is today's loop as it was
  when it read the chain's list once per round.

"Before" is the poller as it was (``ListingPoller`` below, kept here): it listed every running workflow of the
cluster each poll, started jobs one at a time, and had no lease; its cancellation loop (``SerialCancels``) took
the requests one at a time, oldest first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.audit import AuditLog
from activities.chain.client import StatusReport
from activities.chain.local_ledger import LocalLedger
from tests.conftest import binary, make_config
from tests.pipeline_harness import OFFERING, TENANT, setup_ledger
from virtengine_hpc.config import Config
from virtengine_hpc.messages import JOB_WORKFLOW_NAME
from virtengine_hpc.signing import Signer, write_private_key
from virtengine_hpc.states import JobState
from workers.intake_lease import IntakeLease
from workers.poller import ChainPoller, PollStats
from workers.wiring import job_settings
from workflows.hpc_job import SEARCH_ATTRIBUTES


class ListingPoller(ChainPoller):
    """The poller before: lists every running workflow of its cluster each poll, starts one job at a time, and
    trusts its own listing (no lease)."""

    async def running_ids(self) -> set[str]:
        query = (
            f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND ExecutionStatus = 'Running' "
            f"AND VeClusterId = '{self.cluster_id}'"
        )
        ids = {wf.id async for wf in self.client.list_workflows(query)}
        now = time.monotonic()
        self._recent = {k: t for k, t in self._recent.items() if now - t < 60 and k not in ids}
        return ids | set(self._recent)

    async def take_jobs(self, stats: PollStats | None = None) -> PollStats:
        stats = stats or PollStats()
        limit = self.config.hpc.job_service.max_concurrent_jobs
        running = await self.running_ids()
        window = limit + 100
        free = limit - len(running)
        after: str | None = None
        while True:
            page = await self.chain.pending_jobs(self.cluster_id, self.provider, limit=window, after=after)
            for job in page:
                if job.job_id in running:
                    continue
                if free <= 0:
                    stats.waiting += 1
                elif await self._try_start(job, stats):
                    free -= 1
            if len(page) < window or free <= 0:
                break
            after = page[-1].job_id
        return stats


WHOLE_LIST = 2**62
"""The cancellation loops before read the chain's whole list of cancel requests at once."""


class SerialCancels(ChainPoller):
    """The cancellation loop before: one request at a time, oldest first (the chain listed them by age)."""

    order: dict[str, int] = {}

    async def _forward_cancellations(self, stats: PollStats) -> None:
        requested = await self.chain.cancel_requested_jobs(self.cluster_id, self.provider, limit=WHOLE_LIST)
        for job_id in sorted(requested, key=lambda job_id: self.order.get(job_id, 0)):
            if job_id not in self._signalled and await self._forward_cancel(job_id):
                self._signalled.add(job_id)
                stats.cancelled.append(job_id)


class OneReading(ChainPoller):
    """Today's cancellation loop as it was before it read the chain's list again within a round: it read the list
    once, at the round's start, so a cancel requested during the round waited for the whole round."""

    async def _forward_cancellations(self, stats: PollStats) -> None:
        requested = await self.chain.cancel_requested_jobs(self.cluster_id, self.provider, limit=WHOLE_LIST)
        await self._forward_batch([job_id for job_id in requested if job_id not in self._signalled], stats)


class CountingClient:
    """The real client, counting the job workflow starts that succeed."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.started: list[str] = []
        self.first: float | None = None  # perf_counter of the first start
        self.signalled: dict[str, float] = {}  # perf_counter of each workflow's first signal sent through it
        self.on_signal: Any = (
            None  # called with the number of workflows signalled so far, after each first signal
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start_workflow(self, workflow: Any, *args: Any, **kwargs: Any) -> Any:
        handle = await self.client.start_workflow(workflow, *args, **kwargs)
        if workflow == JOB_WORKFLOW_NAME:
            self.started.append(kwargs["id"])
            if self.first is None:
                self.first = time.perf_counter()
        return handle

    def get_workflow_handle(self, workflow_id: str, **kwargs: Any) -> Any:
        return _SignalTimes(self.client.get_workflow_handle(workflow_id, **kwargs), self)


class _SignalTimes:
    def __init__(self, handle: Any, counting: CountingClient) -> None:
        self.handle = handle
        self.counting = counting

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    async def signal(self, *args: Any, **kwargs: Any) -> Any:
        signalled = self.counting.signalled
        if self.handle.id not in signalled:
            signalled[self.handle.id] = time.perf_counter()
            if self.counting.on_signal is not None:
                self.counting.on_signal(len(signalled))
        return await self.handle.signal(*args, **kwargs)


def cluster_config(base: Path, address: str, limit: int, interval: str = "1s") -> Config:
    return make_config(
        base,
        hpc={
            "cluster_id": f"intake-{uuid.uuid4().hex[:6]}",
            "job_service": {"max_concurrent_jobs": limit, "job_poll_interval": interval},
        },
        temporal={"address": address},
        logging={"level": "WARNING"},
    )


def fill(ledger: LocalLedger, config: Config, count: int, tenant: str = TENANT) -> list[str]:
    ledger.fund(tenant, count)
    return [
        ledger.submit_job(
            {
                "job_id": f"JOB-{uuid.uuid4().hex[:12]}",
                "tenant": tenant,
                "provider": config.provider.address,
                "offering_id": OFFERING,
                "script": "true\n",
                "walltime_seconds": 600,
                "max_price": "1",
            }
        )
        for _ in range(count)
    ]


def make_poller(
    kind: type[ChainPoller], client: Any, ledger: LocalLedger, config: Config, holder: str
) -> ChainPoller:
    real = cast(Client, client)
    return kind(
        real,
        ledger,
        config,
        AuditLog(config.hpc.audit),
        task_queue=f"idle-{uuid.uuid4().hex[:8]}",
        settings=job_settings(config),
        lease=IntakeLease(
            real, config.hpc.cluster_id, term=config.hpc.job_service.intake_lease, holder=holder
        ),
    )


async def dev_server() -> WorkflowEnvironment:
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
        dev_server_log_level="error",
    )


async def backlog(kind: type[ChainPoller], base: Path, key: Path, jobs: int) -> dict[str, Any]:
    """Every pending job started by one poller polling back to back, on a dev server of its own (a server
    holding thousands of workflows starts more slowly: each poller gets an empty one)."""
    env = await dev_server()
    try:
        return await _backlog(kind, env.client, base, key, jobs)
    finally:
        await env.shutdown()


async def _backlog(
    kind: type[ChainPoller], client: Client, base: Path, key: Path, jobs: int
) -> dict[str, Any]:
    address = client.service_client.config.target_host
    config = cluster_config(base / kind.__name__, address, jobs + 100)
    ledger = setup_ledger(config, Signer.from_file(key))
    fill(ledger, config, jobs)
    counting = CountingClient(client)
    poller = make_poller(kind, counting, ledger, config, holder=f"bench-{kind.__name__}")
    polls = 0
    t0 = time.perf_counter()
    while len(counting.started) < jobs:
        await poller.take_jobs()
        polls += 1
    total = time.perf_counter() - t0
    first = (counting.first or t0) - t0
    fill(ledger, config, 1)
    t1 = time.perf_counter()
    stats = await poller.take_jobs()
    full_poll = time.perf_counter() - t1
    assert len(stats.started) == 1, stats
    return {
        "poller": kind.__name__,
        "jobs": jobs,
        "first_start_s": round(first, 2),
        "all_started_s": round(total, 1),
        "starts_per_s": round(jobs / total, 1),
        "polls": polls,
        "poll_with_all_running_s": round(full_poll, 2),
    }


async def churn(
    kind: type[ChainPoller], client: Client, base: Path, key: Path, jobs: int, limit: int, seconds: float
) -> dict[str, Any]:
    """Two pollers of one cluster side by side while jobs end at random; the most that ran at once."""
    address = client.service_client.config.target_host
    config = cluster_config(base / f"churn-{kind.__name__}", address, limit, interval="0.2s")
    ledger = setup_ledger(config, Signer.from_file(key))
    fill(ledger, config, jobs)
    counting = CountingClient(client)
    pollers = [make_poller(kind, counting, ledger, config, holder=f"{kind.__name__}-{n}") for n in (1, 2)]
    stop = asyncio.Event()
    ended: set[str] = set()
    peak = 0
    tasks = [asyncio.create_task(p.run(stop)) for p in pollers]
    deadline = time.monotonic() + seconds
    rng = random.Random(7)
    try:
        while time.monotonic() < deadline:
            peak = max(peak, len(counting.started) - len(ended))
            if len(counting.started) - len(ended) > limit // 2:
                candidates = [j for j in counting.started if j not in ended]
                if candidates:
                    job_id = rng.choice(candidates)
                    ended.add(job_id)
                    await ledger.report_status(
                        StatusReport(job_id=job_id, state=JobState.FAILED, cluster_id=config.hpc.cluster_id)
                    )
                    with contextlib.suppress(RPCError):
                        await client.get_workflow_handle(job_id).terminate("benchmark churn")
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "pollers": f"2 x {kind.__name__}",
        "max_concurrent_jobs": limit,
        "started": len(counting.started),
        "ended_by_churn": len(ended),
        "most_running_at_once": peak,
        "overshoot": max(0, peak - limit),
    }


LATE_AFTER = 100
"""The cancel flood's third cancel is requested once this many workflows have been signalled in the round."""


async def cancel_flood(kind: type[ChainPoller], base: Path, key: Path, flood: int) -> dict[str, Any]:
    """One round of the cancellation loop: ``flood`` cancels of one tenant's pending jobs, requested first, then
    another tenant's cancel of a running job. On a dev server of its own."""
    env = await dev_server()
    try:
        address = env.client.service_client.config.target_host
        config = cluster_config(base / f"cancel-{kind.__name__}", address, 2)
        ledger = setup_ledger(config, Signer.from_file(key))
        victim, late = fill(ledger, config, 2)
        counting = CountingClient(env.client)
        poller = make_poller(kind, counting, ledger, config, holder=f"cancel-{kind.__name__}")
        assert (await poller.take_jobs()).started == [victim, late]  # their workflows run (both slots)
        requested: list[float] = []

        def cancel_late(
            signalled: int,
        ) -> None:  # a third cancel, of a running job, while the flood is forwarded
            if signalled == LATE_AFTER:
                ledger.request_cancel(late)
                requested.append(time.perf_counter())

        counting.on_signal = cancel_late
        jobs = fill(ledger, config, flood, tenant="flooding-tenant")
        for job_id in jobs:
            ledger.request_cancel(job_id)
        ledger.request_cancel(victim)
        SerialCancels.order = {job_id: n for n, job_id in enumerate([*jobs, victim, late])}
        stop = asyncio.Event()
        keeper = asyncio.create_task(
            poller.lease.keep(stop)
        )  # as in the poller's run(): a round may outlast a term
        t0 = time.perf_counter()
        stats = await poller.forward_cancellations()
        total = time.perf_counter() - t0
        stop.set()
        await keeper
        assert len(stats.cancelled) >= flood + 1, len(stats.cancelled)
        at = counting.signalled[victim]
        late_at = counting.signalled.get(late)
        return {
            "cancel_loop": kind.__name__,
            "flood": flood,
            "forwarded_before_the_other_tenants": sum(1 for t in counting.signalled.values() if t < at),
            "other_tenants_cancel_after_s": round(at - t0, 2),
            # requested after the round's 100th signal: forwarded this long after, or not in the round at all
            "cancel_requested_in_the_round_after_s": None
            if late_at is None
            else round(late_at - requested[0], 2),
            "whole_round_s": round(total, 1),
        }
    finally:
        await env.shutdown()


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="pending jobs of the backlog")
    parser.add_argument("--churn-jobs", type=int, default=600)
    parser.add_argument("--churn-limit", type=int, default=100)
    parser.add_argument("--churn-seconds", type=float, default=30.0)
    parser.add_argument(
        "--cancel-flood", type=int, default=1000, help="one tenant's cancels before another's"
    )
    parser.add_argument("--only-cancels", action="store_true", help="run the cancel flood part alone")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="vehpc-intake-"))
    key = base / "provider.key"
    write_private_key(key)
    for kind in (SerialCancels, OneReading, ChainPoller):
        print(json.dumps(await cancel_flood(kind, base, key, args.cancel_flood)), flush=True)
    if args.only_cancels:
        return
    for kind in (ListingPoller, ChainPoller):
        print(json.dumps(await backlog(kind, base, key, args.jobs)), flush=True)
    env = await dev_server()
    try:
        for kind in (ListingPoller, ChainPoller):
            figures = await churn(
                kind, env.client, base, key, args.churn_jobs, args.churn_limit, args.churn_seconds
            )
            print(json.dumps(figures), flush=True)
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
