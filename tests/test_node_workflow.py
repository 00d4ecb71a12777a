"""NodeWorkflow on a real Temporal dev server: states, timers, scheduler drains, commands, history."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Replayer

from activities.chain.node_ledger import NodeLedger
from tests.node_support import audit_events, beat, capacity, node_worker, quick_settings, wait_for
from virtengine_hpc.node.heartbeat import NodePlacement
from virtengine_hpc.node.lifecycle import NodeCommand, NodeState, NodeStatus, NodeWorkflowInput
from virtengine_hpc.signing import Signer, public_key_b64
from workflows.node import NodeWorkflow


def enrol(ledger: NodeLedger, cluster: str, node: str) -> None:
    ledger.allow(cluster, node, public_key_b64(Signer.generate().public_key), scheduler_node=f"slurm-{node}")
    ledger.register(
        cluster,
        node,
        public_key_b64=ledger.allowed(cluster, node).public_key,  # type: ignore[union-attr]
        hostname=node,
        agent_version="test",
        capacity=capacity(),
        placement=NodePlacement(),
    )


async def start(
    client: Client, task_queue: str, cluster: str, node: str, **settings: object
) -> WorkflowHandle[NodeWorkflow, NodeStatus]:
    return await client.start_workflow(
        NodeWorkflow.run,
        NodeWorkflowInput(cluster_id=cluster, node_id=node, settings=quick_settings(**settings)),
        id=f"node-{cluster}-{node}-{uuid.uuid4().hex[:6]}",
        task_queue=task_queue,
        start_signal="heartbeat",
        start_signal_args=[beat(1)],
    )


async def command(handle: WorkflowHandle[NodeWorkflow, NodeStatus], action: str) -> NodeStatus:
    return await handle.execute_update(
        "command", NodeCommand.model_validate({"action": action}), result_type=NodeStatus
    )


async def state_of(handle: WorkflowHandle[NodeWorkflow, NodeStatus]) -> NodeState:
    status: NodeStatus = await handle.query(NodeWorkflow.status)
    return status.state


async def test_silence_makes_a_node_stale_then_offline_and_a_heartbeat_brings_it_back(
    client: Client, tmp_path: Path
) -> None:
    async with node_worker(client, tmp_path) as h:
        enrol(h.ledger, "c1", "n1")
        handle = await start(client, h.task_queue, "c1", "n1")
        await wait_for(lambda: _is(handle, NodeState.ACTIVE), 10, "active")
        assert h.ledger.get("c1", "n1").state is NodeState.ACTIVE  # type: ignore[union-attr]
        assert h.ledger.cluster_capacity("c1").cpus == 8

        await wait_for(lambda: _is(handle, NodeState.STALE), 10, "stale")
        assert h.scheduler.actions() == ["drain"], "a stale node is drained in the scheduler"
        assert h.scheduler.calls[0][1] == "slurm-n1", "the scheduler's own node name is used"
        assert h.ledger.cluster_capacity("c1").active_nodes == 0, "a stale node holds no capacity"
        await wait_for(lambda: _is(handle, NodeState.OFFLINE), 10, "offline")

        await handle.signal(NodeWorkflow.heartbeat, beat(2))
        await wait_for(lambda: _is(handle, NodeState.ACTIVE), 10, "active again")
        assert h.scheduler.actions() == ["drain", "resume"]
        assert h.ledger.cluster_capacity("c1").active_nodes == 1

        changes = [
            (e["details"]["previous_state"], e["details"]["state"])
            for e in audit_events(h.audit_path, "node_state_changed")
        ]
        assert changes == [
            ("pending", "active"),
            ("active", "stale"),
            ("stale", "offline"),
            ("offline", "active"),
        ]
        kinds = [u.kind for u in h.ledger.updates("c1", "n1")]
        assert kinds.count("state_change") == 4
        await handle.terminate()


async def _is(handle: WorkflowHandle[NodeWorkflow, NodeStatus], state: NodeState) -> bool:
    return await state_of(handle) is state


async def test_drain_waits_for_jobs_then_resume_and_deregister_is_terminal(
    client: Client, tmp_path: Path
) -> None:
    async with node_worker(client, tmp_path) as h:
        h.scheduler.busy_checks = 2
        enrol(h.ledger, "c1", "n2")
        handle = await start(client, h.task_queue, "c1", "n2", stale_after=60, offline_after=120)
        await wait_for(lambda: _is(handle, NodeState.ACTIVE), 10, "active")

        status = await command(handle, "drain")
        assert status.state is NodeState.DRAINING, "jobs still run, so the node is draining"
        await wait_for(lambda: _is(handle, NodeState.DRAINED), 10, "drained")
        assert h.scheduler.actions() == ["drain"]
        assert len(audit_events(h.audit_path, "node_drained")) == 1
        assert h.ledger.cluster_capacity("c1").active_nodes == 0

        await handle.signal(NodeWorkflow.heartbeat, beat(2))
        await asyncio.sleep(0.5)
        assert await state_of(handle) is NodeState.DRAINED, "heartbeats do not undo an operator's drain"

        status = await command(handle, "resume")
        assert status.state is NodeState.ACTIVE
        assert h.scheduler.actions() == ["drain", "resume"]
        assert len(audit_events(h.audit_path, "node_resumed")) == 1

        status = await command(handle, "deregister")
        assert status.state is NodeState.DEREGISTERED
        final = await handle.result()
        assert final.state is NodeState.DEREGISTERED
        allowed = h.ledger.allowed("c1", "n2")
        assert allowed is not None and not allowed.active, "deregistration revokes the node's key"
        with pytest.raises(Exception):  # noqa: B017 - the workflow is closed: no update is accepted
            await command(handle, "resume")


async def test_a_node_whose_key_was_never_allowed_ends_deregistered(client: Client, tmp_path: Path) -> None:
    async with node_worker(client, tmp_path) as h:
        handle = await start(client, h.task_queue, "c1", "ghost")
        final = await handle.result()
        assert final.state is NodeState.DEREGISTERED


async def test_history_stays_bounded_by_continue_as_new_and_the_state_survives_it(
    client: Client, tmp_path: Path
) -> None:
    async with node_worker(client, tmp_path) as h:
        enrol(h.ledger, "c1", "n3")
        handle = await start(
            client, h.task_queue, "c1", "n3", max_history_events=60, stale_after=60, offline_after=120
        )
        await wait_for(lambda: _is(handle, NodeState.ACTIVE), 10, "active")
        for sequence in range(2, 42):
            await handle.signal(NodeWorkflow.heartbeat, beat(sequence))
            await asyncio.sleep(0.02)
        latest = client.get_workflow_handle(handle.id)

        async def caught_up() -> bool:
            status: NodeStatus = await latest.query(NodeWorkflow.status)
            return status.last_sequence == 41

        await wait_for(caught_up, 15, "all heartbeats handled")
        status = await latest.query(NodeWorkflow.status)
        assert status.runs > 1, "the workflow continued as new"
        assert status.state is NodeState.ACTIVE
        assert status.history_length < 120
        # The recorded history replays deterministically.
        history = await handle.fetch_history()
        await Replayer(workflows=[NodeWorkflow], data_converter=pydantic_data_converter).replay_workflow(
            history
        )
        await latest.terminate()


async def test_update_is_refused_once_deregistered(client: Client, tmp_path: Path) -> None:
    async with node_worker(client, tmp_path) as h:
        enrol(h.ledger, "c1", "n4")
        handle = await start(client, h.task_queue, "c1", "n4")
        await wait_for(lambda: _is(handle, NodeState.ACTIVE), 10, "active")
        both = await asyncio.gather(
            command(handle, "deregister"),
            command(handle, "drain"),
            return_exceptions=True,
        )
        assert isinstance(both[0], NodeStatus) and both[0].state is NodeState.DEREGISTERED
        # The drain raced the deregistration: it ran first (draining, then deregistered), was queued behind it and
        # ignored (the node stays deregistered), or arrived after it and was refused by the validator.
        if isinstance(both[1], NodeStatus):
            assert both[1].state in (NodeState.DRAINING, NodeState.DRAINED, NodeState.DEREGISTERED)
        else:
            assert isinstance(both[1], WorkflowUpdateFailedError), both[1]
            assert "is deregistered" in str(both[1].cause)
        assert (await handle.result()).state is NodeState.DEREGISTERED
        # Once deregistered, no command brings the node back: the finished workflow refuses it.
        with pytest.raises(RPCError, match="already completed"):
            await command(handle, "resume")
        assert (await handle.result()).state is NodeState.DEREGISTERED
