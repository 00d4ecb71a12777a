"""Helpers shared by the CLIs (``virtengine-hpc`` and ``hpc-node-agent``): running a parser, loading the config,
printing JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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


def exit_process(main: Callable[[], int | None]) -> NoReturn:
    """Run a command's ``main`` and leave the process without interpreter teardown.

    A process that has used a Temporal client or worker holds the SDK's Rust runtime threads; when CPython finalises
    while one of them still calls back into Python, the process aborts with "Fatal Python error: PyGILState_Release"
    (temporalio/sdk-python#300) - after the command has printed its result, turning a success into exit 134. So once
    ``main`` returns, the output streams and log handlers are flushed and the process ends with ``os._exit`` and the
    command's own exit code. Nothing of ours relies on ``atexit``.
    """
    try:
        code: int = int(main() or 0)
    except SystemExit as exc:  # argparse (--help, a usage error) and sys.exit inside a command
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # the reader went away (``jobs list | head``): stop quietly, as a SIGPIPE would
        code = 141
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe (``| head``) or a closed stream: nothing more to say.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
