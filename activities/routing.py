"""The routing enforcer: checks a job's placement against the on-chain scheduling decision.

Modes (seed 001, DESIGN.md invariant 7):

* ``strict`` fails closed: a missing (when ``require_decision_for_submission``), stale, mismatched, unavailable,
  over-capacity or unauthorised-fallback decision rejects the job.
* ``permissive`` asks the chain for a new decision when the decision is missing or stale, and falls back to another
  cluster when the decided one is unavailable or full; every fallback is recorded with its reason. A decision that
  is a fallback without a reason is an unauthorised fallback and is refused.
* ``audit_only`` enforces nothing and logs everything: every violation is written, the job runs where this worker
  runs it.

Each violation writes one ``routing_violation`` audit record with its type and severity; the outcome writes
``routing_enforcement_passed`` or ``routing_enforcement_failed`` (+ ``job_routing_rejected``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from virtengine_hpc.config import RoutingConfig
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

CapacityProbe = Callable[[str], Awaitable[int | None]]
"""Returns the nodes a cluster can offer now (from node heartbeats), or None when nothing is known."""


@dataclass
class RoutingResult:
    accepted: bool
    cluster_id: str
    decision: SchedulingDecision | None = None
    is_fallback: bool = False
    fallback_reason: str | None = None
    violations: list[Violation] = field(default_factory=list)
    message: str = ""


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

    async def enforce(self, job: JobSpec, local_cluster_id: str) -> RoutingResult:
        mode = self.config.enforcement_mode
        result = RoutingResult(accepted=True, cluster_id=local_cluster_id)
        decision = await self.chain.get_decision(job.job_id)

        if decision is None:
            strict_blocks = mode == "strict" and self.config.require_decision_for_submission
            self._violate(job, result, "missing_decision", "no scheduling decision on chain", decision)
            self.audit.record("routing_decision_missing", job_id=job.job_id, success=not strict_blocks)
            if strict_blocks:
                return self._reject(job, result, "no scheduling decision for the job (strict mode)")
            if mode == "permissive":
                decision = await self._refresh(job, "missing decision")
        elif self._is_stale(decision, await self.chain.current_height()):
            age_blocks, age_seconds = await self._age(decision)
            what = f"decision {decision.decision_id} is stale ({age_blocks} blocks, {age_seconds:.0f} s old)"
            if mode == "strict":
                self._violate(job, result, "stale_decision", what, decision)
                return self._reject(job, result, what)
            self._violate(job, result, "stale_decision", what, decision, severity=STALE_ALLOWED_SEVERITY)
            if mode == "permissive":
                refreshed = await self._refresh(job, "stale decision")
                if refreshed is not None:
                    decision = refreshed
                else:
                    self.audit.record(
                        "routing_stale_decision_allowed", job_id=job.job_id, details={"reason": what}
                    )
            else:
                self.audit.record(
                    "routing_stale_decision_allowed", job_id=job.job_id, details={"reason": what}
                )

        result.decision = decision
        if decision is not None:
            rejected = await self._check_decision(job, decision, result, local_cluster_id)
            if rejected:
                return rejected

        if mode != "audit_only" and result.violations and not result.accepted:
            return self._reject(job, result, result.message)
        self.audit.record(
            "routing_enforcement_passed",
            job_id=job.job_id,
            cluster_id=result.cluster_id,
            details={
                "mode": mode,
                "decision_id": decision.decision_id if decision else None,
                "is_fallback": result.is_fallback,
                "fallback_reason": result.fallback_reason,
                "violations": [v.type for v in result.violations],
            },
        )
        if result.is_fallback:
            self.audit.record(
                "routing_fallback_used",
                job_id=job.job_id,
                cluster_id=result.cluster_id,
                details={
                    "reason": result.fallback_reason,
                    "decided": decision.selected_cluster_id if decision else None,
                },
            )
        return result

    async def _check_decision(
        self, job: JobSpec, decision: SchedulingDecision, result: RoutingResult, local: str
    ) -> RoutingResult | None:
        mode = self.config.enforcement_mode
        fallback_allowed = mode == "permissive" or self.config.allow_automatic_fallback

        if decision.is_fallback and (not fallback_allowed or not decision.fallback_reason):
            why = "without a recorded reason" if fallback_allowed else "while fallbacks are not allowed"
            what = f"decision {decision.decision_id} is a fallback {why}"
            self._violate(job, result, "unauthorized_fallback", what, decision)
            if mode != "audit_only":
                return self._reject(job, result, what)
        elif decision.is_fallback:
            result.is_fallback = True
            result.fallback_reason = decision.fallback_reason

        target = decision.selected_cluster_id
        if target != local and target not in self.served:
            what = f"decision selects cluster {target}, this worker serves {local}"
            self._violate(job, result, "cluster_mismatch", what, decision)
            if mode == "strict" and not self.config.allow_automatic_fallback:
                return self._reject(job, result, what)
            if mode != "audit_only":
                result.is_fallback = True
                result.fallback_reason = f"decided cluster {target} is not served here; fell back to {local}"
            target = local

        problem = await self._placement_problem(job, target)
        if problem and mode == "permissive" and target != local:
            kind, what = problem
            self._violate(job, result, kind, what, decision)
            local_problem = await self._placement_problem(job, local)
            if local_problem is None:
                result.is_fallback = True
                result.fallback_reason = f"{what}; fell back to {local}"
                problem = None
                target = local
            else:
                problem = local_problem
        if problem:
            kind, what = problem
            self._violate(job, result, kind, what, decision)
            if mode != "audit_only":
                return self._reject(job, result, what)
        result.cluster_id = target
        return None

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
        if self.capacity_probe is not None:
            probed = await self.capacity_probe(cluster.cluster_id)
            if probed is not None:
                return probed
        return cluster.available_nodes if cluster.total_nodes else None

    def _is_stale(self, decision: SchedulingDecision, height: int) -> bool:
        age_seconds = (self.now() - _aware(decision.created_at)).total_seconds()
        return (
            height - decision.block_height > self.config.decision_max_age_blocks
            or age_seconds > self.config.decision_max_age.total_seconds()
        )

    async def _age(self, decision: SchedulingDecision) -> tuple[int, float]:
        height = await self.chain.current_height()
        return height - decision.block_height, (self.now() - _aware(decision.created_at)).total_seconds()

    async def _refresh(self, job: JobSpec, reason: str) -> SchedulingDecision | None:
        try:
            decision = await self.chain.request_scheduling(job.job_id, reason)
        except Exception as exc:  # the chain could not schedule: keep going with what we have
            self.audit.record(
                "routing_decision_refreshed", job_id=job.job_id, success=False, error_msg=str(exc)[:300]
            )
            return None
        self.audit.record(
            "routing_decision_refreshed",
            job_id=job.job_id,
            cluster_id=decision.selected_cluster_id,
            details={
                "reason": reason,
                "decision_id": decision.decision_id,
                "block_height": decision.block_height,
            },
        )
        return decision

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
        violation = Violation(type=kind, severity=severity or SEVERITY[kind], message=message)
        result.violations.append(violation)
        self.audit.record(
            "routing_violation",
            job_id=job.job_id,
            cluster_id=decision.selected_cluster_id if decision else None,
            success=False,
            severity=violation.severity,
            error_msg=message,
            details={
                "violation_type": kind,
                "mode": self.config.enforcement_mode,
                "decision_id": decision.decision_id if decision else None,
                "decision_block_height": decision.block_height if decision else None,
            },
        )

    def _reject(self, job: JobSpec, result: RoutingResult, message: str) -> RoutingResult:
        result.accepted = False
        result.message = message
        details = {"mode": self.config.enforcement_mode, "violations": [v.type for v in result.violations]}
        self.audit.record(
            "routing_enforcement_failed", job_id=job.job_id, success=False, error_msg=message, details=details
        )
        self.audit.record(
            "job_routing_rejected", job_id=job.job_id, success=False, error_msg=message, details=details
        )
        return result


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
