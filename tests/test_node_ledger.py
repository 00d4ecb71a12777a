"""The node tables of the embedded chain, in the LocalLedger's own file, and routing on their capacity."""

from __future__ import annotations

import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from activities.audit import AuditLog
from activities.chain.local_ledger import LocalLedger
from activities.chain.node_ledger import NodeLedger
from activities.routing import RoutingEnforcer
from tests.node_support import beat, capacity
from virtengine_hpc.config import AuditConfig, RoutingConfig
from virtengine_hpc.errors import ChainUnavailable, SecurityError, ValidationError
from virtengine_hpc.models import Cluster, JobSpec
from virtengine_hpc.node.heartbeat import NodePlacement
from virtengine_hpc.node.lifecycle import NodeMetadataUpdate, NodeState, NodeStateChange
from virtengine_hpc.signing import Signer, public_key_b64

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def enrol(ledger: NodeLedger, node: str, *, cluster: str = "c1", cpus: int = 8) -> None:
    key = public_key_b64(Signer.generate().public_key)
    ledger.allow(cluster, node, key)
    ledger.register(
        cluster,
        node,
        public_key_b64=key,
        hostname=node,
        agent_version="t",
        capacity=capacity(cpus),
        placement=NodePlacement(),
    )


def move(ledger: NodeLedger, node: str, previous: NodeState, state: NodeState, n: int, cpus: int = 8) -> bool:
    return ledger.apply_state(
        NodeStateChange(
            update_id=f"{node}/{n}",
            cluster_id="c1",
            node_id=node,
            previous=previous,
            state=state,
            cause="heartbeat",
            at=NOW,
            beat=beat(n, cpus),
        )
    )


def test_sequences_are_strictly_increasing_and_survive_a_new_connection(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    enrol(ledger, "n1")
    assert ledger.accept_sequence("c1", "n1", 3, NOW).accepted
    assert not ledger.accept_sequence("c1", "n1", 3, NOW).accepted
    assert not ledger.accept_sequence("c1", "n1", 2, NOW).accepted
    ledger.close()
    reopened = NodeLedger(tmp_path / "ledger.db")  # a restarted provider still refuses the replay
    refused = reopened.accept_sequence("c1", "n1", 3, NOW)
    assert not refused.accepted and refused.last_sequence == 3
    assert reopened.accept_sequence("c1", "n1", 4, NOW).accepted


def test_concurrent_acceptance_of_one_sequence_happens_once(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    enrol(NodeLedger(path), "n1")
    ledgers = [NodeLedger(path) for _ in range(4)]  # four API processes' connections
    results: list[bool] = []
    barrier = threading.Barrier(len(ledgers))

    def race(ledger: NodeLedger) -> None:
        barrier.wait()
        results.append(ledger.accept_sequence("c1", "n1", 7, NOW).accepted)

    threads = [threading.Thread(target=race, args=(ledger,)) for ledger in ledgers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, False, True]


def test_capacity_counts_only_active_nodes(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    assert ledger.cluster_capacity("c1").known_nodes == 0
    for node in ("n1", "n2", "n3"):
        enrol(ledger, node)
    move(ledger, "n1", NodeState.PENDING, NodeState.ACTIVE, 1, cpus=8)
    move(ledger, "n2", NodeState.PENDING, NodeState.ACTIVE, 1, cpus=32)
    move(ledger, "n2", NodeState.ACTIVE, NodeState.STALE, 2, cpus=32)
    cap = ledger.cluster_capacity("c1")
    assert (cap.active_nodes, cap.cpus, cap.memory_mb, cap.known_nodes, cap.max_cpus_per_node) == (
        1,
        8,
        16000,
        3,
        8,
    )
    move(ledger, "n2", NodeState.STALE, NodeState.ACTIVE, 3, cpus=32)
    cap = ledger.cluster_capacity("c1")
    assert (cap.active_nodes, cap.cpus, cap.max_cpus_per_node) == (2, 40, 32)


def test_state_changes_and_metadata_updates_are_idempotent_by_id(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    enrol(ledger, "n1")
    assert move(ledger, "n1", NodeState.PENDING, NodeState.ACTIVE, 1)
    assert not move(ledger, "n1", NodeState.PENDING, NodeState.ACTIVE, 1), "a retried activity writes nothing"
    update = NodeMetadataUpdate(
        update_id="n1/2", cluster_id="c1", node_id="n1", state=NodeState.ACTIVE, at=NOW, beat=beat(2, cpus=12)
    )
    assert ledger.record_metadata([update, update]) == 1
    assert [u.kind for u in ledger.updates("c1", "n1")] == ["state_change", "metadata"]
    row = ledger.get("c1", "n1")
    assert row is not None and row.capacity is not None and row.capacity.cpu_cores_total == 12


def test_deregistration_revokes_the_key_and_is_terminal(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    enrol(ledger, "n1")
    move(ledger, "n1", NodeState.PENDING, NodeState.DEREGISTERED, 1)
    allowed = ledger.allowed("c1", "n1")
    assert allowed is not None and not allowed.active
    with pytest.raises(ValidationError):
        move(ledger, "n1", NodeState.DEREGISTERED, NodeState.DEREGISTERED, 2)
    # Allowed again by the operator: a fresh lifecycle starts as pending.
    ledger.allow("c1", "n1", allowed.public_key)
    enrol(ledger, "n1")
    row = ledger.get("c1", "n1")
    assert row is not None and row.state is NodeState.PENDING


def test_allow_refuses_something_that_is_not_a_public_key(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="not a base64 Ed25519 public key"):
        NodeLedger(tmp_path / "ledger.db").allow("c1", "n1", "bm90IGEga2V5")


def test_node_tables_share_the_local_ledgers_file_without_touching_its_tables(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    chain = LocalLedger(path)
    nodes = NodeLedger(path)
    enrol(nodes, "n1")
    chain.register_cluster(Cluster(cluster_id="c1", provider="virtengine1provider0test", name="c1"))
    with sqlite3.connect(path) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {"node_allowed_keys", "node_registry", "node_metadata_updates"} <= tables
    assert chain.cluster("c1") is not None


def test_a_write_while_another_process_holds_the_lock_is_chain_unavailable(tmp_path: Path) -> None:
    """The node tables follow the ledger's error policy: a busy file is ``ChainUnavailable`` (transient, so the
    node workflow's activity retries it), the message saying which ledger is busy; nothing is written."""
    path = tmp_path / "ledger.db"
    nodes = NodeLedger(path, busy_timeout=0.2)
    enrol(nodes, "n1")
    other = sqlite3.connect(path, isolation_level=None)  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(
            ChainUnavailable, match=rf"node ledger {path} is busy: database is locked"
        ) as caught:
            nodes.accept_sequence("c1", "n1", 5, NOW)
        assert caught.value.transient
        assert nodes.get("c1", "n1") is not None  # reads go on while the lock is held
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert nodes.accept_sequence("c1", "n1", 5, NOW).accepted  # the same call, once the lock is free


def test_close_closes_the_connections_of_every_thread(tmp_path: Path) -> None:
    """The API and the node activities call the node tables from worker threads; ``close()`` at shutdown releases
    the file for all of them (the last connection to close removes the WAL file) and the tables are closed."""
    path = tmp_path / "ledger.db"
    nodes = NodeLedger(path)
    enrol(nodes, "n1")
    threads = [threading.Thread(target=nodes.accept_sequence, args=("c1", "n1", n, NOW)) for n in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert Path(f"{path}-wal").exists()
    nodes.close()
    assert not Path(f"{path}-wal").exists()
    with pytest.raises(sqlite3.ProgrammingError, match="closed database"):
        nodes.get("c1", "n1")
    reopened = NodeLedger(path).get("c1", "n1")
    assert reopened is not None and reopened.last_sequence == 3


async def test_routing_refuses_a_job_that_the_active_nodes_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    chain = LocalLedger(path)
    nodes = NodeLedger(path)
    chain.register_cluster(
        Cluster(
            cluster_id="c1", provider="virtengine1provider0test", name="c1", total_nodes=8, available_nodes=8
        )
    )
    audit_path = tmp_path / "audit.log"
    enforcer = RoutingEnforcer(
        chain,
        AuditLog(AuditConfig(log_path=audit_path)),
        RoutingConfig(),
        served_clusters=frozenset({"c1"}),
        capacity_probe=nodes.available_nodes,
    )
    spec = {
        "job_id": "job-1",
        "tenant": "virtengine1tenant0test",
        "provider": "virtengine1provider0test",
        "offering_id": "offer-1",
        "resources": {"nodes": 2},
        "script": "#!/bin/bash\ntrue\n",
    }
    chain.submit_job(spec, escrow=0)
    chain.create_decision("job-1", "c1")
    job = JobSpec.model_validate(spec)
    for node in ("n1", "n2"):
        enrol(nodes, node)
    move(nodes, "n1", NodeState.PENDING, NodeState.ACTIVE, 1)
    result = await enforcer.enforce(job, "c1")
    assert not result.accepted
    assert [v.type for v in result.violations] == ["capacity_exceeded"]
    assert "has 1 available" in result.message

    move(nodes, "n2", NodeState.PENDING, NodeState.ACTIVE, 1)
    assert (await enforcer.enforce(job, "c1")).accepted
