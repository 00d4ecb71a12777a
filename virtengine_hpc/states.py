"""The nine job states, their order and allowed transitions, and the lifecycle events between them.

One enum with an order and a ``final`` flag (after psij's ``JobState``): backward moves are ignored unless
they are an explicit requeue, skipped intermediate states are filled in so that every lifecycle callback
fires, and a final state never changes again.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """State of an HPC job, mirrored from the native scheduler.

    Values are the on-chain spelling. ``order`` ranks the happy path; all final states share the highest rank.
    """

    PENDING = "pending"
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"

    @property
    def order(self) -> int:
        return _ORDER[self]

    @property
    def final(self) -> bool:
        return self in FINAL_STATES

    @property
    def active(self) -> bool:
        """True while the scheduler holds the job (queued, starting, running or suspended)."""
        return self in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED)


FINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED})

_ORDER = {
    JobState.PENDING: 0,
    JobState.QUEUED: 1,
    JobState.STARTING: 2,
    JobState.RUNNING: 3,
    JobState.SUSPENDED: 3,
    JobState.COMPLETED: 4,
    JobState.FAILED: 4,
    JobState.TIMEOUT: 4,
    JobState.CANCELLED: 4,
}

# Allowed direct transitions. Every non-final state may end in failed or cancelled (a job can be rejected or
# cancelled before it ever runs); timeout needs a job the scheduler holds (a queued job times out when it does
# not start within the provider's job_timeout_default); completed needs a job that ran.
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    JobState.QUEUED: frozenset(
        {JobState.STARTING, JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT}
    ),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT}
    ),
    JobState.RUNNING: frozenset(
        {
            JobState.SUSPENDED,
            JobState.QUEUED,  # requeue (preemption with requeue, node failure with requeue)
            JobState.COMPLETED,
            JobState.FAILED,
            JobState.TIMEOUT,
            JobState.CANCELLED,
        }
    ),
    JobState.SUSPENDED: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED}
    ),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.TIMEOUT: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def can_transition(old: JobState, new: JobState) -> bool:
    return new in ALLOWED_TRANSITIONS[old]


class LifecycleEvent(StrEnum):
    """Callback fired on a transition; written to the audit log as ``job_lifecycle_event``."""

    SUBMITTED = "submitted"
    QUEUED = "queued"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    SUSPENDED = "suspended"
    RESUMED = "resumed"


def lifecycle_event(old: JobState, new: JobState) -> LifecycleEvent | None:
    """The callback a transition fires.

    ``None`` for moves with no event of their own: entering ``starting`` (``started`` fires on ``running``,
    whether or not the scheduler showed the starting phase). A requeue (running→queued) fires ``queued``
    again.
    """
    if new == JobState.RUNNING:
        return LifecycleEvent.RESUMED if old == JobState.SUSPENDED else LifecycleEvent.STARTED
    return {
        JobState.QUEUED: LifecycleEvent.QUEUED,
        JobState.SUSPENDED: LifecycleEvent.SUSPENDED,
        JobState.COMPLETED: LifecycleEvent.COMPLETED,
        JobState.FAILED: LifecycleEvent.FAILED,
        JobState.TIMEOUT: LifecycleEvent.TIMEOUT,
        JobState.CANCELLED: LifecycleEvent.CANCELLED,
    }.get(new)


def transition_path(old: JobState, new: JobState) -> list[JobState]:
    """States to pass through from ``old`` to ``new``, skipped intermediate states filled in.

    Returns ``[]`` when the move must be ignored: same state, a backward move that is not a requeue, or any
    move out of a final state. A scheduler poll that jumps from queued straight to completed yields
    ``[running, completed]`` so that ``started`` fires before ``completed``.
    """
    if old == new or old.final:
        return []
    if can_transition(old, new):
        return [new]
    if new.order < old.order:
        return []
    # Shortest forward path (breadth first, happy-path order), never through a requeue edge.
    frontier: list[list[JobState]] = [[old]]
    seen = {old}
    while frontier:
        nxt: list[list[JobState]] = []
        for path in frontier:
            here = path[-1]
            for step in sorted(ALLOWED_TRANSITIONS[here], key=lambda s: (s.order, list(JobState).index(s))):
                if step in seen or step.order < here.order:
                    continue
                if step == new:
                    return [*path[1:], step]
                seen.add(step)
                nxt.append([*path, step])
        frontier = nxt
    return []
