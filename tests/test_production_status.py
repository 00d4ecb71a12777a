"""``virtengine-hpc status``: the operator's live view, checked frame by frame (``--once``, ``--json``).

A provider with jobs in known states (one queued, one running, one completed, one refused by routing), two nodes
and a worker polling the cluster's task queue; the real command, run as a process, must show exactly that.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from temporalio.client import Client

from activities.chain.node_ledger import NodeLedger
from tests.conftest import REPO, make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import running_pipeline
from virtengine_hpc.cli.status import snapshot
from virtengine_hpc.config import Config
from virtengine_hpc.node.heartbeat import NodeCapacity, NodePlacement
from virtengine_hpc.node.lifecycle import NodeState, NodeStateChange
from virtengine_hpc.states import JobState
from workers.wiring import task_queue

Q, R, C = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED


async def run_cli(config_path: Path, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "virtengine_hpc",
        "-c",
        str(config_path),
        "status",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def add_nodes(config: Config) -> None:
    ledger = NodeLedger(config.ledger_path)
    from virtengine_hpc.signing import Signer, public_key_b64

    cluster = config.hpc.cluster_id
    for node in ("n1", "n2"):
        key = public_key_b64(Signer.generate().public_key)
        ledger.allow(cluster, node, key)
        ledger.register(
            cluster,
            node,
            public_key_b64=key,
            hostname=node,
            agent_version="0.1.0",
            capacity=NodeCapacity(
                cpu_cores_total=8, cpu_cores_available=8, memory_mb_total=16000, memory_mb_available=16000
            ),
            placement=NodePlacement(),
        )
    ledger.apply_state(
        NodeStateChange(
            update_id=f"u-{uuid.uuid4().hex[:8]}",
            cluster_id=cluster,
            node_id="n1",
            previous=NodeState.PENDING,
            state=NodeState.ACTIVE,
            cause="heartbeat",
            at=datetime.now(UTC),
        )
    )
    ledger.close()


def row(text: str, first: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.strip().startswith(first + " ")]
    return line.split()


async def test_status_once_shows_jobs_nodes_and_violations(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    config = make_config(
        tmp_path,
        hpc={"cluster_id": cluster},
        temporal={
            "address": client.service_client.config.target_host,
            "task_queue": f"tq-{uuid.uuid4().hex[:8]}",
        },
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    adapter = MemoryAdapter()
    async with running_pipeline(client, config, key_path, adapter, task_queue(config)) as p:
        queued = p.submit()
        running = p.submit()
        done = p.submit()
        refused = p.submit(decide=False)
        adapter.scripts[queued] = Script([(0, Q)])
        adapter.scripts[running] = Script([(0, Q), (0.1, R)])
        adapter.scripts[done] = Script([(0, Q), (0.1, R), (0.5, C)], exit_code=0)
        await p.run_until_done([done, refused])
        add_nodes(config)

        # Visibility is eventually consistent: wait until it agrees, then look at what the command prints.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            snap = await snapshot(config, client)
            counts = snap.clusters[0]
            if (counts.running.get("queued"), counts.running.get("running")) == (
                1,
                1,
            ) and counts.ended_24h.get("failed") == 1:
                break
            await asyncio.sleep(0.3)

        code, text = await run_cli(path, "--once")
        assert code == 0, text
        jobs, rest = text.split("\nNodes\n")
        node_text, violations = rest.split("\nRecent violations\n")
        heads = row(jobs, "CLUSTER")
        values = dict(zip(heads[: heads.index("|")], row(jobs, cluster), strict=False))
        assert values["WORKERS"] == "1", text  # the pipeline's worker polls the cluster's task queue
        assert (values["pending"], values["queued"], values["running"]) == ("0", "1", "1"), text
        ended = row(jobs, cluster)[heads.index("|") + 1 :]
        finals = [h for h in heads[heads.index("|") + 1 :] if h != "24h"]
        assert dict(zip(finals, ended, strict=True)) == {
            "completed": "1",
            "failed": "1",
            "timeout": "0",
            "cancelled": "0",
        }, text
        nodes = row(node_text, cluster)
        node_heads = row(node_text, "CLUSTER")
        assert dict(zip(node_heads, nodes, strict=True))["pending"] == "1"
        assert dict(zip(node_heads, nodes, strict=True))["active"] == "1"
        assert (
            "routing_violation" in violations and refused in violations and "missing_decision" in violations
        )

        code, raw = await run_cli(path, "--json")
        assert code == 0, raw
        data: dict[str, Any] = json.loads(raw)
        assert data["clusters"][0]["running"]["running"] == 1
        assert data["nodes"] == {cluster: {"pending": 1, "active": 1}}
        assert any(v["subject"] == refused for v in data["violations"])
        await p.handle(queued).terminate()
        await p.handle(running).terminate()


async def test_status_says_what_it_cannot_reach(tmp_path: Path) -> None:
    config = make_config(tmp_path, temporal={"address": "127.0.0.1:1"})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    code, text = await run_cli(path, "--once")
    assert code == 1
    assert "no job counts: Temporal says: cannot connect to Temporal at 127.0.0.1:1" in text
    assert "no node registry" in text and "no audit log" in text
