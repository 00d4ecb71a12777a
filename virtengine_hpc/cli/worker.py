"""``virtengine-hpc worker run`` and ``virtengine-hpc poller run``: the long-running provider processes; ``worker
build-id``: the build id this installation's workers register with (what an upgrade's ``temporal worker
deployment`` commands name)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from virtengine_hpc.cli.common import config_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    worker = sub.add_parser("worker", help="run a worker for the configured cluster")
    wsub = worker.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = wsub.add_parser("run", help="run HPCJobWorkflow and its activities (Ctrl-C or SIGTERM to stop)")
    run.add_argument("--poller", action="store_true", help="also run the chain poller in this process")
    run.add_argument("--log-level", default="INFO")
    run.set_defaults(func=_run_worker)
    build = wsub.add_parser(
        "build-id", help="print the build id this installation's workers register in the Worker Deployment"
    )
    build.set_defaults(func=_print_build_id)

    poller = sub.add_parser("poller", help="run the chain poller alone")
    psub = poller.add_subparsers(dest="action", metavar="ACTION", required=True)
    prun = psub.add_parser("run", help="start one workflow per pending chain job, every job_poll_interval")
    prun.add_argument("--log-level", default="INFO")
    prun.set_defaults(func=_run_poller)


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _run_worker(args: argparse.Namespace) -> int:
    from workers.worker import run_worker

    _logging(args.log_level)
    asyncio.run(run_worker(config_from_args(args), with_poller=args.poller))
    return 0


def _print_build_id(args: argparse.Namespace) -> int:
    temporal = config_from_args(args).temporal
    if temporal.deployment_name is None:
        raise SystemExit(
            "temporal.deployment_name is null: these workers are unversioned and register no build"
        )
    print(temporal.build_id)
    return 0


def _run_poller(args: argparse.Namespace) -> int:
    from workers.worker import run_poller

    _logging(args.log_level)
    asyncio.run(run_poller(config_from_args(args)))
    return 0
