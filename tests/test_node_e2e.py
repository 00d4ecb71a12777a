"""End to end with real processes on loopback: ``hpc-node-agent`` processes, the node API process
(``python -m workers.node_api``), the ``virtengine-hpc nodes`` CLI, and a node worker on a real Temporal dev
server. Timeouts are short (stale 3 s, offline 6 s, heartbeat 0.5 s) so the lifecycle plays out in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.node_support import RecordingNodeScheduler, audit_events, node_worker, wait_for
from virtengine_hpc.node.lifecycle import NodeState, NodeStatus, workflow_id

CLUSTER = "e2e-cluster"
PROVIDER = "virtengine1provider0e2e"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Provider:
    """The provider's side: config file, node API process, CLI runs."""

    def __init__(self, tmp_path: Path, temporal_address: str) -> None:
        self.port = free_port()
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
                    "temporal": {"address": temporal_address, "task_queue": self.task_queue_prefix},
                    "provider": {"address": PROVIDER},
                    "nodes": {
                        "listen_port": self.port,
                        "stale_after": "3s",
                        "offline_after": "6s",
                        "metadata_interval": "2s",
                        "drain_poll_interval": "500ms",
                        "audit_rate_window": "0s",
                    },
                }
            )
        )
        self.api: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
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

    def stop(self) -> None:
        if self.api is not None:
            self.api.terminate()
            self.api.wait(10)


class Agent:
    """One ``hpc-node-agent`` with its own key and config."""

    def __init__(self, tmp_path: Path, node_id: str, provider: Provider) -> None:
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
                    "provider-address": PROVIDER,
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

    async def status(self) -> dict[str, Any]:
        done = await self.run("status", "--config", str(self.config_path))
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture
def provider(tmp_path: Path, temporal_env: WorkflowEnvironment) -> Iterator[Provider]:
    provider = Provider(tmp_path, temporal_env.client.service_client.config.target_host)
    provider.start_api()
    yield provider
    provider.stop()


async def node_status(client: Client, node_id: str) -> NodeStatus:
    handle = client.get_workflow_handle(workflow_id(CLUSTER, node_id))
    return await handle.query("status", result_type=NodeStatus)


async def reaches(client: Client, node_id: str, state: NodeState, timeout: float) -> None:
    async def check() -> bool:
        try:
            return (await node_status(client, node_id)).state is state
        except Exception:
            return False

    await wait_for(check, timeout, f"{node_id} to become {state.value}")


async def test_agent_lifecycle_kill_stale_offline_restart_drain_deregister(
    client: Client, provider: Provider, tmp_path: Path
) -> None:
    scheduler = RecordingNodeScheduler(busy_checks=1)
    async with node_worker(
        client,
        tmp_path,
        cluster_id=CLUSTER,
        scheduler=scheduler,
        ledger_path=provider.ledger_path,
        audit_path=provider.audit_path,
        task_queue=provider.task_queue,
    ) as nodes:
        agent = Agent(tmp_path, "node-001", provider)
        public_key = await agent.init()
        try:
            # Not yet allowed: the agent's registration is refused and audited.
            agent.start()
            await wait_for(
                lambda: bool(audit_events(provider.audit_path, "node_registration_rejected")), 20, "a refusal"
            )
            await provider.cli("allow", "node-001", "--public-key", public_key, "--cluster", CLUSTER)
            await reaches(client, "node-001", NodeState.ACTIVE, 20)
            row = nodes.ledger.get(CLUSTER, "node-001")
            assert row is not None and row.placement is not None and row.placement.rack == "rack-7"
            capacity = nodes.ledger.cluster_capacity(CLUSTER)
            assert capacity.active_nodes == 1 and capacity.cpus == os.cpu_count()

            # Kill the agent: stale (drained in the scheduler), then offline.
            agent.kill()
            killed_at = agent.sequence()
            await reaches(client, "node-001", NodeState.STALE, 15)
            assert scheduler.actions() == ["drain"]
            assert nodes.ledger.cluster_capacity(CLUSTER).active_nodes == 0
            await reaches(client, "node-001", NodeState.OFFLINE, 15)

            # Restart: the persisted sequence goes on and the provider accepts it.
            agent.start()
            await reaches(client, "node-001", NodeState.ACTIVE, 20)
            assert scheduler.actions() == ["drain", "resume"]
            await wait_for(lambda: agent.sequence() > killed_at + 2, 10, "more heartbeats")
            rejected = [
                e["details"]["reason"] for e in audit_events(provider.audit_path, "heartbeat_rejected")
            ]
            assert "sequence_replayed" not in rejected, "a restarted agent is accepted"
            status = await agent.status()
            assert status["last_heartbeat"]["ok"] is True
            assert status["capacity"]["cpu_cores_total"] == os.cpu_count()
            assert status["latency"][0]["latency_us"] is not None

            # Drain through the CLI: draining while a job runs, then drained; resume.
            drained = json.loads(
                (await provider.cli("drain", "node-001", "--reason", "maintenance", "--wait")).stdout
            )
            assert drained["state"] == "drained"
            assert scheduler.actions() == ["drain", "resume", "drain"]
            seen = agent.sequence()
            await wait_for(lambda: agent.sequence() > seen + 2, 5, "heartbeats to go on while drained")
            assert (await node_status(client, "node-001")).state is NodeState.DRAINED
            resumed = json.loads((await provider.cli("resume", "node-001")).stdout)
            assert resumed["state"] == "active"

            listing = json.loads((await provider.cli("list", "--json")).stdout)
            assert [(n["node_id"], n["state"]) for n in listing] == [("node-001", "active")]

            # Deregister: terminal; the still-running agent is refused from now on.
            gone = json.loads(
                (await provider.cli("deregister", "node-001", "--reason", "decommissioned")).stdout
            )
            assert gone["state"] == "deregistered"
            handle = client.get_workflow_handle(workflow_id(CLUSTER, "node-001"), result_type=NodeStatus)
            assert (await handle.result()).state is NodeState.DEREGISTERED
            await wait_for(
                lambda: any(
                    e["details"]["reason"] == "key_revoked"
                    for e in audit_events(provider.audit_path, "heartbeat_rejected")
                ),
                10,
                "the deregistered node's heartbeat to be refused",
            )
            again = await provider.cli("drain", "node-001", check=False)
            assert again.returncode != 0 and "no running lifecycle" in again.stderr
            changes = [
                (e["details"]["previous_state"], e["details"]["state"])
                for e in audit_events(provider.audit_path, "node_state_changed")
            ]
            assert changes == [
                ("pending", "active"),
                ("active", "stale"),
                ("stale", "offline"),
                ("offline", "active"),
                ("active", "draining"),
                ("draining", "drained"),
                ("drained", "active"),
                ("active", "deregistered"),
            ]
        finally:
            agent.stop()


async def test_an_agent_that_lost_its_sequence_file_is_accepted_again(
    client: Client, provider: Provider, tmp_path: Path
) -> None:
    async with node_worker(
        client,
        tmp_path,
        cluster_id=CLUSTER,
        ledger_path=provider.ledger_path,
        audit_path=provider.audit_path,
        task_queue=provider.task_queue,
    ) as nodes:
        agent = Agent(tmp_path, "node-002", provider)
        await provider.cli("allow", "node-002", "--public-key", await agent.init(), "--cluster", CLUSTER)
        try:
            agent.start()
            await reaches(client, "node-002", NodeState.ACTIVE, 20)
            await wait_for(lambda: agent.sequence() >= 4, 10, "a few heartbeats")
            agent.kill()
            before = nodes.ledger.get(CLUSTER, "node-002").last_sequence  # type: ignore[union-attr]
            (agent.dir / "agent.key.seq").unlink()
            agent.start()
            await wait_for(
                lambda: nodes.ledger.get(CLUSTER, "node-002").last_sequence > before + 2,  # type: ignore[union-attr]
                15,
                "heartbeats accepted after the sequence file was lost",
            )
        finally:
            agent.stop()
