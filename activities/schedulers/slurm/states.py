"""Slurm's native job states and pending reasons, mapped to the nine job states (invariant 5 in docs/architecture.md).

One table, read by every transport (``squeue``/``sacct`` text, slurmrestd JSON, pyslurm), so the CLI and REST paths
can never disagree about what a native state means. Every state Slurm 22.05 documents is here, under its long name
and its compact code (``squeue %t``); an unknown code is logged and mapped to a non-final state, never a crash and
never an invented end.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from virtengine_hpc.states import JobState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateInfo:
    state: JobState
    reason: str
    """What the native state means, in words a tenant understands (used when Slurm gives no better reason)."""


Q, S, R, P = JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUSPENDED
C, F, T, X = JobState.COMPLETED, JobState.FAILED, JobState.TIMEOUT, JobState.CANCELLED

NATIVE_STATES: dict[str, StateInfo] = {
    # waiting
    "PENDING": StateInfo(Q, "waiting in the queue"),
    "REQUEUED": StateInfo(Q, "requeued by Slurm; it will run again"),
    "REQUEUE_HOLD": StateInfo(Q, "requeued and held"),
    "REQUEUE_FED": StateInfo(Q, "requeued by the federation"),
    "RESV_DEL_HOLD": StateInfo(Q, "held because its reservation was deleted"),
    # starting
    "CONFIGURING": StateInfo(S, "nodes allocated, being booted or configured"),
    "POWER_UP_NODE": StateInfo(S, "nodes allocated, powering up"),
    # running (COMPLETING still holds its nodes; its end state follows)
    "RUNNING": StateInfo(R, "running"),
    "COMPLETING": StateInfo(R, "its processes are ending; the final state follows"),
    "RESIZING": StateInfo(R, "changing size"),
    "SIGNALING": StateInfo(R, "being signalled"),
    "STAGE_OUT": StateInfo(R, "staging out data"),
    # paused
    "SUSPENDED": StateInfo(P, "suspended by Slurm (preemption or an administrator)"),
    "STOPPED": StateInfo(P, "stopped (SIGSTOP); it keeps its allocation"),
    # final
    "COMPLETED": StateInfo(C, "completed"),
    "CANCELLED": StateInfo(X, "cancelled"),
    "FAILED": StateInfo(F, "failed: non-zero exit code or launch failure"),
    "TIMEOUT": StateInfo(T, "reached its time limit (walltime)"),
    "DEADLINE": StateInfo(T, "reached its deadline before it could finish"),
    "NODE_FAIL": StateInfo(F, "ended because a node it ran on failed"),
    "BOOT_FAIL": StateInfo(F, "its nodes failed to boot"),
    "OUT_OF_MEMORY": StateInfo(F, "out of memory: it exceeded its memory limit and was killed"),
    "PREEMPTED": StateInfo(F, "preempted by a higher-priority job and not requeued"),
    "SPECIAL_EXIT": StateInfo(F, "ended with the special exit code (requeue-hold)"),
    "REVOKED": StateInfo(X, "revoked: a sibling cluster of the federation runs it"),
}

COMPACT_CODES: dict[str, str] = {
    "PD": "PENDING",
    "RQ": "REQUEUED",
    "RH": "REQUEUE_HOLD",
    "RF": "REQUEUE_FED",
    "RD": "RESV_DEL_HOLD",
    "CF": "CONFIGURING",
    "PU": "POWER_UP_NODE",
    "R": "RUNNING",
    "CG": "COMPLETING",
    "RS": "RESIZING",
    "SI": "SIGNALING",
    "SO": "STAGE_OUT",
    "S": "SUSPENDED",
    "ST": "STOPPED",
    "CD": "COMPLETED",
    "CA": "CANCELLED",
    "F": "FAILED",
    "TO": "TIMEOUT",
    "DL": "DEADLINE",
    "NF": "NODE_FAIL",
    "BF": "BOOT_FAIL",
    "OOM": "OUT_OF_MEMORY",
    "PR": "PREEMPTED",
    "SE": "SPECIAL_EXIT",
    "RV": "REVOKED",
}

# Pending reasons that mean the job, as submitted, will never start: failing it at once (and cancelling it, so it
# cannot start later behind our back) beats waiting for job_timeout_default. Reasons about the cluster's current
# load or state (Resources, Priority, ReqNodeNotAvail, PartitionDown, AssocGrp*Limit, *PerUser*) are not here:
# those clear by themselves.
NEVER_START_REASONS: dict[str, str] = {
    "PartitionConfig": "the partition's configuration cannot satisfy the request",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows",
    "PartitionTimeLimit": "the job's walltime exceeds the partition's time limit",
    "BadConstraints": "the job's constraints can never be satisfied",
    "AccountNotAllowed": "the account may not use this partition",
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "QOSNotAllowed": "the QOS may not be used here",
    "DependencyNeverSatisfied": "a dependency can never be satisfied",
    "AccountingPolicy": "the job violates the accounting policy",
}
# Per-job limits of an association or QOS ("AssocMaxWallDurationPerJobLimit", "QOSMaxCpuPerJobLimit",
# "QOSMinGRES", ...): the job itself is too big or too small for them.
_NEVER_START_PATTERN = re.compile(r"^(Assoc|QOS)(Max\w*PerJob\w*|Min\w+)$")


@dataclass(frozen=True)
class Mapped:
    state: JobState
    native_state: str
    reason: str
    never_starts: bool = False


def normalize_state(native: str) -> tuple[str, str]:
    """``("CANCELLED", "by 0")`` from ``"CANCELLED by 0"``; compact codes expanded; sacct's ``+`` dropped."""
    text = native.strip().rstrip("+")
    base, _, rest = text.partition(" ")
    base = base.upper()
    base = COMPACT_CODES.get(base, base)
    return base, rest.strip()


def map_state(native: str, pending_reason: str = "") -> Mapped:
    """Map a native state (and, for pending jobs, Slurm's reason) to a job state with a reason."""
    base, detail = normalize_state(native)
    info = NATIVE_STATES.get(base)
    reason_code = _clean_reason(pending_reason)
    if info is None:
        log.warning("unknown Slurm job state %r: treated as still queued", native)
        return Mapped(JobState.QUEUED, native.strip(), f"unknown Slurm state {native.strip()!r}")
    if info.state == JobState.QUEUED and reason_code:
        never = never_start_reason(reason_code)
        if never is not None:
            return Mapped(
                JobState.FAILED, base, f"will never start: {reason_code} ({never})", never_starts=True
            )
        return Mapped(info.state, base, f"pending: {reason_code}")
    reason = info.reason
    if base == "CANCELLED" and detail.startswith("by "):
        who = detail[3:].strip()
        reason = f"cancelled by {'uid ' + who if who.isdigit() else who}"
    elif reason_code and not info.state.final and info.state != JobState.RUNNING:
        reason = f"{info.reason} ({reason_code})"
    return Mapped(info.state, base, reason)


def never_start_reason(reason: str) -> str | None:
    """Why a job pending for ``reason`` can never start, or ``None`` when it may still start."""
    code = _clean_reason(reason)
    if code in NEVER_START_REASONS:
        return NEVER_START_REASONS[code]
    if _NEVER_START_PATTERN.match(code):
        return "the job exceeds a per-job limit of its association or QOS"
    return None


def _clean_reason(reason: str) -> str:
    text = (reason or "").strip().strip("()")
    if text in ("None", "(null)", "null", "N/A"):
        return ""
    # "ReqNodeNotAvail, UnavailableNodes:node3" -> "ReqNodeNotAvail"
    return text.split(",", 1)[0].strip()


def exit_code_from_pair(text: str) -> int | None:
    """Slurm's ``ExitCode`` (``"3:0"`` = exit status 3, signal 0) as one number, the way a shell reports it.

    A job killed by a real signal N reports ``128 + N``; Slurm's internal pseudo-signals (``0:125`` for
    OUT_OF_MEMORY) carry no exit status, so they report ``None`` unless the script's own status is non-zero.
    """
    code_text, _, signal_text = text.strip().partition(":")
    try:
        code = int(code_text)
        signal = int(signal_text or 0)
    except ValueError:
        return None
    return _combine(code, signal)


def exit_code_from_wait_status(status: int | None) -> int | None:
    """slurmrestd's ``exit_code`` is the raw wait(2) status (``768`` = exit 3)."""
    if status is None or status < 0:
        return None
    signal = status & 0x7F
    code = (status >> 8) & 0xFF
    return _combine(code, signal)


def _combine(code: int, signal: int) -> int | None:
    if signal == 0:
        return code
    if 0 < signal < 65:
        return 128 + signal
    return code or None
