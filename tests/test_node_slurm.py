"""NodeWorkflow against the real local SLURM cluster: a silent node is drained in SLURM, a heartbeat resumes it.

Uses the SLURM adapter's CLI transport on the cluster from ``temporal-dev/slurm-up.sh`` (skipped when it is not
up, unless ``VEHPC_REQUIRE_SLURM=1``). The node is drained for a few seconds only and always resumed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from tests import slurm_cluster
from tests.node_support import beat, capacity, node_worker, quick_settings, wait_for
from virtengine_hpc.node.heartbeat import NodePlacement
from virtengine_hpc.node.lifecycle import NodeState, NodeStatus, NodeWorkflowInput
from virtengine_hpc.signing import Signer, public_key_b64
from workflows.node import NodeWorkflow

pytestmark = pytest.mark.slurm


def node_state(env: dict[str, Any], node: str) -> tuple[str, str]:
    """(State, Reason) of a node as ``scontrol`` shows it."""
    line = slurm_cluster.slurm_command(env, ["scontrol", "show", "node", node, "-o"])
    state = re.search(r"\bState=(\S+)", line)
    reason = re.search(r"\bReason=(.*?)(?: \[|$)", line)
    return (state.group(1) if state else "", reason.group(1).strip() if reason else "")


async def test_a_stale_node_is_drained_in_slurm_and_resumed_by_its_next_heartbeat(
    client: Client, tmp_path: Path
) -> None:
    env = slurm_cluster.cluster()
    node = env["node"]
    adapter = slurm_cluster.adapter(env, "cli")
    cluster = "slurm-test"
    try:
        async with node_worker(client, tmp_path, cluster_id=cluster, scheduler=adapter) as h:
            key = public_key_b64(Signer.generate().public_key)
            h.ledger.allow(cluster, "vnode-1", key, scheduler_node=node)
            h.ledger.register(
                cluster, "vnode-1", public_key_b64=key, hostname=node, agent_version="t", capacity=capacity(),
                placement=NodePlacement(),
            )  # fmt: skip
            handle = await client.start_workflow(
                NodeWorkflow.run,
                NodeWorkflowInput(
                    cluster_id=cluster,
                    node_id="vnode-1",
                    settings=quick_settings(stale_after=2, offline_after=60),
                ),
                id=f"node-slurmtest-{tmp_path.name[-8:]}",
                task_queue=h.task_queue,
                start_signal="heartbeat",
                start_signal_args=[beat(1)],
            )

            async def is_(state: NodeState) -> bool:
                return (await handle.query("status", result_type=NodeStatus)).state is state

            await wait_for(lambda: is_(NodeState.STALE), 15, "stale")
            state, reason = node_state(env, node)
            assert "DRAIN" in state, state
            assert "no heartbeat" in reason, reason

            await handle.signal("heartbeat", beat(2))
            await wait_for(lambda: is_(NodeState.ACTIVE), 15, "active again")
            state, _ = node_state(env, node)
            assert "DRAIN" not in state, state
            await handle.terminate()
    finally:
        if "DRAIN" in node_state(env, node)[0]:
            await adapter.resume_node(node)
        await adapter.close()
