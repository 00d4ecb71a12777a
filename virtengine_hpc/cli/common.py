"""Helpers shared by the CLI areas: loading the config, printing JSON."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pydantic import BaseModel

from virtengine_hpc.config import Config, load_config


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
