"""``make demo``: the whole pipeline on the embedded default, as a tenant and a provider would see it.

It expects the Temporal dev server from ``temporal-dev/temporal-up.sh``; it creates a fresh LocalLedger and a
provider signing key under ``.dev/demo``, starts a worker with the chain poller as a background process, submits
sample jobs as a tenant (success, non-zero exit, walltime exceeded, cancelled, rejected by routing, malformed),
shows their progress, and prints a summary: final states, usage records with verified signatures, audit events and
the settlement. The worker and the dev server keep running for inspection; ``make down`` stops them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from activities.audit import read_events, verify_log
from activities.chain.local_ledger import LocalLedger
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config, default_build_id, load_config
from virtengine_hpc.models import Cluster, Partition, PricedQueue, Pricing
from virtengine_hpc.signing import Signer, public_key_b64, write_private_key
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import verify_record

TENANT = "virtengine1tenant0demo"
PROVIDER = "virtengine1provider0demo"
CLUSTER = "demo-cluster"
OFFERING = "demo-standard"
BURN = 'end=$((SECONDS+8)); while [ "$SECONDS" -lt "$end" ]; do :; done; echo "burned 8 s of CPU"\n'


def dev_dir() -> Path:
    repo = Path(__file__).resolve().parents[1]
    return Path(os.environ.get("VEHPC_DEV_DIR", repo / ".dev"))


def demo_dir() -> Path:
    return dev_dir() / "demo"


def demo_tenants() -> dict[str, Any]:
    """Who runs the demo tenant's jobs. A worker running as root never runs a tenant's job as root or as itself: the
    demo maps its tenant to ``nobody``, an account every Debian host has. Run by anyone else, the worker can only
    run jobs as itself, which ``isolation: none`` says outright (docs/security.md)."""
    if os.geteuid() == 0:
        return {"accounts": {TENANT: "nobody"}}
    return {"isolation": "none"}


def demo_jobs_dir(base: Path) -> Path:
    """Where the demo's local jobs live: under ``base``, unless (as root) a directory above it lets no other
    account through (a checkout under /root), which the jobs' account must pass; then a fresh one in the system's
    temporary directory."""
    from activities.schedulers.local import closed_directory

    jobs = base / "state" / "local-jobs"
    if os.geteuid() != 0 or closed_directory(base) is None:
        return jobs
    own = Path(tempfile.mkdtemp(prefix="virtengine-hpc-demo-"))
    own.chmod(0o711)  # others pass through to their work directories, never list
    return own / "local-jobs"


def demo_config_data(base: Path, temporal_address: str) -> dict[str, Any]:
    return {
        "hpc": {
            "scheduler_type": "local",
            "cluster_id": CLUSTER,
            "job_service": {
                "job_poll_interval": "1s",
                "max_concurrent_jobs": 20,
                "state_store_path": str(base / "state"),
            },
            "usage_reporting": {"report_interval": "5s", "batch_size": 50},
            "retry": {"max_retries": 3, "initial_backoff": "500ms", "max_backoff": "5s"},
            "audit": {"log_path": str(base / "audit.log")},
            # The demo opts in to the local executor (no multi-tenant sandbox: docs/security.md).
            "local": {
                "job_poll_interval": "1s",
                "max_parallel_jobs": 8,
                "allow_unisolated": True,
                "state_dir": str(demo_jobs_dir(base)),
            },
            "tenants": demo_tenants(),
        },
        "routing": {"enforcement_mode": "strict"},
        "temporal": {
            "address": temporal_address,
            "task_queue": "virtengine-hpc-demo",
            # A deployment per build: the demo's first worker makes its build current (promote_first_build),
            # also when the dev server still holds the deployment of an earlier build's demo (the default build id
            # changes with the workflow code, so each build gets its own demo deployment; Temporal refuses a '.' in a
            # deployment name).
            "deployment_name": "virtengine-hpc-demo-" + re.sub(r"[^A-Za-z0-9_-]", "-", default_build_id()),
        },
        "provider": {"address": PROVIDER},
    }


def stop_worker(base: Path | None = None) -> bool:
    pidfile = (base or demo_dir()) / "worker.pid"
    if not pidfile.exists():
        return False
    pid = int(pidfile.read_text().strip() or 0)
    stopped = False
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                time.sleep(0.1)
                os.kill(pid, 0)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stopped = True
    pidfile.unlink(missing_ok=True)
    return stopped


def _prepare(base: Path, temporal_address: str) -> tuple[Config, Path, Signer, LocalLedger]:
    stop_worker(base)
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    config_path = base / "config.yaml"
    config_path.write_text(yaml.safe_dump(demo_config_data(base, temporal_address), sort_keys=False))
    config = load_config(config_path, env={})
    key_path = base / "provider.key"
    write_private_key(key_path)
    signer = Signer.from_file(key_path)
    ledger = LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)
    ledger.register_cluster(
        Cluster(
            cluster_id=CLUSTER,
            provider=PROVIDER,
            name="demo",
            scheduler_type="local",
            partitions=(Partition(name="debug", nodes=1, max_nodes=1, max_runtime_seconds=3600),),
            total_nodes=1,
            available_nodes=1,
        )
    )
    ledger.add_queue(
        PricedQueue(
            offering_id=OFFERING,
            cluster_id=CLUSTER,
            partition="debug",
            pricing=Pricing(
                node_hour=Decimal("3.60"),
                core_hour=Decimal("1.80"),
                memory_gb_hour=Decimal("0.36"),
                minimum_charge=Decimal("0.001"),
            ),
            max_duration_seconds=3600,
        )
    )
    ledger.register_provider_key(PROVIDER, public_key_b64(signer.public_key))
    ledger.fund(TENANT, Decimal("1000"))
    return config, key_path, signer, ledger


def _start_worker(base: Path, config_path: Path, key_path: Path) -> int:
    env = dict(os.environ, PROVIDER_SIGNING_KEY_PATH=str(key_path))
    log = open(base / "worker.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "virtengine_hpc", "--config", str(config_path), "worker", "run", "--poller"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    (base / "worker.pid").write_text(str(proc.pid))
    return proc.pid


def _submit(ledger: LocalLedger, run: str) -> dict[str, str]:
    common = {"tenant": TENANT, "provider": PROVIDER, "offering_id": OFFERING, "partition": "debug"}
    jobs: dict[str, dict[str, Any]] = {
        "success": {"script": BURN, "walltime_seconds": 600, "max_price": "5"},
        "failure": {
            "script": 'echo "about to fail" >&2\nexit 3\n',
            "walltime_seconds": 600,
            "max_price": "5",
        },
        "walltime": {"script": "sleep 600\n", "walltime_seconds": 60, "max_price": "5"},
        "cancelled": {"script": "sleep 600\n", "walltime_seconds": 900, "max_price": "5"},
        "no-decision": {"script": "echo never runs\n", "walltime_seconds": 600, "max_price": "5"},
        "malformed": {"script": "echo never runs\n", "resources": {"nodes": -1}, "max_price": "5"},
    }
    ids: dict[str, str] = {}
    for label, spec in jobs.items():
        job_id = ledger.submit_job({"job_id": f"DEMO-{run}-{label}", "name": label, **common, **spec})
        if label != "no-decision":
            ledger.create_decision(job_id, CLUSTER)
        ids[label] = job_id
    return ids


def _progress_line(ledger: LocalLedger, ids: dict[str, str], elapsed: float) -> str:
    cells = []
    for label, job_id in ids.items():
        job = ledger.job(job_id)
        state = job.state.value if job else "?"
        records = len(ledger.usage_records(job_id))
        cells.append(f"{label}={state}" + (f"({records} rec)" if records else ""))
    return f"[{elapsed:5.1f}s] " + "  ".join(cells)


def run_demo(temporal_address: str = "127.0.0.1:7233", ui_port: int = 8233) -> int:
    base = demo_dir()
    config, key_path, signer, ledger = _prepare(base, temporal_address)
    print(f"LocalLedger: {config.ledger_path}\nprovider key: {key_path} (key id {signer.key_id[:16]}...)")
    pid = _start_worker(base, base / "config.yaml", key_path)
    print(f"worker + chain poller started (pid {pid}, log {base / 'worker.log'})\n")
    run = time.strftime("%H%M%S")
    ids = _submit(ledger, run)
    print("tenant submitted:", ", ".join(f"{label} -> {job_id}" for label, job_id in ids.items()))
    print("  'no-decision' has no scheduling decision on chain (strict routing rejects it);")
    print(
        "  'malformed' asks for -1 nodes; 'walltime' sleeps past its 60 s walltime; 'cancelled' is cancelled"
    )
    print("  by the tenant once it runs.\n")

    start = time.monotonic()
    cancelled = False
    last = ""
    while time.monotonic() - start < 240:
        elapsed = time.monotonic() - start
        job = ledger.job(ids["cancelled"])
        if not cancelled and job is not None and job.state == JobState.RUNNING:
            ledger.request_cancel(ids["cancelled"])
            cancelled = True
            print(f"[{elapsed:5.1f}s] tenant cancels {ids['cancelled']} on chain")
        line = _progress_line(ledger, ids, elapsed)
        if line.split("] ", 1)[1] != last:
            print(line)
            last = line.split("] ", 1)[1]
        if all((j := ledger.job(i)) is not None and j.state.final for i in ids.values()) and all(
            ledger.settlement(i) is not None or not ledger.usage_records(i) for i in ids.values()
        ):
            break
        time.sleep(1.0)
    else:
        print("\nsome jobs did not finish in 240 s; see", base / "worker.log")
        return 1
    _summary(config, ledger, signer, ids)
    _inspect_help(config, ids, ui_port)
    return 0


def _summary(config: Config, ledger: LocalLedger, signer: Signer, ids: dict[str, str]) -> None:
    print("\n=== final states")
    print(f"{'job':<28} {'state':<10} {'exit':<5} message")
    for job_id in ids.values():
        job = ledger.job(job_id)
        assert job is not None
        exit_code = "-" if job.exit_code is None else str(job.exit_code)
        print(f"{job_id:<28} {job.state.value:<10} {exit_code:<5} {job.status_message[:90]}")

    print("\n=== usage records (Ed25519 signatures verified against the provider key registered on chain)")
    for job_id in ids.values():
        for rec in ledger.usage_records(job_id):
            ok = "verified" if verify_record(rec, signer.public_key) else "BAD SIGNATURE"
            m = rec.metrics
            used = "-" if m.cpu_time_seconds is None else f"{m.cpu_time_seconds}"
            print(
                f"{rec.record_id:<44} final={rec.is_final!s:<5} wall={m.wall_clock_seconds:>9}s "
                f"cores={m.cpu_core_seconds:>10} core-s (used {used} s) mem={m.memory_gb_seconds:>9} GB-s  {ok}"
            )

    print("\n=== settlement (from tenant escrow at the agreed price; the rest refunded)")
    for job_id in ids.values():
        s = ledger.settlement(job_id)
        job = ledger.job(job_id)
        if s is not None:
            print(f"{job_id:<28} escrow {s.escrow}  charged {s.charged}  refunded {s.refunded}")
        elif job is not None:
            print(f"{job_id:<28} never ran: escrow refunded")
    print(f"tenant balance {ledger.balance(TENANT)}   provider balance {ledger.balance(PROVIDER)}")

    log_path = config.hpc.audit.log_path
    counts = Counter(e["event_type"] for e in read_events(log_path))
    print(f"\n=== audit log {log_path}")
    print("  " + ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())))
    violations = [e for e in read_events(log_path) if e["event_type"] == AuditEvent.ROUTING_VIOLATION]
    for v in violations:
        print(
            f"  routing_violation {v['details']['violation_type']} (severity {v['severity']}) on {v['job_id']}"
        )
    result = verify_log(log_path)
    print(f"  hash chain: {'intact' if result.ok else 'BROKEN: ' + str(result.error)} ({result.lines} lines)")


def _inspect_help(config: Config, ids: dict[str, str], ui_port: int) -> None:
    addr = config.temporal.address
    some = ids["success"]
    print(
        f"""
=== inspect
  Web UI:   http://127.0.0.1:{ui_port}/namespaces/default/workflows
  temporal workflow list --address {addr} --query "VeClusterId='{CLUSTER}'"
  temporal workflow list --address {addr} --query "VeJobState='failed'"
  temporal workflow describe --address {addr} --workflow-id {some}
  temporal workflow query --address {addr} --workflow-id {some} --type status
  temporal workflow show --address {addr} --workflow-id {some}
  (the temporal binary is .venv/bin/temporal)
  .venv/bin/virtengine-hpc -c {demo_dir() / "config.yaml"} jobs list
  .venv/bin/virtengine-hpc -c {demo_dir() / "config.yaml"} audit verify
  stop everything: make down"""
    )
