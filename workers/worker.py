"""The worker process: runs HPCJobWorkflow and its activities for one cluster (and, optionally, the poller).

Recovery needs no state of its own: kill the process at any instant and start another; Temporal replays every
workflow and the idempotent activities pick up where the dead worker stopped.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from activities.jobs import JobActivities
from virtengine_hpc.config import Config, Secrets
from workers.poller import ChainPoller
from workers.wiring import WorkerDeps, build_worker_deps, connect, job_settings, task_queue
from workflows.hpc_job import HPCJobWorkflow

log = logging.getLogger(__name__)


def job_activities(acts: JobActivities) -> list[Callable[..., Any]]:
    return [
        acts.route_job,
        acts.submit_job,
        acts.watch_job,
        acts.cancel_job,
        acts.report_transition,
        acts.report_usage,
    ]


def make_worker(client: Client, deps: WorkerDeps, *, queue: str | None = None) -> Worker:
    config = deps.config
    limit = config.hpc.job_service.max_concurrent_jobs
    return Worker(
        client,
        task_queue=queue or task_queue(config),
        workflows=[HPCJobWorkflow],
        activities=[*job_activities(deps.activities), *deps.extra_activities],
        # Every running job holds one long watch activity; leave room for the short ones beside them.
        max_concurrent_activities=2 * limit + 50,
        max_concurrent_workflow_tasks=100,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=3),
        graceful_shutdown_timeout=timedelta(seconds=10),
    )


async def run_worker(config: Config, *, with_poller: bool = False) -> None:
    secrets = Secrets.from_env()
    client = await connect(config, secrets)
    deps = build_worker_deps(config, secrets)
    worker = make_worker(client, deps)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    deps.audit.record(
        "service_started", cluster_id=config.hpc.cluster_id, details={"task_queue": task_queue(config)}
    )
    tasks = [asyncio.create_task(worker.run())]
    if with_poller:
        poller = ChainPoller(
            client,
            deps.chain,
            config,
            deps.audit,
            task_queue=task_queue(config),
            settings=job_settings(config),
        )
        tasks.append(asyncio.create_task(poller.run(stop)))
    log.info("worker for cluster %s on task queue %s", config.hpc.cluster_id, task_queue(config))
    await stop.wait()
    await worker.shutdown()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await deps.close()
    deps.audit.record("service_stopped", cluster_id=config.hpc.cluster_id)


async def run_poller(config: Config) -> None:
    from activities.audit import AuditLog
    from workers.wiring import open_chain

    client = await connect(config)
    audit = AuditLog(config.hpc.audit)
    poller = ChainPoller(
        client,
        open_chain(config),
        config,
        audit,
        task_queue=task_queue(config),
        settings=job_settings(config),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await poller.run(stop)
