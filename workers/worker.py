"""The worker process: runs HPCJobWorkflow, NodeWorkflow and their activities for one or several clusters
(and, optionally, the chain poller).

Recovery needs no state of its own: kill the process at any instant and start another; Temporal replays every
workflow and the idempotent activities pick up where the dead worker stopped. A planned stop is gentler: SIGTERM
turns readiness off, stops polling for new tasks, gives running activities ``temporal.graceful_shutdown_timeout``
to finish, then cancels the rest, which Temporal retries at once on the other workers of the same task queues
(docs/production.md, "Graceful shutdown").

One process serves every cluster in ``Config.served_cluster_ids`` (or those given), one Temporal ``Worker`` per
cluster task queue, sharing one client, one set of activities and one metrics registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import Client
from temporalio.worker import Worker

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from activities.jobs import JobActivities
from activities.schedulers.base import SchedulerAdapter
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import HPCError
from virtengine_hpc.logging import setup_logging
from workers.health import HealthServer, Probes
from workers.metrics import MeteredAuditLog, MetricsSource, WorkerMetrics, keep_job_gauge_fresh, make_runtime
from workers.poller import ChainPoller
from workers.sweeper import JobSweep
from workers.versioning import deployment_config, promote_first_build
from workers.wiring import (
    WorkerDeps,
    anchor_signer,
    build_adapter,
    build_worker_deps,
    connect,
    job_settings,
    missing_search_attributes,
    open_chain,
    search_attribute_commands,
    task_queue,
    tracing_interceptors,
)
from workflows.hpc_job import HPCJobWorkflow

log = logging.getLogger(__name__)
T = TypeVar("T")


def job_activities(acts: JobActivities) -> list[Callable[..., Any]]:
    return [
        acts.route_job,
        acts.submit_job,
        acts.find_job,
        acts.watch_job,
        acts.cancel_job,
        acts.report_transition,
        acts.report_usage,
        acts.recover_job,
        acts.park_job,
        acts.monitor.poll_cluster,
        acts.monitor.watch_with_monitor,
    ]


def make_worker(
    client: Client, deps: WorkerDeps, *, queue: str | None = None, cluster_id: str | None = None
) -> Worker:
    """The Temporal worker of one cluster's task queue (``queue`` overrides it; tests use random queues)."""
    config = deps.config
    limit = config.hpc.job_service.max_concurrent_jobs
    return Worker(
        client,
        task_queue=queue or task_queue(config, cluster_id),
        workflows=[HPCJobWorkflow, *deps.extra_workflows],
        activities=[*job_activities(deps.activities), *deps.extra_activities],
        # Every running job holds one long watch activity; leave room for the short ones beside them.
        max_concurrent_activities=2 * limit + 50,
        max_concurrent_workflow_tasks=100,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=3),
        graceful_shutdown_timeout=config.temporal.graceful_shutdown_timeout,
        deployment_config=deployment_config(config.temporal),
    )


def _process_logging(config: Config, role: str) -> None:
    static = {"role": role}
    if config.temporal.build_id:
        static["build_id"] = config.temporal.build_id
    if config.logging.format == "json" or config.logging.level:
        setup_logging(config.logging.format, config.logging.level, static=static)


class WorkerProcess:
    """A whole worker process, startable and stoppable in-process (tests) or from ``run_worker`` (production).

    ``chain`` and ``adapters`` replace the configured ones (tests); ``clusters`` limits the served clusters.
    """

    def __init__(
        self,
        config: Config,
        secrets: Secrets,
        *,
        with_poller: bool = False,
        clusters: Sequence[str] | None = None,
        chain: ChainClient | None = None,
        adapters: dict[str, SchedulerAdapter] | None = None,
        client: Client | None = None,
    ) -> None:
        self.config = config
        self.secrets = secrets
        self.with_poller = with_poller
        self.clusters = list(clusters) if clusters else None
        self._chain = chain
        self._adapters = adapters
        self.client = client
        self.metrics = WorkerMetrics()
        self.deps: WorkerDeps | None = None
        self.workers: dict[str, Worker] = {}
        self.pollers: list[ChainPoller] = []
        self.sweeps: list[JobSweep] = []
        self.health: HealthServer | None = None
        self.stopping = False
        self._stopped = False
        self._stop = asyncio.Event()
        self._worker_tasks: dict[str, asyncio.Task[None]] = {}
        self._side_tasks: list[asyncio.Task[None]] = []

    @property
    def cluster_ids(self) -> list[str]:
        return list(self.workers)

    async def start(self) -> None:
        config = self.config
        sdk_url = None
        if self.client is None:
            runtime, sdk_url = make_runtime(
                sdk_metrics=bool(config.metrics.listen and config.metrics.sdk_metrics),
                forward_logs=config.logging.format == "json",
            )
            self.client = await wait_out_transient(
                lambda: connect(
                    config, self.secrets, runtime=runtime, interceptors=tracing_interceptors(config)
                ),
                "worker start",
                lambda: self.stopping,
            )
        client = self.client
        await _warn_about_search_attributes(client, config.temporal.namespace)
        deps = await wait_out_transient(
            lambda: asyncio.sleep(
                0,
                result=build_worker_deps(
                    config,
                    self.secrets,
                    chain=self._chain,
                    adapters=self._adapters,
                    clusters=self.clusters,
                    metrics=self.metrics,
                    node_capacity=True,
                ),
            ),
            "worker start",
            lambda: self.stopping,
        )
        self.deps = deps
        self.metrics.up.labels(config.temporal.build_id or "", ",".join(deps.cluster_ids)).set(1)
        for cluster_id in deps.cluster_ids:
            worker = make_worker(client, deps, cluster_id=cluster_id)
            self.workers[cluster_id] = worker
            self._worker_tasks[cluster_id] = asyncio.create_task(worker.run(), name=f"worker-{cluster_id}")
        if config.temporal.promote_first_build and deployment_config(config.temporal) is not None:
            self._side_tasks.append(asyncio.create_task(self._promote_first_build(client)))
        if self.with_poller:
            self.pollers = [
                _poller(client, deps.chain, config, deps.audit, cluster_id, self.metrics)
                for cluster_id in deps.cluster_ids
            ]
            self._side_tasks += [asyncio.create_task(p.run(self._stop)) for p in self.pollers]
            self.sweeps = [
                _sweep(
                    client,
                    deps.chain,
                    deps.adapters[poller.cluster_id],
                    config,
                    deps.audit,
                    poller,
                    self.metrics,
                )
                for poller in self.pollers
            ]
            self._side_tasks += [asyncio.create_task(s.run(self._stop)) for s in self.sweeps]
        interval = config.metrics.jobs_refresh_interval.total_seconds()
        if config.metrics.listen and interval > 0:
            self._side_tasks.append(
                asyncio.create_task(
                    keep_job_gauge_fresh(client, self.metrics, config.cluster_ids(), interval, self._stop)
                )
            )
        if config.metrics.listen:
            self.health = HealthServer(
                config.metrics.listen, self._probes(MetricsSource(self.metrics, sdk_url))
            )
            await self.health.start()
        for cluster_id in deps.cluster_ids:
            deps.audit.record(
                AuditEvent.SERVICE_STARTED,
                cluster_id=cluster_id,
                details={
                    "service": "worker",
                    "task_queue": task_queue(config, cluster_id),
                    "poller": self.with_poller,
                    "build_id": config.temporal.build_id,
                },
            )
            log.info(
                "worker for cluster %s on task queue %s, build %s",
                cluster_id,
                task_queue(config, cluster_id),
                config.temporal.build_id,
            )

    async def _promote_first_build(self, client: Client) -> None:
        try:
            await promote_first_build(client, self.config.temporal, stopping=lambda: self.stopping)
        except Exception as exc:  # the workers serve on; jobs wait until an operator makes a build current
            log.error(
                "could not make build %s current on worker deployment %s (make it current with the temporal "
                "CLI, docs/deploys.md): %s",
                self.config.temporal.build_id,
                self.config.temporal.deployment_name,
                exc,
            )

    def _probes(self, metrics: MetricsSource) -> Probes:
        client, deps = self.client, self.deps
        assert client is not None and deps is not None
        timeout = self.config.metrics.readiness_timeout

        async def temporal() -> None:
            if not await client.service_client.check_health(timeout=timeout):
                raise HPCError("Temporal answers but its workflow service is not serving")

        async def chain() -> None:
            await deps.chain.current_height()

        return Probes(
            live=self.problems,
            checks={
                "temporal": temporal,
                "chain": chain,
                "search_attributes": search_attributes_check(client, self.config.temporal.namespace),
            },
            metrics=metrics,
            stopping=lambda: self.stopping,
            check_timeout=timeout.total_seconds(),
        )

    def problems(self) -> list[str]:
        """Why the process is not alive: a Temporal worker that stopped without being asked to."""
        found = []
        for cluster_id, task in self._worker_tasks.items():
            if task.done() and not self.stopping:
                exc = None if task.cancelled() else task.exception()
                found.append(f"worker for cluster {cluster_id} stopped: {exc or 'without an error'}")
        return found

    async def wait(self) -> None:
        """Until ``stop()`` is asked for or a worker fails (raised as ``HPCError`` after a clean stop)."""
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait([stop, *self._worker_tasks.values()], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        problems = self.problems()
        if problems:
            await self.stop()
            raise HPCError("; ".join(problems))

    def request_stop(self) -> None:
        if self.stopping:
            log.warning("already stopping; send SIGKILL to stop at once")
        self.stopping = True
        self._stop.set()

    async def stop(self) -> None:
        """Graceful shutdown: readiness off, no new tasks, running activities finish or are handed over."""
        if self._stopped:
            return
        self._stopped = True
        self.stopping = True
        self._stop.set()
        log.info(
            "stopping: running activities get %s s to finish, the rest are retried on other workers",
            self.config.temporal.graceful_shutdown_timeout.total_seconds(),
        )
        await asyncio.gather(*(w.shutdown() for w in self.workers.values()), return_exceptions=True)
        for task in self._side_tasks:
            task.cancel()
        await asyncio.gather(*self._worker_tasks.values(), *self._side_tasks, return_exceptions=True)
        if self.health is not None:
            await self.health.stop()
        if self.deps is not None:
            await self.deps.close()
            for cluster_id in self.deps.cluster_ids:
                self.deps.audit.record(
                    AuditEvent.SERVICE_STOPPED, cluster_id=cluster_id, details={"service": "worker"}
                )
        log.info("stopped")


async def wait_out_transient(
    build: Callable[[], Awaitable[T]],
    what: str,
    stopping: Callable[[], bool],
    *,
    max_delay: float = 30.0,
) -> T:
    """``await build()``, retried while it fails with a transient ``HPCError``: Temporal unreachable, the chain
    busy or unreachable. (A synchronous step is passed as ``lambda: asyncio.sleep(0, result=step())``.)

    A worker (re)started while Temporal was down exited at once, and one started while another process held the
    ledger's write lock exited after the 30 s busy timeout: an outage could keep workers down after it ended
    (found by ``benchmarks/chaos.py``). Permanent errors (bad config, a key others can read) still end the start
    at once.
    """
    delay = 1.0
    while True:
        try:
            return await build()
        except HPCError as exc:
            if not exc.transient or stopping():
                raise
            log.warning("%s: %s; trying again in %.0f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


async def _warn_about_search_attributes(client: Client, namespace: str) -> None:
    try:
        missing = await missing_search_attributes(client, namespace)
    except Exception as exc:
        log.warning("cannot list the search attributes of namespace %s: %s", namespace, exc)
        return
    if missing:
        log.error(
            "namespace %s lacks the search attributes %s; no job can start until they exist: %s",
            namespace,
            ", ".join(missing),
            search_attribute_commands(namespace, missing),
        )


def search_attributes_check(client: Client, namespace: str) -> Callable[[], Awaitable[None]]:
    """A readiness check that the namespace has the job workflow's search attributes (checked until it has)."""
    found = False

    async def check() -> None:
        nonlocal found
        if found:
            return
        missing = await missing_search_attributes(client, namespace)
        if missing:
            raise HPCError(
                f"namespace {namespace} lacks the search attributes {', '.join(missing)}: "
                f"{search_attribute_commands(namespace, missing)}"
            )
        found = True

    return check


def _poller(
    client: Client,
    chain: ChainClient,
    config: Config,
    audit: AuditLog,
    cluster_id: str,
    metrics: WorkerMetrics,
) -> ChainPoller:
    return ChainPoller(
        client,
        chain,
        config.for_cluster(cluster_id),
        audit,
        task_queue=task_queue(config, cluster_id),
        settings=job_settings(config, cluster_id),
        metrics=metrics,
    )


def _sweep(
    client: Client,
    chain: ChainClient,
    adapter: SchedulerAdapter,
    config: Config,
    audit: AuditLog,
    poller: ChainPoller,
    metrics: WorkerMetrics,
) -> JobSweep:
    """The sweep of the poller's cluster; it sweeps while that poller holds the cluster's intake lease."""
    return JobSweep(
        client,
        chain,
        adapter,
        config.for_cluster(poller.cluster_id),
        audit,
        metrics=metrics,
        lease=poller.lease,
    )


def _sweep_adapters(config: Config, served: Sequence[str]) -> dict[str, SchedulerAdapter]:
    """The poller process's own adapters, for its sweeps (a cluster whose adapter cannot be built is not swept)."""
    adapters: dict[str, SchedulerAdapter] = {}
    if config.hpc.job_service.sweep_interval is None:
        return adapters
    secrets = Secrets.from_env()
    for cluster_id in served:
        try:
            adapters[cluster_id] = build_adapter(config, secrets, cluster_id)
        except HPCError as exc:
            log.error(
                "cluster %s: no sweep for scheduler jobs no workflow names: %s",
                cluster_id,
                exc,
                extra={"cluster_id": cluster_id},
            )
    return adapters


@contextlib.contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Any:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def run_worker(
    config: Config, *, with_poller: bool = False, clusters: Sequence[str] | None = None
) -> None:
    """``virtengine-hpc worker run``: serve the configured clusters until SIGTERM or SIGINT."""
    _process_logging(config, "worker")
    process = WorkerProcess(config, Secrets.from_env(), with_poller=with_poller, clusters=clusters)
    with _stop_on_signals(process.request_stop):
        try:
            await process.start()
            await process.wait()
        finally:
            await process.stop()


async def run_poller(config: Config, *, clusters: Sequence[str] | None = None) -> None:
    """``virtengine-hpc poller run``: start workflows for the pending jobs of the served clusters."""
    _process_logging(config, "poller")
    runtime, sdk_url = make_runtime(
        sdk_metrics=bool(config.metrics.listen and config.metrics.sdk_metrics),
        forward_logs=config.logging.format == "json",
    )
    client = await wait_out_transient(
        lambda: connect(config, runtime=runtime, interceptors=tracing_interceptors(config)),
        "poller start",
        lambda: False,
    )
    metrics = WorkerMetrics()
    audit = MeteredAuditLog(config.hpc.audit, metrics, anchor_signer=anchor_signer(Secrets.from_env()))
    chain = await wait_out_transient(
        lambda: asyncio.sleep(0, result=open_chain(config)), "poller start", lambda: False
    )
    served = list(clusters) if clusters else config.served_cluster_ids()
    pollers = [_poller(client, chain, config, audit, cluster_id, metrics) for cluster_id in served]
    adapters = _sweep_adapters(config, served)
    sweeps = [
        _sweep(client, chain, adapters[poller.cluster_id], config, audit, poller, metrics)
        for poller in pollers
        if poller.cluster_id in adapters
    ]
    stop = asyncio.Event()
    health = None
    if config.metrics.listen:

        async def temporal() -> None:
            if not await client.service_client.check_health(timeout=config.metrics.readiness_timeout):
                raise HPCError("Temporal answers but its workflow service is not serving")

        async def ledger() -> None:
            await chain.current_height()

        health = HealthServer(
            config.metrics.listen,
            Probes(
                checks={
                    "temporal": temporal,
                    "chain": ledger,
                    "search_attributes": search_attributes_check(client, config.temporal.namespace),
                },
                metrics=MetricsSource(metrics, sdk_url),
                stopping=stop.is_set,
                check_timeout=config.metrics.readiness_timeout.total_seconds(),
            ),
        )
        await health.start()
    with _stop_on_signals(stop.set):
        log.info("chain poller for clusters %s", ", ".join(served))
        try:
            await asyncio.gather(*(p.run(stop) for p in pollers), *(s.run(stop) for s in sweeps))
        finally:
            for adapter in adapters.values():
                await adapter.close()
    if health is not None:
        await health.stop()
