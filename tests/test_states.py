"""Job states: the transition table, the filling-in of skipped states, and the lifecycle events they fire.

These rules decide which callbacks a tenant's job fires and which status reports the chain accepts, so every
cell of the table is pinned here, and a property test drives arbitrary sequences of observed scheduler states
through ``transition_path`` the way the workflow and the ledger do.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from virtengine_hpc.states import (
    ALLOWED_TRANSITIONS,
    FINAL_STATES,
    JobState,
    LifecycleEvent,
    can_transition,
    lifecycle_event,
    transition_path,
)

S = JobState
P, Q, ST, R, SU = S.PENDING, S.QUEUED, S.STARTING, S.RUNNING, S.SUSPENDED
C, F, T, X = S.COMPLETED, S.FAILED, S.TIMEOUT, S.CANCELLED

# The whole table, written out independently of the module so that a change to it must change this test too.
EXPECTED_ALLOWED: dict[JobState, set[JobState]] = {
    P: {Q, F, X},
    Q: {ST, R, F, X, T},  # timeout from queued: job_timeout_default for a job that never started
    ST: {R, Q, F, X, T},
    R: {SU, Q, C, F, T, X},  # running -> queued is a requeue (preemption or node failure with requeue)
    SU: {R, Q, F, T, X},
    C: set(),
    F: set(),
    T: set(),
    X: set(),
}
ALL_PAIRS = list(itertools.product(JobState, JobState))


def test_nine_states_with_the_chain_spelling() -> None:
    assert [s.value for s in JobState] == [
        "pending",
        "queued",
        "starting",
        "running",
        "suspended",
        "completed",
        "failed",
        "timeout",
        "cancelled",
    ]
    assert {s for s in JobState if s.final} == {C, F, T, X} == FINAL_STATES
    assert {s for s in JobState if s.active} == {Q, ST, R, SU}


def test_order_ranks_the_happy_path() -> None:
    assert P.order < Q.order < ST.order < R.order < C.order
    assert SU.order == R.order
    assert {s.order for s in FINAL_STATES} == {max(s.order for s in JobState)}


@pytest.mark.parametrize(("old", "new"), ALL_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in ALL_PAIRS])
def test_every_transition_is_allowed_or_forbidden_as_specified(old: JobState, new: JobState) -> None:
    assert can_transition(old, new) is (new in EXPECTED_ALLOWED[old])


def test_the_table_covers_every_state() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(JobState)
    assert {k: set(v) for k, v in ALLOWED_TRANSITIONS.items()} == EXPECTED_ALLOWED


def test_completed_needs_a_job_that_ran() -> None:
    assert [s for s in JobState if can_transition(s, C)] == [R]


@pytest.mark.parametrize(
    ("old", "new", "path"),
    [
        (Q, C, [R, C]),  # finished between two polls: started fires before completed
        (P, C, [Q, R, C]),
        (P, R, [Q, R]),
        (P, ST, [Q, ST]),
        (P, SU, [Q, R, SU]),
        (P, T, [Q, T]),
        (ST, C, [R, C]),
        (ST, SU, [R, SU]),
        (SU, C, [R, C]),  # resumed and finished between polls
        (Q, SU, [R, SU]),
        (Q, ST, [ST]),
        (Q, R, [R]),  # starting is not invented: queued -> running is a move of its own
        (R, SU, [SU]),
        (SU, R, [R]),
        (R, Q, [Q]),  # requeue
        (ST, Q, [Q]),
        (SU, Q, [Q]),
        (P, X, [X]),
        (P, F, [F]),
    ],
)
def test_transition_path_fills_skipped_states(old: JobState, new: JobState, path: list[JobState]) -> None:
    assert transition_path(old, new) == path


@pytest.mark.parametrize(
    ("old", "new"),
    [(Q, P), (ST, P), (R, P), (R, ST), (SU, ST), (SU, P)],
)
def test_backward_moves_other_than_requeue_are_ignored(old: JobState, new: JobState) -> None:
    assert transition_path(old, new) == []


@pytest.mark.parametrize("state", list(JobState))
def test_repeating_a_state_is_ignored(state: JobState) -> None:
    assert transition_path(state, state) == []


@pytest.mark.parametrize(("old", "new"), [(f, s) for f in sorted(FINAL_STATES) for s in JobState])
def test_nothing_leaves_a_final_state(old: JobState, new: JobState) -> None:
    assert transition_path(old, new) == []
    assert not can_transition(old, new)


@pytest.mark.parametrize(
    ("old", "new", "event"),
    [
        (P, Q, LifecycleEvent.QUEUED),
        (R, Q, LifecycleEvent.QUEUED),  # a requeued job is queued again
        (Q, ST, None),  # starting has no callback of its own; started fires on running
        (ST, R, LifecycleEvent.STARTED),
        (Q, R, LifecycleEvent.STARTED),
        (R, SU, LifecycleEvent.SUSPENDED),
        (SU, R, LifecycleEvent.RESUMED),
        (R, C, LifecycleEvent.COMPLETED),
        (R, F, LifecycleEvent.FAILED),
        (P, F, LifecycleEvent.FAILED),
        (R, T, LifecycleEvent.TIMEOUT),
        (Q, T, LifecycleEvent.TIMEOUT),
        (P, X, LifecycleEvent.CANCELLED),
        (SU, X, LifecycleEvent.CANCELLED),
    ],
)
def test_lifecycle_event_names(old: JobState, new: JobState, event: LifecycleEvent | None) -> None:
    assert lifecycle_event(old, new) == event


def test_lifecycle_event_spellings_are_the_seeds() -> None:
    assert {e.value for e in LifecycleEvent} == {
        "submitted",
        "queued",
        "started",
        "completed",
        "failed",
        "cancelled",
        "timeout",
        "suspended",
        "resumed",
    }


def test_a_job_seen_only_at_the_end_still_fires_started_once_then_completed() -> None:
    """What a tenant's callbacks see when the scheduler is polled rarely: queued, then directly completed."""
    events = []
    state = P
    for observed in (Q, C):
        for step in transition_path(state, observed):
            events.append(lifecycle_event(state, step))
            state = step
    assert events == [LifecycleEvent.QUEUED, LifecycleEvent.STARTED, LifecycleEvent.COMPLETED]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(JobState)), max_size=30))
def test_any_observed_sequence_yields_only_allowed_transitions(observed: list[JobState]) -> None:
    """Scheduler polls can report anything in any order; what the workflow applies must stay legal."""
    state = P
    reached_final = False
    for seen in observed:
        path = transition_path(state, seen)
        if reached_final:
            assert path == []
        if path:
            assert path[-1] == seen
        for step in path:
            assert can_transition(state, step), f"{state} -> {step}"
            assert not state.final
            # Only an explicit requeue ever goes backwards.
            assert step.order >= state.order or step == Q
            state = step
        reached_final = reached_final or state.final
    assert reached_final == state.final
