"""Activities of the node workflow: ledger writes, audit records, and drain/resume through the scheduler
adapter.

``NodeActivities`` gets its dependencies injected: the node ledger, the scheduler adapter of
each cluster this worker serves (the same mapping the job activities get), and the audit log. Metadata updates
from many node workflows are coalesced by ``MetadataBatcher`` into one ledger transaction per short window, so
a provider with thousands of nodes writes to the chain in batches, while each node's workflow limits itself to
one update per ``metadata_interval`` plus one per state change.

An adapter that cannot drain (``NotImplementedError``, e.g. the local executor) is not an error: the result
says ``supported=False``, a log line says so, and the node's lifecycle goes on (there is simply no
scheduler-side drain).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from temporalio import activity

from activities.audit import AuditLog
from activities.chain.node_ledger import NodeLedger
from activities.group_commit import GroupCommit
from activities.jobs import to_application_error
from activities.schedulers.base import SchedulerAdapter
from virtengine_hpc.activity_names import (
    NODE_APPLY_STATE,
    NODE_LOAD,
    NODE_PUBLISH_METADATA,
    NODE_SCHEDULER_BUSY,
    NODE_SCHEDULER_DRAIN,
    NODE_SCHEDULER_RESUME,
)
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.errors import HPCError
from virtengine_hpc.node.lifecycle import (
    NodeMetadataUpdate,
    NodeRecord,
    NodeRef,
    NodeState,
    NodeStateChange,
    SchedulerNodeRequest,
    SchedulerNodeResult,
)

log = logging.getLogger(__name__)


class MetadataBatcher:
    """Coalesces concurrent metadata writes into one ledger transaction per ``window`` seconds (a ``GroupCommit``
    lingering ``window``; updates that arrive during a write go in the next one). ``batches`` counts the writes
    that succeeded."""

    def __init__(self, ledger: NodeLedger, *, window: float = 0.05, max_batch: int = 500) -> None:
        self.ledger = ledger
        self.window = window
        self.max_batch = max_batch
        self._writes: GroupCommit[NodeMetadataUpdate, None] = GroupCommit(
            self._write, max_batch=max_batch, linger=window
        )
        self.batches = 0

    async def submit(self, update: NodeMetadataUpdate) -> None:
        await self._writes.submit(update)

    async def _write(self, updates: list[NodeMetadataUpdate]) -> list[None]:
        # A failure reaches every waiter, and its activity retries.
        await asyncio.to_thread(self.ledger.record_metadata, updates)
        self.batches += 1
        return [None] * len(updates)


class NodeActivities:
    """The I/O of ``NodeWorkflow``. Register ``NodeActivities(...).all()`` on the cluster's worker."""

    def __init__(
        self,
        ledger: NodeLedger,
        adapters: Mapping[str, SchedulerAdapter],
        audit: AuditLog,
        *,
        batch_window: float = 0.05,
    ) -> None:
        self.ledger = ledger
        self.adapters = adapters
        self.audit = audit
        self.batcher = MetadataBatcher(ledger, window=batch_window)

    def all(self) -> Sequence[Callable[..., Any]]:
        return [
            self.load_node,
            self.apply_state,
            self.publish_metadata,
            self.drain_in_scheduler,
            self.resume_in_scheduler,
            self.node_busy,
        ]

    @activity.defn(name=NODE_LOAD)
    async def load_node(self, ref: NodeRef) -> NodeRecord:
        allowed = await asyncio.to_thread(self.ledger.allowed, ref.cluster_id, ref.node_id)
        row = await asyncio.to_thread(self.ledger.get, ref.cluster_id, ref.node_id)
        return NodeRecord(
            allowed=allowed is not None and allowed.active,
            scheduler_node=allowed.scheduler_node if allowed else ref.node_id,
            registered=row is not None,
            state=row.state if row else None,
        )

    @activity.defn(name=NODE_APPLY_STATE)
    async def apply_state(self, change: NodeStateChange) -> None:
        """Record a transition on the ledger, then audit it once (audited again on retry if lost)."""
        try:
            await asyncio.to_thread(self.ledger.apply_state, change)
        except HPCError as exc:
            raise to_application_error(exc) from None
        if not await asyncio.to_thread(self.ledger.unaudited, change.update_id):
            return
        details = {
            "node_id": change.node_id,
            "previous_state": change.previous.value,
            "state": change.state.value,
            "cause": change.cause,
            "reason": change.reason,
            "update_id": change.update_id,
        }
        self.audit.record(AuditEvent.NODE_STATE_CHANGED, cluster_id=change.cluster_id, details=details)
        if change.state is NodeState.DRAINED:
            self.audit.record(AuditEvent.NODE_DRAINED, cluster_id=change.cluster_id, details=details)
        elif change.previous.operator_held and not change.state.operator_held and not change.state.final:
            self.audit.record(AuditEvent.NODE_RESUMED, cluster_id=change.cluster_id, details=details)
        await asyncio.to_thread(self.ledger.mark_audited, change.update_id)

    @activity.defn(name=NODE_PUBLISH_METADATA)
    async def publish_metadata(self, update: NodeMetadataUpdate) -> None:
        await self.batcher.submit(update)

    def _adapter(self, cluster_id: str) -> SchedulerAdapter | None:
        return self.adapters.get(cluster_id)

    async def _scheduler_call(
        self, request: SchedulerNodeRequest, what: str, call: Any
    ) -> SchedulerNodeResult:
        adapter = self._adapter(request.cluster_id)
        if adapter is None:
            message = (
                f"no scheduler adapter for cluster {request.cluster_id} on this worker: "
                f"no scheduler-side {what}"
            )
            log.warning(message)
            return SchedulerNodeResult(supported=False, message=message)
        try:
            outcome = await call(adapter)
        except NotImplementedError:
            name = adapter.name or type(adapter).__name__
            message = f"the {name} adapter cannot {what} nodes: no scheduler-side {what}"
            log.info("%s (node %s)", message, request.scheduler_node)
            return SchedulerNodeResult(supported=False, message=message)
        except HPCError as exc:
            raise to_application_error(exc) from None
        if isinstance(outcome, bool):
            return SchedulerNodeResult(supported=True, busy=outcome)
        return SchedulerNodeResult(supported=True, message=f"{what} of {request.scheduler_node} done")

    @activity.defn(name=NODE_SCHEDULER_DRAIN)
    async def drain_in_scheduler(self, request: SchedulerNodeRequest) -> SchedulerNodeResult:
        """Stop the scheduler from starting jobs on the node (SLURM: ``scontrol update state=DRAIN``)."""
        return await self._scheduler_call(
            request, "drain", lambda a: a.drain_node(request.scheduler_node, request.reason)
        )

    @activity.defn(name=NODE_SCHEDULER_RESUME)
    async def resume_in_scheduler(self, request: SchedulerNodeRequest) -> SchedulerNodeResult:
        return await self._scheduler_call(request, "resume", lambda a: a.resume_node(request.scheduler_node))

    @activity.defn(name=NODE_SCHEDULER_BUSY)
    async def node_busy(self, request: SchedulerNodeRequest) -> SchedulerNodeResult:
        """Whether jobs still run on a draining node (an adapter that cannot tell counts it as drained)."""
        return await self._scheduler_call(request, "check", lambda a: a.node_busy(request.scheduler_node))
