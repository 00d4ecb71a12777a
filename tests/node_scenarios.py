"""The NodeWorkflow scenarios of the replay corpus (recorded by ``tests/record_histories.py``).

Every later change to ``workflows/node.py`` must still replay them, or the node workflows already running in
production (one per node, for months) would break on deploy.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client

from tests.node_support import RecordingNodeScheduler, beat, capacity, node_worker, quick_settings, wait_for
from virtengine_hpc.node.heartbeat import NodePlacement
from virtengine_hpc.node.lifecycle import NodeCommand, NodeState, NodeStatus, NodeWorkflowInput
from virtengine_hpc.signing import Signer, public_key_b64
from workflows.node import NodeWorkflow


async def lifecycle(client: Client, base: Path) -> str:
    """pending → active → stale → offline → active → draining → drained → active → deregistered."""
    async with node_worker(client, base, scheduler=RecordingNodeScheduler(busy_checks=1)) as h:
        key = public_key_b64(Signer.generate().public_key)
        h.ledger.allow("c1", "n1", key)
        h.ledger.register(
            "c1", "n1", public_key_b64=key, hostname="n1", agent_version="t", capacity=capacity(),
            placement=NodePlacement(),
        )  # fmt: skip
        handle = await client.start_workflow(
            NodeWorkflow.run,
            NodeWorkflowInput(cluster_id="c1", node_id="n1", settings=quick_settings()),
            id=f"record-node-lifecycle-{uuid.uuid4().hex[:8]}",
            task_queue=h.task_queue,
            start_signal="heartbeat",
            start_signal_args=[beat(1)],
        )

        async def state_is(state: NodeState) -> bool:
            return (await handle.query("status", result_type=NodeStatus)).state is state

        await wait_for(lambda: state_is(NodeState.OFFLINE), 20, "offline")
        await handle.signal("heartbeat", beat(2))
        await wait_for(lambda: state_is(NodeState.ACTIVE), 10, "active")
        for action in ("drain", "resume", "deregister"):
            await handle.execute_update("command", NodeCommand(action=action), result_type=NodeStatus)
            if action == "drain":
                await wait_for(lambda: state_is(NodeState.DRAINED), 10, "drained")
        await handle.result()
        return (await handle.fetch_history()).to_json()


async def continued(client: Client, base: Path) -> str:
    """A run that ends in continue-as-new after heartbeats and a metadata publish."""
    async with node_worker(client, base) as h:
        key = public_key_b64(Signer.generate().public_key)
        h.ledger.allow("c1", "n2", key)
        settings = quick_settings(max_history_events=60, stale_after=60, offline_after=120)
        handle = await client.start_workflow(
            NodeWorkflow.run,
            NodeWorkflowInput(cluster_id="c1", node_id="n2", settings=settings),
            id=f"record-node-continued-{uuid.uuid4().hex[:8]}",
            task_queue=h.task_queue,
            start_signal="heartbeat",
            start_signal_args=[beat(1)],
        )
        first_run = (await handle.describe()).run_id
        for sequence in range(2, 30):
            await handle.signal("heartbeat", beat(sequence))
            await asyncio.sleep(0.05)
        await asyncio.sleep(timedelta(seconds=2).total_seconds())
        history = await client.get_workflow_handle(handle.id, run_id=first_run).fetch_history()
        await client.get_workflow_handle(handle.id).terminate()
        return history.to_json()
