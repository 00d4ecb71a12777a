"""Helpers shared by the CLIs (``virtengine-hpc`` and ``hpc-node-agent``): running a parser, loading the config,
printing JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from virtengine_hpc.config import Config, load_config
from virtengine_hpc.errors import HPCError


def config_from_args(args: argparse.Namespace) -> Config:
    path = getattr(args, "config", None) or os.environ.get("VIRTENGINE_HPC_CONFIG")
    return load_config(path)


def print_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        print(value.model_dump_json(indent=2))
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
        print(json.dumps([v.model_dump(mode="json") for v in value], indent=2))
    else:
        print(json.dumps(value, indent=2, default=str))


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse, dispatch to the subcommand's ``func``, and turn the errors a user can fix into one line (exit 2)."""
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
