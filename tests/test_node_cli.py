"""``virtengine-hpc nodes`` commands that need no running node: allow, list, capacity, show, deregister."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from temporalio.testing import WorkflowEnvironment

from activities.chain.node_ledger import NodeLedger
from virtengine_hpc.cli import main
from virtengine_hpc.signing import Signer, public_key_b64


def write_config(tmp_path: Path, temporal_address: str) -> Path:
    path = tmp_path / "provider.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "hpc": {
                    "cluster_id": "c1",
                    "job_service": {"state_store_path": str(tmp_path / "state")},
                    "audit": {"log_path": str(tmp_path / "audit.log")},
                },
                "temporal": {"address": temporal_address},
            }
        )
    )
    return path


def run(config: Path, *args: str) -> int:
    """The CLI as a user runs it; in its own thread, since it runs its own event loop (asyncio.run)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(main, ["--config", str(config), "nodes", *args]).result()


def test_allow_list_capacity_and_show_from_the_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "127.0.0.1:1")  # nothing listens: show must still answer from the ledger
    key = public_key_b64(Signer.generate().public_key)
    assert run(config, "allow", "node-7", "--public-key", key, "--scheduler-node", "sn007") == 0
    allowed = json.loads(capsys.readouterr().out)
    assert (allowed["cluster_id"], allowed["scheduler_node"], allowed["public_key"]) == ("c1", "sn007", key)

    assert run(config, "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == [
        {
            "cluster_id": "c1",
            "node_id": "node-7",
            "state": "allowed",
            "last_heartbeat_at": None,
            "last_sequence": 0,
            "cpus": None,
            "memory_mb": None,
            "gpus": None,
        }
    ]
    assert run(config, "list") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["CLUSTER", "NODE", "STATE"] and table[1].split()[:3] == [
        "c1",
        "node-7",
        "allowed",
    ]

    assert run(config, "capacity") == 0
    assert json.loads(capsys.readouterr().out)["active_nodes"] == 0

    assert run(config, "show", "node-7") == 0
    shown = capsys.readouterr()
    assert "workflow status unavailable" in shown.err
    report = json.loads(shown.out)
    assert report["allowed"]["node_id"] == "node-7" and report["workflow"] is None


def test_allow_refuses_a_bad_key_and_show_an_unknown_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, "127.0.0.1:1")
    assert run(config, "allow", "node-7", "--public-key", "not-a-key") == 2
    assert "not a base64 Ed25519 public key" in capsys.readouterr().err
    assert run(config, "show", "ghost") == 2
    assert "no node ghost in cluster c1" in capsys.readouterr().err


async def test_deregistering_a_node_that_never_registered_revokes_its_key(
    tmp_path: Path, temporal_env: WorkflowEnvironment, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, temporal_env.client.service_client.config.target_host)
    key = public_key_b64(Signer.generate().public_key)
    assert run(config, "allow", "node-8", "--public-key", key) == 0
    capsys.readouterr()
    assert run(config, "drain", "node-8") == 2
    assert "has no running lifecycle" in capsys.readouterr().err
    assert run(config, "deregister", "node-8") == 0
    assert json.loads(capsys.readouterr().out)["state"] == "deregistered"
    allowed = NodeLedger(tmp_path / "state" / "ledger.db").allowed("c1", "node-8")
    assert allowed is not None and not allowed.active
