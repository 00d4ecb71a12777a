"""MOAB's native job states, hold reasons and completion codes, mapped to the nine job states (invariant 5 in docs/architecture.md).

One table, read by both transports (``showq``/``checkjob`` XML over SSH, MOAB Web Services JSON), so they can never
disagree about what a native state means. An unknown state is logged and mapped to a non-final state, never a crash
and never an invented end.

MOAB reports a finished job as ``Completed`` whatever its exit status, ``Removed`` when it was cancelled (by its
owner, an administrator, or the scheduler for exceeding its walltime) and ``Vacated`` when a system failure ended it
after it started. The *completion code* says the rest: the job's exit status, Torque's negative ``JOB_EXEC_*`` codes
(``-11``: walltime exceeded), ``> 256``: killed by signal ``code - 256``, and ``CNCLD``/``CNCLD(<code>)`` in the
completed queue for a job that was cancelled.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from virtengine_hpc.states import JobState

log = logging.getLogger(__name__)

Q, S, R, P = JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED
C, F, T, X = JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED


@dataclass(frozen=True)
class StateInfo:
    state: JobState
    reason: str


#: Every state MOAB documents (``checkjob``, ``showq``, MWS ``states.state``), by lower-cased name.
NATIVE_STATES: dict[str, StateInfo] = {
    "idle": StateInfo(Q, "waiting in the queue, eligible to run"),
    "notqueued": StateInfo(Q, "accepted; not yet queued by the resource manager"),
    "staging": StateInfo(Q, "staging data in before it can start"),
    "staged": StateInfo(Q, "data staged; waiting to start"),
    "migrated": StateInfo(Q, "migrated to another partition; waiting there"),
    "deferred": StateInfo(Q, "deferred: MOAB cannot schedule it under current conditions and retries later"),
    "blocked": StateInfo(Q, "blocked by a throttling policy (limits on running jobs or cores)"),
    "hold": StateInfo(Q, "held"),
    "userhold": StateInfo(Q, "held by its owner (user hold)"),
    "systemhold": StateInfo(Q, "held by an administrator (system hold)"),
    "batchhold": StateInfo(Q, "held by the batch system (batch hold)"),
    "starting": StateInfo(S, "starting: the resource manager is running its prologue"),
    "allocatingresources": StateInfo(S, "allocating resources"),
    "running": StateInfo(R, "running"),
    "ending": StateInfo(R, "its processes are ending (epilogue); the final state follows"),
    "suspended": StateInfo(P, "suspended (preemption or an administrator)"),
    "completed": StateInfo(C, "completed"),
    "removed": StateInfo(X, "cancelled"),
    "vacated": StateInfo(F, "vacated: a system failure ended it after it started"),
    "submiterr": StateInfo(F, "the resource manager refused to take the job"),
    "lost": StateInfo(F, "lost by the resource manager"),
}

#: States whose meaning depends on whether the job had started (``Canceling``: the cancel is in progress).
_IN_PROGRESS = {"canceling": "being cancelled"}

#: Batch holds with these reasons (``HoldReason``/``blocks``) never clear by themselves: the job fails at once and
#: is cancelled, instead of waiting for ``job_timeout_default``.
NEVER_START_HOLDS: dict[str, str] = {
    "rmreject": "the resource manager rejected the job",
    "noresources": "no resources in the cluster can ever satisfy the request",
    "systemlimitsexceeded": "the job exceeds the system's limits",
    "policyviolation": "the job violates a scheduling policy",
    "bankfailure": "the allocation manager refused the job's account",
}

#: Torque's JOB_EXEC_* codes, as MOAB reports them in ``CompletionCode``.
TORQUE_CODES: dict[int, tuple[JobState, str]] = {
    -1: (F, "job start failed (JOB_EXEC_FAIL1)"),
    -2: (F, "job start failed after files were staged (JOB_EXEC_FAIL2)"),
    -3: (F, "job start failed and will not be retried (JOB_EXEC_RETRY)"),
    -4: (F, "job start aborted on a node (JOB_EXEC_INITABT)"),
    -5: (F, "job start aborted during restart (JOB_EXEC_INITRST)"),
    -6: (F, "job start aborted on node resources (JOB_EXEC_INITRMG)"),
    -7: (F, "job restart failed (JOB_EXEC_BADRESRT)"),
    -8: (F, "the job's command could not be executed (JOB_EXEC_CMDFAIL)"),
    -9: (F, "the job's output could not be written (JOB_EXEC_STDOUTFAIL)"),
    -10: (F, "out of memory: it exceeded its memory limit and was killed (JOB_EXEC_OVERLIMIT_MEM)"),
    -11: (T, "reached its time limit (walltime)"),
    -12: (F, "exceeded its CPU time limit (JOB_EXEC_OVERLIMIT_CPUT)"),
}
_CANCELLED_CODE = re.compile(r"^CNCLD(?:\((-?\d+)\))?$", re.I)


@dataclass(frozen=True)
class Mapped:
    state: JobState
    native_state: str
    reason: str
    exit_code: int | None = None
    never_starts: bool = False


@dataclass(frozen=True)
class Completion:
    """A ``CompletionCode`` as MOAB prints it: an integer, or ``CNCLD``/``CNCLD(<code>)`` for cancelled jobs."""

    code: int | None
    cancelled: bool = False

    @classmethod
    def parse(cls, text: str | int | None) -> Completion:
        if text is None:
            return cls(None)
        if isinstance(text, int):
            return cls(text)
        value = text.strip()
        match = _CANCELLED_CODE.match(value)
        if match:
            return cls(int(match.group(1)) if match.group(1) else None, cancelled=True)
        try:
            return cls(int(value))
        except ValueError:
            return cls(None)


def map_state(
    native: str,
    *,
    completion: Completion | None = None,
    started: bool = False,
    hold_reason: str = "",
    walltime_reached: bool = False,
) -> Mapped:
    """Map a native state (plus, for ended jobs, its completion code) to a job state with a reason."""
    name = native.strip()
    key = name.lower().replace(" ", "")
    if key in _IN_PROGRESS:
        return Mapped(R if started else Q, name, _IN_PROGRESS[key])
    info = NATIVE_STATES.get(key)
    if info is None:
        log.warning("unknown MOAB job state %r: treated as still queued", native)
        return Mapped(Q, name, f"unknown MOAB state {name!r}")
    if info.state == Q:
        hold = hold_reason.strip()
        never = NEVER_START_HOLDS.get(hold.lower()) if key in ("batchhold", "hold") else None
        if never is not None:
            return Mapped(F, name, f"will never start: {hold} ({never})", never_starts=True)
        return Mapped(Q, name, f"{info.reason} ({hold})" if hold else info.reason)
    if not info.state.final:
        return Mapped(info.state, name, info.reason)
    return _ended(name, key, info, completion or Completion(None), walltime_reached)


def _ended(name: str, key: str, info: StateInfo, done: Completion, walltime_reached: bool) -> Mapped:
    code = done.code
    if code in TORQUE_CODES:
        state, why = TORQUE_CODES[code]
        return Mapped(state, name, why, exit_code=None)
    if key == "removed" or done.cancelled:
        if walltime_reached:
            return Mapped(T, name, "reached its time limit (walltime) and was removed")
        return Mapped(X, name, "cancelled")
    if code is not None and code > 256:
        signal = code - 256
        return Mapped(F, name, f"killed by signal {signal}", exit_code=128 + signal)
    if key == "completed":
        if code is None:
            return Mapped(C, name, "completed (no completion code reported)")
        if code == 0:
            return Mapped(C, name, "completed", exit_code=0)
        if code < 0:
            return Mapped(F, name, f"failed: resource manager code {code}", exit_code=None)
        return Mapped(F, name, f"failed: exit code {code}", exit_code=code)
    return Mapped(info.state, name, info.reason, exit_code=code if code and code > 0 else None)
