"""End to end with real processes on loopback: ``hpc-node-agent`` processes, the node API process
(``python -m workers.node_api``), the ``virtengine-hpc nodes`` CLI, and a node worker on a real Temporal dev
server. Timeouts are short (stale 3 s, offline 6 s, heartbeat 0.5 s) so the lifecycle plays out in seconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.node_support import (
    CLUSTER,
    Agent,
    Provider,
    RecordingNodeScheduler,
    audit_events,
    node_status,
    reaches,
    wait_for,
)
from virtengine_hpc.node.lifecycle import NodeState, NodeStatus, workflow_id


@pytest.fixture
def provider(tmp_path: Path, temporal_env: WorkflowEnvironment) -> Iterator[Provider]:
    provider = Provider(tmp_path, temporal_env.client.service_client.config.target_host)
    provider.start_api()
    yield provider
    provider.stop()


async def test_agent_lifecycle_kill_stale_offline_restart_drain_deregister(
    client: Client, provider: Provider, tmp_path: Path
) -> None:
    scheduler = RecordingNodeScheduler(busy_checks=1)
    async with provider.node_worker(client, tmp_path, scheduler=scheduler) as nodes:
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
    async with provider.node_worker(client, tmp_path) as nodes:
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
