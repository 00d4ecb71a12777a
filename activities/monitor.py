"""Activities of the cluster monitor: one status query per cluster per interval, signals to the jobs that changed.

``poll_cluster`` runs once per poll interval for the monitor of a cluster (``workflows/cluster_monitor.py``). It
reads the watch set through the monitor's ``watched`` query, asks the scheduler about all of it with one
``status_batch`` call, compares each answer with what the job's workflow was last told (kept in this process) or,
when this process has told it nothing yet, with what the job registered, and signals ``observe`` to the jobs
whose state changed. So a retried round or a monitor continued as new loses no transition: a job is told again
at worst, and ignores a state it already has. A job missing from the scheduler is told only once it has been
missing for the vanished-job grace.

A job that takes its period usage records from the monitor (its registration says when the next one is due) has
them sent by the round: for each such job whose period is due and that the scheduler still shows running, the
round asks the job for the record it would send (the ``period_due`` query: its sequence, period start and
cumulative usage live in the job's workflow), sends it through the job activities' own usage path (the same
reading, metering and signing; records of one round go to the chain in batches), and signals the job the record
the chain holds (``period_recorded``). Exactly once: a record's id is the job's and sequence's, so a round retried
while a timed-out attempt still runs, or a round racing the job's own report, finds the record already on chain
and carries it; a round never sends before the job says its period is due.

``register`` is how a job workflow reaches its monitor: signal-with-start, so the first job of a cluster starts
the monitor and a job never waits for one that ended while idle; registrations that wait in a worker process while
it sends leave together, in one ``watch_many`` signal to a monitor run that handles it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.common import Priority
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.attempts import Attempt, AttemptProgress, heartbeating
from activities.group_commit import GroupCommit
from activities.schedulers.base import NativeStatus, SchedulerAdapter
from virtengine_hpc.activity_names import POLL_CLUSTER, WATCH_WITH_MONITOR
from virtengine_hpc.errors import SchedulerError
from virtengine_hpc.messages import (
    MONITOR_WORKFLOW_NAME,
    Ended,
    MonitorInput,
    Observation,
    PeriodDue,
    PeriodRecorded,
    PollInput,
    PollOutput,
    UsageInput,
    UsageOutput,
    WatchedSet,
    WatchEntry,
    WatchRegistration,
    monitor_workflow_id,
)
from virtengine_hpc.models import UsageRecord
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import next_report_due, record_id
from virtengine_hpc.watch_batch import MAX_WATCH_BATCH, MONITOR_TAKES_BATCHES, WATCH_MANY, WatchBatch

log = logging.getLogger(__name__)
SIGNALS_IN_FLIGHT = 64
"""Signals to job workflows sent at once when many jobs change in one round."""
MAX_ENDED = 1000
"""Ended jobs a round hands back to be forgotten (the rest follow in the next rounds): bounds its result."""
REGISTRATIONS_IN_FLIGHT = 8
"""Registrations with one monitor that a worker process sends at once. A monitor is one workflow, which Temporal
updates one request at a time: 10,000 jobs queued within minutes sent it thousands at once, most were refused as
"Workflow is busy" or timed out, and each refusal failed the job's report activity, retried with its chain report."""
BUSY_RETRIES = 6
"""Tries of a registration that Temporal refuses as busy or that times out, before the caller's activity fails."""
BUSY_BACKOFF_SECONDS = 0.5
"""Wait before the second try, doubled for each one after (with jitter: ~16 s over all the tries)."""
MONITOR_PRIORITY = 1
"""The monitor's Temporal priority key (1 is the highest, jobs run at the default 3): its workflow tasks and its
rounds share the cluster task queue with every job's, and during a ramp of 10,000 jobs its next workflow task waited
behind theirs for more than ten minutes (no round, no job told of anything, registrations piling up)."""
_BUSY = frozenset(
    {RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED}
)
_rooms: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Semaphore] = {}
_batchers: dict[tuple[asyncio.AbstractEventLoop, str], _Batcher] = {}
MAX_REPORTS = 500
"""Period records a round sends at most (the jobs beyond wait for the next round): bounds the round's length."""
QUERY_TIMEOUT = timedelta(seconds=10)
"""How long a round waits for a job's answer to ``period_due`` (no worker of the job: asked again next round)."""

ReportUsage = Callable[[UsageInput, Attempt], Awaitable[UsageOutput]]
"""Signs and sends one usage record: the job activities' own path (``JobActivities._report_usage``)."""


@dataclass
class _Told:
    """What this process last told a job's workflow (or what the job registered, before that)."""

    version: int
    status: NativeStatus
    missing_since: float | None = None
    report_at: datetime | None = None
    """When this process next looks at the job's period record (None: when its registration says)."""
    signed: UsageRecord | None = None
    """A period record signed by an earlier round that did not reach the job: sent again, never a new reading."""


@dataclass
class _Monitor:
    told: dict[str, _Told] = field(default_factory=dict)


class MonitorActivities:
    """The cluster monitor's I/O. ``queries`` and ``failures`` count status queries by cluster (metrics).

    ``report`` sends a usage record (the job activities' path); without it the rounds send no period records.
    """

    def __init__(self, adapters: Mapping[str, SchedulerAdapter], report: ReportUsage | None = None) -> None:
        self.adapters = adapters
        self.report = report
        self._monitors: dict[str, _Monitor] = {}
        self.queries: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    @activity.defn(name=POLL_CLUSTER)
    async def poll_cluster(self, request: PollInput) -> PollOutput:
        """One round: the watch set from the monitor, one scheduler query, signals to the jobs that changed."""
        monitor_id = activity.info().workflow_id or ""
        adapter = self.adapters.get(request.cluster_id)
        if adapter is None:
            raise ApplicationError(
                f"this worker has no scheduler adapter for cluster {request.cluster_id}", type="ConfigError"
            )
        client = activity.client()
        watched: WatchedSet = await heartbeating(
            client.get_workflow_handle(monitor_id).query("watched", result_type=WatchedSet)
        )
        monitor = self._monitors.setdefault(monitor_id, _Monitor())
        entries = watched.entries
        for gone in set(monitor.told) - set(entries):
            del monitor.told[gone]
        if not entries:
            return PollOutput()
        self.queries[request.cluster_id] += 1
        try:
            answer = await heartbeating(adapter.status_batch({e.scheduler_job_id for e in entries.values()}))
        except SchedulerError as exc:
            self.failures[request.cluster_id] += 1
            log.warning("status query of cluster %s failed (not a state change): %s", request.cluster_id, exc)
            return PollOutput(watched=len(entries), error=str(exc)[:300])
        except Exception as exc:
            # An adapter's bug fails the round the same way (as the watch activities' batcher does): failing the
            # activity had Temporal retry it with a growing backoff while no job heard of anything.
            self.failures[request.cluster_id] += 1
            log.exception("status query of cluster %s failed (not a state change)", request.cluster_id)
            return PollOutput(watched=len(entries), error=f"status query failed: {exc}"[:300])
        news = self._changes(monitor, entries, answer, request.vanished_grace_seconds)
        await heartbeating(self._tell(client, monitor, news))
        due = _periods_due(monitor, entries, answer, news)
        reported = await heartbeating(self._send_periods(client, monitor, due)) if due else 0
        return PollOutput(
            watched=len(entries), signalled=len(news), ended=_ended(monitor, entries), reported=reported
        )

    def _changes(
        self,
        monitor: _Monitor,
        entries: Mapping[str, WatchEntry],
        answer: Mapping[str, NativeStatus],
        grace: float,
    ) -> dict[str, NativeStatus]:
        """The jobs whose workflow must hear of a change, with what to tell each."""
        now = time.time()
        news: dict[str, NativeStatus] = {}
        for workflow_id, entry in entries.items():
            told = monitor.told.get(workflow_id)
            if told is None or told.version != entry.version:
                known = NativeStatus(
                    scheduler_job_id=entry.scheduler_job_id, state=entry.state, start_time=entry.start_time
                )
                told = _Told(entry.version, known, told.missing_since if told else None)
                monitor.told[workflow_id] = told
            status = answer.get(entry.scheduler_job_id) or NativeStatus(
                scheduler_job_id=entry.scheduler_job_id, found=False, reason="not in the answer"
            )
            if not status.found:
                told.missing_since = told.missing_since or now
                if now - told.missing_since >= grace and told.status.found:
                    news[workflow_id] = status
                continue
            told.missing_since = None
            if _changed(told.status, status):
                news[workflow_id] = status
        return news

    async def _tell(self, client: Client, monitor: _Monitor, news: Mapping[str, NativeStatus]) -> None:
        """Signal each changed job (a job whose workflow has ended counts as told that it is gone)."""
        room = asyncio.Semaphore(SIGNALS_IN_FLIGHT)

        async def tell(workflow_id: str, status: NativeStatus) -> None:
            async with room:
                try:
                    await client.get_workflow_handle(workflow_id).signal(
                        "observe", Observation(status=status)
                    )
                except RPCError as exc:
                    if exc.status != RPCStatusCode.NOT_FOUND:
                        log.warning("could not tell job %s of its state (next round): %s", workflow_id, exc)
                        return
                    status = status.model_copy(update={"found": False})  # its workflow has ended
            monitor.told[workflow_id].status = status

        await asyncio.gather(*(tell(w, s) for w, s in news.items()))

    async def _send_periods(self, client: Client, monitor: _Monitor, due: list[str]) -> int:
        """Send the period records of the jobs in ``due`` (concurrently: the usage batcher sends them to the chain
        together) and signal each job its record; the number signalled."""
        if self.report is None:
            return 0
        room = asyncio.Semaphore(SIGNALS_IN_FLIGHT)

        async def send(workflow_id: str) -> bool:
            async with room:
                return await self._send_period(client, workflow_id, monitor.told[workflow_id])

        return sum(await asyncio.gather(*(send(w) for w in due)))

    async def _send_period(self, client: Client, workflow_id: str, told: _Told) -> bool:
        """One job's period record, if the job says it is due: sent (or found on chain), then signalled."""
        assert self.report is not None
        handle = client.get_workflow_handle(workflow_id)
        now = datetime.now(UTC)
        try:
            asked: PeriodDue = await handle.query(
                "period_due", result_type=PeriodDue, rpc_timeout=QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
            log.info("job %s did not say whether its period record is due: %s", workflow_id, exc)
            # (Its workers may be away: the next rounds do not wait for it again at once.)
            told.report_at = now + QUERY_TIMEOUT
            return False
        every = timedelta(seconds=asked.interval_seconds or 60)
        if asked.report is None or asked.due_at is None:
            told.report_at = (
                now + every
            )  # not sent by the monitor now (not running, finishing): look again later
            return False
        if asked.due_at > now:
            told.report_at = asked.due_at  # a record sent meanwhile (the job's own, an earlier round's)
            return False
        request = asked.report
        rid = record_id(request.cluster_id, request.job_id, request.sequence)
        attempt = _RoundAttempt.of(
            told.signed if told.signed is not None and told.signed.record_id == rid else None
        )
        try:
            out = await self.report(request, attempt)
        except ApplicationError as exc:
            # Nothing moves: the period stays where the job's last record ended. A busy chain is tried again next
            # round with the same signed record (it may have landed); a refusal (it did not) waits for the job's
            # next report time and a new reading.
            if exc.non_retryable:
                told.signed, told.report_at = None, next_report_due(asked.started_at, now, every)
            else:
                told.signed, told.report_at = attempt.progress.usage_record, None
            log.warning("period record %s of job %s not sent: %s", rid, workflow_id, exc)
            return False
        except Exception:
            # A fault outside the domain's errors (an adapter's or the chain client's): it is this job's alone, and
            # the round goes on for the others. The job is looked at again at its next report time, with the record
            # this attempt signed if it did (it may have landed).
            told.signed, told.report_at = (
                attempt.progress.usage_record,
                next_report_due(asked.started_at, now, every),
            )
            log.exception("period record %s of job %s not sent", rid, workflow_id)
            return False
        if out.record_id is None:
            told.signed, told.report_at = (
                None,
                now + every,
            )  # the job ended: its final record closes the period
            return False
        try:
            await handle.signal("period_recorded", PeriodRecorded(usage=out))
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                told.signed, told.report_at = None, now + every  # its workflow has ended
                return False
            # Next round sends it again: the chain answers "duplicate" and the stored record is signalled.
            told.signed = attempt.progress.usage_record
            log.warning("could not tell job %s of its record %s (next round): %s", workflow_id, rid, exc)
            return False
        told.signed = None
        told.report_at = next_report_due(asked.started_at, out.period_end, every)
        return True

    @activity.defn(name=WATCH_WITH_MONITOR)
    async def watch_with_monitor(self, registration: WatchRegistration) -> None:
        """Register the job with its cluster's monitor (started if it is not running)."""
        await register(activity.client(), registration)


def _ended(monitor: _Monitor, entries: Mapping[str, WatchEntry]) -> list[Ended]:
    """The jobs told of their end (or of being gone), for the monitor to forget; again each round until it has."""
    ended: list[Ended] = []
    for workflow_id, told in monitor.told.items():
        if (not told.status.found or told.status.state.final) and len(ended) < MAX_ENDED:
            ended.append(Ended(workflow_id=workflow_id, version=entries[workflow_id].version))
    return ended


def _periods_due(
    monitor: _Monitor,
    entries: Mapping[str, WatchEntry],
    answer: Mapping[str, NativeStatus],
    news: Mapping[str, NativeStatus],
) -> list[str]:
    """The jobs whose period record the round sends: registered for it, running on both sides with no news this
    round, and due by what this process last learnt (or by their registration)."""
    now = datetime.now(UTC)
    due: list[str] = []
    for workflow_id, entry in entries.items():
        if entry.report_due is None or entry.state != JobState.RUNNING or workflow_id in news:
            continue
        status = answer.get(entry.scheduler_job_id)
        if status is None or not status.found or status.state != JobState.RUNNING:
            continue
        at = monitor.told[workflow_id].report_at or entry.report_due
        if at <= now and len(due) < MAX_REPORTS:
            due.append(workflow_id)
    return due


class _RoundAttempt(Attempt):
    """One job's period record within a monitor round. The round's attempt number decides whether an earlier
    attempt may have sent it (a retried round looks on chain first); its heartbeats carry no details (one round
    serves many jobs), and a record it signed is kept by the round's process instead."""

    @classmethod
    def of(cls, signed: UsageRecord | None) -> _RoundAttempt:
        info = activity.info()
        return cls(info.attempt, info.activity_type, AttemptProgress(usage_record=signed))

    def beat(self) -> None:
        activity.heartbeat()


def _changed(told: NativeStatus, status: NativeStatus) -> bool:
    if status.state != told.state:
        return True
    # Requeued and started again between two polls: the same state, a new start.
    return (
        status.state == JobState.RUNNING
        and told.start_time is not None
        and status.start_time is not None
        and status.start_time != told.start_time
    )


async def register(client: Client, registration: WatchRegistration) -> None:
    """Tell the cluster's monitor where a job stands: one workflow per cluster task queue, started by the first job.

    Registrations that arrive while this process is sending to the same monitor wait and leave together, in one
    ``watch_many`` signal when the monitor's running run handles it (its memo says so), else one signal-with-start
    of ``watch`` each (see ``_Batcher``). Returns once the monitor's history holds the registration.
    """
    monitor_id = monitor_workflow_id(registration.monitor.task_queue)
    key = (asyncio.get_running_loop(), monitor_id)
    batcher = _batchers.get(key) or _batchers.setdefault(key, _Batcher(monitor_id))
    await batcher.register(client, registration)


class _Batcher:
    """One process's registrations with one monitor, sent by group commit: whatever waits when a send ends leaves
    together. 10,000 jobs registering within minutes sent 10,000 signals to the one monitor workflow, which Temporal
    applies one at a time (measured about 1.2 s each on a loaded dev server): jobs waited minutes to be watched,
    and their report activities timed out. A batch goes as one ``watch_many`` signal to the run the monitor's memo
    names as handling it (``MONITOR_TAKES_BATCHES``), addressed to that run, so a run that ended meanwhile refuses
    it instead of an older build's next run taking a signal it does not know; otherwise, and for a registration
    alone, each goes as before (``_register_one``)."""

    def __init__(self, monitor_id: str) -> None:
        self.monitor_id = monitor_id
        self.sends: GroupCommit[tuple[Client, WatchRegistration], None] = GroupCommit(
            self._send, max_batch=MAX_WATCH_BATCH
        )

    async def register(self, client: Client, registration: WatchRegistration) -> None:
        await self.sends.submit((client, registration))

    async def _send(self, batch: list[tuple[Client, WatchRegistration]]) -> list[BaseException | None]:
        if len(batch) > 1 and await self._send_batch(batch[0][0], [r for _, r in batch]):
            return [None] * len(batch)
        return await asyncio.gather(*(_register_one(c, r) for c, r in batch), return_exceptions=True)

    async def _send_batch(self, client: Client, registrations: list[WatchRegistration]) -> bool:
        """One ``watch_many`` signal to a monitor run that handles it; False: there is none (send one by one)."""
        batch = WatchBatch(registrations=registrations)
        for attempt in range(BUSY_RETRIES):
            run = await self._run_taking_batches(client)
            if run is None:
                return False
            try:
                await client.get_workflow_handle(self.monitor_id, run_id=run).signal(WATCH_MANY, batch)
                return True
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    continue  # that run has just ended (continued as new, or idle): look again
                if exc.status not in _BUSY:
                    raise
                await asyncio.sleep(BUSY_BACKOFF_SECONDS * 2**attempt * random.uniform(0.5, 1.5))
        return False

    async def _run_taking_batches(self, client: Client) -> str | None:
        """The id of the monitor's running run if its memo says that run handles ``watch_many``."""
        try:
            described = await client.get_workflow_handle(self.monitor_id).describe()
        except RPCError:
            return None  # not started yet, or Temporal busy: one by one (their own retries)
        if described.status != WorkflowExecutionStatus.RUNNING:
            return None
        taker = await described.memo_value(MONITOR_TAKES_BATCHES, None, type_hint=str)
        return described.run_id if taker == described.run_id else None


async def _register_one(client: Client, registration: WatchRegistration) -> None:
    """One registration by itself (signal-with-start of ``watch``). At most ``REGISTRATIONS_IN_FLIGHT`` leave
    this process at once for one monitor; one refused as busy, or timed out, is sent again after a backoff (a
    registration is idempotent: the monitor keeps the latest). A job that ended only leaves the watch set: a
    monitor that is not running is not started for that, and a monitor that cannot be told forgets the job anyway
    when its next signal to the ended workflow fails."""
    monitor_id = monitor_workflow_id(registration.monitor.task_queue)
    room = _rooms.setdefault(
        (asyncio.get_running_loop(), monitor_id), asyncio.Semaphore(REGISTRATIONS_IN_FLIGHT)
    )
    for attempt in range(BUSY_RETRIES):
        try:
            async with room:
                await _register_once(client, registration)
            return
        except RPCError as exc:
            if exc.status not in _BUSY or attempt + 1 == BUSY_RETRIES:
                raise
            delay = BUSY_BACKOFF_SECONDS * 2**attempt
            log.info(
                "monitor %s is busy (%s); registering %s again in %.1f s",
                monitor_id,
                exc,
                registration.workflow_id,
                delay,
            )
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))


async def _register_once(client: Client, registration: WatchRegistration) -> None:
    settings = registration.monitor
    if registration.entry.state.final:
        try:
            await client.get_workflow_handle(monitor_workflow_id(settings.task_queue)).signal(
                "watch", registration
            )
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.info("job %s ended; its monitor was not told (%s)", registration.workflow_id, exc)
        return
    await client.start_workflow(
        MONITOR_WORKFLOW_NAME,
        MonitorInput(settings=settings),
        id=monitor_workflow_id(settings.task_queue),
        task_queue=settings.task_queue,
        start_signal="watch",
        start_signal_args=[registration],
        priority=Priority(priority_key=MONITOR_PRIORITY),
    )


__all__ = ["MonitorActivities", "register"]
