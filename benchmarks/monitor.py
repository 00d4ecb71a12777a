"""Watching N held SLURM jobs with W worker processes: the cluster monitor against the per-job watch activity.

    VEHPC_DEV_DIR=<the dev state of the running SLURM cluster, default .dev>   # run as root
    .venv/bin/python benchmarks/monitor.py [--jobs 1000] [--old-jobs N] [--workers 2] [--interval 2] [--window 40]

Both designs in one run, one after the other, on the real SLURM cluster and one Temporal dev server, both of this
checkout: "old" is a heartbeating watch activity per job (``hpc.job_service.cluster_monitor: false``, the path a
job started before the monitor keeps), "new" the cluster monitor. (Older revisions cannot be run beside this one:
the poller here starts jobs with an input their workflow code refuses.) For each design: W worker
processes (``--serve`` mode of this file: the design's own worker wiring, the SLURM adapter over the local CLI,
submitting every job ``--hold`` so it never starts) serve one cluster task queue; N chain jobs are submitted on a
LocalLedger and started by the chain poller; once all N are queued on chain (held in SLURM), the benchmark waits
``--settle`` seconds and then, over ``--window`` seconds, counts:

* the controller's job-state RPCs (``sdiag``, REQUEST_JOB_INFO, REQUEST_JOB_INFO_SINGLE, REQUEST_JOB_USER_INFO),
  diffed before and after the window (``sdiag -r`` would reset every user's counters), and the same counts
  over a window before the design's workers started, so other users of the cluster can be told apart;
* the worker processes' RSS (idle before the jobs, and with N watched) and their CPU over the window;
* the history events of the watched jobs so far.

Afterwards every job's workflow is terminated and its held SLURM job cancelled; the job ids carry a token of the
run, and every SLURM job whose name holds it is cancelled too, also when the run fails or is interrupted (a job
submitted but not yet recorded on chain). Needs the SLURM cluster's ``MaxJobCount`` and the tenant account's
``MaxSubmitJobs`` to have room for N more jobs. A design that cannot get all N queued (``--old-jobs`` runs the old
one at a smaller N) is reported as such, with how far it got, and the run goes on with the next design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

CODE = Path(__file__).resolve().parents[1]
JOB_RPCS = ("REQUEST_JOB_INFO", "REQUEST_JOB_INFO_SINGLE", "REQUEST_JOB_USER_INFO")
RUN = uuid.uuid4().hex[:8]
"""In every job id of this run, so its SLURM jobs can be found and cancelled by name whatever happens."""
QUERY_USER = "nobody"
"""The user the workers' ``squeue`` runs as: nobody else on the cluster uses it."""


def sdiag(env: dict[str, str]) -> dict[str, int]:
    """RPC counts by message type, and by user as ``user:<name>``, from ``sdiag`` (cumulative)."""
    out = subprocess.run(["sdiag"], env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    counts: dict[str, int] = {}
    by_user = False
    for line in out.splitlines():
        by_user = by_user or "by user" in line
        found = re.match(r"\s*(\S+)\s+\(\s*\d+\)\s+count:(\d+)", line)
        if found:
            counts[f"user:{found.group(1)}" if by_user else found.group(1)] = int(found.group(2))
    return counts


def squeue_as(user: str, into: Path) -> Path:
    """A ``squeue`` that runs as ``user``: put first on the workers' PATH, it makes their status queries the only
    RPCs of that user in ``sdiag``, whatever else the cluster's other users run meanwhile."""
    wrapper = into / "squeue"
    wrapper.write_text(
        f'#!/bin/sh\nexec setpriv --reuid={user} --regid=65534 --clear-groups /usr/bin/squeue "$@"\n'
    )
    wrapper.chmod(0o755)
    return into


def slurm_env() -> tuple[dict[str, Any], dict[str, str]]:
    dev = Path(os.environ.get("VEHPC_DEV_DIR", str(CODE / ".dev")))
    env = json.loads((dev / "slurm" / "env.json").read_text())
    return env, {**os.environ, "SLURM_CONF": env["slurm_conf"]}


# ---- worker processes (--serve) -----------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    """One worker process of a design: its own code's wiring, the SLURM adapter holding every job it submits."""
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter

    from activities.schedulers.slurm.adapter import SlurmAdapter
    from virtengine_hpc.config import Secrets, load_config
    from workers.wiring import build_worker_deps
    from workers.worker import make_worker

    config = load_config(data=json.loads(Path(args.config).read_text()), env={})
    secrets = Secrets(provider_signing_key_path=Path(args.key))
    adapter = SlurmAdapter.from_config(config, secrets, config.hpc.cluster_id)
    adapter.hold = True
    deps = build_worker_deps(config, secrets, adapters={config.hpc.cluster_id: adapter}, nodes=False)
    client = await Client.connect(
        config.temporal.address, namespace=config.temporal.namespace, data_converter=pydantic_data_converter
    )
    async with make_worker(client, deps, queue=args.queue):
        import workflows.hpc_job

        print(f"worker of {workflows.hpc_job.__file__} on {args.queue}", flush=True)
        Path(args.ready).touch()
        await asyncio.Event().wait()


async def count_events(args: argparse.Namespace) -> None:
    """History events of one short job of the design's code (in-memory scheduler, real activities and chain), once
    without periodic reports and once with one every second: the fixed cost and the cost per report period."""
    import uuid as _uuid

    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from tests.conftest import binary, make_config
    from tests.memory_adapter import MemoryAdapter, Script
    from tests.pipeline_harness import running_pipeline
    from virtengine_hpc.signing import write_private_key
    from virtengine_hpc.states import JobState
    from workflows.hpc_job import SEARCH_ATTRIBUTES

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
        dev_server_log_level="error",
    )
    found: dict[str, tuple[int, int]] = {}
    try:
        for label, interval in (("fixed", "600s"), ("reports", "1s")):
            base = Path(tempfile.mkdtemp(prefix="vehpc-events-"))
            key = base / "provider.key"
            write_private_key(key)
            config = make_config(
                base,
                hpc={
                    "cluster_id": f"ev-{_uuid.uuid4().hex[:6]}",
                    "usage_reporting": {"report_interval": interval},
                    "job_service": {"cluster_monitor": not args.watch_activity},
                },
            )
            adapter = MemoryAdapter()
            adapter.default = Script(
                [(0, JobState.QUEUED), (1.0, JobState.RUNNING), (12.0, JobState.COMPLETED)], exit_code=0
            )
            async with running_pipeline(env.client, config, key, adapter, f"ev-{_uuid.uuid4().hex[:6]}") as p:
                job_id = p.submit()
                await p.run_until_done([job_id])
                events = [e async for e in p.handle(job_id).fetch_history_events()]
                found[label] = (len(events), len(p.ledger.usage_records(job_id)))
    finally:
        await env.shutdown()
    (fixed, _), (total, records) = found["fixed"], found["reports"]
    print(json.dumps({"short_job": fixed, "per_period": (total - fixed) / max(1, records - 1)}))


def events_of(design: Design) -> dict[str, float]:
    watch = [] if design.monitor else ["--watch-activity"]
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--events", "--code", str(design.code), *watch],
        env={**os.environ, "PYTHONPATH": str(design.code)},
        cwd=design.code,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# ---- the benchmark ------------------------------------------------------------------------------------------


@dataclass
class Design:
    name: str
    code: Path
    jobs: int
    monitor: bool


class DidNotGetThrough(RuntimeError):
    """A design's ramp stopped before all its jobs were queued."""


@dataclass
class Figures:
    design: str
    jobs: int
    started_in: float
    watched_in: float
    rpcs: dict[str, int]
    background: dict[str, int]
    window: float
    rounds: float
    rss_idle: int
    rss_watching: int
    cpu_seconds: float
    events: list[int]
    load: tuple[float, float] = (0.0, 0.0)
    """The machine's 1-minute load average when the window began and when it ended."""
    short_job: float = 0.0
    per_period: float = 0.0


def config_data(base: Path, env: dict[str, Any], address: str, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(CODE))
    from tests.slurm_cluster import slurm_section, tenants_section

    room = max(args.jobs, args.old_jobs or 0) + 100
    return {
        "hpc": {
            "scheduler_type": "slurm",
            "cluster_id": f"mon-{uuid.uuid4().hex[:6]}",
            "slurm": slurm_section(
                env,
                "cli",
                job_poll_interval=f"{args.interval}s",
                remote_env={
                    "PATH": f"{squeue_as(QUERY_USER, base)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                },
            ),
            # Jobs run as the tenant's own account, as in production (the tests' mapping).
            "tenants": {**tenants_section(env), "assignments_path": str(base / "tenant-accounts.db")},
            "job_service": {
                "max_concurrent_jobs": room,
                "job_poll_interval": "1s",
                "state_store_path": str(base / "state"),
                "vanished_job_grace": "120s",
            },
            "usage_reporting": {"report_interval": "300s"},
            "retry": {"max_retries": 3, "initial_backoff": "1s", "max_backoff": "10s"},
            "audit": {"log_path": str(base / "audit.log")},
        },
        # A ramp of 10,000 jobs takes longer than a decision's default age (600 s): the ramp measures the host,
        # not routing (a decision made at submission went stale before its job was routed).
        "routing": {"decision_max_age": "6h", "decision_max_age_blocks": 1_000_000},
        "provider": {"address": "virtengine1provider0bench"},
        "temporal": {"address": address, "deployment_name": None},
        "logging": {"level": "WARNING"},
    }


async def run_design(
    design: Design, args: argparse.Namespace, address: str, env: dict[str, Any], shell: dict[str, str]
) -> Figures:
    import psutil
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.service import RPCError

    from tests.pipeline_harness import setup_ledger
    from virtengine_hpc.config import load_config
    from virtengine_hpc.signing import Signer, write_private_key
    from virtengine_hpc.states import JobState
    from workers.poller import ChainPoller
    from workers.wiring import job_settings

    base = Path(tempfile.mkdtemp(prefix=f"vehpc-monitor-{design.name}-"))
    key = base / "provider.key"
    write_private_key(key)
    data = config_data(base, env, address, args)
    data["hpc"]["job_service"]["cluster_monitor"] = design.monitor
    config = load_config(data=data, env={})
    (base / "config.json").write_text(json.dumps(data))
    queue = f"bench-{design.name}-{uuid.uuid4().hex[:6]}"
    ledger = setup_ledger(config, Signer.from_file(key))
    ledger.fund("virtengine1tenant0alice", Decimal(100 * args.jobs))  # each job's escrow is its max price
    client = await Client.connect(address, data_converter=pydantic_data_converter)

    before = sdiag(shell)
    await asyncio.sleep(args.window)
    background = _diff(sdiag(shell), before)

    # Bytecode for the workers' imports: Temporal's sandbox imports the workflow modules afresh for every workflow
    # it loads, and with PYTHONDONTWRITEBYTECODE (set on the project machine) and no __pycache__ each load compiled
    # them from source (a third of a worker's CPU during a 10,000-job ramp, py-spy); an installed package has it.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "virtengine_hpc", "workflows", "activities", "workers"],
        cwd=design.code,
        check=True,
    )
    workers: list[subprocess.Popen[bytes]] = []
    job_ids: list[str] = []
    keep = False  # the run's directory (logs), kept when the design did not get through
    try:
        for n in range(args.workers):
            ready = base / f"ready-{n}"
            workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--serve",
                        "--config",
                        str(base / "config.json"),
                        "--key",
                        str(key),
                        "--queue",
                        queue,
                        "--ready",
                        str(ready),
                        "--code",
                        str(design.code),
                    ],
                    env={**shell, "PYTHONPATH": str(design.code)},
                    cwd=design.code,
                    stdout=open(base / f"worker-{n}.log", "wb"),  # noqa: SIM115 - closed with the process
                    stderr=subprocess.STDOUT,
                )
            )
            while not ready.exists():
                if workers[-1].poll() is not None:
                    raise RuntimeError(
                        f"worker {n} of {design.name} exited: {(base / f'worker-{n}.log').read_text()[-2000:]}"
                    )
                await asyncio.sleep(0.2)
        print(f"  {design.name}: {(base / 'worker-0.log').read_text().splitlines()[0]}", flush=True)
        procs = [psutil.Process(w.pid) for w in workers]
        await asyncio.sleep(3)
        rss_idle = sum(p.memory_info().rss for p in procs)

        job_ids = [
            ledger.submit_job(
                {
                    "job_id": f"JOB-{design.name}-{RUN}-{uuid.uuid4().hex[:10]}",
                    "tenant": "virtengine1tenant0alice",
                    "provider": config.provider.address,
                    "offering_id": "offering-standard",
                    "script": "#!/bin/bash\ntrue\n",
                    "walltime_seconds": 600,
                    "max_price": "100",
                }
            )
            for _ in range(design.jobs)
        ]
        for job_id in job_ids:
            ledger.create_decision(job_id, config.hpc.cluster_id)
        from activities.audit import AuditLog

        poller = ChainPoller(
            client,
            ledger,
            config,
            AuditLog(config.hpc.audit),
            task_queue=queue,
            settings=job_settings(config),
        )
        started = time.monotonic()
        queued, stuck = 0, 0
        while True:
            try:
                await poller.poll_once()
            except RPCError as exc:  # a production poller polls again at its next interval; so does this loop
                print(
                    f"  {design.name}: a poll failed ({exc.status.name}: {exc.message}); polling again",
                    flush=True,
                )
            jobs = [ledger.job(j) for j in job_ids]
            failed = [j for j in jobs if j is not None and j.state.final]
            if failed:
                raise DidNotGetThrough(
                    f"{len(failed)} jobs ended instead of waiting ({queued} queued): {failed[0].status_message}"
                )
            was, queued = queued, sum(1 for j in jobs if j is not None and j.state == JobState.QUEUED)
            elapsed = time.monotonic() - started
            print(f"  {design.name}: {queued}/{design.jobs} queued (held) after {elapsed:.0f} s", flush=True)
            if queued >= design.jobs:
                break
            stuck = 0 if queued > was else stuck + 5
            if stuck >= args.stall or elapsed >= args.ramp_limit:
                raise DidNotGetThrough(
                    f"{queued} of {design.jobs} queued after {elapsed:.0f} s, none for {stuck} s"
                )
            await asyncio.sleep(5)
        started_in = time.monotonic() - started
        if design.monitor:  # queued on chain is reported before the job registers with the monitor
            await _until_watched(client, queue, design.jobs, started, args)
        watched_in = time.monotonic() - started
        await asyncio.sleep(args.settle)

        cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        load0 = os.getloadavg()[0]
        before = sdiag(shell)
        t0 = time.monotonic()
        await asyncio.sleep(args.window)
        after = sdiag(shell)
        window = time.monotonic() - t0
        cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
        rss = sum(p.memory_info().rss for p in procs)
        events = []
        for job_id in job_ids[: min(len(job_ids), 50)]:
            events.append(len((await client.get_workflow_handle(job_id).fetch_history()).events))
        return Figures(
            design.name,
            design.jobs,
            started_in,
            watched_in,
            _diff(after, before),
            background,
            window,
            window / args.interval,
            rss_idle,
            rss,
            cpu,
            events,
            (load0, os.getloadavg()[0]),
        )
    except BaseException:
        keep = True
        print(f"  {design.name}: the workers' logs and the audit log are kept in {base}", flush=True)
        raise
    finally:
        await _clean_up(client, ledger, shell, workers, job_ids, queue)
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


async def _until_watched(
    client: Any, queue: str, jobs: int, started: float, args: argparse.Namespace
) -> None:
    """Until the cluster's monitor watches every job (its ``watched`` query), or the ramp's limits."""
    from virtengine_hpc.messages import WatchedSet, monitor_workflow_id

    watched, stuck = 0, 0.0
    while True:
        was = watched
        try:
            answer = await client.get_workflow_handle(monitor_workflow_id(queue)).query(
                "watched", result_type=WatchedSet, rpc_timeout=timedelta(seconds=60)
            )
            watched = len(answer.entries)
        except Exception as exc:  # a monitor busy or not started yet: asked again
            print(f"  the monitor did not answer ({exc})", flush=True)
        elapsed = time.monotonic() - started
        print(f"  new: {watched}/{jobs} watched by the monitor after {elapsed:.0f} s", flush=True)
        if watched >= jobs:
            return
        stuck = 0 if watched > was else stuck + 10
        if stuck >= args.stall or elapsed >= args.ramp_limit:
            raise DidNotGetThrough(
                f"{watched} of {jobs} watched after {elapsed:.0f} s, none more for {stuck:.0f} s"
            )
        await asyncio.sleep(10)


async def _clean_up(
    client: Any, ledger: Any, shell: dict[str, str], workers: list[Any], job_ids: list[str], queue: str
) -> None:
    """Stop the workers, cancel the run's held SLURM jobs (first: the cluster is shared) and close its workflows."""
    from temporalio.service import RPCError

    from virtengine_hpc.messages import monitor_workflow_id

    for w in workers:
        w.terminate()
    for w in workers:
        w.wait(timeout=60)
    held = [j.scheduler_job_id for j in map(ledger.job, job_ids) if j is not None and j.scheduler_job_id]
    for chunk in range(0, len(held), 500):
        subprocess.run(["scancel", *held[chunk : chunk + 500]], env=shell, check=False, timeout=120)
    cancel_run_jobs(shell)
    room = asyncio.Semaphore(32)

    async def terminate(workflow_id: str) -> None:
        async with room:
            with contextlib.suppress(RPCError):  # never started, or already closed
                await client.get_workflow_handle(workflow_id).terminate("benchmark over")

    await asyncio.gather(*(terminate(w) for w in [*job_ids, monitor_workflow_id(queue)]))


def cancel_run_jobs(shell: dict[str, str]) -> int:
    """Cancel every SLURM job of this run (its name holds ``RUN``), whoever's account it runs as."""
    listing = subprocess.run(
        ["squeue", "-h", "-o", "%i %j"], env=shell, capture_output=True, text=True, check=False, timeout=300
    ).stdout
    ours = [line.split()[0] for line in listing.splitlines() if RUN in line and line.split()]
    for chunk in range(0, len(ours), 500):
        subprocess.run(["scancel", *ours[chunk : chunk + 500]], env=shell, check=False, timeout=120)
    return len(ours)


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after.get(name, 0) - before.get(name, 0) for name in (*JOB_RPCS, f"user:{QUERY_USER}")}


def rpcs_per_squeue(shell: dict[str, str]) -> int:
    """How many RPCs one status query (``squeue -j`` of several ids) costs the controller, counted as above."""
    with tempfile.TemporaryDirectory() as scratch:
        wrapper = squeue_as(QUERY_USER, Path(scratch)) / "squeue"
        before = sdiag(shell)
        subprocess.run(
            [str(wrapper), "-h", "-t", "all", "-j", "1,2,3"], env=shell, capture_output=True, check=False
        )
        return _diff(sdiag(shell), before)[f"user:{QUERY_USER}"]


def report(figures: list[Figures], failed: dict[str, str], args: argparse.Namespace) -> None:
    print(
        f"\nheld jobs watched by {args.workers} worker processes, poll interval {args.interval} s, "
        f"window {args.window} s; one squeue costs the controller {args.rpcs_per_squeue} RPCs; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    for name, why in failed.items():
        print(f"{name}: did not get through: {why}")
    if not figures:
        return
    head = f"{'':44}" + "".join(f"{f.design:>16}" for f in figures)
    print(head)

    def row(label: str, values: list[str]) -> None:
        print(f"{label:44}" + "".join(f"{v:>16}" for v in values))

    ours = f"user:{QUERY_USER}"
    row("held jobs watched (N)", [str(f.jobs) for f in figures])
    row("time to N watched (s)", [f"{f.watched_in:.0f}" for f in figures])
    row("time to N queued (s)", [f"{f.started_in:.0f}" for f in figures])
    row(f"workers' squeue RPCs in the window ({QUERY_USER})", [str(f.rpcs[ours]) for f in figures])
    row(
        "  status queries per poll interval",
        [f"{f.rpcs[ours] / args.rpcs_per_squeue / f.rounds:.2f}" for f in figures],
    )
    for name in JOB_RPCS:
        row(f"{name}, all users, in the window", [str(f.rpcs[name]) for f in figures])
        row("  same, before the workers started", [str(f.background[name]) for f in figures])
    row("worker RSS idle (MiB)", [f"{f.rss_idle / 2**20:.0f}" for f in figures])
    row("worker RSS watching N (MiB)", [f"{f.rss_watching / 2**20:.0f}" for f in figures])
    row(
        "memory per watched job (KiB)",
        [f"{(f.rss_watching - f.rss_idle) / f.jobs / 1024:.1f}" for f in figures],
    )
    row("worker CPU while watching (% of a core)", [f"{100 * f.cpu_seconds / f.window:.1f}" for f in figures])
    row(
        "  per 1,000 watched jobs", [f"{100 * f.cpu_seconds / f.window / f.jobs * 1000:.2f}" for f in figures]
    )
    row("load average (1 min), window start / end", [f"{f.load[0]:.1f} / {f.load[1]:.1f}" for f in figures])
    row("history events per held job (max)", [str(max(f.events)) for f in figures])
    row("history events, short job start to settlement", [f"{f.short_job:.0f}" for f in figures])
    row("  per usage-report period", [f"{f.per_period:.1f}" for f in figures])


async def main(args: argparse.Namespace) -> None:
    from temporalio.testing import WorkflowEnvironment

    sys.path.insert(0, str(CODE))
    from tests.conftest import binary
    from workflows.hpc_job import SEARCH_ATTRIBUTES

    env, shell = slurm_env()
    args.rpcs_per_squeue = rpcs_per_squeue(shell)
    temporal = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
        dev_server_log_level="error",
    )
    try:
        address = temporal.client.service_client.config.target_host
        known = {
            "old": Design("old", CODE, args.old_jobs or args.jobs, monitor=False),
            "new": Design("new", CODE, args.jobs, monitor=True),
        }
        figures: list[Figures] = []
        failed: dict[str, str] = {}
        for name in args.designs.split(","):
            design = known[name]
            try:
                figure = await run_design(design, args, address, env, shell)
            except Exception as exc:  # reported; the next design still runs
                failed[f"{design.name} at N={design.jobs}"] = str(exc)
                print(f"  {design.name}: did not get through: {exc}", flush=True)
                continue
            if args.count_events:
                counted = events_of(design)
                figure.short_job, figure.per_period = counted["short_job"], counted["per_period"]
            figures.append(figure)
        report(figures, failed, args)
    finally:
        await temporal.shutdown()
        print(
            f"run {RUN}: {cancel_run_jobs(shell)} SLURM jobs of the run left to cancel at the end", flush=True
        )


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--interval", type=float, default=2.0, help="scheduler_poll_interval, seconds")
    parser.add_argument("--window", type=float, default=40.0, help="seconds counted")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds after all are queued, before counting"
    )
    parser.add_argument("--old-jobs", type=int, help="N for the old design (default: --jobs)")
    parser.add_argument("--designs", default="old,new", help="which designs, in this order")
    parser.add_argument(
        "--stall", type=float, default=600.0, help="give a design up when no job was queued for this long (s)"
    )
    parser.add_argument("--ramp-limit", type=float, default=3600.0, help="give a design's ramp up after (s)")
    parser.add_argument(
        "--no-events", dest="count_events", action="store_false", help="skip the short-job history count"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--events", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch-activity", action="store_true", help=argparse.SUPPRESS)
    for name in ("--config", "--key", "--queue", "--ready", "--code"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve or args.events:
        sys.path.insert(0, args.code)
        asyncio.run(serve(args) if args.serve else count_events(args))
    else:
        # A terminated run unwinds like an interrupted one: workers stopped, workflows closed, jobs cancelled.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
