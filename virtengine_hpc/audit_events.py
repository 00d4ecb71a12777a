"""The name of every audit event, defined once, with the category that decides whether it is recorded.

The names come from the product's list of events (the reference implementation uses the same), plus a few this
project adds (marked below). An event's name is written into every audit line, which the log's hash chain covers,
so a name never changes once released: an ``AuditEvent`` is a ``str`` whose value is the name itself, written as
that plain string. Its ``category`` decides which ``hpc.audit`` switch records it (``activities/audit.py``).
"""

from __future__ import annotations

from enum import StrEnum


class Category(StrEnum):
    JOB = "job"
    SECURITY = "security"
    USAGE = "usage"
    ROUTING = "routing"
    SERVICE = "service"
    NODE = "node"


class AuditEvent(StrEnum):
    """An audit event's name (the member's value) and its category."""

    category: Category

    def __new__(cls, name: str, category: Category) -> AuditEvent:
        member = str.__new__(cls, name)
        member._value_ = name
        member.category = category
        return member

    JOB_SUBMITTED = "job_submitted", Category.JOB
    JOB_CANCELLED = "job_cancelled", Category.JOB
    JOB_LIFECYCLE_EVENT = "job_lifecycle_event", Category.JOB
    JOB_VALIDATION_FAILED = "job_validation_failed", Category.JOB
    JOB_SUBMISSION_FAILED = "job_submission_failed", Category.JOB
    JOB_CANCELLATION_FAILED = "job_cancellation_failed", Category.JOB
    JOB_MAX_RETRIES_EXCEEDED = "job_max_retries_exceeded", Category.JOB
    JOB_QUEUE_FULL = "job_queue_full", Category.JOB
    JOB_ROUTING_REJECTED = "job_routing_rejected", Category.ROUTING
    STATUS_REPORTED = "status_reported", Category.JOB
    STATUS_REPORT_FAILED = "status_report_failed", Category.JOB
    STATE_RECOVERED = "state_recovered", Category.JOB
    JOB_PARKED = "job_parked", Category.JOB
    #: This project's own: racing submit attempts' extra job.
    DUPLICATE_JOB_CANCELLED = "duplicate_job_cancelled", Category.JOB
    #: This project's own: a job no workflow names, cancelled by the sweep.
    UNOWNED_JOB_CANCELLED = "unowned_job_cancelled", Category.JOB
    #: This project's own: the same, reported only (unowned_jobs: report).
    UNOWNED_JOB_FOUND = "unowned_job_found", Category.JOB
    #: This project's own: the reconciler closes a job no open workflow owns.
    JOB_RECONCILED = "job_reconciled", Category.JOB
    USAGE_REPORTED = "usage_reported", Category.USAGE
    USAGE_REPORT_FAILED = "usage_report_failed", Category.USAGE
    ACCOUNTING_REPORTED = "accounting_reported", Category.USAGE
    ACCOUNTING_REPORT_FAILED = "accounting_report_failed", Category.USAGE
    SETTLEMENT_COMPLETED = "settlement_completed", Category.USAGE
    ROUTING_ENFORCEMENT_PASSED = "routing_enforcement_passed", Category.ROUTING
    ROUTING_ENFORCEMENT_FAILED = "routing_enforcement_failed", Category.ROUTING
    ROUTING_ENFORCED = "routing_enforced", Category.ROUTING
    ROUTING_DECISION_MISSING = "routing_decision_missing", Category.ROUTING
    ROUTING_FALLBACK_USED = "routing_fallback_used", Category.ROUTING
    ROUTING_DECISION_REFRESHED = "routing_decision_refreshed", Category.ROUTING
    ROUTING_STALE_DECISION_ALLOWED = "routing_stale_decision_allowed", Category.ROUTING
    ROUTING_VIOLATION = "routing_violation", Category.ROUTING
    SECURITY_VIOLATION = "security_violation", Category.SECURITY
    #: This project's own: a look-alike scheduler job was not adopted.
    ADOPTION_REFUSED = "adoption_refused", Category.SECURITY
    #: This project's own: a pool account left its tenant.
    TENANT_ACCOUNT_RELEASED = "tenant_account_released", Category.SECURITY
    #: This project's own: its jobs or files stay.
    TENANT_ACCOUNT_RELEASE_REFUSED = "tenant_account_release_refused", Category.SECURITY
    SIGNATURE_INVALID = "signature_invalid", Category.SECURITY
    TEMPLATE_REJECTED = "template_rejected", Category.SECURITY
    HEARTBEAT_REJECTED = "heartbeat_rejected", Category.SECURITY
    NODE_REGISTRATION_REJECTED = "node_registration_rejected", Category.SECURITY
    NODE_REGISTERED = "node_registered", Category.NODE
    NODE_STATE_CHANGED = "node_state_changed", Category.NODE
    NODE_DRAINED = "node_drained", Category.NODE
    NODE_RESUMED = "node_resumed", Category.NODE
    SERVICE_STARTED = "service_started", Category.SERVICE
    SERVICE_STOPPED = "service_stopped", Category.SERVICE
