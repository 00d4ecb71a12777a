"""Pipeline throughput against a bare workflow with the same number of activities, side by side in one run.

    .venv/bin/python benchmarks/pipeline.py [--jobs 200] [--rounds 2]

The pipeline: N jobs through HPCJobWorkflow with its real activities (routing against a LocalLedger, the local
executor running a trivial script as a real process, signed usage, accounting and settlement). The baseline: N
workflows that run 7 trivial activities in sequence (``--bare-steps``: the activities a job ran before routing,
reports and its final record became local activities), on the same dev server and worker settings. Both are
started all at once and awaited; rounds alternate so machine noise hits both. Prints jobs/s, the ratio, the steps
of a job (activities and local activities) and history events per job. Target: ratio >= 1 against 7 activities.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activities.schedulers.base import SchedulerAdapter
from activities.schedulers.local import LocalAdapter
from benchmarks.bare import BareWorkflow, bench_noop
from tests.conftest import binary, make_config
from tests.pipeline_harness import setup_ledger
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import JobResult, JobWorkflowInput
from virtengine_hpc.models import JobSpec
from virtengine_hpc.signing import Signer, write_private_key
from virtengine_hpc.states import JobState
from workers.wiring import build_worker_deps, job_settings
from workers.worker import make_worker
from workflows.hpc_job import SEARCH_ATTRIBUTES, initial_search_attributes


async def run_pipeline(
    client: Client, config: Config, key: Path, ledger_jobs: list[str], queue: str
) -> float:
    start = time.monotonic()
    handles = []
    for job_id in ledger_jobs:
        spec = JobSpec.model_validate(
            {
                "job_id": job_id,
                "tenant": "virtengine1tenant0alice",
                "provider": config.provider.address,
                "offering_id": "offering-standard",
                "script": "true\n",
                "walltime_seconds": 600,
                "max_price": "100",  # covers the quote (allocation x walltime), else routing refuses the job
            }
        )
        inp = JobWorkflowInput(
            job=spec,
            cluster_id=config.hpc.cluster_id,
            provider=config.provider.address,
            settings=job_settings(config),
        )
        handles.append(
            await client.start_workflow(
                "HPCJobWorkflow",
                inp,
                id=job_id,
                task_queue=queue,
                search_attributes=initial_search_attributes(inp),
                result_type=JobResult,
            )
        )
    results = await asyncio.gather(*(h.result() for h in handles))
    elapsed = time.monotonic() - start
    bad = [r for r in results if r.state.value != "completed"]
    if bad:
        raise SystemExit(f"{len(bad)} pipeline jobs did not complete: {bad[0]}")
    return elapsed


async def run_bare(client: Client, n: int, steps: int, queue: str) -> float:
    start = time.monotonic()
    handles = [
        await client.start_workflow("BareWorkflow", steps, id=f"bare-{uuid.uuid4().hex}", task_queue=queue)
        for _ in range(n)
    ]
    await asyncio.gather(*(h.result() for h in handles))
    return time.monotonic() - start


def _children_named(name: str) -> list[int]:
    """Pids of this process's children called ``name`` (the dev server that ``start_local`` spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if comm == name and ppid == os.getpid():
            pids.append(int(entry.name))
    return pids


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by this process (worker + client) and by the dev server, per measured phase."""

    def __init__(self) -> None:
        self.server = _children_named("temporal")

    def read(self) -> tuple[float, float]:
        return time.process_time(), sum(_cpu_seconds(pid) for pid in self.server)


async def history_events(client: Client, workflow_id: str) -> tuple[int, int]:
    """Events of a job's history, and its steps: activities and local activities (one marker each)."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    steps = sum(
        1
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
        or (
            e.HasField("marker_recorded_event_attributes")
            and e.marker_recorded_event_attributes.marker_name == "core_local_activity"
        )
    )
    return len(history.events), steps


BARE_STEPS = 7
"""The activities of the bare workflow: what a short job ran as activities before its chain steps were local."""


async def main(n: int, rounds: int, scheduler: str, bare_steps: int = BARE_STEPS) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
        dev_server_log_level="error",
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp)
            key = base / "provider.key"
            write_private_key(key)
            config = make_config(
                base,
                hpc={
                    "cluster_id": "bench-cluster",
                    "job_service": {"max_concurrent_jobs": max(100, n)},
                    "local": {"max_parallel_jobs": 64, "job_poll_interval": "200ms"},
                },
            )
            ledger = setup_ledger(config, Signer.from_file(key))
            adapter: SchedulerAdapter
            if scheduler == "memory":
                from tests.memory_adapter import MemoryAdapter, Script

                adapter = MemoryAdapter(
                    default=Script(
                        [(0, JobState.QUEUED), (0.05, JobState.RUNNING), (0.1, JobState.COMPLETED)], 0
                    )
                )
            else:
                adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
            deps = build_worker_deps(
                config,
                Secrets(provider_signing_key_path=key),
                chain=ledger,
                adapters={"bench-cluster": adapter},
            )
            pipe_queue, bare_queue = f"pipe-{uuid.uuid4().hex[:6]}", f"bare-{uuid.uuid4().hex[:6]}"
            pipe_worker = make_worker(env.client, deps, queue=pipe_queue)
            bare_worker = Worker(
                env.client,
                task_queue=bare_queue,
                workflows=[BareWorkflow],
                activities=[bench_noop],
                max_concurrent_activities=pipe_worker.config()["max_concurrent_activities"],
                max_concurrent_workflow_tasks=100,
            )
            async with pipe_worker, bare_worker:
                # Warm up both paths.
                warm = f"JOB-warm-{uuid.uuid4().hex[:6]}"
                ledger.submit_job(_raw(config, warm))
                ledger.create_decision(warm, "bench-cluster")
                await run_pipeline(env.client, config, key, [warm], pipe_queue)
                events, _ = await history_events(env.client, warm)
                await run_bare(env.client, 5, bare_steps, bare_queue)

                pipe_rates, bare_rates = [], []
                step_counts: list[int] = []
                meter = CpuMeter()
                cpu = {"pipeline": [0.0, 0.0], "bare": [0.0, 0.0]}  # [this process, dev server] seconds
                for r in range(rounds):
                    ids = [f"JOB-b{r}-{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
                    for job_id in ids:
                        ledger.submit_job(_raw(config, job_id))
                        ledger.create_decision(job_id, "bench-cluster")
                    before = meter.read()
                    pipe_rates.append(n / await run_pipeline(env.client, config, key, ids, pipe_queue))
                    pipe_done = meter.read()
                    # How many steps a job ran depends on how many polls saw it change: a sample of this round's.
                    sample = [
                        (await history_events(env.client, job_id))[1] for job_id in ids[:: max(1, n // 10)]
                    ]
                    step_counts.append(round(statistics.median(sample)))
                    bare_start = meter.read()  # the history reads above count for neither
                    bare_rates.append(n / await run_bare(env.client, n, bare_steps, bare_queue))
                    after = meter.read()
                    for kind, (a, b) in (("pipeline", (before, pipe_done)), ("bare", (bare_start, after))):
                        cpu[kind][0] += b[0] - a[0]
                        cpu[kind][1] += b[1] - a[1]
                    print(
                        f"round {r + 1}: pipeline {pipe_rates[-1]:.1f} jobs/s, bare {bare_rates[-1]:.1f} wf/s"
                    )
                sample_events, _ = await history_events(env.client, ids[0])
            await deps.close()
    finally:
        await env.shutdown()
    pipe, bare = statistics.median(pipe_rates), statistics.median(bare_rates)
    print()
    print(f"jobs per round            {n}")
    print(
        f"steps per job             {'/'.join(map(str, step_counts))} per round (activities and local activities, "
        "median of a sample of its jobs)"
    )
    print(f"pipeline throughput       {pipe:.1f} jobs/s (median of {rounds})")
    print(f"bare workflow throughput  {bare:.1f} wf/s ({bare_steps} activities)")
    print(f"ratio pipeline / bare     {pipe / bare:.2f}   (target >= 1)")
    print(f"history events per job    {sample_events} (warm-up job: {events})")
    jobs = n * rounds
    for kind in ("pipeline", "bare"):
        worker_ms, server_ms = (1000 * seconds / jobs for seconds in cpu[kind])
        print(
            f"CPU per {kind + ' job':13s}  worker+client {worker_ms:5.1f} ms, Temporal server {server_ms:5.1f} ms"
        )


def _raw(config: Config, job_id: str) -> dict[str, object]:
    return {
        "job_id": job_id,
        "tenant": "virtengine1tenant0alice",
        "provider": config.provider.address,
        "offering_id": "offering-standard",
        "script": "true\n",
        "walltime_seconds": 600,
        "max_price": "100",  # covers the quote (allocation x walltime), else routing refuses the job
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--scheduler",
        choices=["local", "memory"],
        default="local",
        help="local: the real local executor (default); memory: the tests' in-memory scheduler, to separate the "
        "executor's cost from the workflow's",
    )
    parser.add_argument(
        "--bare-steps", type=int, default=BARE_STEPS, help="activities of the bare workflow (default 7)"
    )
    args = parser.parse_args()
    asyncio.run(main(args.jobs, args.rounds, args.scheduler, args.bare_steps))
