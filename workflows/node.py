"""NodeWorkflow: one durable workflow per compute node (workflow id ``node-<cluster>-<node>``).

The node API forwards every verified heartbeat as a ``heartbeat`` signal (signal-with-start, so the first
heartbeat or the registration starts the workflow). Silence is measured with workflow timers on the provider's
clock: ``stale_after`` without a heartbeat makes an active node stale and drains it in the scheduler,
``offline_after`` makes it offline; the next heartbeat resumes it in the scheduler and makes it active again.
Operators drain, resume and deregister through the ``command`` update (``virtengine-hpc nodes
drain|resume|deregister``); a draining node becomes drained once the scheduler reports no job on it.
``deregistered`` is terminal.

History stays bounded (invariant 3 in docs/architecture.md): one timer covers the liveness deadline and is re-armed only
when it fires (a heartbeat moves the deadline without touching the timer), metadata goes to the chain at most
once per ``metadata_interval`` plus once per state change, and the workflow continues as new past
``max_history_events`` or when Temporal suggests it. Everything the workflow must remember travels in
``NodeLifecycle``.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from virtengine_hpc.activity_names import (
        NODE_APPLY_STATE,
        NODE_LOAD,
        NODE_PUBLISH_METADATA,
        NODE_SCHEDULER_BUSY,
        NODE_SCHEDULER_DRAIN,
        NODE_SCHEDULER_RESUME,
    )
    from virtengine_hpc.errors import NODE_LEDGER_NON_RETRYABLE_TYPES, NODE_SCHEDULER_NON_RETRYABLE_TYPES
    from virtengine_hpc.node.lifecycle import (
        NODE_WORKFLOW_NAME,
        NodeBeat,
        NodeCommand,
        NodeLifecycle,
        NodeMetadataUpdate,
        NodeRecord,
        NodeRef,
        NodeRegistered,
        NodeState,
        NodeStateChange,
        NodeStatus,
        NodeWorkflowInput,
        SchedulerNodeRequest,
        SchedulerNodeResult,
        can_transition,
        liveness_state,
    )

T = TypeVar("T")

_LEDGER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=60),
    non_retryable_error_types=list(NODE_LEDGER_NON_RETRYABLE_TYPES),
)
_SCHEDULER_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    maximum_attempts=5,
    non_retryable_error_types=list(NODE_SCHEDULER_NON_RETRYABLE_TYPES),
)
_MIN_TIMER = timedelta(milliseconds=100)
PATCH_UPGRADE_ON_CONTINUE_AS_NEW = "upgrade-on-continue-as-new"
"""Since 0.3: a node's lifecycle is pinned to the build of the workers that started it; when another build becomes
current, it continues as new at its next step and the new run starts on that build, so old builds drain."""
Cause = Literal["heartbeat", "silence", "command", "start"]


@workflow.defn(name=NODE_WORKFLOW_NAME)
class NodeWorkflow:
    @workflow.init
    def __init__(self, inp: NodeWorkflowInput) -> None:
        self.inp = inp
        self.s = inp.settings
        self.c: NodeLifecycle = inp.carried or NodeLifecycle()
        self._beat: NodeBeat | None = None
        self._beat_at: datetime | None = None
        self._commands: list[tuple[int, NodeCommand]] = []
        self._issued = 0
        self._done = 0
        self._wake = False
        self._timer: asyncio.Task[None] | None = None
        self._timer_at: datetime | None = None

    # --- messages -------------------------------------------------------------------------------------------

    @workflow.signal(name="heartbeat")
    def heartbeat(self, beat: NodeBeat) -> None:
        """A verified heartbeat; only the newest one waiting to be handled matters."""
        if self._beat is None or beat.sequence_number > self._beat.sequence_number:
            self._beat = beat
            self._beat_at = workflow.now()
        self._wake = True

    @workflow.signal(name="registered")
    def registered(self, registration: NodeRegistered) -> None:
        self._wake = True

    @workflow.update(name="command")
    async def command(self, command: NodeCommand) -> NodeStatus:
        """Drain, resume or deregister; returns the node's status once the command took effect."""
        self._issued += 1
        mine = self._issued
        self._commands.append((mine, command))
        self._wake = True
        await workflow.wait_condition(lambda: self._done >= mine)
        return self._status()

    @command.validator
    def _validate_command(self, command: NodeCommand) -> None:
        if self.c.state.final:
            raise ValueError(f"node {self.inp.node_id} is deregistered")

    @workflow.query(name="status")
    def status(self) -> NodeStatus:
        return self._status()

    def _status(self) -> NodeStatus:
        last = self.c.last_beat_at
        return NodeStatus(
            cluster_id=self.inp.cluster_id,
            node_id=self.inp.node_id,
            state=self.c.state,
            scheduler_node=self.c.scheduler_node,
            last_beat_at=last,
            last_sequence=self.c.last_beat.sequence_number if self.c.last_beat else 0,
            silent_seconds=(workflow.now() - last).total_seconds() if last else None,
            state_changed_at=self.c.state_changed_at,
            scheduler_drained=self.c.scheduler_drained,
            scheduler_note=self.c.scheduler_note,
            runs=self.c.runs,
            history_length=workflow.info().get_current_history_length(),
        )

    # --- main loop ------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: NodeWorkflowInput) -> NodeStatus:
        if inp.carried is None:
            await self._begin()
        while not self.c.state.final:
            await self._step()
            if self.c.state.final:
                break
            moving = self._history_full() or self._new_build_is_current()
            if moving and not self._commands and self._beat is None:
                # An update that arrives meanwhile waits for the loop: handle it first, never deadlock on it.
                await workflow.wait_condition(
                    lambda: workflow.all_handlers_finished() or bool(self._commands)
                )
                if not self._commands and self._beat is None:
                    workflow.continue_as_new(
                        self.inp.model_copy(
                            update={"carried": self.c.model_copy(update={"runs": self.c.runs + 1})}
                        ),
                        initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
                    )
                continue
            await self._sleep_until_woken()
        self._commands.clear()
        self._done = self._issued
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._status()

    async def _begin(self) -> None:
        now = workflow.now()
        record = await self._ledger(
            NODE_LOAD, NodeRef(cluster_id=self.inp.cluster_id, node_id=self.inp.node_id), NodeRecord
        )
        self.c = self.c.model_copy(
            update={
                "scheduler_node": record.scheduler_node or self.inp.node_id,
                "watching_since": now,
                "state_changed_at": now,
                "lifecycle_id": workflow.info().first_execution_run_id,
            }
        )
        if not record.allowed:
            await self._transition(
                NodeState.DEREGISTERED, "start", "the node's key is not allowed (or revoked)"
            )

    async def _step(self) -> None:
        self._wake = False
        while self._commands:
            number, command = self._commands.pop(0)
            if not self.c.state.final:
                await self._apply_command(command)
            self._done = number
        if self._beat is not None and not self.c.state.final:
            beat, at = self._beat, self._beat_at or workflow.now()
            self._beat = None
            await self._on_beat(beat, at)
        if self.c.state.final:
            return
        await self._check_silence()
        await self._check_draining()
        await self._publish_if_due()

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self.s.max_history_events
        )

    def _new_build_is_current(self) -> bool:
        """Another build of the workers became current: continue as new onto it (docs/deploys.md)."""
        return workflow.info().is_target_worker_deployment_version_changed() and workflow.patched(
            PATCH_UPGRADE_ON_CONTINUE_AS_NEW
        )

    def _next_wake(self) -> datetime | None:
        c, s = self.c, self.s
        due: list[datetime] = []
        if c.state is NodeState.ACTIVE and c.last_beat_at is not None:
            due.append(c.last_beat_at + s.stale_after)
        elif c.state is NodeState.STALE and c.last_beat_at is not None:
            due.append(c.last_beat_at + s.offline_after)
        elif c.state is NodeState.PENDING and c.last_beat_at is None and c.watching_since is not None:
            due.append(c.watching_since + s.offline_after)
        if c.state is NodeState.DRAINING and c.next_drain_check_at is not None:
            due.append(c.next_drain_check_at)
        if c.metadata_dirty and c.metadata_published_at is not None:
            due.append(c.metadata_published_at + s.metadata_interval)
        return min(due) if due else None

    async def _sleep_until_woken(self) -> None:
        """Wait for a signal, an update or the next deadline, keeping one timer alive across heartbeats."""
        wake_at = self._next_wake()
        if wake_at is not None:
            now = workflow.now()
            timer_idle = self._timer is None or self._timer.done()
            if timer_idle or self._timer_at is None or self._timer_at > wake_at:
                if self._timer is not None and not self._timer.done():
                    self._timer.cancel()
                delay = max(wake_at - now, _MIN_TIMER)
                self._timer = asyncio.ensure_future(asyncio.sleep(delay.total_seconds()))
                self._timer_at = now + delay
        await workflow.wait_condition(
            lambda: self._wake or (self._timer is not None and self._timer.done()) or bool(self._commands)
        )
        if self._timer is not None and self._timer.done():
            self._timer = None

    # --- transitions ----------------------------------------------------------------------------------------

    async def _on_beat(self, beat: NodeBeat, at: datetime) -> None:
        if self.c.last_beat is not None and beat.sequence_number <= self.c.last_beat.sequence_number:
            return
        self.c = self.c.model_copy(update={"last_beat_at": at, "last_beat": beat, "metadata_dirty": True})
        state = self.c.state
        if state is NodeState.ACTIVE or state.operator_held:
            return
        if self.c.scheduler_drained:
            await self._scheduler_resume()
        await self._transition(NodeState.ACTIVE, "heartbeat", f"heartbeat {beat.sequence_number} received")

    async def _check_silence(self) -> None:
        state = self.c.state
        if state not in (NodeState.PENDING, NodeState.ACTIVE, NodeState.STALE):
            return
        now = workflow.now()
        since = self.c.watching_since or now
        target = liveness_state(self.c.last_beat_at, since, now, self.s.stale_after, self.s.offline_after)
        if target not in (NodeState.STALE, NodeState.OFFLINE) or target is state:
            return
        silent = int((now - (self.c.last_beat_at or since)).total_seconds())
        reason = f"no heartbeat for {silent} s"
        await self._ensure_scheduler_drained(f"virtengine: {reason}")
        if state is NodeState.ACTIVE:
            await self._transition(NodeState.STALE, "silence", reason)
        if target is NodeState.OFFLINE:
            await self._transition(NodeState.OFFLINE, "silence", reason)

    async def _check_draining(self) -> None:
        due = self.c.next_drain_check_at
        if self.c.state is not NodeState.DRAINING or due is None or workflow.now() < due:
            return
        result = await self._scheduler(NODE_SCHEDULER_BUSY, "")
        if result.supported and result.busy:
            self.c = self.c.model_copy(
                update={"next_drain_check_at": workflow.now() + self.s.drain_poll_interval}
            )
            return
        self.c = self.c.model_copy(update={"next_drain_check_at": None})
        await self._transition(NodeState.DRAINED, "command", "no job left on the node")

    async def _apply_command(self, command: NodeCommand) -> None:
        state = self.c.state
        reason = command.reason or f"requested by {command.requested_by}"
        if command.action == "drain":
            if state.operator_held:
                return
            await self._ensure_scheduler_drained(f"virtengine: drained by operator: {reason}")
            await self._transition(NodeState.DRAINING, "command", reason)
            self.c = self.c.model_copy(update={"next_drain_check_at": workflow.now()})
            await self._check_draining()
        elif command.action == "resume":
            if not state.operator_held:
                return
            now = workflow.now()
            target = liveness_state(
                self.c.last_beat_at,
                self.c.watching_since or now,
                now,
                self.s.stale_after,
                self.s.offline_after,
            )
            if target in (NodeState.ACTIVE, NodeState.PENDING) and self.c.scheduler_drained:
                await self._scheduler_resume()
            self.c = self.c.model_copy(update={"next_drain_check_at": None})
            await self._transition(target, "command", reason)
        else:
            await self._ensure_scheduler_drained("virtengine: node deregistered")
            await self._transition(NodeState.DEREGISTERED, "command", reason)

    async def _transition(self, target: NodeState, cause: Cause, reason: str) -> None:
        previous = self.c.state
        if not can_transition(previous, target):
            workflow.logger.warning(
                "ignoring illegal node transition %s -> %s (%s)", previous, target, reason
            )
            return
        now = workflow.now()
        number = self.c.update_seq + 1
        change = NodeStateChange(
            update_id=f"{self.c.lifecycle_id}/{number}",
            cluster_id=self.inp.cluster_id,
            node_id=self.inp.node_id,
            previous=previous,
            state=target,
            cause=cause,
            reason=reason,
            at=now,
            beat=self.c.last_beat,
        )
        await self._ledger(NODE_APPLY_STATE, change, type(None))
        update: dict[str, Any] = {"state": target, "state_changed_at": now, "update_seq": number}
        if self.c.last_beat is not None:
            update.update(metadata_published_at=now, metadata_dirty=False)
        self.c = self.c.model_copy(update=update)

    async def _publish_if_due(self) -> None:
        c = self.c
        if not c.metadata_dirty or c.last_beat is None:
            return
        now = workflow.now()
        if c.metadata_published_at is not None and now < c.metadata_published_at + self.s.metadata_interval:
            return
        number = c.update_seq + 1
        await self._ledger(
            NODE_PUBLISH_METADATA,
            NodeMetadataUpdate(
                update_id=f"{c.lifecycle_id}/{number}",
                cluster_id=self.inp.cluster_id,
                node_id=self.inp.node_id,
                state=c.state,
                at=now,
                beat=c.last_beat,
            ),
            type(None),
        )
        self.c = self.c.model_copy(
            update={"update_seq": number, "metadata_published_at": now, "metadata_dirty": False}
        )

    # --- activities -----------------------------------------------------------------------------------------

    async def _ledger(self, name: str, arg: Any, result_type: type[T]) -> T:
        return await workflow.execute_activity(
            name,
            arg,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=_LEDGER_RETRY,
            result_type=result_type,
        )

    def _scheduler_request(self, reason: str) -> SchedulerNodeRequest:
        return SchedulerNodeRequest(
            cluster_id=self.inp.cluster_id,
            node_id=self.inp.node_id,
            scheduler_node=self.c.scheduler_node or self.inp.node_id,
            reason=reason,
        )

    async def _scheduler(self, name: str, reason: str) -> SchedulerNodeResult:
        """Call the scheduler; a failure after retries is noted on the node, never fatal to its lifecycle."""
        try:
            result: SchedulerNodeResult = await workflow.execute_activity(
                name,
                self._scheduler_request(reason),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=_SCHEDULER_RETRY,
                result_type=SchedulerNodeResult,
            )
        except ActivityError as exc:
            message = f"{name} failed: {exc.cause or exc}"
            workflow.logger.warning("node %s: %s", self.inp.node_id, message)
            result = SchedulerNodeResult(supported=False, message=message[:500])
        self.c = self.c.model_copy(update={"scheduler_note": result.message[:500]})
        return result

    async def _ensure_scheduler_drained(self, reason: str) -> None:
        if self.c.scheduler_drained:
            return
        result = await self._scheduler(NODE_SCHEDULER_DRAIN, reason)
        if result.supported:
            self.c = self.c.model_copy(update={"scheduler_drained": True})

    async def _scheduler_resume(self) -> None:
        result = await self._scheduler(NODE_SCHEDULER_RESUME, "")
        if result.supported:
            self.c = self.c.model_copy(update={"scheduler_drained": False})
