"""Fault injection: jobs of every outcome through real processes while the machinery under them fails.

    .venv/bin/python benchmarks/chaos.py [--jobs 16] [--kills 4] [--seed N] [--slurmctld-outage 30]
                                         [--ledger-outage 40] [--no-temporal-restart] [--local N]

What runs, all as real processes: a Temporal dev server on a SQLite file (so a restart keeps its state), the
production worker (``virtengine-hpc worker run``) and chain poller (``virtengine-hpc poller run``), the LocalLedger
as the chain, and the jobs on the local SLURM cluster (``temporal-dev/slurm-up.sh``; CLI transport) and, with
``--local N``, N more on the local executor. Jobs of four kinds are submitted at once on the ledger: ``complete``
(sleeps a few seconds), ``fail`` (exit 3), ``timeout`` (runs past its walltime) and ``cancel`` (cancelled by the
tenant on chain once it runs). Each job appends a line to a marker file each time its script starts.

The faults, at seeded random or fixed moments while the jobs are in every phase:

* the worker is killed with SIGKILL ``--kills`` times (a new one starts 0.5-3 s later);
* the Temporal dev server is killed with SIGKILL and started again on the same database;
* slurmctld is stopped for ``--slurmctld-outage`` seconds (only when no other pytest is using the shared
  cluster, unless ``--force-slurm-outage``; always brought back with ``temporal-dev/slurm-up.sh``);
* the ledger becomes unwritable for ``--ledger-outage`` seconds: another process holds SQLite's write lock on it,
  so every chain write waits out its busy timeout (30 s) and fails with ``ChainUnavailable`` (transient), to be
  retried. Reads go on (WAL).

Then, per invariant, it prints PASS or FAIL with the evidence, and exits 1 on any violation:

1. every job reached the terminal state of its kind (and ``fail`` kept its exit code), every workflow completed;
2. exactly one scheduler job per chain job (SLURM: ``sacct`` and ``squeue`` by the job's name and any marker tag; local: its job
   directory), the one the chain and the workflow name, and its script ran exactly once (markers);
3. usage record sequences are gapless and unique, and the workflow counts as many as the chain holds;
4. exactly one ``is_final`` record, the last, per job that ran; none for a job that never ran;
5. the period records add up to the scheduler's own final accounting (the adapter's final reading);
6. the settlement is what the records price to, and charge + refund = escrow;
7. every record's signature verifies with the provider's key;
8. the audit log's hash chain verifies (several processes appended to it, some killed mid-run);
9. no workflow task failed (replay stayed deterministic across kills and the server restart).

``tests/test_chaos.py`` runs a small version of this in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psutil
import yaml
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from activities.audit import read_events, verify_log  # noqa: E402
from activities.chain.local_ledger import LocalLedger, settle_amounts  # noqa: E402
from activities.schedulers.base import SchedulerAdapter  # noqa: E402
from tests.local_support import TENANT_POOL, running_as_root  # noqa: E402
from virtengine_hpc.config import Config, Secrets, load_config  # noqa: E402
from virtengine_hpc.errors import ChainUnavailable, HPCError  # noqa: E402
from virtengine_hpc.messages import JobResult  # noqa: E402
from virtengine_hpc.metering import meter  # noqa: E402
from virtengine_hpc.models import Cluster, Partition, PricedQueue, Pricing, Resources, UsageMetrics  # noqa: E402
from virtengine_hpc.signing import Signer, public_key_b64, write_private_key  # noqa: E402
from virtengine_hpc.states import JobState  # noqa: E402
from virtengine_hpc.usage import sum_metrics, verify_record  # noqa: E402
from workflows.hpc_job import SEARCH_ATTRIBUTES  # noqa: E402

TENANT = "virtengine1tenant0chaos"
PROVIDER = "virtengine1provider0chaos"
BIN = Path(sys.executable).parent
EXPECTED = {
    "complete": JobState.COMPLETED,
    "fail": JobState.FAILED,
    "timeout": JobState.TIMEOUT,
    "cancel": JobState.CANCELLED,
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Running and not a zombie (zombies linger a moment under this machine's PID 1)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---- the processes ----------------------------------------------------------------------------------------------


class TemporalServer:
    """``temporal server start-dev`` on a SQLite file, killable and restartable on the same port and data."""

    def __init__(self, base: Path) -> None:
        self.port = free_port()
        self.db = base / "temporal.sqlite"
        self.log = base / "temporal.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            str(BIN / "temporal"),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db),
            "--log-level",
            "error",
        ]
        for key in SEARCH_ATTRIBUTES:
            args += ["--search-attribute", f"{key.name}=Keyword"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = subprocess.run(
                [str(BIN / "temporal"), "operator", "cluster", "health", "--address", self.address],
                capture_output=True,
                text=True,
            )
            if "SERVING" in health.stdout:
                return
            time.sleep(0.2)
        raise RuntimeError(f"Temporal did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


class Service:
    """A ``virtengine-hpc`` process (worker or poller), started again after each kill; output appended to one log."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            out.write(
                f"\n==== {self.name} start {self.starts + 1} at {time.strftime('%H:%M:%S')} ====\n".encode()
            )
            out.flush()
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=out, stderr=out)
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() not in (None, -signal.SIGKILL):
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the {self.name} exited with {self.proc.returncode}:\n{tail}")


class LedgerLock:
    """Another process holding the ledger's write lock (``BEGIN IMMEDIATE``): chain writes wait, then fail."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen[str] | None = None

    def hold(self, seconds: float) -> None:
        code = (
            "import sqlite3, sys, time\n"
            f"db = sqlite3.connect({str(self.path)!r}, isolation_level=None, timeout=60)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "print('locked', flush=True)\n"
            f"time.sleep({seconds})\n"
            "db.execute('ROLLBACK')\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "locked":
            raise RuntimeError("could not take the ledger's write lock")

    def release(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def other_pytests() -> list[int]:
    """pytest processes other than this process and its ancestors: someone else may be using the cluster."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in mine and "pytest" in cmdline:
            found.append(proc.info["pid"])
    return found


class Slurmctld:
    """Stop the shared cluster's controller through its pid file, as an operator would; bring it back with
    ``temporal-dev/slurm-up.sh`` (which leaves running daemons alone)."""

    def __init__(self, env: dict[str, Any]) -> None:
        self.pid_file = Path(env["state_dir"]) / "run" / "slurm" / "slurmctld.pid"
        self.down = False

    def stop(self) -> None:
        pid = int(self.pid_file.read_text().strip())
        self.down = True
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if alive(pid):
            raise RuntimeError("slurmctld did not stop")

    def start(self) -> None:
        subprocess.run(
            [str(REPO / "temporal-dev" / "slurm-up.sh")], check=True, capture_output=True, timeout=300
        )
        self.down = False


# ---- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class PlannedJob:
    job_id: str
    kind: str
    cluster_id: str
    script: str
    walltime: int
    cancel_after: float = 0.0
    cancel_requested: bool = False
    running_since: float | None = None

    @property
    def expected(self) -> JobState:
        return EXPECTED[self.kind]


@dataclass
class Fault:
    at: float
    name: str
    action: Callable[[], Awaitable[None]]


@dataclass
class Plan:
    """What to run: job kinds per cluster and the faults. ``slurm`` is the cluster's env.json (None: no SLURM)."""

    slurm: dict[str, Any] | None
    slurm_jobs: dict[str, int] = field(default_factory=dict)
    local_jobs: dict[str, int] = field(default_factory=dict)
    kills: int = 4
    kill_window: tuple[float, float] = (8.0, 140.0)
    temporal_restart_at: float | None = 35.0
    slurmctld_outage_at: float | None = 60.0
    slurmctld_outage: float = 30.0
    ledger_outage_at: float | None = 100.0
    ledger_outage: float = 40.0
    force_slurm_outage: bool = False
    seed: int = 0
    timeout: float = 900.0
    local_walltime: float = 30.0
    """The local executor stops jobs at this walltime (the model's minimum of 60 s would make timeouts slow);
    long enough that a cancellation delayed by the faults still arrives before it."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Outcome:
    checks: list[Check]
    jobs: list[dict[str, Any]]
    faults: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def print(self) -> None:
        print("\nfaults injected:")
        for line in self.faults:
            print(f"  {line}")
        print("\njobs:")
        header = ("job", "kind", "cluster", "state", "sched id", "runs", "records", "charged")
        print("  " + "  ".join(f"{h:<14}" for h in header))
        for job in self.jobs:
            print("  " + "  ".join(f"{job.get(h, '')!s:<14}"[:14] for h in header))
        print("\ninvariants:")
        for check in self.checks:
            print(f"  {'PASS' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
        print(f"\n{'all invariants hold' if self.ok else 'VIOLATIONS'} ({self.seconds:.0f} s)")


# ---- the run ----------------------------------------------------------------------------------------------------


class ChaosRun:
    def __init__(self, base: Path, plan: Plan) -> None:
        self.base = base
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.run_id = uuid.uuid4().hex[:6]
        # SLURM jobs run as a tenant's account, which must reach the markers: beside the cluster's job directories
        # (the base may sit below a directory only root can enter, such as pytest's).
        root = Path(plan.slurm["jobs_dir"]) if plan.slurm_jobs and plan.slurm else base
        self.markers = root / f"chaos-runs-{self.run_id}"
        self.markers.mkdir(parents=True, exist_ok=True)
        self.markers.chmod(0o1777)
        self.temporal = TemporalServer(base)
        self.key = base / "keys" / "provider.key"
        write_private_key(self.key)
        self.local_id = f"chaos-local-{self.run_id}"
        self.slurm_id = f"chaos-slurm-{self.run_id}"
        self.jobs: list[PlannedJob] = []
        self.fault_log: list[str] = []
        self.started = 0.0
        self.slurmctld: Slurmctld | None = None
        self.lock: LedgerLock | None = None

    # ---- set-up ----
    def config(self) -> Config:
        clusters: list[dict[str, Any]] = []
        # Local jobs run as a tenant account under a root worker (temporal-dev/slurm-up.sh makes the pool).
        tenants: dict[str, Any] = (
            {"accounts": {TENANT: TENANT_POOL[0]}} if running_as_root() else {"isolation": "none"}
        )
        if self.plan.local_jobs:
            clusters.append(
                {
                    "cluster_id": self.local_id,
                    "scheduler_type": "local",
                    "local": {
                        "allow_unisolated": True,  # the local executor runs only when a config opts in
                        "job_poll_interval": "1s",
                        "max_walltime": f"{self.plan.local_walltime:.0f}s",
                        "kill_wait": "2s",
                    },
                }
            )
        if self.plan.slurm_jobs:
            assert self.plan.slurm is not None, "SLURM jobs need the SLURM cluster"
            from tests.slurm_cluster import slurm_section, tenant_accounts

            tenants = {"accounts": {TENANT: tenant_accounts(self.plan.slurm)[0]}}
            clusters.append(
                {
                    "cluster_id": self.slurm_id,
                    "scheduler_type": "slurm",
                    "slurm": slurm_section(self.plan.slurm, "cli", job_poll_interval="1s"),
                }
            )
        state = self.base / "state"
        return load_config(
            data={
                "hpc": {
                    "scheduler_type": clusters[0]["scheduler_type"],
                    "cluster_id": clusters[0]["cluster_id"],
                    "clusters": clusters,
                    "job_service": {
                        "job_poll_interval": "1s",
                        "state_store_path": str(state),
                        "vanished_job_grace": "120s",
                    },
                    "usage_reporting": {"report_interval": "5s"},
                    "retry": {"max_retries": 3, "initial_backoff": "500ms", "max_backoff": "5s"},
                    "audit": {"log_path": str(self.base / "audit.log")},
                    "tenants": tenants,
                },
                "provider": {"address": PROVIDER},
                "temporal": {"address": self.temporal.address, "task_queue": f"chaos-{self.run_id}"},
                "logging": {"level": "INFO"},
            },
            env={},
        )

    def setup_ledger(self, config: Config) -> LocalLedger:
        ledger = LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)
        partitions = {
            self.local_id: "debug",
            self.slurm_id: (self.plan.slurm or {}).get("partition", "debug"),
        }
        for cluster_id in config.cluster_ids():
            ledger.register_cluster(
                Cluster(
                    cluster_id=cluster_id,
                    provider=PROVIDER,
                    name=cluster_id,
                    partitions=(
                        Partition(
                            name=partitions[cluster_id], nodes=1, max_nodes=1, max_runtime_seconds=86400
                        ),
                    ),
                    total_nodes=1,
                    available_nodes=1,
                )
            )
            ledger.add_queue(
                PricedQueue(
                    offering_id=f"offering-{cluster_id}",
                    cluster_id=cluster_id,
                    partition=partitions[cluster_id],
                    pricing=Pricing(
                        node_hour=Decimal(36),
                        core_hour=Decimal("3.6"),
                        memory_gb_hour=Decimal("0.36"),
                        minimum_charge=Decimal("0.01"),
                    ),
                )
            )
        ledger.register_provider_key(PROVIDER, public_key_b64(Signer.from_file(self.key).public_key))
        ledger.fund(TENANT, Decimal(1_000_000))
        return ledger

    def plan_jobs(self) -> None:
        for cluster_id, kinds in (
            (self.slurm_id, self.plan.slurm_jobs),
            (self.local_id, self.plan.local_jobs),
        ):
            for kind, count in kinds.items():
                for _ in range(count):
                    self.jobs.append(self._job(kind, cluster_id, len(self.jobs)))
        self.rng.shuffle(self.jobs)

    def _job(self, kind: str, cluster_id: str, n: int) -> PlannedJob:
        job_id = f"CHAOS-{self.run_id}-{n:02d}-{kind}"
        marker = self.markers / job_id
        start = f'#!/bin/bash\necho "$(date +%s.%N) ${{SLURM_JOB_ID:-local}}" >> {marker}\n'
        if kind == "complete":
            body = f"sleep {self.rng.randint(3, 9)}\necho done\n"
        elif kind == "fail":
            body = "sleep 2\necho failing >&2\nexit 3\n"
        else:  # timeout, cancel: run until stopped
            body = "sleep 600\n"
        return PlannedJob(
            job_id=job_id,
            kind=kind,
            cluster_id=cluster_id,
            script=start + body,
            walltime=60 if kind == "timeout" else 900,
            cancel_after=self.rng.uniform(2, 6),
        )

    def submit(self, ledger: LocalLedger) -> None:
        for job in self.jobs:
            ledger.submit_job(
                {
                    "job_id": job.job_id,
                    "tenant": TENANT,
                    "provider": PROVIDER,
                    "offering_id": f"offering-{job.cluster_id}",
                    "name": job.kind,
                    "script": job.script,
                    "walltime_seconds": job.walltime,
                    "max_price": "100",
                    "resources": {"memory_mb_per_node": 256},
                }
            )
            ledger.create_decision(job.job_id, job.cluster_id)

    # ---- faults ----
    def faults(self, worker: Service, config: Config) -> list[Fault]:
        plan = self.plan
        out: list[Fault] = []
        low, high = plan.kill_window
        times: list[float] = []
        for _ in range(1000):  # random moments at least 6 s apart; evenly spaced if the window is too tight
            if len(times) == plan.kills:
                break
            at = self.rng.uniform(low, high)
            if all(abs(at - t) >= 6 for t in times):
                times.append(at)
        else:
            step = (high - low) / max(1, plan.kills)
            times = [low + step * (i + 0.5) for i in range(plan.kills)]

        def kill_worker(n: int) -> Callable[[], Awaitable[None]]:
            async def act() -> None:
                worker.kill()
                delay = self.rng.uniform(0.5, 3.0)
                self.note(f"worker SIGKILLed (kill {n}); a new one starts in {delay:.1f} s")
                await asyncio.sleep(delay)
                worker.start()

            return act

        out += [Fault(at, f"kill {i + 1}", kill_worker(i + 1)) for i, at in enumerate(sorted(times))]
        if plan.temporal_restart_at is not None:

            async def restart_temporal() -> None:
                self.temporal.kill()
                self.note("Temporal dev server SIGKILLed")
                await asyncio.sleep(3)
                await asyncio.to_thread(self.temporal.start)
                self.note("Temporal dev server started again on the same database")

            out.append(Fault(plan.temporal_restart_at, "temporal restart", restart_temporal))
        if plan.slurmctld_outage_at is not None and plan.slurm is not None and plan.slurm_jobs:

            async def slurm_outage() -> None:
                others = other_pytests()
                if others and not plan.force_slurm_outage:
                    self.note(f"slurmctld outage SKIPPED: other pytest processes use the cluster ({others})")
                    return
                assert self.slurmctld is not None
                await asyncio.to_thread(self.slurmctld.stop)
                self.note(f"slurmctld stopped for {plan.slurmctld_outage:.0f} s")
                try:
                    await asyncio.sleep(plan.slurmctld_outage)
                finally:
                    await asyncio.to_thread(self.slurmctld.start)
                self.note("slurmctld back (temporal-dev/slurm-up.sh)")

            out.append(Fault(plan.slurmctld_outage_at, "slurmctld outage", slurm_outage))
        if plan.ledger_outage_at is not None:

            async def ledger_outage() -> None:
                self.lock = LedgerLock(config.ledger_path)
                await asyncio.to_thread(self.lock.hold, plan.ledger_outage)
                self.note(f"ledger write lock held by another process for {plan.ledger_outage:.0f} s")
                await asyncio.sleep(plan.ledger_outage)
                self.lock.release()
                self.note("ledger write lock released")

            out.append(Fault(plan.ledger_outage_at, "ledger outage", ledger_outage))
        return sorted(out, key=lambda fault: fault.at)

    def note(self, message: str) -> None:
        line = f"{time.monotonic() - self.started:6.1f}s  {message}"
        self.fault_log.append(line)
        log(message)

    async def inject(self, faults: Sequence[Fault], done: asyncio.Event) -> None:
        running: list[asyncio.Task[None]] = []
        for fault in faults:
            wait = fault.at - (time.monotonic() - self.started)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), wait)
            if done.is_set():
                self.note(f"{fault.name}: not injected, every job had ended")
                continue
            running.append(asyncio.ensure_future(fault.action()))
        await asyncio.gather(*running)

    # ---- the tenant's side: cancellations ----
    def _tenant_cancels(self, ledger: LocalLedger, states: dict[str, str]) -> None:
        now = time.monotonic()
        for job in self.jobs:
            if job.kind != "cancel" or job.cancel_requested:
                continue
            if states.get(job.job_id) == "running" and job.running_since is None:
                job.running_since = now
            if job.running_since is not None and now - job.running_since >= job.cancel_after:
                try:
                    ledger.request_cancel(job.job_id, tenant=TENANT)
                except ChainUnavailable:
                    continue  # the chain is busy for the tenant too: ask again next round
                job.cancel_requested = True

    # ---- main loop ----
    async def run(self) -> Outcome:
        self.temporal.start()
        config = self.config()
        config_path = self.base / "config.yaml"
        config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        ledger = self.setup_ledger(config)
        if self.plan.slurm is not None:
            self.slurmctld = Slurmctld(self.plan.slurm)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("VIRTENGINE_HPC")},
            "PROVIDER_SIGNING_KEY_PATH": str(self.key),
        }
        cli = [str(BIN / "virtengine-hpc"), "-c", str(config_path)]
        worker = Service("worker", [*cli, "worker", "run"], env, self.base / "worker.log")
        poller = Service("poller", [*cli, "poller", "run"], env, self.base / "poller.log")
        self.plan_jobs()
        done = asyncio.Event()
        verified = False
        try:
            worker.start()
            poller.start()
            self.started = time.monotonic()
            self.submit(ledger)
            log(f"{len(self.jobs)} jobs submitted; state under {self.base}")
            faults = asyncio.create_task(self.inject(self.faults(worker, config), done))
            try:
                await self.wait_until_done(ledger, worker, poller, done)
                await faults
            finally:
                done.set()
                if self.lock is not None:
                    self.lock.release()
                if self.slurmctld is not None and self.slurmctld.down:
                    self.slurmctld.start()
                faults.cancel()
                worker.stop()
                poller.stop()
            seconds = time.monotonic() - self.started
            if self.plan.slurm_jobs:
                await asyncio.sleep(6)  # accounting lags the controller by ~5 s
            outcome = await self.verify(config, ledger, seconds)
            verified = True
            return outcome
        finally:
            if not verified:
                worker.kill()
                poller.kill()
            self.temporal.kill()
            self.cancel_leftovers()

    def cancel_leftovers(self) -> None:
        """A run that stopped early must not leave jobs occupying the shared cluster."""
        if not self.plan.slurm_jobs or self.plan.slurm is None:
            return
        from tests.slurm_cluster import slurm_command

        prefix = f"vehpc-CHAOS-{self.run_id}-"
        lines = slurm_command(self.plan.slurm, ["squeue", "-h", "-o", "%A|%j"]).splitlines()
        ids = [line.split("|", 1)[0] for line in lines if line.partition("|")[2].startswith(prefix)]
        if ids:
            slurm_command(self.plan.slurm, ["scancel", *ids])
            log(f"cancelled {len(ids)} leftover Slurm jobs")

    async def wait_until_done(
        self, ledger: LocalLedger, worker: Service, poller: Service, done: asyncio.Event
    ) -> None:
        final = {"completed", "failed", "timeout", "cancelled"}
        last: dict[str, str] = {}
        while True:
            worker.check()
            poller.check()
            elapsed = time.monotonic() - self.started
            if elapsed > self.plan.timeout:
                raise RuntimeError(f"not done after {elapsed:.0f} s: {last}")
            states = job_states(ledger.path)
            await asyncio.to_thread(self._tenant_cancels, ledger, states)
            if states != last:
                counts: dict[str, int] = {}
                for state in states.values():
                    counts[state] = counts.get(state, 0) + 1
                log(f"{elapsed:6.1f}s  {dict(sorted(counts.items()))}")
                last = states
            if len(states) == len(self.jobs) and all(s in final for s in states.values()):
                done.set()
                return
            await asyncio.sleep(1)

    # ---- the invariants ----
    async def verify(self, config: Config, ledger: LocalLedger, seconds: float) -> Outcome:
        client = await Client.connect(self.temporal.address, data_converter=pydantic_data_converter)
        public = Signer.from_file(self.key).public_key
        adapters = self.adapters(config)
        results: dict[str, JobResult | None] = {}
        task_failures: dict[str, int] = {}
        for job in self.jobs:
            handle = client.get_workflow_handle(job.job_id, result_type=JobResult)
            desc = await handle.describe()
            results[job.job_id] = (
                await handle.result() if desc.status == WorkflowExecutionStatus.COMPLETED else None
            )
            history = await handle.fetch_history()
            task_failures[job.job_id] = sum(
                1 for e in history.events if e.HasField("workflow_task_failed_event_attributes")
            )
        rows: list[dict[str, Any]] = []
        failures: dict[str, list[str]] = {name: [] for name in INVARIANTS}
        for job in self.jobs:
            row = await self.check_job(job, ledger, results[job.job_id], adapters, public, failures)
            rows.append(row)
            if task_failures[job.job_id]:
                failures["deterministic replay"].append(
                    f"{job.job_id}: {task_failures[job.job_id]} workflow task failures"
                )
        for adapter in adapters.values():
            await adapter.close()
        audit = verify_log(config.hpc.audit.log_path)
        if not audit.ok:
            failures["audit chain"].append(f"line {audit.bad_line}: {audit.error}")
        details = {
            "terminal states": f"{len(self.jobs)} jobs, all workflows completed",
            "exactly one scheduler job": "one scheduler job and one execution per job that was submitted",
            "usage sequences": f"{sum(r['records'] for r in rows)} records, gapless and unique",
            "one final record": "one is_final, the last, per job that ran; none for the rest",
            "records add up to the scheduler's accounting": "sum of records = the adapter's final reading",
            "settlement": "charge = price of the records, charge + refund = escrow",
            "signatures": "every record verifies with the provider's key",
            "audit chain": f"{audit.lines} lines verify",
            "deterministic replay": "no workflow task failed",
        }
        checks = [
            Check(
                name, not failures[name], "; ".join(failures[name][:5]) if failures[name] else details[name]
            )
            for name in INVARIANTS
        ]
        self.fault_log.append(self.evidence(config))
        return Outcome(checks, rows, self.fault_log, seconds)

    def adapters(self, config: Config) -> dict[str, SchedulerAdapter]:
        from workers.wiring import build_adapter

        return {
            cluster_id: build_adapter(config, Secrets(), cluster_id) for cluster_id in config.cluster_ids()
        }

    async def check_job(
        self,
        job: PlannedJob,
        ledger: LocalLedger,
        result: JobResult | None,
        adapters: dict[str, SchedulerAdapter],
        public: Any,
        fail: dict[str, list[str]],
    ) -> dict[str, Any]:
        chain = ledger.job(job.job_id)
        assert chain is not None
        records = ledger.usage_records(job.job_id)
        runs = self.executions(job)
        # A job that started and failed between two polls goes queued -> failed on chain, yet it ran (and is
        # billed for its seconds): its own executions count as evidence too.
        ran = runs > 0 or any(t.to_state.value in ("running", "starting") for t in ledger.history(job.job_id))
        scheduler_ids = await self.scheduler_jobs(job, chain.scheduler_job_id)
        row = {
            "job": job.job_id.rsplit("-", 2)[-2],
            "kind": job.kind,
            "cluster": "slurm" if job.cluster_id == self.slurm_id else "local",
            "state": chain.state.value,
            "sched id": chain.scheduler_job_id or "-",
            "runs": runs,
            "records": len(records),
            "charged": "-",
        }
        self.check_outcome(job, chain, result, scheduler_ids, runs, ran, fail)
        self.check_records(job, records, result, ran, public, fail)
        total = sum_metrics([r.metrics for r in records])
        if records and chain.scheduler_job_id is not None:
            await self.compare_accounting(job, chain.scheduler_job_id, total, adapters, fail)
        settlement = ledger.settlement(job.job_id)
        queue = ledger.queue(f"offering-{job.cluster_id}")
        if settlement is None or queue is None:
            fail["settlement"].append(f"{job.job_id}: not settled")
        else:
            expected = settle_amounts(total, queue, chain.escrow) if records else (Decimal(0), chain.escrow)
            if (settlement.charged, settlement.refunded) != expected:
                fail["settlement"].append(
                    f"{job.job_id}: settled {settlement.charged}/{settlement.refunded}, records price to {expected}"
                )
            if result is not None and records and result.charged != str(settlement.charged):
                fail["settlement"].append(f"{job.job_id}: workflow says charged {result.charged}")
            row["charged"] = str(settlement.charged)
        return row

    @staticmethod
    def check_outcome(
        job: PlannedJob,
        chain: Any,
        result: JobResult | None,
        scheduler_ids: list[str],
        runs: int,
        ran: bool,
        fail: dict[str, list[str]],
    ) -> None:
        """Invariants 1 and 2: the right end, and one scheduler job that ran once."""
        if result is None:
            fail["terminal states"].append(f"{job.job_id}: workflow did not complete")
        elif result.state != job.expected or chain.state != job.expected:
            fail["terminal states"].append(
                f"{job.job_id} ({job.kind}): chain {chain.state.value}, workflow {result.state.value}: "
                f"{chain.status_message[:120]}"
            )
        elif job.kind == "fail" and chain.exit_code != 3:
            fail["terminal states"].append(f"{job.job_id}: exit code {chain.exit_code}, expected 3")
        submitted = chain.scheduler_job_id is not None
        if submitted and scheduler_ids != [chain.scheduler_job_id]:
            fail["exactly one scheduler job"].append(
                f"{job.job_id}: scheduler holds {scheduler_ids}, chain says {chain.scheduler_job_id}"
            )
        if not submitted and scheduler_ids:
            fail["exactly one scheduler job"].append(
                f"{job.job_id}: never submitted but found {scheduler_ids}"
            )
        if result is not None and result.scheduler_job_id != chain.scheduler_job_id:
            fail["exactly one scheduler job"].append(
                f"{job.job_id}: workflow names {result.scheduler_job_id}"
            )
        if runs > 1 or (job.kind != "cancel" and runs != 1) or (runs == 0 and ran):
            fail["exactly one scheduler job"].append(f"{job.job_id}: the script ran {runs} times")

    @staticmethod
    def check_records(
        job: PlannedJob,
        records: list[Any],
        result: JobResult | None,
        ran: bool,
        public: Any,
        fail: dict[str, list[str]],
    ) -> None:
        """Invariants 3, 4 and 7: gapless unique sequences, one final record, valid signatures."""
        sequences = [r.sequence for r in records]
        unique = len({r.record_id for r in records}) == len(records)
        if sequences != list(range(1, len(records) + 1)) or not unique:
            fail["usage sequences"].append(f"{job.job_id}: sequences {sequences}")
        if result is not None and result.usage_records != len(records):
            fail["usage sequences"].append(
                f"{job.job_id}: workflow counts {result.usage_records}, chain holds {len(records)}"
            )
        finals = [r.sequence for r in records if r.is_final]
        if ran and (finals != [len(records)] or not records):
            fail["one final record"].append(f"{job.job_id}: final records at {finals} of {len(records)}")
        if not ran and records:
            fail["one final record"].append(f"{job.job_id}: never ran but has {len(records)} records")
        bad = [r.sequence for r in records if not verify_record(r, public)]
        if bad:
            fail["signatures"].append(f"{job.job_id}: records {bad} do not verify")

    async def compare_accounting(
        self,
        job: PlannedJob,
        scheduler_job_id: str,
        total: UsageMetrics,
        adapters: dict[str, SchedulerAdapter],
        fail: dict[str, list[str]],
    ) -> None:
        try:
            accounting = await adapters[job.cluster_id].usage(scheduler_job_id)
        except HPCError as exc:
            fail["records add up to the scheduler's accounting"].append(f"{job.job_id}: {exc}")
            return
        final = meter(accounting.reading, Resources(memory_mb_per_node=256)).metrics  # what every job asks
        if not accounting.final:
            fail["records add up to the scheduler's accounting"].append(f"{job.job_id}: accounting not final")
        differ = [
            f"{name} {getattr(total, name)} != {getattr(final, name)}"
            for name in UsageMetrics.model_fields
            if getattr(total, name) != getattr(final, name)
        ]
        if differ:
            fail["records add up to the scheduler's accounting"].append(f"{job.job_id}: " + ", ".join(differ))

    def executions(self, job: PlannedJob) -> int:
        marker = self.markers / job.job_id
        return len(marker.read_text().splitlines()) if marker.exists() else 0

    async def scheduler_jobs(self, job: PlannedJob, known: str | None) -> list[str]:
        """Every scheduler job that carries this chain job, found independently of the adapter."""
        if job.cluster_id == self.slurm_id:
            assert self.plan.slurm is not None
            from tests.slurm_cluster import slurm_command

            # By name, whatever marker tag follows it (vehpc-<workflow id>.<tag>; vehpc-<workflow id> before tags).
            name = f"vehpc-{job.job_id}"
            accounted = slurm_command(
                self.plan.slurm,
                ["sacct", "-a", "-X", "-P", "-n", "-S", "now-1days", "-o", "JobIDRaw,JobName"],
            )
            queued = slurm_command(self.plan.slurm, ["squeue", "-h", "-t", "all", "-o", "%A|%j"])
            rows = (line.strip().split("|", 1) for line in (accounted + queued).splitlines() if "|" in line)
            return sorted({jid for jid, jname in rows if jname == name or jname.startswith(name + ".")})
        from activities.schedulers.local import scheduler_job_id

        jobs_dir = self.base / "state" / "local-jobs"
        found = [d.name for d in jobs_dir.rglob(scheduler_job_id(job.job_id)) if d.is_dir()]
        return sorted(set(found))

    def evidence(self, config: Config) -> str:
        """Proof that the faults hit: activity attempts the outages made fail, and worker starts."""
        events = list(read_events(config.hpc.audit.log_path))
        adopted = sum(1 for e in events if e["event_type"] == "state_recovered")
        worker_log = (self.base / "worker.log").read_text(errors="replace")
        busy = worker_log.count("ApplicationError: ChainUnavailable")
        unavailable = worker_log.count("SchedulerUnavailable") + worker_log.count("status query failed")
        # A local step (a fast chain call run inside the workflow task) that outlasts its 10 s timeout, as one does
        # during a ledger outage, is cancelled and then run as an ordinary, heartbeating activity: by design. Its
        # cancellation shows as the SDK's "untracked local activity" warning when its late completion arrives.
        local_timeouts = worker_log.count("Tried to complete untracked local activity")
        cancelled = max(0, worker_log.count("Activity cancelled") - local_timeouts)
        return (
            f"evidence: {worker_log.count('==== worker start')} worker starts; {busy} activity attempts failed "
            f"with ChainUnavailable and were retried; {unavailable} scheduler queries failed; {adopted} "
            f"submissions adopted after a crash (state_recovered); {cancelled} attempts cancelled by Temporal; "
            f"{local_timeouts} local steps timed out and ran as activities"
        )


INVARIANTS = (
    "terminal states",
    "exactly one scheduler job",
    "usage sequences",
    "one final record",
    "records add up to the scheduler's accounting",
    "settlement",
    "signatures",
    "audit chain",
    "deterministic replay",
)


def job_states(path: Path) -> dict[str, str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
        return dict(db.execute("SELECT job_id, state FROM jobs").fetchall())


def split(total: int, weights: dict[str, int]) -> dict[str, int]:
    """``total`` jobs over the kinds in proportion to ``weights``, each kind at least one."""
    scale = sum(weights.values())
    counts = {kind: max(1, round(total * w / scale)) for kind, w in weights.items()}
    while sum(counts.values()) > total and max(counts.values()) > 1:
        counts[max(counts, key=lambda k: counts[k])] -= 1
    while sum(counts.values()) < total:
        counts["complete"] += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--jobs", type=int, default=16, help="SLURM jobs (8:3:2:3 complete:fail:timeout:cancel)"
    )
    parser.add_argument("--local", type=int, default=0, help="more jobs on the local executor, same mix")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-temporal-restart", action="store_true")
    parser.add_argument("--slurmctld-outage", type=float, default=30.0, help="seconds; 0: none")
    parser.add_argument("--force-slurm-outage", action="store_true", help="even if other pytests run")
    parser.add_argument("--ledger-outage", type=float, default=40.0, help="seconds; 0: none")
    parser.add_argument("--keep", action="store_true", help="keep the state directory")
    args = parser.parse_args(argv)
    from tests.slurm_cluster import _probe

    slurm = _probe()
    if not isinstance(slurm, dict):
        print(
            f"the local SLURM cluster is not up ({slurm}); start it with temporal-dev/slurm-up.sh",
            file=sys.stderr,
        )
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    mix = {"complete": 8, "fail": 3, "timeout": 2, "cancel": 3}
    plan = Plan(
        slurm=slurm,
        slurm_jobs=split(args.jobs, mix) if args.jobs else {},
        local_jobs=split(args.local, mix) if args.local else {},
        kills=args.kills,
        temporal_restart_at=None if args.no_temporal_restart else 35.0,
        slurmctld_outage_at=60.0 if args.slurmctld_outage else None,
        slurmctld_outage=args.slurmctld_outage,
        ledger_outage_at=100.0 if args.ledger_outage else None,
        ledger_outage=args.ledger_outage,
        force_slurm_outage=args.force_slurm_outage,
        seed=seed,
    )
    base = Path(f"/tmp/vehpc-chaos-{seed}")
    base.mkdir(parents=True, exist_ok=True)
    log(f"seed {seed}; plan: SLURM {plan.slurm_jobs}, local {plan.local_jobs}")
    outcome = asyncio.run(ChaosRun(base, plan).run())
    outcome.print()
    (base / "outcome.json").write_text(
        json.dumps(
            {"ok": outcome.ok, "checks": [c.__dict__ for c in outcome.checks], "faults": outcome.faults},
            indent=2,
        )
    )
    if outcome.ok and not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
