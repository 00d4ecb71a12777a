"""ClusterMonitorWorkflow: one per cluster task queue, asks the scheduler once per poll interval for every job.

Job workflows register here (signal ``watch``, sent with signal-with-start by the activity that reports their
transitions, or ``watch_many``, one signal for the registrations a worker process has waiting) and wait for a signal instead of running a heartbeating watch activity each: the status of every
watched job comes from one ``poll_cluster`` activity per interval, whatever the number of workers serving the
cluster (invariant 4 in docs/architecture.md). The activity reads the watch set through the ``watched`` query, so
the set never travels through history but once per continue-as-new, and signals only the jobs whose state
changed. The monitor ends when nothing has been watched for a while; the next registration starts it again.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from virtengine_hpc.activity_names import POLL_CLUSTER
    from virtengine_hpc.messages import (
        MONITOR_WORKFLOW_NAME,
        MonitorInput,
        PollInput,
        PollOutput,
        WatchedSet,
        WatchEntry,
        WatchRegistration,
    )
    from virtengine_hpc.watch_batch import MONITOR_TAKES_BATCHES, WATCH_MANY, WatchBatch

IDLE_ROUNDS = 20
"""Poll intervals without any watched job before the monitor ends (at least a minute)."""
IDLE_LOOK_EVERY = timedelta(seconds=10)
"""How often an idle monitor looks whether another build became current (each poll interval, when longer)."""
PATCH_IDLE_MOVES = "monitor-leaves-old-build-when-idle"
"""An idle monitor ends as soon as it sees another build of the workers current (the next job's registration
starts it on that build): it waited out its whole idle time pinned to the old build, which never drained."""
PATCH_TAKES_BATCHES = "monitor-takes-registration-batches"
"""A run says in its memo that it handles ``watch_many`` (its value is the run's id), so that a worker process sends
the registrations it has waiting in one signal: 10,000 jobs sent one signal each, which Temporal applies to the one
workflow one at a time (about 10 a second on a loaded dev server). A run without the memo, an older build's, is sent
one ``watch`` per job, the only signal it knows."""
_POLL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))


@workflow.defn(name=MONITOR_WORKFLOW_NAME)
class ClusterMonitorWorkflow:
    @workflow.init
    def __init__(self, inp: MonitorInput) -> None:
        self.inp = inp
        self.watched: dict[str, WatchEntry] = dict(inp.watched)
        self.next_version = inp.next_version

    @workflow.signal(name="watch")
    def watch(self, registration: WatchRegistration) -> None:
        """A job says where it stands; a final state ends its watch."""
        self._watch(registration)

    @workflow.signal(name=WATCH_MANY)
    def watch_many(self, batch: WatchBatch) -> None:
        """Several jobs say where they stand (one worker process's waiting registrations), in the order sent."""
        for registration in batch.registrations:
            self._watch(registration)

    def _watch(self, registration: WatchRegistration) -> None:
        if registration.entry.state.final:
            self.watched.pop(registration.workflow_id, None)
            return
        self.watched[registration.workflow_id] = registration.entry.model_copy(
            update={"version": self.next_version}
        )
        self.next_version += 1

    @workflow.query(name="watched")
    def query_watched(self) -> WatchedSet:
        return WatchedSet(entries=self.watched)

    @workflow.run
    async def run(self, inp: MonitorInput) -> int:
        settings = inp.settings
        interval = timedelta(seconds=settings.poll_interval_seconds)
        idle = max(timedelta(seconds=60), IDLE_ROUNDS * interval)
        rounds = inp.rounds
        if workflow.patched(PATCH_TAKES_BATCHES):
            workflow.upsert_memo({MONITOR_TAKES_BATCHES: workflow.info().run_id})
        while True:
            if not self.watched and not await self._woken_within(idle, interval):
                await workflow.wait_condition(workflow.all_handlers_finished)
                return rounds
            out: PollOutput = await workflow.execute_activity(
                POLL_CLUSTER,
                PollInput(
                    cluster_id=settings.cluster_id, vanished_grace_seconds=settings.vanished_grace_seconds
                ),
                task_queue=settings.task_queue,
                start_to_close_timeout=max(timedelta(minutes=5), 4 * interval),
                heartbeat_timeout=max(timedelta(seconds=settings.heartbeat_timeout_seconds), 4 * interval),
                retry_policy=_POLL_RETRY,
                result_type=PollOutput,
            )
            rounds += 1
            for ended in out.ended:
                entry = self.watched.get(ended.workflow_id)
                if entry is not None and entry.version == ended.version:  # not registered again meanwhile
                    del self.watched[ended.workflow_id]
            if self._should_continue_as_new():
                workflow.continue_as_new(
                    MonitorInput(
                        settings=settings, watched=self.watched, next_version=self.next_version, rounds=rounds
                    ),
                    initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
                )
            await workflow.sleep(interval)

    async def _woken_within(self, idle: timedelta, interval: timedelta) -> bool:
        """Whether a job registers within ``idle``: False ends the monitor, as does another build becoming
        current meanwhile (``PATCH_IDLE_MOVES``), so that an idle monitor never keeps the old build running."""
        if not workflow.patched(PATCH_IDLE_MOVES):
            try:
                await workflow.wait_condition(lambda: bool(self.watched), timeout=idle)
            except TimeoutError:
                return False
            return True
        until = workflow.now() + idle
        look = max(IDLE_LOOK_EVERY, interval)
        while not self.watched:
            if workflow.info().is_target_worker_deployment_version_changed():
                return False
            left = until - workflow.now()
            if left <= timedelta(0):
                return False
            try:
                await workflow.wait_condition(
                    lambda: (
                        bool(self.watched) or workflow.info().is_target_worker_deployment_version_changed()
                    ),
                    timeout=min(look, left),
                )
            except TimeoutError:
                continue
        return True

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self.inp.settings.max_history_events
            or info.is_target_worker_deployment_version_changed()
        )
