"""Load: N jobs running at once on one worker, then the pipeline's ratio against a bare workflow.

    .venv/bin/python benchmarks/load.py [--jobs 1000] [--sleep 300] [--report-interval 60] [--ratio-jobs 200]

Part 1. A real worker process (``virtengine-hpc worker run --poller``, the production entry point) serves one
cluster on the local executor with room for every job (``max_parallel_jobs`` and ``max_concurrent_jobs`` above
N). N jobs that sleep ``--sleep`` seconds are submitted on the ledger at once; the poller starts them, each runs as
a real process under its own supervisor, sends a signed usage record every ``--report-interval``, and settles.
Every two seconds the benchmark samples: the jobs by state (ledger), the worker process's RSS and CPU (and,
apart, the supervisors' and jobs' total), and the worker's Prometheus counters: batched status queries, and
scheduler calls by operation. Printed: time and rate to N running, worker memory idle / at N running / per job,
scheduler status queries per poll interval while N run (the target is 1), usage reads, time and rate from N
running to N settled, history events per job, and an end check (every job completed, records gapless with one
final record, settled).

Attempts: how many activity attempts were lost and retried, by activity. From every job's history (an
activity's completing attempt carries its number and the failure of the attempt before it: ``retried`` is the sum
of the attempts that did not complete, ``heartbeat`` those whose successor names a heartbeat timeout, a lower
bound when an activity took more than two attempts), and from the worker's
``virtengine_hpc_activity_attempts_cancelled_total`` (attempts the live worker saw cancelled because the server
had given them up: ``timed_out``/``not_found``).

Part 2. ``benchmarks/pipeline.py`` in the same run: the job pipeline against a bare workflow with the same
number of activities (``--ratio-jobs`` jobs, ``--ratio-rounds`` rounds), local executor and in-memory scheduler.

Needs about 7 MiB of memory per running job for its supervisor (7 GiB for 1,000) and a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import TimeoutType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import pipeline
from tests.conftest import binary, make_config
from tests.pipeline_harness import OFFERING, TENANT, setup_ledger
from virtengine_hpc.config import Config, JobServiceConfig
from virtengine_hpc.signing import Signer, write_private_key
from workflows.hpc_job import SEARCH_ATTRIBUTES

MIB = 1024 * 1024


@dataclass
class Sample:
    at: float
    states: Counter[str]
    worker_rss: int
    worker_cpu: float
    children: int
    children_rss: int
    queries: float
    calls: dict[str, float]


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)

    def first(self, predicate: object) -> Sample | None:
        return next((s for s in self.samples if predicate(s)), None)  # type: ignore[operator]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_last_scrape: tuple[float, dict[str, float]] = (0.0, {})


def scrape(url: str) -> tuple[float, dict[str, float]]:
    """(batched status queries, scheduler calls by operation) from the worker's /metrics; the last answer when
    a worker too loaded to answer in time keeps it waiting (counters only grow, the next sample catches up)."""
    global _last_scrape
    queries = 0.0
    calls: dict[str, float] = {}
    try:
        samples = metric_samples(url)
    except OSError as exc:
        print(f"/metrics did not answer ({exc}); keeping the last sample's counters", flush=True)
        return _last_scrape
    for sample in samples:
        if sample.name == "virtengine_hpc_scheduler_queries_total":
            queries += sample.value
        elif sample.name == "virtengine_hpc_scheduler_call_seconds_count":
            operation = sample.labels["operation"]
            calls[operation] = calls.get(operation, 0.0) + sample.value
    _last_scrape = (queries, calls)
    return queries, calls


def metric_samples(url: str) -> list[Any]:
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def cancelled_attempts(url: str) -> dict[str, int]:
    """Attempts the worker saw cancelled by Temporal, as ``activity/reason`` -> count."""
    return {
        f"{s.labels['activity']}/{s.labels['reason']}": int(s.value)
        for s in metric_samples(url)
        if s.name == "virtengine_hpc_activity_attempts_cancelled_total" and s.value
    }


def states(ledger_path: Path) -> Counter[str]:
    with sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True, timeout=30) as db:
        return Counter(dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()))


def job_processes(state_dir: Path) -> dict[int, psutil.Process]:
    """The local executor's supervisors (they leave the worker's session, so they are not its children) and
    their jobs' processes, by pid."""
    marker = str(state_dir)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in arg for arg in cmdline):
            found[proc.pid] = proc
            try:
                found.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.Error:
                continue
    return found


def proportional_memory(processes: dict[int, psutil.Process], sample: int = 150) -> int:
    """Sum of PSS (shared pages such as the interpreter's counted once across the processes, not once each),
    extrapolated from ``sample`` of them: reading every process's smaps at 3,000 processes took minutes."""
    chosen = random.Random(0).sample(sorted(processes), min(sample, len(processes)))
    total, read = 0, 0
    for pid in chosen:
        try:
            total += processes[pid].memory_full_info().pss
            read += 1
        except psutil.Error:
            continue
    return total * len(processes) // max(1, read)


def sample(
    worker: psutil.Process,
    ledger_path: Path,
    state_dir: Path,
    metrics_url: str,
    started: float,
    *,
    processes: bool = True,
) -> Sample:
    children = job_processes(state_dir) if processes else {}
    children_rss = proportional_memory(children) if processes else -1
    queries, calls = scrape(metrics_url)
    return Sample(
        at=time.monotonic() - started,
        states=states(ledger_path),
        worker_rss=worker.memory_info().rss,
        worker_cpu=worker.cpu_percent(),
        children=len(children),
        children_rss=children_rss,
        queries=queries,
        calls=calls,
    )


def s_all_running(run: Run, jobs: int) -> bool:
    return bool(run.samples) and run.samples[-1].states["running"] >= jobs


def worker_config(base: Path, address: str, args: argparse.Namespace, metrics: str) -> Config:
    room = args.jobs + 100
    return make_config(
        base,
        hpc={
            "cluster_id": f"load-{uuid.uuid4().hex[:6]}",
            "job_service": {
                "max_concurrent_jobs": room,
                "job_poll_interval": "1s",
                "vanished_job_grace": "60s",
                "activity_heartbeat_timeout": f"{args.heartbeat_timeout}s",
            },
            "usage_reporting": {"report_interval": f"{args.report_interval}s"},
            "local": {"max_parallel_jobs": room, "job_poll_interval": f"{args.poll_interval}s"},
            "retry": {"max_retries": 3, "initial_backoff": "1s", "max_backoff": "10s"},
        },
        # Decisions are made when the jobs are submitted, all at once: a ramp slower than the default 600 s on a
        # loaded host must not turn the last jobs' decisions stale (that measures the host, not the pipeline).
        routing={"decision_max_age": "6h", "decision_max_age_blocks": 1_000_000},
        temporal={"address": address, "task_queue": f"load-{uuid.uuid4().hex[:6]}"},
        metrics={"listen": metrics, "jobs_refresh_interval": "0s", "sdk_metrics": False},
        logging={"level": "WARNING"},
    )


async def history_events(client: Client, job_ids: list[str]) -> list[int]:
    counts = []
    for job_id in job_ids:
        history = await client.get_workflow_handle(job_id).fetch_history()
        counts.append(len(history.events))
    return counts


async def retried_attempts(client: Client, job_ids: list[str]) -> dict[str, tuple[int, int]]:
    """Per activity type: (attempts that did not complete, of which heartbeat timeouts named by the next one)."""
    heartbeat = TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    found: dict[str, tuple[int, int]] = {}
    for job_id in job_ids:
        history = await client.get_workflow_handle(job_id).fetch_history()
        types: dict[int, str] = {}
        for event in history.events:
            if event.HasField("activity_task_scheduled_event_attributes"):
                types[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
            elif event.HasField("activity_task_started_event_attributes"):
                started = event.activity_task_started_event_attributes
                name = types.get(started.scheduled_event_id, "?")
                last = started.last_failure
                timed_out = (
                    last.HasField("timeout_failure_info")
                    and last.timeout_failure_info.timeout_type == heartbeat
                )
                retried, by_heartbeat = found.get(name, (0, 0))
                found[name] = (
                    retried + started.attempt - 1,
                    by_heartbeat + int(started.attempt > 1 and timed_out),
                )
    return {name: counts for name, counts in sorted(found.items()) if counts[0]}


def end_check(config: Config, job_ids: list[str]) -> list[str]:
    from activities.chain.local_ledger import LocalLedger
    from virtengine_hpc.usage import sum_metrics

    ledger = LocalLedger(config.ledger_path)
    problems = []
    for job_id in job_ids:
        job = ledger.job(job_id)
        if job is None or job.state.value != "completed":
            problems.append(f"{job_id}: {getattr(job, 'state', None)} {getattr(job, 'status_message', '')}")
            continue
        records = ledger.usage_records(job_id)
        if [r.sequence for r in records] != list(range(1, len(records) + 1)):
            problems.append(f"{job_id}: sequences {[r.sequence for r in records]}")
        if sum(r.is_final for r in records) != 1 or not records[-1].is_final:
            problems.append(f"{job_id}: is_final {[r.is_final for r in records]}")
        settlement = ledger.settlement(job_id)
        if settlement is None or settlement.charged + settlement.refunded != settlement.escrow:
            problems.append(f"{job_id}: settlement {settlement}")
        elif sum_metrics([r.metrics for r in records]).wall_clock_seconds < 1:
            problems.append(f"{job_id}: no wall clock recorded")
    return problems


async def load(args: argparse.Namespace) -> dict[str, object]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
        dev_server_log_level="error",
    )
    base = Path(tempfile.mkdtemp(prefix="vehpc-load-"))
    worker: subprocess.Popen[bytes] | None = None
    try:
        key = base / "provider.key"
        write_private_key(key)
        metrics = f"127.0.0.1:{free_port()}"
        config = worker_config(base, env.client.service_client.config.target_host, args, metrics)
        ledger = setup_ledger(config, Signer.from_file(key))
        config_path = base / "config.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        log = open(base / "worker.log", "wb")  # noqa: SIM115 - closed with the process
        worker = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "virtengine-hpc"),
                "-c",
                str(config_path),
                "worker",
                "run",
                "--poller",
            ],
            env={**os.environ, "PROVIDER_SIGNING_KEY_PATH": str(key)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc = psutil.Process(worker.pid)
        metrics_url = f"http://{metrics}/metrics"
        for _ in range(150):
            try:
                scrape(metrics_url)
                break
            except OSError:
                if worker.poll() is not None:
                    raise SystemExit((base / "worker.log").read_text()[-3000:]) from None
                await asyncio.sleep(0.2)
        await asyncio.sleep(2)
        proc.cpu_percent()
        idle = sample(proc, config.ledger_path, config.local_state_dir, metrics_url, time.monotonic())
        ledger.fund(TENANT, 50 * args.jobs)
        script = f"#!/bin/bash\nsleep {args.sleep}\n"
        job_ids = []
        for i in range(args.jobs):
            job_id = f"JOB-load-{i}-{uuid.uuid4().hex[:6]}"
            ledger.submit_job(
                {
                    "job_id": job_id,
                    "tenant": TENANT,
                    "provider": config.provider.address,
                    "offering_id": OFFERING,
                    "script": script,
                    "walltime_seconds": max(600, args.sleep * 2),
                    "max_price": "50",
                    "resources": {"memory_mb_per_node": 64},
                }
            )
            ledger.create_decision(job_id, config.hpc.cluster_id)
            job_ids.append(job_id)
        started = time.monotonic()
        run = Run()
        measured = False
        final = {"completed", "failed", "cancelled", "timeout"}
        while True:
            if worker.poll() is not None:
                raise SystemExit("the worker died: " + (base / "worker.log").read_text()[-3000:])
            s = sample(
                proc,
                config.ledger_path,
                config.local_state_dir,
                metrics_url,
                started,
                # Counting the job processes and their memory reads /proc for thousands of processes: once,
                # when all jobs run, so the benchmark does not load the machine it measures.
                processes=not measured and s_all_running(run, args.jobs),
            )
            measured = measured or s.children > 0
            run.samples.append(s)
            done = sum(s.states[state] for state in final)
            print(
                f"{s.at:6.0f}s  running {s.states['running']:5}  done {done:5}  worker {s.worker_rss / MIB:6.0f} MiB "
                f"cpu {s.worker_cpu:5.0f}%  queries {s.queries:6.0f}  load {os.getloadavg()[0]:5.1f}",
                flush=True,
            )
            if done >= args.jobs:
                break
            if s.children:
                print(
                    f"        {s.children} supervisor and job processes, {s.children_rss / MIB:.0f} MiB (PSS)"
                )
            if s.at > args.sleep * 4 + 600:
                raise SystemExit(f"not done after {s.at:.0f} s: {dict(s.states)}")
            await asyncio.sleep(2)
        histories = await history_events(env.client, job_ids[:: max(1, args.jobs // 25)])
        problems = end_check(config, job_ids)
        result = summarize(args, run, idle, histories, problems)
        result["attempts_retried"] = await retried_attempts(env.client, job_ids)
        result["attempts_cancelled"] = cancelled_attempts(metrics_url)
        return result
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
        await env.shutdown()


def summarize(
    args: argparse.Namespace, run: Run, idle: Sample, histories: list[int], problems: list[str]
) -> dict[str, object]:
    n = args.jobs
    all_running = run.first(lambda s: s.states["running"] >= n)
    peak = max(run.samples, key=lambda s: s.worker_rss)
    last = run.samples[-1]
    out: dict[str, object] = {
        "jobs": n,
        "sleep": args.sleep,
        "report_interval": args.report_interval,
        "heartbeat_timeout": args.heartbeat_timeout,
    }
    if all_running is not None:
        out["to_all_running_s"] = round(all_running.at, 1)
        out["start_rate"] = round(n / all_running.at, 1)
        steady = [s for s in run.samples if s.states["running"] >= n]
        window = steady[-1].at - steady[0].at
        out["steady_window_s"] = round(window, 1)
        if window > 0:
            intervals = window / args.poll_interval
            out["queries_per_interval"] = round((steady[-1].queries - steady[0].queries) / intervals, 2)
            reads = steady[-1].calls.get("usage", 0) - steady[0].calls.get("usage", 0)
            out["usage_reads_per_s"] = round(reads / window, 1)
            out["worker_cpu_steady"] = round(statistics.mean(s.worker_cpu for s in steady), 1)
        out["worker_rss_all_running_mib"] = round(statistics.median(s.worker_rss for s in steady) / MIB, 1)
        out["per_job_kib"] = round(
            (statistics.median(s.worker_rss for s in steady) - idle.worker_rss) / n / 1024, 1
        )
        out["supervisors_and_jobs_mib"] = round(max(s.children_rss for s in run.samples) / MIB, 1)
        out["job_processes"] = max(s.children for s in run.samples)
        first_done = run.first(lambda s: s.states["completed"] > 0)
        if first_done is not None:
            out["drain_s"] = round(last.at - first_done.at, 1)
            out["drain_rate"] = round(n / max(0.1, last.at - first_done.at), 1)
    out["worker_rss_idle_mib"] = round(idle.worker_rss / MIB, 1)
    out["worker_rss_peak_mib"] = round(peak.worker_rss / MIB, 1)
    out["total_s"] = round(last.at, 1)
    out["history_events"] = (min(histories), statistics.median(histories), max(histories))
    out["status_queries_total"] = last.queries
    out["scheduler_calls_total"] = last.calls
    out["end_check"] = "ok" if not problems else problems[:10]
    return out


def report(result: dict[str, object]) -> None:
    print()
    print(
        f"jobs running at once                 {result['jobs']} (each sleeps {result['sleep']} s, "
        f"usage record every {result['report_interval']} s, heartbeat timeout {result['heartbeat_timeout']:g} s)"
    )
    for key, label in [
        ("to_all_running_s", "submitted -> all running (s)"),
        ("start_rate", "jobs started per second"),
        ("steady_window_s", "all running for (s)"),
        ("queries_per_interval", "status queries per poll interval"),
        ("usage_reads_per_s", "usage readings per second (reports)"),
        ("worker_cpu_steady", "worker CPU while all run (% of a core)"),
        ("worker_rss_idle_mib", "worker RSS idle (MiB)"),
        ("worker_rss_all_running_mib", "worker RSS, all running (MiB)"),
        ("worker_rss_peak_mib", "worker RSS peak (MiB)"),
        ("per_job_kib", "worker memory per running job (KiB)"),
        ("job_processes", "supervisor and job processes"),
        ("supervisors_and_jobs_mib", "supervisors + jobs memory (PSS, MiB)"),
        ("drain_s", "first settled -> all settled (s)"),
        ("drain_rate", "jobs settled per second"),
        ("total_s", "total (s)"),
        ("history_events", "history events per job (min, median, max)"),
        ("status_queries_total", "status queries in all"),
        ("scheduler_calls_total", "scheduler calls by operation"),
        ("attempts_retried", "attempts retried (all, heartbeat timeouts)"),
        ("attempts_cancelled", "attempts the worker saw cancelled"),
        ("end_check", "end check"),
    ]:
        if key in result:
            print(f"{label:44} {result[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--sleep", type=int, default=300, help="seconds each job sleeps")
    parser.add_argument("--report-interval", type=int, default=60, help="seconds between usage records")
    parser.add_argument("--poll-interval", type=float, default=2.0, help="the local executor's poll interval")
    parser.add_argument(
        "--ratio-jobs", type=int, default=200, help="jobs per round of the pipeline ratio; 0: skip"
    )
    parser.add_argument("--ratio-rounds", type=int, default=2)
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=JobServiceConfig().activity_heartbeat_timeout.total_seconds(),
        help="hpc.job_service.activity_heartbeat_timeout in seconds (default: the product's default)",
    )
    args = parser.parse_args()
    result = asyncio.run(load(args))
    report(result)
    if args.ratio_jobs:
        for scheduler in ("local", "memory"):
            print(f"\n== pipeline against a bare workflow ({scheduler} scheduler) ==", flush=True)
            asyncio.run(pipeline.main(args.ratio_jobs, args.ratio_rounds, scheduler))
    if result["end_check"] != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
