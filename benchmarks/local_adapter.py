"""Benchmark of the local adapter: submit rate against the raw cost of spawning a process, status_batch cost.

Run: ``.venv/bin/python benchmarks/local_adapter.py [--jobs 1000] [--live 300]``. Figures go to
``docs/local-executor.md``. It starts real processes (``--live`` idle supervisors at once, ~7 MiB each) and
cleans up after itself.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activities.schedulers import local_supervisor as sup
from activities.schedulers.base import SubmitRequest
from activities.schedulers.local import LocalAdapter
from tests.local_support import tenant_accounts
from virtengine_hpc.config import LocalSchedulerConfig
from virtengine_hpc.models import JobSpec


def request(n: int, body: str) -> SubmitRequest:
    job = JobSpec(job_id=f"bench-{n}", tenant="tenant1", provider="provider1", offering_id="o1", script=body)
    return SubmitRequest(workflow_id=f"bench-{n}", job=job, body=body)


def raw_spawn_rate(count: int) -> float:
    """The transport's raw limit: start a Python interpreter like the supervisor's and wait for it."""
    started = time.perf_counter()
    for _ in range(count):
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
    return count / (time.perf_counter() - started)


async def timed_status(adapter: LocalAdapter, ids: list[str], rounds: int = 5) -> tuple[float, Counter[str]]:
    times, states = [], Counter[str]()
    for _ in range(rounds):
        started = time.perf_counter()
        result = await adapter.status_batch(ids)
        times.append(time.perf_counter() - started)
        states = Counter(s.state.value for s in result.values())
    return statistics.median(times), states


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1000, help="short jobs run to the end")
    parser.add_argument("--live", type=int, default=300, help="jobs held queued or running at once")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="local-bench-"))
    root.chmod(0o711)  # the jobs' account (tenant1's, as root) passes through to its work directories
    try:
        raw = raw_spawn_rate(50)
        adapter = LocalAdapter(
            LocalSchedulerConfig(max_parallel_jobs=64, kill_wait="1s", allow_unisolated=True),
            root / "a",
            "bench",
            tenant_accounts(),
        )
        started = time.perf_counter()
        ids = [(await adapter.submit(request(n, "true\n"))).scheduler_job_id for n in range(50)]
        submit = 50 / (time.perf_counter() - started)
        print(f"submit, one at a time: {submit:.1f}/s; raw interpreter spawn {raw:.1f}/s")

        sem = asyncio.Semaphore(8)

        async def submit_one(n: int) -> str:
            async with sem:
                return (await adapter.submit(request(n, "true\n"))).scheduler_job_id

        started = time.perf_counter()
        ids = list(await asyncio.gather(*(submit_one(n) for n in range(args.jobs))))
        elapsed = time.perf_counter() - started
        print(f"{args.jobs} jobs submitted 8 at a time: {args.jobs / elapsed:.1f}/s")
        while True:
            result = await adapter.status_batch(ids)
            if all(s.state.final for s in result.values()):
                break
            await asyncio.sleep(0.5)
        print(f"all {args.jobs} done after {time.perf_counter() - started:.1f}s")
        median, states = await timed_status(adapter, ids)
        print(f"status_batch({len(ids)}) of ended jobs: {median * 1000:.1f} ms median {dict(states)}")

        live = LocalAdapter(
            LocalSchedulerConfig(max_parallel_jobs=16, kill_wait="1s", allow_unisolated=True),
            root / "b",
            "bench",
            tenant_accounts(),
        )
        live_ids = [(await live.submit(request(n, "sleep 120\n"))).scheduler_job_id for n in range(args.live)]
        await asyncio.sleep(3)
        median, states = await timed_status(live, live_ids)
        print(f"status_batch({len(live_ids)}) of live jobs: {median * 1000:.1f} ms median {dict(states)}")
        procs = []
        for sid in live_ids:
            status = sup.read_json(live.job_dir(sid) / sup.STATUS) or {}
            procs.append(psutil.Process(int(status["supervisor_pid"])))
        uss = statistics.mean(p.memory_full_info().uss for p in procs[:30]) / 2**20
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        await asyncio.sleep(5)
        cpu1 = sum(sum(p.cpu_times()[:2]) for p in procs)
        share = (cpu1 - cpu0) / 5 * 100
        print(f"supervisor USS {uss:.1f} MiB; {len(procs)} supervisors used {share:.1f}% of a core")
        started = time.perf_counter()
        for sid in live_ids:
            await live.cancel(sid)
        while not all(s.state.final for s in (await live.status_batch(live_ids)).values()):
            await asyncio.sleep(0.1)
        print(f"cancelled {len(live_ids)} live jobs in {time.perf_counter() - started:.2f}s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
