"""Routing enforcement (``routing``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from pydantic import Field

from virtengine_hpc.config.base import Duration, Section


class RoutingConfig(Section):
    """Routing enforcement against the on-chain scheduling decision (``docs/routing.md``)."""

    enforcement_mode: Literal["strict", "permissive", "audit_only"] = Field(
        "strict",
        description="strict (fail closed), permissive (re-schedule and fall back, logged) or audit_only (log, enforce nothing); see docs/routing.md.",
    )
    require_decision_for_submission: bool = Field(
        True, description="In strict mode, reject a job that has no scheduling decision on chain."
    )
    allow_automatic_fallback: bool = Field(
        False,
        description="In strict mode, accept fallback decisions (with a reason) and run a job decided for an unserved or unavailable cluster on this one.",
    )
    decision_max_age_blocks: int = Field(
        100, ge=1, description="A decision more than this many blocks old is stale."
    )
    decision_max_age: Duration = Field(
        timedelta(seconds=600),
        description="A decision older than this is stale (whichever limit is reached first).",
    )
