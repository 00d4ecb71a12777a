"""The routing enforcer: checks a job's placement against the on-chain scheduling decision.

Modes (invariant 7 in docs/architecture.md); the full table of mode x violation -> outcome is ``docs/routing.md``:

* ``strict`` fails closed: a missing (when ``require_decision_for_submission``), stale, mismatched, unavailable,
  over-capacity or unauthorised-fallback decision rejects the job. ``allow_automatic_fallback`` lets it accept
  fallback decisions that carry a reason and run a job decided for an unserved or unavailable cluster on this
  worker's own cluster, as a recorded fallback.
* ``permissive`` asks the chain for a new decision when the decision is missing or stale, and falls back to this
  worker's cluster when the decided one is not served here, unavailable or full; every fallback is recorded with
  its reason. A fallback decision without a reason is an unauthorised fallback and is refused.
* ``audit_only`` enforces nothing and logs everything: it records every violation that ``strict`` with the same
  switches would find, and the job runs on this worker's cluster.

A job without a decision (strict with ``require_decision_for_submission: false``, audit_only, or permissive when
the chain could not schedule it) is placed on this worker's cluster, which must still be registered, active and
have room.

Each violation writes one ``routing_violation`` audit record with its type and severity; the outcome writes
``routing_enforcement_passed`` or ``routing_enforcement_failed`` (+ ``job_routing_rejected``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import RoutingConfig
from virtengine_hpc.errors import HPCError
from virtengine_hpc.messages import Violation
from virtengine_hpc.models import Cluster, JobSpec, SchedulingDecision

SEVERITY = {
    "missing_decision": 4,
    "stale_decision": 2,
    "cluster_mismatch": 5,
    "cluster_unavailable": 3,
    "capacity_exceeded": 3,
    "unauthorized_fallback": 4,
}
STALE_ALLOWED_SEVERITY = 1
"""A stale decision that the mode tolerates (permissive re-schedules it, audit_only logs it) is less severe."""

CapacityProbe = Callable[[str], Awaitable[int | None]]
"""Returns the nodes a cluster can offer now (from node heartbeats), or None when nothing is known."""


@dataclass
class RoutingResult:
    """The enforcer's verdict: where the job runs (``cluster_id``), on which decision, and what was wrong."""

    accepted: bool
    cluster_id: str
    decision: SchedulingDecision | None = None
    is_fallback: bool = False
    fallback_reason: str | None = None
    violations: list[Violation] = field(default_factory=list)
    message: str = ""


class _Rejected(Exception):
    """Internal: a check rejected the job; ``enforce`` turns it into a rejected ``RoutingResult``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RoutingEnforcer:
    def __init__(
        self,
        chain: ChainClient,
        audit: AuditLog,
        config: RoutingConfig,
        *,
        served_clusters: frozenset[str],
        capacity_probe: CapacityProbe | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.chain = chain
        self.audit = audit
        self.config = config
        self.served = served_clusters
        self.capacity_probe = capacity_probe
        self.now = now

    @property
    def _enforcing(self) -> bool:
        return self.config.enforcement_mode != "audit_only"

    @property
    def _fallback_allowed(self) -> bool:
        """May a job run somewhere other than its decided cluster (and may a decision be a fallback)?"""
        return self.config.enforcement_mode == "permissive" or self.config.allow_automatic_fallback

    async def enforce(self, job: JobSpec, local_cluster_id: str) -> RoutingResult:
        """Check ``job`` against its decision for a run on ``local_cluster_id`` (this worker's cluster).

        Returns the verdict; never raises for a routing problem (the violations are in the result and the audit
        log). A transient chain error propagates, so the activity retries instead of deciding on missing data.
        """
        result = RoutingResult(accepted=True, cluster_id=local_cluster_id)
        try:
            decision = await self._usable_decision(job, result)
            result.decision = decision
            if decision is not None:
                await self._check_decision(job, decision, result, local_cluster_id)
            else:
                await self._check_placement(job, result, local_cluster_id)
        except _Rejected as rejected:
            return self._reject(job, result, rejected.message)
        self._passed(job, result)
        return result

    # ---- the decision: missing, stale, refreshed ---------------------------------------------------------------

    async def _usable_decision(self, job: JobSpec, result: RoutingResult) -> SchedulingDecision | None:
        mode = self.config.enforcement_mode
        decision = await self.chain.get_decision(job.job_id)
        if decision is None:
            blocks = mode == "strict" and self.config.require_decision_for_submission
            self._violate(job, result, "missing_decision", "no scheduling decision on chain", None)
            self.audit.record(AuditEvent.ROUTING_DECISION_MISSING, job_id=job.job_id, success=not blocks)
            if blocks:
                raise _Rejected("no scheduling decision for the job (strict mode)")
            if mode == "permissive":
                return await self._refresh(job, "missing decision")
            return None

        height = await self.chain.current_height()
        age_blocks = height - decision.block_height
        age_seconds = (self.now() - _aware(decision.created_at)).total_seconds()
        if (
            age_blocks <= self.config.decision_max_age_blocks
            and age_seconds <= self.config.decision_max_age.total_seconds()
        ):
            return decision
        what = f"decision {decision.decision_id} is stale ({age_blocks} blocks, {age_seconds:.0f} s old)"
        if mode == "strict":
            self._violate(job, result, "stale_decision", what, decision)
            raise _Rejected(what)
        self._violate(job, result, "stale_decision", what, decision, severity=STALE_ALLOWED_SEVERITY)
        refreshed = await self._refresh(job, "stale decision") if mode == "permissive" else None
        if refreshed is not None:
            return refreshed
        self.audit.record(
            AuditEvent.ROUTING_STALE_DECISION_ALLOWED,
            job_id=job.job_id,
            cluster_id=decision.selected_cluster_id,
            details={
                "reason": what,
                "decision_id": decision.decision_id,
                "age_blocks": age_blocks,
                "age_seconds": round(age_seconds, 3),
            },
        )
        return decision

    async def _refresh(self, job: JobSpec, reason: str) -> SchedulingDecision | None:
        """Ask the chain to schedule the job again (permissive). ``None`` when it refuses for good (no cluster
        has room); a transient failure propagates so the activity retries."""
        try:
            decision = await self.chain.request_scheduling(job.job_id, reason)
        except HPCError as exc:
            if exc.transient:
                raise
            self.audit.record(
                AuditEvent.ROUTING_DECISION_REFRESHED,
                job_id=job.job_id,
                success=False,
                error_msg=str(exc)[:300],
                details={"reason": reason},
            )
            return None
        self.audit.record(
            AuditEvent.ROUTING_DECISION_REFRESHED,
            job_id=job.job_id,
            cluster_id=decision.selected_cluster_id,
            details={
                "reason": reason,
                "decision_id": decision.decision_id,
                "block_height": decision.block_height,
                "is_fallback": decision.is_fallback,
                "fallback_reason": decision.fallback_reason,
            },
        )
        return decision

    # ---- the placement: fallback, mismatch, availability, capacity --------------------------------------------

    async def _check_decision(
        self, job: JobSpec, decision: SchedulingDecision, result: RoutingResult, local: str
    ) -> None:
        if decision.is_fallback and (not self._fallback_allowed or not decision.fallback_reason):
            why = "without a recorded reason" if self._fallback_allowed else "while fallbacks are not allowed"
            what = f"decision {decision.decision_id} is a fallback {why}"
            self._violate(job, result, "unauthorized_fallback", what, decision)
            if self._enforcing:
                raise _Rejected(what)
        elif decision.is_fallback:
            self._fall_back(result, decision.fallback_reason or "")

        target = decision.selected_cluster_id
        if target != local and target not in self.served:
            what = f"decision selects cluster {target}, this worker serves {local}"
            self._violate(job, result, "cluster_mismatch", what, decision)
            if self._enforcing and not self._fallback_allowed:
                raise _Rejected(what)
            if self._enforcing:
                self._fall_back(result, f"decided cluster {target} is not served here; fell back to {local}")
            target = local

        problem = await self._placement_problem(job, target)
        if problem is not None and target != local and self._enforcing and self._fallback_allowed:
            kind, what = problem
            self._violate(job, result, kind, what, decision)
            problem = await self._placement_problem(job, local)
            if problem is None:
                self._fall_back(result, f"{what}; fell back to {local}")
                target = local
        if problem is not None:
            kind, what = problem
            self._violate(job, result, kind, what, decision)
            if self._enforcing:
                raise _Rejected(what)
        result.cluster_id = target

    async def _check_placement(self, job: JobSpec, result: RoutingResult, cluster_id: str) -> None:
        """No decision to follow: the job runs here, so this cluster must be registered, active and roomy."""
        problem = await self._placement_problem(job, cluster_id)
        if problem is not None:
            kind, what = problem
            self._violate(job, result, kind, what, None)
            if self._enforcing:
                raise _Rejected(what)
        result.cluster_id = cluster_id

    async def _placement_problem(self, job: JobSpec, cluster_id: str) -> tuple[str, str] | None:
        cluster = await self.chain.get_cluster(cluster_id)
        if cluster is None:
            return "cluster_unavailable", f"cluster {cluster_id} is not registered on chain"
        if cluster.state != "active":
            return "cluster_unavailable", f"cluster {cluster_id} is {cluster.state}"
        capacity = await self._capacity(cluster)
        if capacity is not None and job.resources.nodes > capacity:
            return (
                "capacity_exceeded",
                f"job needs {job.resources.nodes} nodes, cluster {cluster_id} has {capacity} available",
            )
        return None

    async def _capacity(self, cluster: Cluster) -> int | None:
        """Free nodes: the probe's live count (node heartbeats) first, else what the chain says when the
        cluster reports its node totals, else unknown (no capacity check)."""
        if self.capacity_probe is not None:
            probed = await self.capacity_probe(cluster.cluster_id)
            if probed is not None:
                return probed
        return cluster.available_nodes if cluster.total_nodes else None

    # ---- outcomes and audit records -----------------------------------------------------------------------------

    @staticmethod
    def _fall_back(result: RoutingResult, reason: str) -> None:
        """Mark the run as a fallback; a second reason (the chain's fallback, then ours) is appended."""
        result.is_fallback = True
        result.fallback_reason = f"{result.fallback_reason}; {reason}" if result.fallback_reason else reason

    def _violate(
        self,
        job: JobSpec,
        result: RoutingResult,
        kind: str,
        message: str,
        decision: SchedulingDecision | None,
        *,
        severity: int | None = None,
    ) -> None:
        violation = Violation.model_validate(
            {"type": kind, "severity": severity or SEVERITY[kind], "message": message}
        )
        result.violations.append(violation)
        self.audit.record(
            AuditEvent.ROUTING_VIOLATION,
            job_id=job.job_id,
            cluster_id=decision.selected_cluster_id if decision else None,
            success=False,
            severity=violation.severity,
            error_msg=message,
            details={
                "violation_type": kind,
                "mode": self.config.enforcement_mode,
                "enforced": self._enforcing,
                "decision_id": decision.decision_id if decision else None,
                "decision_block_height": decision.block_height if decision else None,
            },
        )

    def _passed(self, job: JobSpec, result: RoutingResult) -> None:
        decision = result.decision
        self.audit.record(
            AuditEvent.ROUTING_ENFORCEMENT_PASSED,
            job_id=job.job_id,
            cluster_id=result.cluster_id,
            details={
                "mode": self.config.enforcement_mode,
                "decision_id": decision.decision_id if decision else None,
                "is_fallback": result.is_fallback,
                "fallback_reason": result.fallback_reason,
                "violations": [v.type for v in result.violations],
            },
        )
        if result.is_fallback:
            self.audit.record(
                AuditEvent.ROUTING_FALLBACK_USED,
                job_id=job.job_id,
                cluster_id=result.cluster_id,
                details={
                    "reason": result.fallback_reason,
                    "decided": decision.selected_cluster_id if decision else None,
                    "decision_id": decision.decision_id if decision else None,
                },
            )

    def _reject(self, job: JobSpec, result: RoutingResult, message: str) -> RoutingResult:
        result.accepted = False
        result.message = message
        details = {"mode": self.config.enforcement_mode, "violations": [v.type for v in result.violations]}
        self.audit.record(
            AuditEvent.ROUTING_ENFORCEMENT_FAILED,
            job_id=job.job_id,
            success=False,
            error_msg=message,
            details=details,
        )
        self.audit.record(
            AuditEvent.JOB_ROUTING_REJECTED,
            job_id=job.job_id,
            success=False,
            error_msg=message,
            details=details,
        )
        return result


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
