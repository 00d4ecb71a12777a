"""The routing enforcer against the real LocalLedger and a real audit log: every mode x every violation.

What a provider operator and the chain notice is asserted: whether the job runs (and where), the violations with
their severities, and the audit trail (``routing_violation`` records with ``violation_type`` and ``severity``,
``routing_enforcement_passed``/``failed``, ``job_routing_rejected``, ``routing_decision_refreshed``,
``routing_fallback_used`` with its reason, ``routing_stale_decision_allowed``). The expected outcomes are the table
in docs/routing.md; a test reads that table and checks it says the same as the one here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from activities.audit import AuditLog, read_events, verify_log
from activities.chain.local_ledger import LocalLedger
from activities.routing import SEVERITY, STALE_ALLOWED_SEVERITY, RoutingEnforcer, RoutingResult
from virtengine_hpc.config import AuditConfig, RoutingConfig
from virtengine_hpc.errors import ChainUnavailable
from virtengine_hpc.models import Cluster, JobSpec, SchedulingDecision

REPO = Path(__file__).resolve().parents[1]
PROVIDER = "virtengine1provider0test"
TENANT = "virtengine1tenant0test"
LOCAL = "c-local"
OTHER = "c-other"  # registered and active, but no adapter on this worker
GENESIS = datetime(2025, 1, 1, tzinfo=UTC)
SECONDS_PER_BLOCK = 6.0
START = GENESIS + timedelta(seconds=6000)  # height 1001
ROUTING_EVENTS = {
    "routing_violation",
    "routing_decision_missing",
    "routing_decision_refreshed",
    "routing_stale_decision_allowed",
    "routing_fallback_used",
    "routing_enforcement_passed",
    "routing_enforcement_failed",
    "job_routing_rejected",
}


class Clock:
    """One clock for the ledger (decision times, block heights) and the enforcer (decision age)."""

    def __init__(self, start: datetime) -> None:
        self.moment = start

    def __call__(self) -> datetime:
        return self.moment


@dataclass
class World:
    tmp: Path
    clock: Clock
    ledger: LocalLedger
    audit_path: Path
    free: dict[str, int | None] = field(default_factory=dict)
    served: set[str] = field(default_factory=lambda: {LOCAL})
    local: str = LOCAL
    counter: int = 0

    async def probe(self, cluster_id: str) -> int | None:
        return self.free.get(cluster_id)

    def enforcer(self, mode: str = "strict", **switches: Any) -> RoutingEnforcer:
        return RoutingEnforcer(
            self.ledger,
            AuditLog(AuditConfig(log_path=self.audit_path)),
            RoutingConfig(enforcement_mode=mode, **switches),
            served_clusters=frozenset(self.served),
            capacity_probe=self.probe,
            now=self.clock,
        )

    def job(self, nodes: int = 2, cluster_id: str | None = LOCAL) -> JobSpec:
        self.counter += 1
        spec: dict[str, Any] = {
            "job_id": f"JOB-{self.counter}",
            "tenant": TENANT,
            "provider": PROVIDER,
            "offering_id": "offer-1",
            "resources": {"nodes": nodes},
            "script": "#!/bin/bash\ntrue\n",
        }
        if cluster_id is not None:
            spec["cluster_id"] = cluster_id
        self.ledger.submit_job(spec, escrow=0)
        return JobSpec.model_validate(spec)

    def decide(self, job: JobSpec, cluster_id: str = LOCAL, **kwargs: Any) -> SchedulingDecision:
        return self.ledger.create_decision(job.job_id, cluster_id, **kwargs)

    def events(self, job: JobSpec) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [e for e in read_events(self.audit_path) if e["job_id"] == job.job_id]

    def kinds(self, job: JobSpec) -> list[str]:
        return [e["event_type"] for e in self.events(job) if e["event_type"] in ROUTING_EVENTS]

    def event(self, job: JobSpec, kind: str) -> dict[str, Any]:
        found = [e for e in self.events(job) if e["event_type"] == kind]
        assert len(found) == 1, f"{kind}: {found}"
        return found[0]

    async def enforce(self, enforcer: RoutingEnforcer, job: JobSpec) -> RoutingResult:
        return await enforcer.enforce(job, self.local)


def cluster(cluster_id: str, *, nodes: int = 8, state: str = "active") -> Cluster:
    return Cluster(
        cluster_id=cluster_id,
        provider=PROVIDER,
        name=cluster_id,
        state=state,
        total_nodes=nodes,
        available_nodes=nodes,
    )


@pytest.fixture
def world(tmp_path: Path) -> World:
    clock = Clock(START)
    ledger = LocalLedger(
        tmp_path / "ledger.db", seconds_per_block=SECONDS_PER_BLOCK, genesis_time=GENESIS, clock=clock
    )
    ledger.register_cluster(cluster(LOCAL))
    ledger.register_cluster(cluster(OTHER))
    assert ledger.height() == 1001
    return World(tmp=tmp_path, clock=clock, ledger=ledger, audit_path=tmp_path / "audit.log")


# ---- the matrix ------------------------------------------------------------------------------------------------
#
# Each scenario puts the ledger in a state with exactly one violation and returns the job to route.

Scenario = Callable[[World], JobSpec]


def missing_decision(w: World) -> JobSpec:
    return w.job()


def stale_by_blocks(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, block_height=w.ledger.height() - 101, created_at=w.clock())  # seconds: fresh
    return job


def stale_by_seconds(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, block_height=w.ledger.height(), created_at=w.clock() - timedelta(seconds=601))
    return job


def cluster_mismatch(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, OTHER)
    return job


def cluster_offline(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, LOCAL)
    w.ledger.set_cluster_state(LOCAL, "offline")
    return job


def cluster_not_registered(w: World) -> JobSpec:
    """This worker serves a cluster the chain has never heard of, and the decision names it."""
    w.local = "c-unregistered"
    w.served = {"c-unregistered"}
    job = w.job(cluster_id="c-unregistered")
    w.decide(job, "c-unregistered")
    return job


def capacity_exceeded(w: World) -> JobSpec:
    job = w.job(nodes=4)
    w.decide(job, LOCAL)
    w.free[LOCAL] = 3  # the node heartbeats say three nodes are free
    return job


def fallback_not_allowed(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, LOCAL, is_fallback=True, fallback_reason="requested cluster c-x is full")
    return job


def fallback_without_reason(w: World) -> JobSpec:
    job = w.job()
    w.decide(job, LOCAL, is_fallback=True, fallback_reason=None)
    return job


SCENARIOS: dict[str, tuple[Scenario, str]] = {
    "missing_decision": (missing_decision, "missing_decision"),
    "stale_decision (blocks)": (stale_by_blocks, "stale_decision"),
    "stale_decision (seconds)": (stale_by_seconds, "stale_decision"),
    "cluster_mismatch": (cluster_mismatch, "cluster_mismatch"),
    "cluster_unavailable (offline)": (cluster_offline, "cluster_unavailable"),
    "cluster_unavailable (not registered)": (cluster_not_registered, "cluster_unavailable"),
    "capacity_exceeded": (capacity_exceeded, "capacity_exceeded"),
    "unauthorized_fallback (fallbacks not allowed)": (fallback_not_allowed, "unauthorized_fallback"),
    "unauthorized_fallback (no reason)": (fallback_without_reason, "unauthorized_fallback"),
}

MODES = ("strict", "permissive", "audit_only")

REJECT = ["routing_violation", "routing_enforcement_failed", "job_routing_rejected"]
LOGGED = ["routing_violation", "routing_enforcement_passed"]


@dataclass(frozen=True)
class Expect:
    """One cell: the outcome word of docs/routing.md, the violation severities, the routing audit events."""

    outcome: str  # rejected | accepted | refreshed | fallback
    severities: tuple[int, ...]
    events: tuple[str, ...]


def cell(outcome: str, severities: tuple[int, ...], events: list[str]) -> Expect:
    return Expect(outcome, severities, tuple(events))


MISSING = ["routing_violation", "routing_decision_missing"]
EXPECTED: dict[str, dict[str, Expect]] = {
    "missing_decision": {
        "strict": cell("rejected", (4,), [*MISSING, "routing_enforcement_failed", "job_routing_rejected"]),
        "permissive": cell(
            "refreshed", (4,), [*MISSING, "routing_decision_refreshed", "routing_enforcement_passed"]
        ),
        "audit_only": cell("accepted", (4,), [*MISSING, "routing_enforcement_passed"]),
    },
    **{
        name: {
            "strict": cell("rejected", (2,), REJECT),
            "permissive": cell(
                "refreshed",
                (1,),
                ["routing_violation", "routing_decision_refreshed", "routing_enforcement_passed"],
            ),
            "audit_only": cell(
                "accepted",
                (1,),
                ["routing_violation", "routing_stale_decision_allowed", "routing_enforcement_passed"],
            ),
        }
        for name in ("stale_decision (blocks)", "stale_decision (seconds)")
    },
    "cluster_mismatch": {
        "strict": cell("rejected", (5,), REJECT),
        "permissive": cell("fallback", (5,), [*LOGGED, "routing_fallback_used"]),
        "audit_only": cell("accepted", (5,), LOGGED),
    },
    **{
        name: {
            "strict": cell("rejected", (3,), REJECT),
            "permissive": cell("rejected", (3,), REJECT),
            "audit_only": cell("accepted", (3,), LOGGED),
        }
        for name in (
            "cluster_unavailable (offline)",
            "cluster_unavailable (not registered)",
            "capacity_exceeded",
        )
    },
    "unauthorized_fallback (fallbacks not allowed)": {
        "strict": cell("rejected", (4,), REJECT),
        "permissive": cell("fallback", (), ["routing_enforcement_passed", "routing_fallback_used"]),
        "audit_only": cell("accepted", (4,), LOGGED),
    },
    "unauthorized_fallback (no reason)": {
        "strict": cell("rejected", (4,), REJECT),
        "permissive": cell("rejected", (4,), REJECT),
        "audit_only": cell("accepted", (4,), LOGGED),
    },
}
MATRIX = [(name, mode) for name in SCENARIOS for mode in MODES]


@pytest.mark.parametrize(("scenario", "mode"), MATRIX, ids=[f"{m}-{s}" for s, m in MATRIX])
async def test_mode_by_violation(world: World, scenario: str, mode: str) -> None:
    make, kind = SCENARIOS[scenario]
    expect = EXPECTED[scenario][mode]
    job = make(world)
    result = await world.enforce(world.enforcer(mode), job)

    # Accepted or rejected, and where it runs.
    assert result.accepted is (expect.outcome != "rejected"), result.message
    if result.accepted:
        assert result.cluster_id == world.local
        assert result.message == ""
    else:
        assert result.message
    assert result.is_fallback is (expect.outcome == "fallback")

    # The violations, with their severities.
    assert [v.type for v in result.violations] == [kind] * len(expect.severities)
    assert tuple(v.severity for v in result.violations) == expect.severities

    # The audit trail, in order.
    assert world.kinds(job) == list(expect.events)
    for record, violation in zip(
        [e for e in world.events(job) if e["event_type"] == "routing_violation"],
        result.violations,
        strict=True,
    ):
        assert record["details"]["violation_type"] == kind
        assert record["severity"] == violation.severity
        assert record["success"] is False
        assert record["error_msg"] == violation.message
        assert record["details"]["mode"] == mode
        assert record["details"]["enforced"] is (mode != "audit_only")
    if result.accepted:
        passed = world.event(job, "routing_enforcement_passed")
        assert passed["cluster_id"] == world.local
        assert passed["details"]["violations"] == [v.type for v in result.violations]
    else:
        failed = world.event(job, "routing_enforcement_failed")
        rejected = world.event(job, "job_routing_rejected")
        assert failed["error_msg"] == rejected["error_msg"] == result.message
        assert rejected["details"]["violations"] == [kind]
    assert verify_log(world.audit_path).ok


# ---- what each cell's details say ------------------------------------------------------------------------------


async def test_strict_missing_decision_is_recorded_as_blocking(world: World) -> None:
    job = missing_decision(world)
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.message == "no scheduling decision for the job (strict mode)"
    assert world.event(job, "routing_decision_missing")["success"] is False
    assert world.ledger.decisions(job.job_id) == []  # strict never asks the chain to schedule


@pytest.mark.parametrize("stale", [stale_by_blocks, stale_by_seconds], ids=["blocks", "seconds"])
async def test_strict_stale_message_gives_the_age(world: World, stale: Scenario) -> None:
    job = stale(world)
    result = await world.enforce(world.enforcer("strict"), job)
    assert re.fullmatch(r"decision DEC-\d+ is stale \(\d+ blocks, \d+ s old\)", result.message)
    if stale is stale_by_blocks:
        assert "(101 blocks, 0 s old)" in result.message
    else:
        assert "(0 blocks, 601 s old)" in result.message


async def test_permissive_missing_decision_is_scheduled_on_chain(world: World) -> None:
    job = missing_decision(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    [decision] = world.ledger.decisions(job.job_id)
    assert result.decision == decision
    assert decision.selected_cluster_id == LOCAL and decision.decision_reason == "missing decision"
    refreshed = world.event(job, "routing_decision_refreshed")
    assert refreshed["success"] is True
    assert refreshed["details"]["decision_id"] == decision.decision_id
    assert refreshed["details"]["reason"] == "missing decision"
    assert world.event(job, "routing_decision_missing")["success"] is True


@pytest.mark.parametrize("stale", [stale_by_blocks, stale_by_seconds], ids=["blocks", "seconds"])
async def test_permissive_stale_decision_is_replaced_by_a_fresh_one(world: World, stale: Scenario) -> None:
    job = stale(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    old, new = world.ledger.decisions(job.job_id)
    assert result.decision == new
    assert new.block_height == world.ledger.height()
    assert world.event(job, "routing_violation")["details"]["decision_id"] == old.decision_id
    assert world.event(job, "routing_decision_refreshed")["details"]["decision_id"] == new.decision_id
    assert world.event(job, "routing_enforcement_passed")["details"]["decision_id"] == new.decision_id


@pytest.mark.parametrize("stale", [stale_by_blocks, stale_by_seconds], ids=["blocks", "seconds"])
async def test_audit_only_stale_decision_is_allowed_and_says_how_old(world: World, stale: Scenario) -> None:
    job = stale(world)
    result = await world.enforce(world.enforcer("audit_only"), job)
    [decision] = world.ledger.decisions(job.job_id)
    assert result.decision == decision
    allowed = world.event(job, "routing_stale_decision_allowed")
    assert allowed["details"]["decision_id"] == decision.decision_id
    assert allowed["details"]["reason"] == result.violations[0].message
    if stale is stale_by_blocks:
        assert allowed["details"]["age_blocks"] == 101
    else:
        assert allowed["details"]["age_seconds"] == 601


async def test_permissive_mismatch_falls_back_with_its_reason(world: World) -> None:
    job = cluster_mismatch(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    reason = f"decided cluster {OTHER} is not served here; fell back to {LOCAL}"
    assert result.fallback_reason == reason
    used = world.event(job, "routing_fallback_used")
    assert used["cluster_id"] == LOCAL
    assert used["details"]["reason"] == reason
    assert used["details"]["decided"] == OTHER


async def test_permissive_authorised_fallback_decision_runs_with_the_chains_reason(world: World) -> None:
    job = fallback_not_allowed(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    assert result.fallback_reason == "requested cluster c-x is full"
    assert world.event(job, "routing_fallback_used")["details"]["reason"] == "requested cluster c-x is full"


@pytest.mark.parametrize(
    ("make", "mode", "message"),
    [
        (fallback_not_allowed, "strict", "is a fallback while fallbacks are not allowed"),
        (fallback_without_reason, "strict", "is a fallback while fallbacks are not allowed"),
        (fallback_without_reason, "permissive", "is a fallback without a recorded reason"),
    ],
)
async def test_unauthorized_fallback_messages(world: World, make: Scenario, mode: str, message: str) -> None:
    job = make(world)
    result = await world.enforce(world.enforcer(mode), job)
    assert result.message.endswith(message)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (cluster_offline, f"cluster {LOCAL} is offline"),
        (cluster_not_registered, "cluster c-unregistered is not registered on chain"),
        (capacity_exceeded, f"job needs 4 nodes, cluster {LOCAL} has 3 available"),
        (cluster_mismatch, f"decision selects cluster {OTHER}, this worker serves {LOCAL}"),
    ],
)
async def test_rejection_messages_say_what_is_wrong(world: World, make: Scenario, message: str) -> None:
    job = make(world)
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.message == message


# ---- the switches ----------------------------------------------------------------------------------------------


async def test_strict_without_required_decision_runs_here_and_still_records_it(world: World) -> None:
    job = missing_decision(world)
    result = await world.enforce(world.enforcer("strict", require_decision_for_submission=False), job)
    assert result.accepted and result.cluster_id == LOCAL and result.decision is None
    assert [(v.type, v.severity) for v in result.violations] == [("missing_decision", 4)]
    assert world.kinds(job) == [*MISSING, "routing_enforcement_passed"]
    assert world.event(job, "routing_decision_missing")["success"] is True
    assert world.ledger.decisions(job.job_id) == []  # strict does not re-schedule


async def test_strict_without_required_decision_still_fails_closed_on_an_offline_cluster(
    world: World,
) -> None:
    job = missing_decision(world)
    world.ledger.set_cluster_state(LOCAL, "offline")
    result = await world.enforce(world.enforcer("strict", require_decision_for_submission=False), job)
    assert not result.accepted
    assert [v.type for v in result.violations] == ["missing_decision", "cluster_unavailable"]
    assert result.message == f"cluster {LOCAL} is offline"


async def test_strict_without_required_decision_checks_capacity_here(world: World) -> None:
    job = world.job(nodes=4)
    world.free[LOCAL] = 2
    result = await world.enforce(world.enforcer("strict", require_decision_for_submission=False), job)
    assert not result.accepted
    assert [v.type for v in result.violations] == ["missing_decision", "capacity_exceeded"]


async def test_strict_with_automatic_fallback_runs_a_mismatched_job_here(world: World) -> None:
    job = cluster_mismatch(world)
    result = await world.enforce(world.enforcer("strict", allow_automatic_fallback=True), job)
    assert result.accepted and result.is_fallback and result.cluster_id == LOCAL
    assert [(v.type, v.severity) for v in result.violations] == [("cluster_mismatch", 5)]
    assert world.kinds(job) == [*LOGGED, "routing_fallback_used"]
    assert world.event(job, "routing_fallback_used")["details"]["reason"] == (
        f"decided cluster {OTHER} is not served here; fell back to {LOCAL}"
    )


async def test_strict_with_automatic_fallback_accepts_a_fallback_decision_with_a_reason(world: World) -> None:
    job = fallback_not_allowed(world)
    result = await world.enforce(world.enforcer("strict", allow_automatic_fallback=True), job)
    assert result.accepted and result.is_fallback and result.violations == []
    assert result.fallback_reason == "requested cluster c-x is full"
    assert world.kinds(job) == ["routing_enforcement_passed", "routing_fallback_used"]


async def test_strict_with_automatic_fallback_still_refuses_a_fallback_without_reason(world: World) -> None:
    job = fallback_without_reason(world)
    result = await world.enforce(world.enforcer("strict", allow_automatic_fallback=True), job)
    assert not result.accepted
    assert result.message.endswith("is a fallback without a recorded reason")
    assert [(v.type, v.severity) for v in result.violations] == [("unauthorized_fallback", 4)]


async def test_strict_with_automatic_fallback_still_rejects_stale_and_missing(world: World) -> None:
    enforcer = world.enforcer("strict", allow_automatic_fallback=True)
    for make in (missing_decision, stale_by_blocks):
        job = make(world)
        assert not (await world.enforce(enforcer, job)).accepted


@pytest.mark.parametrize("mode", ["permissive", "strict"])
async def test_an_unavailable_served_cluster_falls_back_here(world: World, mode: str) -> None:
    """This worker serves two clusters; the decided one went offline, so the job runs on the worker's own."""
    world.ledger.register_cluster(cluster("c-second", state="offline"))
    world.served = {LOCAL, "c-second"}
    job = world.job()
    world.decide(job, "c-second")
    enforcer = world.enforcer(mode, allow_automatic_fallback=mode == "strict")
    result = await world.enforce(enforcer, job)
    assert result.accepted and result.cluster_id == LOCAL and result.is_fallback
    assert result.fallback_reason == f"cluster c-second is offline; fell back to {LOCAL}"
    assert [(v.type, v.severity) for v in result.violations] == [("cluster_unavailable", 3)]
    assert world.event(job, "routing_fallback_used")["details"]["reason"] == result.fallback_reason


async def test_a_decision_for_another_served_cluster_runs_there(world: World) -> None:
    world.ledger.register_cluster(cluster("c-second"))
    world.served = {LOCAL, "c-second"}
    job = world.job()
    world.decide(job, "c-second")
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.accepted and result.cluster_id == "c-second" and not result.is_fallback
    assert result.violations == []


async def test_strict_does_not_fall_back_from_an_unavailable_served_cluster(world: World) -> None:
    world.ledger.register_cluster(cluster("c-second", state="draining"))
    world.served = {LOCAL, "c-second"}
    job = world.job()
    world.decide(job, "c-second")
    result = await world.enforce(world.enforcer("strict"), job)
    assert not result.accepted and result.message == "cluster c-second is draining"


async def test_permissive_fallback_to_an_unusable_cluster_is_rejected(world: World) -> None:
    world.ledger.register_cluster(cluster("c-second", state="offline"))
    world.served = {LOCAL, "c-second"}
    world.ledger.set_cluster_state(LOCAL, "offline")
    job = world.job()
    world.decide(job, "c-second")
    result = await world.enforce(world.enforcer("permissive"), job)
    assert not result.accepted
    assert [v.type for v in result.violations] == ["cluster_unavailable", "cluster_unavailable"]
    assert result.message == f"cluster {LOCAL} is offline"
    assert "routing_fallback_used" not in world.kinds(job)


# ---- permissive when the chain cannot schedule ------------------------------------------------------------------


async def test_permissive_missing_decision_when_no_cluster_has_room(world: World) -> None:
    world.ledger.set_cluster_state(LOCAL, "offline")
    world.ledger.set_cluster_state(OTHER, "offline")
    job = missing_decision(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    assert not result.accepted
    refreshed = world.event(job, "routing_decision_refreshed")
    assert refreshed["success"] is False and "no active cluster" in refreshed["error_msg"]
    assert [v.type for v in result.violations] == ["missing_decision", "cluster_unavailable"]


async def test_permissive_stale_decision_is_allowed_when_the_chain_cannot_schedule(world: World) -> None:
    job = stale_by_blocks(world)
    world.ledger.register_cluster(cluster(LOCAL, nodes=1))  # the chain sees no room for 2 nodes here...
    world.ledger.set_cluster_state(OTHER, "offline")  # ...nor anywhere else
    world.free[LOCAL] = 8  # but the live node heartbeats say 8 nodes are free
    result = await world.enforce(world.enforcer("permissive"), job)
    # Scheduling failed, so the stale decision stands and is allowed.
    assert result.accepted
    assert world.event(job, "routing_decision_refreshed")["success"] is False
    assert world.kinds(job) == [
        "routing_violation",
        "routing_decision_refreshed",
        "routing_stale_decision_allowed",
        "routing_enforcement_passed",
    ]
    assert len(world.ledger.decisions(job.job_id)) == 1


async def test_permissive_rescheduling_elsewhere_is_a_fallback_back_to_here(world: World) -> None:
    """The chain re-schedules the job onto another cluster (ours looked full to it); this worker cannot run
    jobs there, so the job runs here as a recorded fallback if the live probe says there is room."""
    world.ledger.register_cluster(cluster(LOCAL, nodes=1))
    world.free[LOCAL] = 4
    job = missing_decision(world)
    result = await world.enforce(world.enforcer("permissive"), job)
    [decision] = world.ledger.decisions(job.job_id)
    assert decision.selected_cluster_id == OTHER and decision.is_fallback
    assert result.accepted and result.cluster_id == LOCAL and result.is_fallback
    assert result.fallback_reason == (
        f"requested cluster {LOCAL} is unavailable or full; "
        f"decided cluster {OTHER} is not served here; fell back to {LOCAL}"
    )
    assert [v.type for v in result.violations] == ["missing_decision", "cluster_mismatch"]


class FlakyLedger(LocalLedger):
    """The real ledger whose scheduler is briefly unreachable."""

    async def request_scheduling(self, job_id: str, reason: str) -> SchedulingDecision:
        raise ChainUnavailable("ledger is busy")


async def test_a_transient_chain_failure_while_rescheduling_is_retried_not_decided(world: World) -> None:
    flaky = FlakyLedger(world.ledger.path, clock=world.clock)
    world.ledger = flaky
    job = missing_decision(world)
    with pytest.raises(ChainUnavailable):
        await world.enforce(world.enforcer("permissive"), job)
    assert "routing_enforcement_passed" not in world.kinds(job)


# ---- staleness bounds and capacity -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blocks_old", "seconds_old", "stale"),
    [(100, 600, False), (101, 0, True), (0, 601, True), (0, 600.5, True), (100, 0, False)],
)
async def test_staleness_limits_are_exclusive(
    world: World, blocks_old: int, seconds_old: float, stale: bool
) -> None:
    job = world.job()
    world.decide(
        job,
        block_height=world.ledger.height() - blocks_old,
        created_at=world.clock() - timedelta(seconds=seconds_old),
    )
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.accepted is not stale
    assert [v.type for v in result.violations] == (["stale_decision"] if stale else [])


async def test_staleness_limits_come_from_the_config(world: World) -> None:
    job = world.job()
    world.decide(job, block_height=world.ledger.height() - 20)
    strict = world.enforcer("strict", decision_max_age_blocks=10)
    assert not (await world.enforce(strict, job)).accepted
    job = world.job()
    world.decide(job, created_at=world.clock() - timedelta(seconds=61))
    strict = world.enforcer("strict", decision_max_age=timedelta(minutes=1))
    assert not (await world.enforce(strict, job)).accepted


async def test_a_decision_goes_stale_as_the_chain_moves_on(world: World) -> None:
    job = world.job()
    world.decide(job)
    enforcer = world.enforcer("strict")
    assert (await world.enforce(enforcer, job)).accepted
    world.clock.moment += timedelta(seconds=601)
    assert not (await world.enforce(enforcer, job)).accepted


@pytest.mark.parametrize(
    ("nodes", "probe", "on_chain", "accepted"),
    [
        (4, 4, 8, True),  # exactly enough
        (4, 3, 8, False),  # the probe wins over the chain's count
        (4, None, 3, False),  # no live reading: the chain's available_nodes
        (4, None, 4, True),
        (4, 10, 1, True),
    ],
)
async def test_capacity_comes_from_the_probe_then_the_chain(
    world: World, nodes: int, probe: int | None, on_chain: int, accepted: bool
) -> None:
    world.ledger.register_cluster(
        Cluster(cluster_id=LOCAL, provider=PROVIDER, name=LOCAL, total_nodes=8, available_nodes=on_chain)
    )
    world.free[LOCAL] = probe
    job = world.job(nodes=nodes)
    world.decide(job)
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.accepted is accepted
    assert [v.type for v in result.violations] == ([] if accepted else ["capacity_exceeded"])


async def test_a_cluster_that_reports_no_node_totals_has_no_capacity_check(world: World) -> None:
    world.ledger.register_cluster(Cluster(cluster_id=LOCAL, provider=PROVIDER, name=LOCAL))
    job = world.job(nodes=500)
    world.decide(job)
    assert (await world.enforce(world.enforcer("strict"), job)).accepted


async def test_a_clean_job_passes_with_no_violation(world: World) -> None:
    job = world.job()
    decision = world.decide(job)
    result = await world.enforce(world.enforcer("strict"), job)
    assert result.accepted and result.violations == [] and result.decision == decision
    assert world.kinds(job) == ["routing_enforcement_passed"]
    passed = world.event(job, "routing_enforcement_passed")
    assert passed["details"]["decision_id"] == decision.decision_id
    assert passed["details"]["is_fallback"] is False


async def test_audit_only_reports_every_violation_at_once(world: World) -> None:
    """Strict stops at the first rejecting violation; audit_only goes on and records all of them."""
    job = world.job(nodes=4)
    world.decide(job, OTHER, is_fallback=True, fallback_reason=None, block_height=world.ledger.height() - 500)
    world.free[LOCAL] = 1
    result = await world.enforce(world.enforcer("audit_only"), job)
    assert result.accepted
    assert [(v.type, v.severity) for v in result.violations] == [
        ("stale_decision", STALE_ALLOWED_SEVERITY),
        ("unauthorized_fallback", 4),
        ("cluster_mismatch", 5),
        ("capacity_exceeded", 3),
    ]
    strict = await world.enforce(world.enforcer("strict"), world_job_like(world, job))
    assert [v.type for v in strict.violations] == ["stale_decision"]


def world_job_like(world: World, job: JobSpec) -> JobSpec:
    twin = world.job(nodes=job.resources.nodes)
    decision = world.ledger.decisions(job.job_id)[-1]
    world.decide(
        twin,
        decision.selected_cluster_id,
        is_fallback=decision.is_fallback,
        fallback_reason=decision.fallback_reason,
        block_height=decision.block_height,
        created_at=decision.created_at,
    )
    return twin


async def test_with_security_events_switched_off_routing_still_enforces(world: World) -> None:
    enforcer = RoutingEnforcer(
        world.ledger,
        AuditLog(AuditConfig(log_path=world.audit_path, log_security_events=False)),
        RoutingConfig(),
        served_clusters=frozenset({LOCAL}),
        now=world.clock,
    )
    job = missing_decision(world)
    assert not (await enforcer.enforce(job, LOCAL)).accepted
    assert world.kinds(job) == []


def test_severities_are_the_references() -> None:
    assert SEVERITY == {
        "missing_decision": 4,
        "stale_decision": 2,
        "cluster_mismatch": 5,
        "cluster_unavailable": 3,
        "capacity_exceeded": 3,
        "unauthorized_fallback": 4,
    }
    assert STALE_ALLOWED_SEVERITY == 1


# ---- the documented table is this table --------------------------------------------------------------------------

WORDS = {"rejected": "rejected", "accepted": "accepted", "refreshed": "re-scheduled", "fallback": "fallback"}


def test_docs_routing_table_matches_the_tested_behaviour() -> None:
    """docs/routing.md's matrix: one row per scenario, `outcome, severity` per mode."""
    text = (REPO / "docs" / "routing.md").read_text()
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].replace("`", "").split(" ")[0] in SEVERITY:
            rows[cells[0].replace("`", "")] = cells[1:]
    assert set(rows) == set(SCENARIOS), sorted(rows)
    for scenario, cells in rows.items():
        for mode, documented in zip(MODES, cells, strict=True):
            expect = EXPECTED[scenario][mode]
            severity = ", ".join(str(s) for s in expect.severities) or "-"
            words = documented.replace("*", "").lower()
            assert words.startswith(WORDS[expect.outcome]), (scenario, mode, documented)
            assert f"({severity})" in words, (scenario, mode, documented)
