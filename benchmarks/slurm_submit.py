"""Benchmark of the SLURM adapter on the local cluster: submissions per second against the transport's raw limit,
and scheduler queries per poll interval with 1,000 held jobs watched through the worker's ``StatusBatcher``.

Run (root, cluster up via ``temporal-dev/slurm-up.sh``)::

    .venv/bin/python -m benchmarks.slurm_submit [--transport cli|ssh|rest] [--jobs 1000] [--raw 200]
        [--sequential 50] [--concurrency 32] [--interval 1.0] [--rounds 5]

All jobs are submitted held (``--hold``: they never run), named ``vehpc-bench-<run>-*``, and cancelled at the end
(also after an error). Figures go to ``docs/benchmarks.md``.

* raw limit: a plain loop of the transport's own submission (``sbatch --parsable --hold`` in one bash loop for the
  CLI; ``sbatch`` over one kept SSH connection; keep-alive ``POST /slurm/<v>/job/submit`` for slurmrestd).
* the adapter, one submit at a time, as the submit activity's first attempt calls it: ``sbatch`` at once (nothing
  can have made the job yet), then the check for duplicates of racing attempts (one controller query). That
  check is the price of exactly-once; a retried submit also looks the job up (controller and accounting) first.
* the adapter, ``--concurrency`` submits in flight (a worker runs many submit activities at once): concurrent
  checks coalesce into one controller query per batch.
* batching: one watcher per job calls ``StatusBatcher.status`` round after round, as every ``watch_job`` activity of
  a worker does; the benchmark counts the scheduler queries the adapter actually makes per interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from activities.schedulers.base import SubmitRequest
from activities.schedulers.batcher import StatusBatcher
from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm.script import plan_submission, render_rest_job
from activities.schedulers.slurm.transports import SSHRunner
from virtengine_hpc.config import Secrets, load_config
from virtengine_hpc.models import JobSpec

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("VEHPC_DEV_DIR", REPO / ".dev")) / "slurm"


def load_env() -> dict[str, Any]:
    env_file = STATE / "env.json"
    if not env_file.exists():
        raise SystemExit(f"{env_file} missing: start the cluster with sudo temporal-dev/slurm-up.sh")
    return json.loads(env_file.read_text())  # type: ignore[no-any-return]


def make_adapter(env: dict[str, Any], transport: str) -> SlurmAdapter:
    slurm: dict[str, Any] = {
        "cluster_name": env["cluster"],
        "controller_host": env["controller_host"],
        "default_partition": env["partition"],
        "account": env["account"],
        "work_dir": env["jobs_dir"],
        "slurm_conf": env["slurm_conf"],
        "transport": transport,
        "connection_timeout": "60s",
    }
    if transport == "ssh":
        slurm.update(
            ssh_host=env["ssh_host"],
            ssh_port=env["ssh_port"],
            ssh_user=env["ssh_user"],
            ssh_key_path=env["ssh_key_file"],
            known_hosts_path=env["ssh_known_hosts"],
        )
    if transport == "rest":
        slurm.update(auth_method="jwt", rest_url=env["slurmrestd_url"], rest_user=env["rest_user"])
    config = load_config(data={"hpc": {"scheduler_type": "slurm", "slurm": slurm}}, env={})
    from pydantic import SecretStr

    token = Path(env["jwt_token_file"]).read_text().strip()
    adapter = SlurmAdapter.from_config(config, Secrets(slurm_jwt_token=SecretStr(token)), "bench")
    adapter.hold = True
    return adapter


def request(run: str, n: int) -> SubmitRequest:
    wf = f"bench-{run}-{n}"
    job = JobSpec(
        job_id=wf,
        tenant="virtengine1tenant0bench",
        provider="virtengine1provider0bench",
        offering_id="bench",
        script="true\n",
        resources={"memory_mb_per_node": 64},
    )
    return SubmitRequest(workflow_id=wf, job=job, body="true\n", first_attempt=True)


# ---- raw limits ------------------------------------------------------------------------------------------------


def raw_sbatch_loop(env: dict[str, Any], run: str, count: int) -> tuple[float, list[str]]:
    """A plain bash loop of ``sbatch --parsable --hold``: the CLI's raw submission rate."""
    script = (
        f"for i in $(seq {count}); do sbatch --parsable --hold -J vehpc-bench-{run}-raw-$i "
        f"-A {env['account']} -o /dev/null --wrap true; done"
    )
    started = time.perf_counter()
    out = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    return count / seconds, [line.split(";")[0] for line in out.stdout.split()]


async def raw_ssh_loop(env: dict[str, Any], run: str, count: int) -> tuple[float, list[str]]:
    runner = SSHRunner(
        host=env["ssh_host"],
        port=env["ssh_port"],
        user=env["ssh_user"],
        key_path=Path(env["ssh_key_file"]),
        known_hosts=Path(env["ssh_known_hosts"]),
        timeout=60,
    )
    ids = []
    await runner.run(["true"], timeout=60)  # connect outside the timing
    started = time.perf_counter()
    for i in range(count):
        result = await runner.run(
            ["sbatch", "--parsable", "--hold", "-J", f"vehpc-bench-{run}-raw-{i}", "-o", "/dev/null"],
            stdin="#!/bin/bash\ntrue\n",
            timeout=60,
        )
        ids.append(result.stdout.strip().split(";")[0])
    seconds = time.perf_counter() - started
    await runner.close()
    return count / seconds, ids


async def raw_rest_loop(env: dict[str, Any], run: str, count: int) -> tuple[float, list[str]]:
    token = Path(env["jwt_token_file"]).read_text().strip()
    headers = {"X-SLURM-USER-NAME": env["rest_user"], "X-SLURM-USER-TOKEN": token}
    url = f"{env['slurmrestd_url']}/slurm/{env['slurmrestd_api_version']}/job/submit"
    ids = []
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        started = time.perf_counter()
        for i in range(count):
            plan = plan_submission(
                request(run, -i - 1),
                cluster_id="bench",
                default_partition=env["partition"],
                work_dir=env["jobs_dir"],
                hold=True,
            )
            body = render_rest_job(plan)
            body["job"]["name"] = f"vehpc-bench-{run}-raw-{i}"
            answer = (await client.post(url, json=body)).json()
            ids.append(str(answer["job_id"]))
        seconds = time.perf_counter() - started
    return count / seconds, ids


# ---- the adapter -----------------------------------------------------------------------------------------------


async def adapter_sequential(
    adapter: SlurmAdapter, run: str, start: int, count: int
) -> tuple[float, list[str]]:
    started = time.perf_counter()
    ids = [(await adapter.submit(request(run, n))).scheduler_job_id for n in range(start, start + count)]
    return count / (time.perf_counter() - started), ids


async def adapter_concurrent(
    adapter: SlurmAdapter, run: str, start: int, count: int, concurrency: int
) -> tuple[float, list[str], int]:
    slots = asyncio.Semaphore(concurrency)
    batches_before = adapter._live_finder.batches

    async def one(n: int) -> str:
        async with slots:
            return (await adapter.submit(request(run, n))).scheduler_job_id

    started = time.perf_counter()
    ids = await asyncio.gather(*(one(n) for n in range(start, start + count)))
    seconds = time.perf_counter() - started
    return count / seconds, list(ids), adapter._live_finder.batches - batches_before


# ---- batching ----------------------------------------------------------------------------------------------------


async def batched_polling(
    adapter: SlurmAdapter, ids: list[str], interval: float, rounds: int
) -> dict[str, Any]:
    batcher = StatusBatcher(adapter, interval)
    before = dict(adapter.calls)
    states: dict[str, int] = {}

    async def watch(job_id: str) -> None:
        for _ in range(rounds):
            status = await batcher.status(job_id)
            states[status.state.value] = states.get(status.state.value, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(watch(i) for i in ids))
    seconds = time.perf_counter() - started
    calls = {k: v - before.get(k, 0) for k, v in adapter.calls.items() if v - before.get(k, 0)}
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        await adapter.status_batch(ids)
        timings.append(time.perf_counter() - t0)
    single = []
    for job_id in ids[:20]:
        t0 = time.perf_counter()
        await adapter.status_batch([job_id])
        single.append(time.perf_counter() - t0)
    return {
        "watchers": len(ids),
        "rounds": batcher.queries,
        "seconds": seconds,
        "scheduler_calls": calls,
        "calls_per_round": sum(calls.values()) / max(1, batcher.queries),
        "states": states,
        "one_batched_query_s": statistics.median(timings),
        "per_job_queries_s_extrapolated": statistics.median(single) * len(ids),
    }


def cancel_run(env: dict[str, Any], run: str) -> int:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%A|%j"],
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
    ).stdout
    ids = [x.split("|")[0] for x in out.splitlines() if f"vehpc-bench-{run}" in x]
    for chunk in range(0, len(ids), 500):
        subprocess.run(
            ["scancel", *ids[chunk : chunk + 500]],
            env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
            check=False,
        )
    return len(ids)


async def raw_loop(env: dict[str, Any], transport: str, run: str, count: int) -> tuple[float, list[str]]:
    if transport == "cli":
        return raw_sbatch_loop(env, run, count)
    if transport == "ssh":
        return await raw_ssh_loop(env, run, count)
    return await raw_rest_loop(env, run, count)


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--transport", choices=("cli", "ssh", "rest"), default="cli")
    parser.add_argument("--jobs", type=int, default=1000, help="held jobs watched in the batching part")
    parser.add_argument(
        "--raw", type=int, default=100, help="jobs per raw loop and per concurrent adapter run"
    )
    parser.add_argument("--sequential", type=int, default=20, help="adapter submits one at a time, per round")
    parser.add_argument("--concurrency", type=int, default=32, help="adapter submits in flight")
    parser.add_argument("--submit-rounds", type=int, default=3, help="alternating raw/adapter rounds")
    parser.add_argument("--interval", type=float, default=1.0, help="StatusBatcher poll interval (s)")
    parser.add_argument("--rounds", type=int, default=5, help="polls per watcher")
    args = parser.parse_args()
    env = load_env()
    run = uuid.uuid4().hex[:6]
    adapter = make_adapter(env, args.transport)
    report: dict[str, Any] = {"transport": args.transport, "run": run}
    ids: list[str] = []
    n = 0
    try:
        await adapter.status_batch(["1"])  # connect and check the cluster outside the timings
        raw_rates, conc_rates, seq_rates, batches = [], [], [], 0
        for r in range(args.submit_rounds):
            rate, got = await raw_loop(env, args.transport, f"{run}r{r}", args.raw)
            raw_rates.append(rate)
            ids += got
            rate, got, b = await adapter_concurrent(adapter, run, n, args.raw, args.concurrency)
            conc_rates.append(rate)
            batches += b
            ids += got
            n += args.raw
            rate, got = await adapter_sequential(adapter, run, n, args.sequential)
            seq_rates.append(rate)
            ids += got
            n += args.sequential
        raw, conc, seq = (statistics.median(x) for x in (raw_rates, conc_rates, seq_rates))
        report["submit"] = {
            "raw_loop_per_s": [round(x) for x in raw_rates],
            "adapter_concurrent_per_s": [round(x) for x in conc_rates],
            "adapter_sequential_per_s": [round(x, 1) for x in seq_rates],
            "concurrency": args.concurrency,
            "scheduler_queries": dict(adapter.calls),
            "check_batches": batches,
            "ratio_concurrent_median": round(conc / raw, 2),
            "ratio_sequential_median": round(seq / raw, 2),
        }
        print(json.dumps(report["submit"], indent=1), flush=True)
        if len(ids) < args.jobs:  # fill up to --jobs held jobs for the batching part
            _, got, _ = await adapter_concurrent(adapter, run, n, args.jobs - len(ids), args.concurrency)
            ids += got
        report["batching"] = await batched_polling(adapter, ids, args.interval, args.rounds)
        print(json.dumps(report["batching"], indent=1), flush=True)
    finally:
        with contextlib.suppress(Exception):
            await adapter.close()
        print(f"cancelled {cancel_run(env, run)} benchmark jobs", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
