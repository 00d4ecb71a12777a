"""The node API in process (ASGI) over a real ledger, audit log, Temporal dev server and node worker.

Every rejection must answer with the right status and leave a security audit record; accepted heartbeats must
reach the node's workflow.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from temporalio.client import Client
from temporalio.service import RPCError

from activities.chain.local_ledger import LocalLedger
from tests.node_support import (
    PROVIDER,
    NodeHarness,
    SimulatedNode,
    audit_events,
    node_worker,
    quick_settings,
    wait_for,
)
from virtengine_hpc.config import NodesConfig
from virtengine_hpc.errors import ChainError
from virtengine_hpc.messages import JOB_WORKFLOW_NAME
from virtengine_hpc.node.agent import NodeAgent
from virtengine_hpc.node.config import load_agent_config
from virtengine_hpc.node.lifecycle import (
    NodeState,
    NodeStatus,
    NodeWorkflowInput,
    legacy_workflow_id,
    workflow_id,
)
from virtengine_hpc.node.sequence import SequenceStore
from workers.node_api import NodeAPI, TemporalForwarder, create_app, peer_key, running_node_workflow
from workflows.node import NodeWorkflow

HB = "/api/v1/hpc/nodes/{}/heartbeat"
REGISTER = "/api/v1/hpc/nodes/register"


@dataclass
class APIHarness:
    http: httpx.AsyncClient
    api: NodeAPI
    nodes: NodeHarness
    client: Client
    app: FastAPI

    def sender(self, host: str) -> httpx.AsyncClient:
        """A client of the same API whose requests come from ``host``."""
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app, client=(host, 40000)), base_url="http://node-api"
        )

    def rejections(self, event: str = "heartbeat_rejected") -> list[str]:
        return [e["details"]["reason"] for e in audit_events(self.nodes.audit_path, event)]

    async def state(self, node: SimulatedNode) -> NodeState:
        handle = self.client.get_workflow_handle(workflow_id(node.cluster_id, node.node_id))
        status: NodeStatus = await handle.query("status", result_type=NodeStatus)
        return status.state


@pytest.fixture
async def harness(client: Client, tmp_path: Path) -> AsyncIterator[APIHarness]:
    cluster = f"c{tmp_path.name[-6:].replace('_', '')}"
    async with node_worker(client, tmp_path, cluster_id=cluster) as nodes:
        forwarder = TemporalForwarder(
            client,
            task_queue_for=lambda _: nodes.task_queue,
            settings=quick_settings(stale_after=60, offline_after=120),
        )
        api = NodeAPI(
            nodes.ledger,
            nodes.audit,
            forwarder,
            provider_address=PROVIDER,
            settings=NodesConfig(audit_rate_window=timedelta(0)),
        )
        app = create_app(api)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node-api") as http:
            yield APIHarness(http, api, nodes, client, app)
        for wf in [f async for f in client.list_workflows(f"TaskQueue = '{nodes.task_queue}'")]:
            if wf.status is not None and wf.status.name == "RUNNING":
                await client.get_workflow_handle(wf.id).terminate()


def allowed_node(h: APIHarness, name: str = "n1") -> SimulatedNode:
    node = SimulatedNode(h.nodes.cluster_id, name)
    h.nodes.ledger.allow(node.cluster_id, node.node_id, node.public_key)
    return node


async def registered_node(h: APIHarness, name: str = "n1") -> SimulatedNode:
    node = allowed_node(h, name)
    answer = await h.http.post(REGISTER, json=node.registration())
    assert answer.status_code == 200, answer.text
    return node


async def test_a_registered_node_heartbeats_and_its_workflow_becomes_active(harness: APIHarness) -> None:
    node = allowed_node(harness)
    answer = await harness.http.post(REGISTER, json=node.registration())
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "pending" and answer.json()["last_sequence"] == 0
    for sequence in (1, 2, 3):
        answer = await harness.http.post(
            HB.format(node.node_id),
            json=node.heartbeat(sequence),
            headers={"X-Node-ID": node.node_id, "X-Cluster-ID": node.cluster_id},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["sequence_number"] == sequence

    async def active() -> bool:
        return await harness.state(node) is NodeState.ACTIVE

    await wait_for(active, 10, "the node's workflow to become active")
    row = harness.nodes.ledger.get(node.cluster_id, node.node_id)
    assert row is not None and row.last_sequence == 3
    assert len(audit_events(harness.nodes.audit_path, "node_registered")) == 1
    assert harness.rejections() == []


async def test_the_signature_covers_the_json_as_received_not_a_re_marshalled_struct(
    harness: APIHarness,
) -> None:
    node = await registered_node(harness)
    document = node.heartbeat(1)
    # Another encoder: keys reversed, indentation, non-ASCII escaped. The same JSON values, so it verifies.
    text = json.dumps(dict(reversed(list(document.items()))), indent=3, ensure_ascii=True)
    answer = await harness.http.post(
        HB.format(node.node_id), content=text.encode(), headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 200, answer.text


async def test_forged_and_tampered_heartbeats_are_refused_and_audited(harness: APIHarness) -> None:
    node = await registered_node(harness)
    impostor = SimulatedNode(node.cluster_id, node.node_id)  # same ids, another key
    answer = await harness.http.post(HB.format(node.node_id), json=impostor.heartbeat(1))
    assert answer.status_code == 401 and answer.json()["error"] == "signature_invalid"

    tampered = node.heartbeat(2)
    tampered["capacity"]["cpu_cores_total"] = 512
    tampered["capacity"]["cpu_cores_available"] = 512
    answer = await harness.http.post(HB.format(node.node_id), json=tampered)
    assert answer.status_code == 401 and answer.json()["error"] == "signature_invalid"
    assert harness.rejections() == ["signature_invalid", "signature_invalid"]
    record = audit_events(harness.nodes.audit_path, "heartbeat_rejected")[0]
    assert record["category"] == "security" and record["success"] is False
    row = harness.nodes.ledger.get(node.cluster_id, node.node_id)
    assert row is not None and row.last_sequence == 0, "a refused heartbeat consumes no sequence"


async def test_a_replayed_sequence_gets_409_with_the_last_accepted_sequence(harness: APIHarness) -> None:
    node = await registered_node(harness)
    document = node.heartbeat(5)
    assert (await harness.http.post(HB.format(node.node_id), json=document)).status_code == 200
    replay = await harness.http.post(HB.format(node.node_id), json=document)
    assert replay.status_code == 409
    assert replay.json() == {
        "error": "sequence_replayed",
        "message": "sequence 5 is not above 5",
        "last_sequence": 5,
    }
    older = await harness.http.post(HB.format(node.node_id), json=node.heartbeat(4))
    assert older.status_code == 409
    assert harness.rejections() == ["sequence_replayed", "sequence_replayed"]


async def test_unknown_and_revoked_keys_are_refused(harness: APIHarness) -> None:
    stranger = SimulatedNode(harness.nodes.cluster_id, "stranger")
    answer = await harness.http.post(REGISTER, json=stranger.registration())
    assert answer.status_code == 401 and answer.json()["error"] == "unknown_node"
    answer = await harness.http.post(HB.format("stranger"), json=stranger.heartbeat(1))
    assert answer.status_code == 401 and answer.json()["error"] == "unknown_node"

    node = allowed_node(harness, "n2")
    rekeyed = SimulatedNode(node.cluster_id, node.node_id)  # the reference let anyone re-register a new key
    answer = await harness.http.post(REGISTER, json=rekeyed.registration())
    assert answer.status_code == 401 and answer.json()["error"] == "key_mismatch"

    answer = await harness.http.post(HB.format("n2"), json=node.heartbeat(1))
    assert answer.status_code == 401 and answer.json()["error"] == "not_registered"

    harness.nodes.ledger.revoke(node.cluster_id, node.node_id)
    answer = await harness.http.post(REGISTER, json=node.registration())
    assert answer.status_code == 401 and answer.json()["error"] == "key_revoked"

    assert harness.rejections("node_registration_rejected") == ["unknown_node", "key_mismatch", "key_revoked"]
    assert harness.rejections() == ["unknown_node", "not_registered"]


async def test_clock_skew_beyond_the_window_is_refused(harness: APIHarness) -> None:
    node = await registered_node(harness)
    past = datetime.now(UTC) - timedelta(minutes=5)
    answer = await harness.http.post(HB.format(node.node_id), json=node.heartbeat(1, timestamp=past))
    assert answer.status_code == 401 and answer.json()["error"] == "clock_skew"
    future = datetime.now(UTC) + timedelta(minutes=5)
    answer = await harness.http.post(REGISTER, json=node.registration(timestamp=future))
    assert answer.status_code == 401 and answer.json()["error"] == "clock_skew"
    within = datetime.now(UTC) - timedelta(seconds=30)
    answer = await harness.http.post(HB.format(node.node_id), json=node.heartbeat(2, timestamp=within))
    assert answer.status_code == 200
    assert harness.rejections() == ["clock_skew"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"not json", "not acceptable JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"node_id": "n1", "node_id": "n1"}', "duplicate key"),
        (b'{"sequence_number": 1.5}', "fractional number"),
        (b'{"sequence_number": NaN}', "not a number"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"node_id": "n1"}', "Field required"),
    ],
)
async def test_malformed_bodies_get_422_and_an_audit_record(
    harness: APIHarness, body: bytes, expected: str
) -> None:
    node = await registered_node(harness)
    answer = await harness.http.post(HB.format(node.node_id), content=body)
    assert answer.status_code == 422
    assert answer.json()["error"] == "malformed" and expected in answer.json()["message"]
    assert harness.rejections() == ["malformed"]


async def test_body_and_path_must_name_the_same_node(harness: APIHarness) -> None:
    node = await registered_node(harness)
    other = await registered_node(harness, "n9")
    answer = await harness.http.post(HB.format(other.node_id), json=node.heartbeat(1))
    assert answer.status_code == 422
    answer = await harness.http.post(
        HB.format(node.node_id), json=node.heartbeat(1), headers={"X-Cluster-ID": "zz"}
    )
    assert answer.status_code == 422


async def test_identical_rejections_are_audited_once_per_window(harness: APIHarness) -> None:
    harness.api.limiter.window = 60.0
    node = await registered_node(harness)
    forger = SimulatedNode(node.cluster_id, node.node_id)
    for sequence in range(1, 6):
        answer = await harness.http.post(HB.format(node.node_id), json=forger.heartbeat(sequence))
        assert answer.status_code == 401
    assert harness.rejections() == ["signature_invalid"], (
        "four repeats within the window are counted, not written"
    )
    harness.api.limiter.window = 0.0
    await harness.http.post(HB.format(node.node_id), json=forger.heartbeat(9))
    last = audit_events(harness.nodes.audit_path, "heartbeat_rejected")[-1]
    assert last["details"]["suppressed_since_last"] == 4


async def test_a_heartbeat_restarts_a_lifecycle_that_was_terminated(harness: APIHarness) -> None:
    node = await registered_node(harness)
    assert (await harness.http.post(HB.format(node.node_id), json=node.heartbeat(1))).status_code == 200
    handle = harness.client.get_workflow_handle(workflow_id(node.cluster_id, node.node_id))
    first_run = (await handle.describe()).run_id
    await handle.terminate(reason="operator mistake")
    # The API signals the running workflow directly; NOT_FOUND makes it fall back to signal-with-start.
    assert (await harness.http.post(HB.format(node.node_id), json=node.heartbeat(2))).status_code == 200

    async def restarted() -> bool:
        description = await harness.client.get_workflow_handle(handle.id).describe()
        return description.run_id != first_run and await harness.state(node) is NodeState.ACTIVE

    await wait_for(restarted, 10, "a new run of the node's workflow")


async def test_an_oversized_body_is_refused_without_reading_it_all(harness: APIHarness) -> None:
    node = await registered_node(harness)
    huge = b'{"node_id": "' + b"x" * (4 * 1024 * 1024) + b'"}'
    answer = await harness.http.post(HB.format(node.node_id), content=huge)
    assert answer.status_code == 413 and answer.json()["error"] == "body_too_large"
    assert harness.rejections() == ["body_too_large"]


# ---- hostile senders and men in the middle ------------------------------------------------------------------


async def test_a_flood_under_made_up_node_ids_is_audited_per_sender(harness: APIHarness) -> None:
    """The limit is keyed by the peer address: inventing a new node id per request does not get each one its own
    audit record (the log's writes were the flood's target)."""
    harness.api.limiter.window = 60.0
    async with harness.sender("203.0.113.7") as attacker:
        for n in range(40):
            forged = SimulatedNode(harness.nodes.cluster_id, f"made-up-{n}")
            answer = await attacker.post(HB.format(forged.node_id), json=forged.heartbeat(1))
            assert answer.status_code == 401 and answer.json()["error"] == "unknown_node"
    events = audit_events(harness.nodes.audit_path, "heartbeat_rejected")
    assert [(e["details"]["remote"], e["details"]["reason"]) for e in events] == [
        ("203.0.113.7", "unknown_node")
    ]
    # Another sender is not silenced by the first one's flood.
    honest = SimulatedNode(harness.nodes.cluster_id, "typo-node")
    await harness.http.post(HB.format(honest.node_id), json=honest.heartbeat(1))
    assert len(audit_events(harness.nodes.audit_path, "heartbeat_rejected")) == 2
    harness.api.limiter.window = 0.0
    async with harness.sender("203.0.113.7") as again:
        late = SimulatedNode(harness.nodes.cluster_id, "made-up-x")
        await again.post(HB.format(late.node_id), json=late.heartbeat(1))
    last = audit_events(harness.nodes.audit_path, "heartbeat_rejected")[-1]
    assert last["details"]["suppressed_since_last"] == 39


def test_ipv6_senders_are_counted_per_64() -> None:
    assert peer_key("2001:db8:1:2:aaaa::1") == peer_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::1") != peer_key("2001:db8:1:2::1")
    assert peer_key("::ffff:192.0.2.5") == "192.0.2.5"
    assert peer_key("192.0.2.5") == "192.0.2.5"


class ManInTheMiddle(httpx.AsyncBaseTransport):
    """Between an agent and the real node API over plain HTTP: every request reaches the API, but the answers to
    the registration and to the first heartbeat are forged to claim a last sequence at the end of the range."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.heartbeats = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        real = await self.inner.handle_async_request(request)
        await real.aread()
        if request.url.path == REGISTER:
            return httpx.Response(real.status_code, json={**real.json(), "last_sequence": END})
        self.heartbeats += 1
        if self.heartbeats == 1:
            forged = {"error": "sequence_replayed", "message": "replayed", "last_sequence": END}
            return httpx.Response(409, json=forged)
        return real


END = (1 << 63) - 1


async def test_a_forged_sequence_answer_does_not_silence_the_agent(
    harness: APIHarness, tmp_path: Path
) -> None:
    node = allowed_node(harness, "n-mitm")
    config = load_agent_config(
        env={},
        overrides={
            "node_id": node.node_id,
            "cluster_id": node.cluster_id,
            "provider_address": PROVIDER,
            "provider_daemon_url": "http://node-api",
            "key_file": tmp_path / "agent.key",
            "storage_path": tmp_path,
        },
    )
    inner = httpx.ASGITransport(app=harness.app)
    http = httpx.AsyncClient(transport=ManInTheMiddle(inner), base_url="http://node-api")
    sequence = SequenceStore(tmp_path / "agent.key.seq")
    agent = NodeAgent(config, node.signer, sequence=sequence, http=http)
    try:
        first = await agent.tick()  # registration answer and heartbeat answer both forged
        assert first["ok"] is False and first["error"] == "sequence_replayed"
        assert "does not take a sequence from an unsigned answer" in first["message"]
        second = await agent.tick()
        third = await agent.tick()
    finally:
        await agent.close()
        sequence.close()
    assert second["ok"] is True and third["ok"] is True, (second, third)
    assert 0 < second["sequence_number"] < third["sequence_number"] < END
    row = harness.nodes.ledger.get(node.cluster_id, node.node_id)
    assert row is not None and row.last_sequence == third["sequence_number"]
    assert json.loads(config.status_file.read_text())["ok"] is True

    async def active() -> bool:
        return await harness.state(node) is NodeState.ACTIVE

    await wait_for(active, 10, "the node's workflow to become active")


# ---- workflow ids: nodes and jobs in separate namespaces ----------------------------------------------------


async def test_a_job_named_like_a_node_cannot_take_the_nodes_lifecycle(harness: APIHarness) -> None:
    """A job's workflow id is its chain job id, which the tenant may choose: one named the way node workflows
    used to be (``node-<cluster>-<node>``) runs before the node registers. The node's lifecycle still starts, the
    job's workflow gets none of the node's signals, and no chain job id can ever equal a node's workflow id."""
    node = allowed_node(harness, "n7")
    squatter_id = legacy_workflow_id(node.cluster_id, node.node_id)
    squatter = await harness.client.start_workflow(
        JOB_WORKFLOW_NAME, {"job": "a tenant's"}, id=squatter_id, task_queue=f"jobs-{uuid.uuid4().hex[:8]}"
    )
    try:
        assert (await harness.http.post(REGISTER, json=node.registration())).status_code == 200
        assert (await harness.http.post(HB.format(node.node_id), json=node.heartbeat(1))).status_code == 200

        async def active() -> bool:
            return await harness.state(node) is NodeState.ACTIVE

        await wait_for(active, 10, "the node's own workflow to become active")
        assert await running_node_workflow(harness.client, node.cluster_id, node.node_id) == workflow_id(
            node.cluster_id, node.node_id
        )
        history = await squatter.fetch_history()
        assert not [e for e in history.events if e.HasField("workflow_execution_signaled_event_attributes")]
    finally:
        await squatter.terminate()
    with pytest.raises(ChainError, match="must match"):
        LocalLedger(harness.nodes.ledger.path).submit_job(
            {
                "job_id": workflow_id(node.cluster_id, node.node_id),
                "tenant": "t",
                "provider": "p",
                "offering_id": "o",
            }
        )


async def test_a_lifecycle_started_under_the_old_id_stays_the_nodes(harness: APIHarness) -> None:
    """A node whose workflow an earlier version started (old id) keeps it: the API signals that one rather than
    start a second lifecycle beside it, and the CLI's lookup finds it."""
    node = allowed_node(harness, "n8")
    old_id = legacy_workflow_id(node.cluster_id, node.node_id)
    await harness.client.start_workflow(
        NodeWorkflow.run,
        NodeWorkflowInput(
            cluster_id=node.cluster_id,
            node_id=node.node_id,
            settings=quick_settings(stale_after=60, offline_after=120),
        ),
        id=old_id,
        task_queue=harness.nodes.task_queue,
    )
    assert (await harness.http.post(REGISTER, json=node.registration())).status_code == 200
    assert (await harness.http.post(HB.format(node.node_id), json=node.heartbeat(1))).status_code == 200

    async def active() -> bool:
        status: NodeStatus = await harness.client.get_workflow_handle(old_id).query(
            "status", result_type=NodeStatus
        )
        return status.state is NodeState.ACTIVE

    await wait_for(active, 10, "the old lifecycle to take the heartbeat")
    assert await running_node_workflow(harness.client, node.cluster_id, node.node_id) == old_id
    with pytest.raises(RPCError):
        await harness.client.get_workflow_handle(workflow_id(node.cluster_id, node.node_id)).describe()
