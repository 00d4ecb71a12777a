"""Helpers of the node tests: a scheduler that records node drains, heartbeat builders, a node worker.

The SLURM adapter's own drain/resume is tested against the real cluster by its suite; here the node lifecycle
only needs to see which scheduler calls it made, so ``RecordingNodeScheduler`` records them (the third level of
scheduler testing: workflow tests with a small in-memory adapter) and can pretend jobs still run on a node for a number of checks.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml
from temporalio.client import Client
from temporalio.worker import Worker

from activities.audit import AuditLog, read_events
from activities.chain.node_ledger import NodeLedger
from activities.nodes import NodeActivities
from activities.schedulers.base import Accounting, NativeStatus, SchedulerAdapter, SubmitRequest, SubmitResult
from virtengine_hpc.config import AuditConfig
from virtengine_hpc.node.heartbeat import (
    HEARTBEAT_DOMAIN,
    REGISTRATION_DOMAIN,
    HeartbeatBody,
    LatencySample,
    NodeCapacity,
    NodeHealth,
    NodePlacement,
    RegistrationBody,
    sign_document,
)
from virtengine_hpc.node.lifecycle import NodeBeat, NodeSettings, NodeState, NodeStatus, workflow_id
from virtengine_hpc.signing import Signer, public_key_b64
from workflows.node import NodeWorkflow


@dataclass
class RecordingNodeScheduler(SchedulerAdapter):
    """Records drain/resume calls; ``busy_checks`` > 0 makes that many busy checks answer "jobs still run"."""

    busy_checks: int = 0
    calls: list[tuple[str, str]] = field(default_factory=list)

    async def drain_node(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node))

    async def resume_node(self, node: str) -> None:
        self.calls.append(("resume", node))

    async def node_busy(self, node: str) -> bool:
        self.calls.append(("busy", node))
        if self.busy_checks > 0:
            self.busy_checks -= 1
            return True
        return False

    def actions(self) -> list[str]:
        return [action for action, _ in self.calls if action != "busy"]

    async def submit(self, request: SubmitRequest, **_: Any) -> SubmitResult:
        raise NotImplementedError

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        raise NotImplementedError

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        raise NotImplementedError

    async def cancel(self, scheduler_job_id: str) -> None:
        raise NotImplementedError

    async def usage(self, scheduler_job_id: str) -> Accounting:
        raise NotImplementedError


def capacity(cpus: int = 8, memory_mb: int = 16000, gpus: int = 0) -> NodeCapacity:
    return NodeCapacity(
        cpu_cores_total=cpus,
        cpu_cores_available=cpus,
        memory_mb_total=memory_mb,
        memory_mb_available=memory_mb // 2,
        gpus_total=gpus,
        gpus_available=gpus,
        storage_gb_total=100,
        storage_gb_available=50,
    )


def health() -> NodeHealth:
    return NodeHealth(status="healthy", uptime_seconds=1000, load_1m=Decimal("0.25"))


def beat(sequence: int, cpus: int = 8) -> NodeBeat:
    now = datetime.now(UTC)
    return NodeBeat(
        sequence_number=sequence,
        sent_at=now,
        received_at=now,
        capacity=capacity(cpus),
        health=health(),
        placement=NodePlacement(rack="rack-7"),
    )


def quick_settings(**overrides: object) -> NodeSettings:
    values: dict[str, object] = {
        "stale_after": timedelta(seconds=3),
        "offline_after": timedelta(seconds=6),
        "metadata_interval": timedelta(seconds=1),
        "drain_poll_interval": timedelta(milliseconds=500),
    }
    values.update(overrides)
    return NodeSettings.model_validate(values)


async def wait_for(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], timeout: float, what: str
) -> None:
    """Poll ``check`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


def audit_events(path: Path, event_type: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [e for e in read_events(path) if event_type is None or e["event_type"] == event_type]


@dataclass
class NodeHarness:
    ledger: NodeLedger
    audit: AuditLog
    audit_path: Path
    scheduler: RecordingNodeScheduler
    task_queue: str
    cluster_id: str


@asynccontextmanager
async def node_worker(
    client: Client,
    tmp_path: Path,
    *,
    cluster_id: str = "c1",
    scheduler: RecordingNodeScheduler | None = None,
    ledger_path: Path | None = None,
    audit_path: Path | None = None,
    task_queue: str | None = None,
) -> AsyncIterator[NodeHarness]:
    """A worker running NodeWorkflow and NodeActivities over a ledger and audit log in ``tmp_path``."""
    ledger = NodeLedger(ledger_path or tmp_path / "ledger.db")
    audit_path = audit_path or tmp_path / "audit.log"
    audit = AuditLog(AuditConfig(log_path=audit_path))
    scheduler = scheduler or RecordingNodeScheduler()
    task_queue = task_queue or f"nodes-{uuid.uuid4().hex[:10]}"
    activities = NodeActivities(ledger, {cluster_id: scheduler}, audit, batch_window=0.01)
    async with Worker(client, task_queue=task_queue, workflows=[NodeWorkflow], activities=activities.all()):
        yield NodeHarness(ledger, audit, audit_path, scheduler, task_queue, cluster_id)
    ledger.close()


PROVIDER = "virtengine1provider0test"


@dataclass
class SimulatedNode:
    """Builds the signed documents a real agent sends, for API tests and the benchmark."""

    cluster_id: str
    node_id: str
    signer: Signer = field(default_factory=Signer.generate)
    provider: str = PROVIDER

    @property
    def public_key(self) -> str:
        return public_key_b64(self.signer.public_key)

    def registration(self, *, timestamp: datetime | None = None) -> dict[str, Any]:
        body = RegistrationBody(
            node_id=self.node_id,
            cluster_id=self.cluster_id,
            provider_address=self.provider,
            public_key=self.public_key,
            timestamp=timestamp or datetime.now(UTC),
            agent_version="0.1.0",
            hostname=self.node_id,
            capacity=capacity(),
            placement=NodePlacement(rack="rack-7"),
        )
        return sign_document(body, REGISTRATION_DOMAIN, self.signer)

    def heartbeat(self, sequence: int, *, timestamp: datetime | None = None) -> dict[str, Any]:
        body = HeartbeatBody(
            node_id=self.node_id,
            cluster_id=self.cluster_id,
            provider_address=self.provider,
            sequence_number=sequence,
            timestamp=timestamp or datetime.now(UTC),
            agent_version="0.1.0",
            capacity=capacity(),
            health=health(),
            placement=NodePlacement(rack="rack-7"),
            latency=[LatencySample(target="node-002", latency_us=180, probes=3, lost=0)],
        )
        return sign_document(body, HEARTBEAT_DOMAIN, self.signer)


# --- real processes: the node API, hpc-node-agent, the nodes CLI -------------------------------------

CLUSTER = "e2e-cluster"
E2E_PROVIDER = "virtengine1provider0e2e"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Provider:
    """The provider's side: config file, node API process, CLI runs."""

    def __init__(
        self,
        tmp_path: Path,
        temporal_address: str,
        *,
        nodes: dict[str, Any] | None = None,
        probe_verify: ssl.SSLContext | None = None,
    ) -> None:
        """``nodes`` adds keys to the ``nodes:`` section (``tls_cert_file``...); ``probe_verify`` is the TLS
        context ``start_api`` checks ``/healthz`` with when the API serves HTTPS."""
        self.port = free_port()
        self.tls = bool(nodes and nodes.get("tls_cert_file"))
        self.probe_verify = probe_verify
        self.dir = tmp_path
        self.task_queue_prefix = f"e2e-{uuid.uuid4().hex[:8]}"
        self.config_path = tmp_path / "provider.yaml"
        self.config_path.write_text(
            yaml.safe_dump(
                {
                    "hpc": {
                        "cluster_id": CLUSTER,
                        "job_service": {"state_store_path": str(tmp_path / "state")},
                        "audit": {"log_path": str(tmp_path / "audit.log")},
                    },
                    "temporal": {
                        "address": temporal_address,
                        "task_queue": self.task_queue_prefix,
                        "deployment_name": None,  # unversioned, as in tests/conftest.py's make_config
                    },
                    "provider": {"address": E2E_PROVIDER},
                    "nodes": {
                        "listen_port": self.port,
                        "stale_after": "3s",
                        "offline_after": "6s",
                        "metadata_interval": "2s",
                        "drain_poll_interval": "500ms",
                        "audit_rate_window": "0s",
                        **(nodes or {}),
                    },
                }
            )
        )
        self.api: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def task_queue(self) -> str:
        return f"{self.task_queue_prefix}.{CLUSTER}"

    @property
    def ledger_path(self) -> Path:
        return self.dir / "state" / "ledger.db"

    @property
    def audit_path(self) -> Path:
        return self.dir / "audit.log"

    def start_api(self) -> None:
        log = open(self.dir / "node-api.log", "wb")  # noqa: SIM115 - the child keeps it
        self.api = subprocess.Popen(
            [sys.executable, "-m", "workers.node_api", "--config", str(self.config_path)],
            stdout=log,
            stderr=log,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                verify: ssl.SSLContext | bool = self.probe_verify or True
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
            if self.api.poll() is not None:
                break
        raise AssertionError("node API did not come up: " + (self.dir / "node-api.log").read_text())

    async def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``virtengine-hpc nodes ...`` without blocking the event loop (the test's worker runs in it)."""
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "virtengine_hpc", "--config", str(self.config_path), "nodes", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"nodes {' '.join(args)} failed: {done.stdout}\n{done.stderr}")
        return done

    def node_worker(
        self, client: Client, tmp_path: Path, *, scheduler: RecordingNodeScheduler | None = None
    ) -> AbstractAsyncContextManager[NodeHarness]:
        """A node worker over this provider's ledger, audit log and task queue (what ``nodes serve`` signals)."""
        return node_worker(
            client,
            tmp_path,
            cluster_id=CLUSTER,
            scheduler=scheduler,
            ledger_path=self.ledger_path,
            audit_path=self.audit_path,
            task_queue=self.task_queue,
        )

    def stop(self) -> None:
        if self.api is not None:
            self.api.terminate()
            self.api.wait(10)


async def node_status(client: Client, node_id: str) -> NodeStatus:
    return await client.get_workflow_handle(workflow_id(CLUSTER, node_id)).query(
        "status", result_type=NodeStatus
    )


async def reaches(client: Client, node_id: str, state: NodeState, timeout: float) -> None:
    async def check() -> bool:
        try:
            return (await node_status(client, node_id)).state is state
        except Exception:
            return False

    await wait_for(check, timeout, f"{node_id} to become {state.value}")


class Agent:
    """One ``hpc-node-agent`` with its own key and config."""

    def __init__(self, tmp_path: Path, node_id: str, provider: Provider, **settings: Any) -> None:
        """``settings`` adds or overrides agent keys (``ca-file``, ``client-cert-file``...)."""
        self.node_id = node_id
        self.dir = tmp_path / node_id
        self.dir.mkdir()
        self.key_file = self.dir / "agent.key"
        self.config_path = self.dir / "hpc-node-agent.yaml"
        self.config_path.write_text(
            yaml.safe_dump(
                {
                    "node-id": node_id,
                    "cluster-id": CLUSTER,
                    "provider-address": E2E_PROVIDER,
                    "provider-daemon-url": provider.url,
                    "heartbeat-interval": "500ms",
                    "key-file": str(self.key_file),
                    "region": "us-east-1",
                    "datacenter": "dc1",
                    "zone": "a",
                    "rack": "rack-7",
                    "row": "row-2",
                    "position": "u14",
                    "latency-targets": [f"127.0.0.1:{provider.port}"],
                    "log-level": "info",
                    **settings,
                }
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    async def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "virtengine_hpc.node.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    async def init(self) -> str:
        done = await self.run("init", "--key-file", str(self.key_file))
        assert done.returncode == 0, done.stderr
        assert (self.key_file.stat().st_mode & 0o777) == 0o600
        return done.stdout.strip()

    def start(self) -> None:
        log = open(self.dir / "agent.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "virtengine_hpc.node.cli", "start", "--config", str(self.config_path)],
            stdout=log,
            stderr=log,
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def sequence(self) -> int:
        return int((self.dir / "agent.key.seq").read_text())

    def log(self) -> str:
        path = self.dir / "agent.log"
        return path.read_text() if path.exists() else ""

    async def status(self) -> dict[str, Any]:
        done = await self.run("status", "--config", str(self.config_path))
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
