"""The agent's own parts: configuration, canonical signing, host readings, latency, persisted sequence, key."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import psutil
import pytest

from virtengine_hpc.errors import ConfigError, SecurityError
from virtengine_hpc.node.config import load_agent_config
from virtengine_hpc.node.heartbeat import (
    HEARTBEAT_DOMAIN,
    HeartbeatBody,
    LatencySample,
    NodeCapacity,
    NodeHealth,
    NodePlacement,
    parse_signed_json,
    sign_document,
    signature_valid,
)
from virtengine_hpc.node.latency import probe, split_target
from virtengine_hpc.node.metrics import MetricsCollector, parse_busy_gpus, parse_gpu_csv
from virtengine_hpc.node.sequence import SequenceStore
from virtengine_hpc.signing import Signer, canonical_bytes, load_private_key, write_private_key

REPO = Path(__file__).resolve().parents[1]
SEED_CONFIG = """\
node-id: "node-001"
cluster-id: "hpc-cluster-1"
provider-address: "virtengine1provider0example"
provider-daemon-url: "http://provider-daemon:8081"
heartbeat-interval: 30s
key-file: "/etc/virtengine/virtengine-agent.key"
region: "us-east-1"
datacenter: "dc1"
zone: "a"
rack: "rack-7"
row: "row-2"
position: "u14"
latency-targets:
  - "node-002"
  - "node-003"
log-level: "info"
"""


def test_the_seed_config_loads_with_every_key(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(SEED_CONFIG)
    config = load_agent_config(path, env={})
    assert config.node_id == "node-001" and config.cluster_id == "hpc-cluster-1"
    assert config.provider_daemon_url == "http://provider-daemon:8081"
    assert config.heartbeat_interval.total_seconds() == 30
    assert config.key_file == Path("/etc/virtengine/virtengine-agent.key")
    assert config.placement == NodePlacement(
        region="us-east-1", datacenter="dc1", zone="a", rack="rack-7", row="row-2", position="u14"
    )
    assert config.latency_targets == ["node-002", "node-003"]
    assert config.log_level == "info"
    assert config.sequence_file == Path("/etc/virtengine/virtengine-agent.key.seq")


def test_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(SEED_CONFIG)
    env = {
        "VE_NODE_HEARTBEAT_INTERVAL": "5s",
        "VE_NODE_LATENCY_TARGETS": "a, b:22",
        "VE_NODE_NODE_ID": "env-node",
    }
    config = load_agent_config(path, env=env, overrides={"node_id": "flag-node", "cluster_id": None})
    assert config.heartbeat_interval.total_seconds() == 5
    assert config.latency_targets == ["a", "b:22"]
    assert config.node_id == "flag-node" and config.cluster_id == "hpc-cluster-1"


@pytest.mark.parametrize(
    ("data", "env", "message"),
    [
        ("heartbeat-interval: 5x\n", {}, "heartbeat-interval: invalid duration '5x'"),
        ("heartbeat-interval: 10ms\n", {}, "heartbeat-interval: must be between 200ms and 1h"),
        ("nodeid: n1\n", {}, "nodeid: unknown key"),
        ("log-level: loud\n", {}, "log-level: Input should be"),
        ("provider-daemon-url: ftp://x\n", {}, "provider-daemon-url: String should match"),
        ("latency-targets: ['a b']\n", {}, "latency-targets.0"),
        ("rack: '../../etc'\n", {}, "rack: String should match"),
        ("", {"VE_NODE_HEARTBEAT": "5s"}, "VE_NODE_HEARTBEAT: unknown setting"),
        ("- a\n", {}, "the top level must be a mapping"),
        ("client-cert-file: /c.pem\n", {}, "client-cert-file and client-key-file go together"),
        ("", {"VE_NODE_CLIENT_KEY_FILE": "/k.pem"}, "client-cert-file and client-key-file go together"),
        (
            "provider-daemon-url: http://p:8081\nca-file: /ca.pem\n",
            {},
            "ca-file needs an https:// provider-daemon-url (it is http://",
        ),
        (
            "provider-daemon-url: http://p:8081\nclient-cert-file: /c.pem\nclient-key-file: /k.pem\nca-file: /ca.pem\n",
            {},
            "ca-file and client-cert-file need an https:// provider-daemon-url",
        ),
        ("", {"VE_NODE_CA_FILES": "/ca.pem"}, "VE_NODE_CA_FILES: unknown setting"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, data: str, env: dict[str, str], message: str) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(data)
    with pytest.raises(ConfigError) as err:
        load_agent_config(path, env=env)
    assert message in str(err.value)


def test_tls_keys_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(SEED_CONFIG.replace("http://provider-daemon:8081", "https://provider-daemon:8081"))
    plain = load_agent_config(path, env={})
    assert plain.uses_tls and plain.ca_file is None and plain.client_cert_file is None
    path.write_text(path.read_text() + "ca-file: /etc/virtengine/node-api-ca.pem\n")
    env = {
        "VE_NODE_CLIENT_CERT_FILE": "/etc/virtengine/node.pem",
        "VE_NODE_CLIENT_KEY_FILE": "/etc/virtengine/node.key",
    }
    config = load_agent_config(path, env=env)
    assert config.ca_file == Path("/etc/virtengine/node-api-ca.pem")
    assert config.client_cert_file == Path("/etc/virtengine/node.pem")
    assert config.client_key_file == Path("/etc/virtengine/node.key")
    assert not load_agent_config(env={"VE_NODE_PROVIDER_DAEMON_URL": "http://x:8081"}).uses_tls


def test_missing_identity_is_reported_with_where_to_set_it() -> None:
    config = load_agent_config(env={})
    with pytest.raises(ConfigError, match=r"node-id \(VE_NODE_NODE_ID or --node-id\)"):
        config.require("node-id", "cluster-id")


def documented_heartbeat() -> HeartbeatBody:
    return HeartbeatBody(
        node_id="node-001",
        cluster_id="hpc-cluster-1",
        provider_address="virtengine1provider0example",
        sequence_number=42,
        timestamp=datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC),
        agent_version="0.1.0",
        capacity=NodeCapacity(
            cpu_cores_total=64,
            cpu_cores_available=60,
            memory_mb_total=257000,
            memory_mb_available=200000,
            gpus_total=4,
            gpus_available=3,
            gpu_type="NVIDIA A100-SXM4-40GB",
            storage_gb_total=1800,
            storage_gb_available=1200,
        ),
        health=NodeHealth(
            status="healthy",
            uptime_seconds=86400,
            load_1m=Decimal("1.50"),
            load_5m=Decimal("1.20"),
            load_15m=Decimal("1.00"),
            cpu_utilization_percent=Decimal("6.25"),
            memory_utilization_percent=Decimal("22.20"),
            disk_utilization_percent=Decimal("33.30"),
            gpu_utilization_percent=Decimal("25.00"),
            services={"slurmd": True, "munged": True},
        ),
        placement=NodePlacement(
            region="us-east-1", datacenter="dc1", zone="a", rack="rack-7", row="row-2", position="u14"
        ),
        latency=[LatencySample(target="node-002", latency_us=182, probes=3, lost=0)],
    )


def test_the_canonical_form_is_exactly_the_documented_one() -> None:
    signed = canonical_bytes(documented_heartbeat().model_dump(mode="json"), HEARTBEAT_DOMAIN).decode()
    doc = (REPO / "docs" / "node-agent.md").read_text()
    block = re.search(r"```\n(virtengine-hpc/node-heartbeat/v1\n\{.*?\})\n```", doc, re.S)
    assert block is not None, "docs/node-agent.md shows the canonical example"
    assert signed == block.group(1)


def test_every_field_is_signed_and_the_wire_form_verifies() -> None:
    signer = Signer.generate()
    document = sign_document(documented_heartbeat(), HEARTBEAT_DOMAIN, signer)
    received = parse_signed_json(json.dumps(document, indent=1).encode())
    assert signature_valid(received, HEARTBEAT_DOMAIN, signer.public_key)
    for path in (
        ("capacity", "gpus_total"),
        ("health", "load_1m"),
        ("placement", "rack"),
        ("sequence_number",),
    ):
        forged = json.loads(json.dumps(document))
        target = forged
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = 7 if isinstance(target[path[-1]], int) else "9.99"
        assert not signature_valid(forged, HEARTBEAT_DOMAIN, signer.public_key), path
    assert not signature_valid(received, "virtengine-hpc/node-registration/v1", signer.public_key)


def test_the_collector_reads_this_host() -> None:
    collector = MetricsCollector(Path("/"), nvidia_smi="")
    capacity, health = collector.collect()
    assert capacity.cpu_cores_total == psutil.cpu_count(logical=True)
    meminfo = Path("/proc/meminfo").read_text()
    total_kb = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo).group(1))  # type: ignore[union-attr]
    assert capacity.memory_mb_total == total_kb // 1024
    statvfs = os.statvfs("/")
    assert capacity.storage_gb_total == statvfs.f_blocks * statvfs.f_frsize // 10**9
    assert capacity.gpus_total == 0 and capacity.gpu_type is None, "no nvidia-smi: no GPUs"
    assert health.uptime_seconds > 0
    assert abs(float(health.load_1m) - os.getloadavg()[0]) < 2.0
    assert set(health.services) == {"slurmd", "munged"}


def test_nvidia_smi_output_is_parsed() -> None:
    listing = (
        "GPU-5e1c9d2a-0000-1111-2222-333344445555, NVIDIA A100-SXM4-40GB, 40960, 35000, 97\n"
        "GPU-7f2e8c3b-0000-1111-2222-333344445555, NVIDIA A100-SXM4-40GB, 40960, 3, 0\n"
        "GPU-9a3f7d4c-0000-1111-2222-333344445555, NVIDIA A100-SXM4-40GB, 40960, [N/A], [N/A]\n"
    )
    gpus = parse_gpu_csv(listing)
    assert [g.memory_mb for g in gpus] == [40960, 40960, 40960]
    assert [g.utilization for g in gpus] == [97.0, 0.0, 0.0]
    busy = parse_busy_gpus(
        "GPU-5e1c9d2a-0000-1111-2222-333344445555\nGPU-5e1c9d2a-0000-1111-2222-333344445555\n"
    )
    assert busy == {"GPU-5e1c9d2a-0000-1111-2222-333344445555"}


def test_a_collector_with_a_gpu_tool_reports_its_gpus(tmp_path: Path) -> None:
    tool = tmp_path / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --query-gpu=*) printf 'GPU-a, NVIDIA H100 80GB HBM3, 81559, 1000, 50\\nGPU-b, NVIDIA H100 80GB HBM3,"
        " 81559, 0, 0\\n' ;;\n"
        "  --query-compute-apps=*) printf 'GPU-a\\n' ;;\n"
        "esac\n"
    )
    tool.chmod(0o755)
    capacity, health = MetricsCollector(Path("/"), nvidia_smi=str(tool)).collect()
    assert (capacity.gpus_total, capacity.gpus_available, capacity.gpu_type) == (
        2,
        1,
        "NVIDIA H100 80GB HBM3",
    )
    assert health.gpu_utilization_percent == Decimal("25.00")


async def test_latency_is_measured_by_tcp_connection_set_up() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        sample = await probe(f"127.0.0.1:{port}", probes=3)
    assert sample.lost == 0 and sample.latency_us is not None and 0 < sample.latency_us < 1_000_000
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    refused = await probe(f"127.0.0.1:{closed_port}", probes=2)
    assert refused.lost == 0 and refused.latency_us is not None, "an RST is an answer too"
    unknown = await probe("no-such-node.invalid")
    assert unknown.latency_us is None and "cannot resolve" in (unknown.error or "")
    assert split_target("node-002") == ("node-002", 6818)
    assert split_target("[::1]:22") == ("::1", 22)


def test_the_sequence_survives_a_restart_and_one_agent_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "agent.key.seq"
    clock = [0]
    store = SequenceStore(path, floor=lambda: clock[0])
    assert [store.next(), store.next(), store.next()] == [1, 2, 3]
    with pytest.raises(ConfigError, match="another hpc-node-agent"):
        SequenceStore(path)
    store.close()
    again = SequenceStore(path, floor=lambda: clock[0])
    assert again.next() == 4, "a restarted agent goes on where it stopped"
    clock[0] = 1000
    assert again.next() == 1000, "never below the clock"
    clock[0] = 10
    assert again.next() == 1001, "never backwards either"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again.close()
    path.unlink()  # lost: the clock alone puts the next number above everything sent before
    assert SequenceStore(path, floor=lambda: 2000).next() == 2000
    path.write_text("garbage")
    with pytest.raises(ConfigError, match="corrupt"):
        SequenceStore(path, lock=False)


def test_the_default_floor_is_the_clock_in_milliseconds(tmp_path: Path) -> None:
    before = time.time_ns() // 1_000_000
    sent = SequenceStore(tmp_path / "agent.key.seq").next()
    assert before <= sent <= time.time_ns() // 1_000_000
    assert sent < (1 << 63) - 1 - 10**15, "the range lasts for millennia of heartbeats"


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "agent.key"
    write_private_key(key)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    key.chmod(0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        load_private_key(key)


def test_init_prints_the_public_key_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from virtengine_hpc.node.cli import main
    from virtengine_hpc.signing import public_key_b64

    key = tmp_path / "k" / "agent.key"
    assert main(["init", "--key-file", str(key)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == public_key_b64(load_private_key(key).public_key())
    assert main(["init", "--key-file", str(key)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err


def test_the_agent_refuses_to_start_without_its_identity() -> None:
    from virtengine_hpc.node.agent import NodeAgent

    config = load_agent_config(env={}, overrides={"node_id": "n1"})
    with pytest.raises(ConfigError, match="cluster-id"):
        NodeAgent(config, Signer.generate())
