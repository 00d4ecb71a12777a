"""``hpc-node-agent``: ``init``, ``register``, ``start`` and ``status`` (the seed's commands).

``--config`` defaults to ``/etc/virtengine/hpc-node-agent.yaml`` when that file exists; ``VE_NODE_*``
variables override the file and flags override both. Errors the user can fix print one line (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from virtengine_hpc.cli.common import exit_process, run
from virtengine_hpc.errors import HPCError
from virtengine_hpc.node.config import DEFAULT_CONFIG_PATH, NodeAgentConfig, load_agent_config
from virtengine_hpc.node.heartbeat import AGENT_VERSION
from virtengine_hpc.signing import Signer, public_key_b64, write_private_key

_IDENTITY_FLAGS = ("node_id", "cluster_id", "provider_address", "provider_daemon_url", "key_file")


def _config(args: argparse.Namespace) -> NodeAgentConfig:
    path = args.config
    if path is None and DEFAULT_CONFIG_PATH.exists():
        path = DEFAULT_CONFIG_PATH
    overrides = {name: getattr(args, name, None) for name in _IDENTITY_FLAGS}
    overrides["log_level"] = getattr(args, "log_level", None)
    return load_agent_config(path, overrides=overrides)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_init(args: argparse.Namespace) -> int:
    key_file = Path(args.key_file) if args.key_file else _config(args).key_file
    try:
        key = write_private_key(key_file)
    except FileExistsError:
        raise HPCError(f"{key_file} already exists; refusing to overwrite a node key") from None
    public = public_key_b64(key.public_key())
    print(public)
    print(
        f"# key written to {key_file} (mode 0600). Allow it on the provider with:\n"
        f"#   virtengine-hpc nodes allow <node-id> --cluster <cluster-id> --public-key {public}",
        file=sys.stderr,
    )
    return 0


async def _with_agent(args: argparse.Namespace, action: str) -> int:
    from virtengine_hpc.node.agent import NodeAgent
    from virtengine_hpc.node.sequence import SequenceStore

    config = _config(args)
    _setup_logging(config.log_level)
    config.require("node-id", "cluster-id", "provider-address", "provider-daemon-url")
    if not config.key_file.exists():
        raise HPCError(f"no key at {config.key_file}: create one with `hpc-node-agent init --key-file PATH`")
    signer = Signer.from_file(config.key_file)
    sequence = SequenceStore(config.sequence_file, lock=action == "start")
    try:
        agent = NodeAgent(
            config, signer, sequence=sequence
        )  # loads the TLS files: ConfigError naming the key
    except BaseException:
        sequence.close()
        raise
    try:
        if action == "register":
            answer = await agent.register()
            print(json.dumps(answer, indent=2))
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        logging.getLogger("hpc-node-agent").info(
            "hpc-node-agent %s: node %s, heartbeat every %s s to %s%s",
            AGENT_VERSION,
            config.node_id,
            config.heartbeat_interval.total_seconds(),
            config.provider_daemon_url,
            _tls_summary(config),
        )
        await agent.run(stop)
        return 0
    finally:
        await agent.close()
        sequence.close()


def _tls_summary(config: NodeAgentConfig) -> str:
    if not config.uses_tls:
        return ""
    trusted = f"CA {config.ca_file}" if config.ca_file else "the system's CAs"
    client = f", client certificate {config.client_cert_file}" if config.client_cert_file else ""
    return f" (TLS verified against {trusted}{client})"


def cmd_register(args: argparse.Namespace) -> int:
    return asyncio.run(_with_agent(args, "register"))


def cmd_start(args: argparse.Namespace) -> int:
    return asyncio.run(_with_agent(args, "start"))


def cmd_status(args: argparse.Namespace) -> int:
    from virtengine_hpc.node.latency import probe_all
    from virtengine_hpc.node.metrics import MetricsCollector
    from virtengine_hpc.node.sequence import SequenceStore

    config = _config(args)
    collector = MetricsCollector(config.storage_path)
    capacity, health = collector.collect()
    last: Any = None
    if config.status_file.exists():
        last = json.loads(config.status_file.read_text())
    report = {
        "node_id": config.node_id,
        "cluster_id": config.cluster_id,
        "capacity": capacity.model_dump(mode="json"),
        "health": health.model_dump(mode="json"),
        "placement": config.placement.model_dump(mode="json"),
        "latency": [s.model_dump(mode="json") for s in asyncio.run(probe_all(list(config.latency_targets)))],
        "sequence": SequenceStore.read(config.sequence_file),
        "last_heartbeat": last,
    }
    print(json.dumps(report, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-node-agent", description="Signed heartbeats from an HPC compute node to its provider."
    )
    parser.add_argument("--version", action="version", version=f"hpc-node-agent {AGENT_VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser, *, identity: bool = True) -> None:
        p.add_argument("--config", "-c", metavar="FILE", help=f"YAML config (default {DEFAULT_CONFIG_PATH})")
        p.add_argument("--key-file", metavar="PATH", help="Ed25519 private key file")
        p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
        if identity:
            p.add_argument("--node-id")
            p.add_argument("--cluster-id")
            p.add_argument("--provider-address")
            p.add_argument("--provider-daemon-url", metavar="URL")

    p = sub.add_parser("init", help="create the node's Ed25519 key (mode 0600) and print its public key")
    common(p, identity=False)
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("register", help="register this node with the provider (its key must be allowed)")
    common(p)
    p.set_defaults(func=cmd_register)
    p = sub.add_parser("start", help="register, then send a signed heartbeat every heartbeat-interval")
    common(p)
    p.set_defaults(func=cmd_start)
    p = sub.add_parser("status", help="print this node's current metrics and the last heartbeat result")
    common(p)
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


def entry() -> None:
    """The ``hpc-node-agent`` console script: ``main``, its exit code and output kept, as ``virtengine-hpc`` does."""
    exit_process(main)


if __name__ == "__main__":
    entry()
