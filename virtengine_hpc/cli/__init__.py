"""``virtengine-hpc``: one command with a subcommand per area.

Each area lives in its own module under ``virtengine_hpc.cli`` and exposes ``register(subparsers)``; a subcommand
sets ``func`` (returning an exit code) on its parser. Errors the user can fix are ``HPCError`` and print as one
line without a traceback (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from virtengine_hpc.errors import HPCError

# Areas in the order ``--help`` lists them. A module that is missing (an optional area) is skipped.
AREAS = ("worker", "jobs", "ledger", "usage", "audit", "templates", "nodes", "status", "dev")


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
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except HPCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
