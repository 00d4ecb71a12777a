"""``virtengine-hpc``: one command with a subcommand per area.

Each area lives in its own module under ``virtengine_hpc.cli`` and exposes ``register(subparsers)``; a subcommand
sets ``func`` (returning an exit code) on its parser. Errors the user can fix are ``HPCError`` and print as one
line without a traceback (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from virtengine_hpc.cli.common import exit_process, run

# Areas in the order ``--help`` lists them. A module that is missing (an optional area) is skipped.
AREAS = ("worker", "jobs", "ledger", "usage", "audit", "templates", "nodes", "tenants", "status", "dev")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="virtengine-hpc",
        description="Durable orchestration of HPC jobs for VirtEngine providers.",
    )
    parser.add_argument(
        "--config", "-c", metavar="FILE", help="YAML config file (default: $VIRTENGINE_HPC_CONFIG if set)"
    )
    sub = parser.add_subparsers(dest="area", metavar="COMMAND")
    for area in AREAS:
        try:
            module = importlib.import_module(f"virtengine_hpc.cli.{area}")
        except ModuleNotFoundError as exc:
            if exc.name == f"virtengine_hpc.cli.{area}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


def entry() -> None:
    """The ``virtengine-hpc`` console script and ``python -m virtengine_hpc``: ``main`` without interpreter teardown
    (see ``exit_process``)."""
    exit_process(main)


if __name__ == "__main__":
    entry()
