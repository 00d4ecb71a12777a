"""Domain exceptions.

Adapters and clients raise these; the activity boundary translates them into Temporal ``ApplicationError`` with
``type`` = the class name and ``non_retryable = not transient``. A workflow never sees a plain
exception.
"""

from __future__ import annotations


class HPCError(Exception):
    """Base of every error this project raises on purpose.

    ``transient`` says whether trying again later may succeed (a timed-out socket) or never will (an invalid
    account). ``code`` is a stable machine-readable name for the audit log and the chain.
    """

    transient: bool = False
    code: str = "hpc_error"

    def __init__(self, message: str, *, transient: bool | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if transient is not None:
            self.transient = transient
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class ConfigError(HPCError):
    """The configuration is invalid; names the bad key and why."""

    code = "config_invalid"


class ValidationError(HPCError):
    """A job, template, record or request is malformed or violates a bound."""

    code = "validation_failed"


class SecurityError(HPCError):
    """A signature, key, host key or credential check failed."""

    code = "security_violation"


class SchedulerError(HPCError):
    """A scheduler command or request failed.

    Carries what an operator needs to diagnose it: the command (argv, never a shell string), exit code, and output.
    Secrets never appear here: commands receive them through the environment or headers, not argv.
    """

    code = "scheduler_error"

    def __init__(
        self,
        message: str,
        *,
        transient: bool | None = None,
        code: str | None = None,
        command: list[str] | None = None,
        exit_code: int | None = None,
        stdout: str = "",
        stderr: str = "",
    ) -> None:
        super().__init__(message, transient=transient, code=code)
        self.command = command or []
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr


class SubmissionRejected(SchedulerError):
    """The scheduler refused the job for good (bad partition, invalid account, too many nodes)."""

    transient = False
    code = "submission_rejected"


class SchedulerUnavailable(SchedulerError):
    """The scheduler could not be reached or timed out; the same request may succeed later."""

    transient = True
    code = "scheduler_unavailable"


class JobNotFound(SchedulerError):
    """The scheduler has no record of the job, in its queue or its accounting."""

    transient = False
    code = "job_not_found"


class ChainError(HPCError):
    """The chain (or the LocalLedger) refused or could not take a request."""

    code = "chain_error"


class ChainUnavailable(ChainError):
    transient = True
    code = "chain_unavailable"


class IllegalTransition(ChainError):
    """A status report asked for a transition the job's state machine does not allow."""

    code = "illegal_transition"


class RoutingRejected(HPCError):
    """The routing enforcer refused the job (strict mode, or a violation no mode tolerates)."""

    code = "routing_rejected"


class TenantAccountError(HPCError):
    """A tenant's job cannot run: it has no cluster account, or the one it would get is privileged.

    Never transient: trying again the same way cannot help, the operator must change ``hpc.tenants``.
    """

    transient = False
    code = "tenant_account_missing"


# ---- what a workflow does not retry -------------------------------------------------------------------------------
# A Temporal retry policy names the errors it does not retry by their type, the class name the activity boundary
# gives an ``ApplicationError``. Each tuple keeps its order: the names travel in the commands a workflow issues.

NON_RETRYABLE: tuple[type[HPCError], ...] = (
    ValidationError,
    ConfigError,
    SubmissionRejected,
    SecurityError,
    IllegalTransition,
    TenantAccountError,
)
"""What the job workflow's steps never retry: the job, the config or a check is wrong, or the scheduler or the
chain refused it for good; trying again the same way cannot help."""
NON_RETRYABLE_TYPES: tuple[str, ...] = tuple(error.__name__ for error in NON_RETRYABLE)

NODE_LEDGER_NON_RETRYABLE: tuple[type[HPCError], ...] = (ValidationError,)
"""What a node workflow's ledger steps never retry."""
NODE_LEDGER_NON_RETRYABLE_TYPES: tuple[str, ...] = tuple(
    error.__name__ for error in NODE_LEDGER_NON_RETRYABLE
)

NODE_SCHEDULER_NON_RETRYABLE: tuple[type[HPCError], ...] = (
    ValidationError,
    SubmissionRejected,
    JobNotFound,
    ConfigError,
)
"""What a node workflow's scheduler steps (drain, resume, busy) never retry."""
NODE_SCHEDULER_NON_RETRYABLE_TYPES: tuple[str, ...] = tuple(
    error.__name__ for error in NODE_SCHEDULER_NON_RETRYABLE
)
