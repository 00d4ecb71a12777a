"""Node lifecycle: the seed's seven node states, their transitions, and the messages of ``NodeWorkflow``.

Pure models and functions only (the workflow imports this module). Liveness is judged by the provider's clock
(the workflow's ``workflow.now()`` when a heartbeat signal arrives), never by the timestamp a node claims, so
a node with a skewed clock can neither keep itself alive nor be declared dead early.

::

    pending ──▶ active ──▶ stale ──▶ offline ──▶ deregistered
                  │  ▲       │  ▲        │  ▲
                  │  └───────┘  └────────┘  (a heartbeat brings a silent node back)
                  ▼
              draining ──▶ drained ──▶ (resume) ──▶ active / stale / offline / pending

Every non-terminal state may go to ``draining`` (operator drain) and to ``deregistered`` (operator);
``deregistered`` is terminal.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from virtengine_hpc.models import Identifier, Model
from virtengine_hpc.node.heartbeat import LatencySample, NodeCapacity, NodeHealth, NodePlacement

NODE_WORKFLOW_NAME = "NodeWorkflow"


class NodeState(StrEnum):
    PENDING = "pending"
    ACTIVE = "active"
    STALE = "stale"
    OFFLINE = "offline"
    DRAINING = "draining"
    DRAINED = "drained"
    DEREGISTERED = "deregistered"

    @property
    def final(self) -> bool:
        return self is NodeState.DEREGISTERED

    @property
    def schedulable(self) -> bool:
        """Only active nodes count towards a cluster's capacity and may receive jobs."""
        return self is NodeState.ACTIVE

    @property
    def operator_held(self) -> bool:
        """States an operator put the node in; heartbeats and silence do not move it out of them."""
        return self in (NodeState.DRAINING, NodeState.DRAINED)


_S = NodeState
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _S.PENDING: frozenset({_S.ACTIVE, _S.OFFLINE, _S.DRAINING, _S.DEREGISTERED}),
    _S.ACTIVE: frozenset({_S.STALE, _S.DRAINING, _S.DEREGISTERED}),
    _S.STALE: frozenset({_S.ACTIVE, _S.OFFLINE, _S.DRAINING, _S.DEREGISTERED}),
    _S.OFFLINE: frozenset({_S.ACTIVE, _S.DRAINING, _S.DEREGISTERED}),
    _S.DRAINING: frozenset({_S.DRAINED, _S.PENDING, _S.ACTIVE, _S.STALE, _S.OFFLINE, _S.DEREGISTERED}),
    _S.DRAINED: frozenset({_S.DRAINING, _S.PENDING, _S.ACTIVE, _S.STALE, _S.OFFLINE, _S.DEREGISTERED}),
    _S.DEREGISTERED: frozenset(),
}


def can_transition(current: NodeState, target: NodeState) -> bool:
    return target in TRANSITIONS[current]


def liveness_state(
    last_beat_at: datetime | None,
    since: datetime,
    now: datetime,
    stale_after: timedelta,
    offline_after: timedelta,
) -> NodeState:
    """Where silence alone puts a node: active, stale, offline, or pending if it never sent a heartbeat.

    ``since`` is when the workflow began watching the node; a node that never beat goes offline after
    ``offline_after`` of it (it was never schedulable, so it skips stale).
    """
    if last_beat_at is None:
        return NodeState.OFFLINE if now - since >= offline_after else NodeState.PENDING
    silent = now - last_beat_at
    if silent >= offline_after:
        return NodeState.OFFLINE
    if silent >= stale_after:
        return NodeState.STALE
    return NodeState.ACTIVE


def workflow_id(cluster_id: str, node_id: str) -> str:
    """``node-<node>@<cluster>``: the id of a node's ``NodeWorkflow``.

    A job's workflow id is its chain job id, which never holds an ``@`` (ids are letters, digits and ``._:-``),
    and neither do node or cluster ids: no tenant can pick a job id that takes a node's workflow id (and so
    stop its lifecycle from starting), and no two nodes share one.
    """
    return f"node-{node_id}@{cluster_id}"


def legacy_workflow_id(cluster_id: str, node_id: str) -> str:
    """``node-<cluster>-<node>``, the id node workflows had before: a chain job id could take it. A node whose
    workflow was started under it keeps it while that workflow runs (it continues as new under the same id);
    ``running_node_workflow`` finds either."""
    return f"node-{cluster_id}-{node_id}"


# --- workflow messages --------------------------------------------------------------------------------------


class NodeSettings(Model):
    """Timeouts of one node's lifecycle, from the provider's ``nodes:`` config when the workflow starts."""

    stale_after: timedelta = timedelta(seconds=120)
    offline_after: timedelta = timedelta(seconds=300)
    metadata_interval: timedelta = Field(
        timedelta(minutes=5),
        description="At most one metadata update per interval, plus one per state change.",
    )
    drain_poll_interval: timedelta = timedelta(seconds=30)
    max_history_events: int = Field(
        2000,
        ge=50,
        le=50_000,
        description="Continue as new past this many events (or when Temporal suggests it).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> NodeSettings:
        if self.offline_after <= self.stale_after:
            raise ValueError("offline_after must be longer than stale_after")
        return self


class NodeBeat(Model):
    """A verified heartbeat as the node API forwards it to the node's workflow (signature checked)."""

    sequence_number: int
    sent_at: datetime = Field(description="The node's own timestamp (informational).")
    received_at: datetime = Field(description="When the provider accepted it (informational).")
    capacity: NodeCapacity
    health: NodeHealth
    placement: NodePlacement = Field(default_factory=NodePlacement)
    latency: list[LatencySample] = Field(default_factory=list)


class NodeRegistered(Model):
    registered_at: datetime
    hostname: str = ""


class NodeCommand(Model):
    """An operator's command (``virtengine-hpc nodes drain|resume|deregister``)."""

    action: Literal["drain", "resume", "deregister"]
    reason: str = Field("", max_length=256)
    requested_by: str = Field("cli", max_length=64)


class NodeLifecycle(Model):
    """Everything the workflow must remember; carried across continue-as-new."""

    state: NodeState = NodeState.PENDING
    scheduler_node: str = ""
    watching_since: datetime | None = None
    last_beat_at: datetime | None = None
    last_beat: NodeBeat | None = None
    state_changed_at: datetime | None = None
    metadata_published_at: datetime | None = None
    metadata_dirty: bool = False
    scheduler_drained: bool = Field(
        False, description="Whether this workflow drained the node in the scheduler."
    )
    scheduler_note: str = ""
    next_drain_check_at: datetime | None = None
    update_seq: int = Field(0, description="Counter of ledger updates (their ids are <lifecycle>/<n>).")
    lifecycle_id: str = Field(
        "", description="The first run id of this lifecycle; stable across continue-as-new."
    )
    runs: int = 1


class NodeWorkflowInput(Model):
    cluster_id: Identifier
    node_id: Identifier
    settings: NodeSettings = Field(default_factory=NodeSettings)
    carried: NodeLifecycle | None = None


class NodeStatus(Model):
    """What ``nodes show`` prints and what every update returns."""

    cluster_id: str
    node_id: str
    state: NodeState
    scheduler_node: str
    last_beat_at: datetime | None
    last_sequence: int
    silent_seconds: float | None = Field(
        description="Silence as of the workflow's last step (a query cannot read the clock; see last_beat_at)."
    )
    state_changed_at: datetime | None
    scheduler_drained: bool
    scheduler_note: str
    runs: int
    history_length: int


# --- activity messages --------------------------------------------------------------------------------------


class NodeRef(Model):
    cluster_id: Identifier
    node_id: Identifier


class NodeRecord(Model):
    """What the ledger knows of a node when its workflow starts."""

    allowed: bool
    scheduler_node: str = ""
    registered: bool = False
    state: NodeState | None = None


class NodeStateChange(Model):
    """One transition, written to the ledger (state + a metadata update record) and to the audit log."""

    update_id: str
    cluster_id: str
    node_id: str
    previous: NodeState
    state: NodeState
    cause: Literal["heartbeat", "silence", "command", "start"]
    reason: str = ""
    at: datetime
    beat: NodeBeat | None = None


class NodeMetadataUpdate(Model):
    """A ``MsgUpdateNodeMetadata``-like record: the node's latest capacity, health, placement and latency."""

    update_id: str
    cluster_id: str
    node_id: str
    state: NodeState
    at: datetime
    beat: NodeBeat


class SchedulerNodeRequest(Model):
    cluster_id: str
    node_id: str
    scheduler_node: str
    reason: str = ""


class SchedulerNodeResult(Model):
    supported: bool = Field(
        description="False when the cluster's adapter cannot do this (no scheduler-side action)."
    )
    busy: bool | None = Field(None, description="For busy checks: whether jobs still run on the node.")
    message: str = ""
