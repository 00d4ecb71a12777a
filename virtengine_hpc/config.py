"""Typed configuration: the seed's ``hpc:`` and ``routing:`` sections plus ``temporal:``, ``chain:`` and ``provider:``.

One YAML file, overridden by environment variables ``VIRTENGINE_HPC__SECTION__KEY`` (``__`` nests; a scalar
value is converted by the key's type, mappings and lists are YAML), validated into frozen pydantic models.
Durations are written ``500ms``, ``15s``, ``5m``, ``24h``, ``1h30m`` or as plain seconds. Errors name the bad key
and say why; the reference of every key is ``docs/configuration.md``, generated from these models by
``scripts/gen-config-doc.py``.

Credentials never come from the file (invariant 8 in docs/architecture.md): they are read only from ``SLURM_JWT_TOKEN``,
``MOAB_USERNAME``, ``MOAB_PASSWORD``, ``OOD_OIDC_CLIENT_SECRET``, ``PROVIDER_SIGNING_KEY_PATH`` and
``PROVIDER_MARKER_SECRET``, and a
configuration (file or override) that holds a credential-like key at any depth is refused. Only worker-side
code reads configuration; workflows get what they need in their input.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.errors import ConfigError
from virtengine_hpc.models import _ADDRESS_RE as ADDRESS_PATTERN  # the pattern jobs name tenants with

ENV_PREFIX = "VIRTENGINE_HPC__"
MAX_DURATION_SECONDS = 10 * 365 * 86400
"""No setting needs a duration longer than ten years; a longer one is a typo (or would overflow ``timedelta``)."""
# re.ASCII: ``\d`` alone matches every script's digits (an Arabic-Indic one followed by "s" would be a second).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.ASCII)
_SECONDS = re.compile(r"\d+(\.\d+)?", re.ASCII)
MAX_CONFIG_VALUES = 100_000
"""A configuration has a few hundred values; a file that expands to more (YAML aliases can make a 300-byte file
expand to hundreds of millions) is refused before anything walks it."""
MAX_CONFIG_DEPTH = 64
MAX_ERRORS_SHOWN = 10
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# Keys that look like credentials; a config file holding one is refused.
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api_key|apikey|private_key|credential)", re.I)
# Keys whose names look like credentials but hold only a location or the name of a variable.
_ALLOWED_SECRETISH = {"token_file_env", "signing_key_path_env", "api_key_env", "oidc_token_url"}
_ACCOUNT = r"^[a-z_][a-z0-9_-]{0,31}$"
"""A Unix account name as Slurm, MOAB and sshd accept it (what useradd allows by default)."""
SERVICE_ACCOUNTS = {
    "munge": "MUNGE's own account: it reads munge.key, which forges a Slurm credential for any uid",
    "slurm": "Slurm's own daemon account (SlurmUser): it rules the cluster",
}
"""Accounts that are never a tenant's, by name (others are refused by uid, or as the scheduler says)."""


def parse_duration(value: Any) -> timedelta:
    """Parse ``15s``, ``5m``, ``24h``, ``1h30m``, ``500ms``, a number of seconds, or a ``timedelta``."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("a duration must be like 15s, 5m or 24h, not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration must not be negative")
        return _seconds(value, value)
    if isinstance(value, str) and value.strip().upper().startswith("P"):
        # ISO 8601 (``PT15S``): how a dumped config writes durations, so configs round-trip through JSON.
        try:
            return _ISO_DURATION.validate_python(value.strip())
        except PydanticValidationError:
            pass
    if isinstance(value, str):
        text = value.strip().lower()
        if _SECONDS.fullmatch(text):
            return _seconds(float(text), value)
        pos, total = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos == len(text) and pos > 0:
            return _seconds(total, value)
    raise ValueError(f"invalid duration {_shown(value)} (use e.g. 500ms, 15s, 5m, 24h or 1h30m)")


def _seconds(seconds: float, given: Any) -> timedelta:
    # timedelta raises OverflowError (not ValueError) for inf, nan and huge numbers; pydantic would let that
    # escape as a crash instead of naming the key. Compare before anything converts an int to float: a
    # 400-digit integer overflows that conversion too.
    if not seconds <= MAX_DURATION_SECONDS or not math.isfinite(seconds):
        raise ValueError(f"invalid duration {_shown(given)} (at most {MAX_DURATION_SECONDS // 86400} days)")
    return timedelta(seconds=seconds)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_ISO_DURATION = TypeAdapter(timedelta)
Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1: `max_concurrent_jobs: yes` would silently mean one job at a time.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and field.annotation in (int, float):
            raise ValueError("must be a number, not true/false")
        return value


class JobServiceConfig(Section):
    """How jobs are taken from the chain and how long they may take (seed: ``hpc.job_service``)."""

    job_poll_interval: Duration = Field(timedelta(seconds=15), description="How often the chain is polled.")
    job_timeout_default: Duration = Field(
        timedelta(hours=24),
        description="The walltime of a job whose spec names none (the longest it may run). It does not limit how "
        "long a job waits in the queue: that is max_queue_wait.",
    )
    max_concurrent_jobs: int = Field(
        100,
        ge=1,
        le=100_000,
        description="Jobs in flight at once on the cluster, whatever the number of pollers; the rest wait on chain.",
    )
    start_concurrency: int = Field(
        4,
        ge=1,
        le=512,
        description="Workflow starts the poller has in flight at once while it takes pending jobs. A single "
        "SQLite dev server gains nothing above 4; a Temporal cluster with several history shards gains more.",
    )
    cancel_concurrency: int = Field(
        8,
        ge=1,
        le=512,
        description="Tenant cancellations the poller forwards at once (a signal, or for a job without a workflow a "
        "start with the cancel in it). Each round takes those of running jobs first, and in turns by tenant, so a "
        "tenant's flood of cancels cannot delay another tenant's.",
    )
    intake_lease: Duration = Field(
        timedelta(seconds=30),
        ge=timedelta(seconds=10),
        description="Term of the lease that lets one poller of a cluster at a time start jobs (so that several "
        "pollers never run more than max_concurrent_jobs). The holder renews it while it lives; if it dies, "
        "another poller takes over within two terms.",
    )
    max_queue_wait: Duration | None = Field(
        None,
        description="Cancel a job that has waited this long in the scheduler's queue without starting and report "
        "it timed out. Unset (the default): no limit, long queues are normal on HPC clusters.",
    )
    walltime_grace: Duration = Field(
        timedelta(minutes=2),
        description="How long past its walltime (counted in running time only: suspended time does not count) a "
        "job may run before the provider cancels it and reports it timed out; the scheduler normally ends it "
        "first.",
    )
    reconcile_interval: Duration = Field(
        timedelta(seconds=60),
        gt=timedelta(0),
        description="How often the poller's reconciler looks for chain jobs that are not final while no workflow "
        "is open for them, and starts a run that closes each (docs/operations.md). A job whose workflow "
        "closed reaches a final chain state within about this plus one such run.",
    )
    activity_heartbeat_timeout: Duration = Field(
        timedelta(seconds=30),
        ge=timedelta(seconds=5),
        le=timedelta(minutes=10),
        description="How long Temporal waits for a job activity's heartbeat (sent every 2 s while it runs) before "
        "it gives the attempt up and starts a retry, perhaps on another worker: a dead worker's submit, usage "
        "report or cancel is taken over after about this long. Too short, and a loaded but alive worker loses "
        "attempts it is still running (10 s lost 412 attempts with 1,000 jobs on one 2-core host, 30 s lost 14; "
        "docs/benchmarks.md). A job's watch waits at least four scheduler poll intervals. Fixed per job when it "
        "starts.",
    )
    cluster_monitor: bool = Field(
        True,
        description="Watch jobs through one cluster monitor workflow per cluster (one status query per poll "
        "interval, whatever the number of workers; a watched job holds no activity), whose round also sends "
        "running jobs' period usage records. False: each job started from then on waits in a heartbeating watch "
        "activity of its own, batched per worker process, and sends its own records, as before 0.4. Fixed per "
        "job when it starts: a running job keeps the way it began with.",
    )
    sweep_interval: Duration | None = Field(
        timedelta(seconds=60),
        gt=timedelta(0),
        description="How often the poller lists, in one scheduler query per cluster, the live jobs that carry "
        "this provider's marker of a workflow and every live job of a tenant's account, and looks for those no "
        "workflow names: the duplicate of a submit whose request the scheduler completed after the retry had "
        "checked, a job whose workflow has closed while its chain job is settled (docs/reliability.md), or a job a "
        "tenant submitted itself, which carries no valid marker (docs/operations.md). Each round also reads, in one "
        "query, the tenants' accounts' jobs that ended since the previous round began and reports those that ran unseen "
        "(unowned_job_found, ended: true). Null: no sweep. SLURM and "
        "MOAB (the others cannot list their jobs).",
    )
    sweep_lookback: Duration = Field(
        timedelta(hours=24),
        gt=timedelta(0),
        description="How far back a poller's first sweep round reads accounting for jobs of the tenants' "
        "accounts that ran and ended unseen (before this poller started, while no poller swept): back to the "
        "last round this host's pollers made (kept in the state directory), but never further than this; this "
        "far when no such round is kept (a first start, a takeover on another host).",
    )
    unowned_jobs: Literal["cancel", "report"] = Field(
        "cancel",
        description="What the sweep does with a job no workflow names: cancel it (audit duplicate_job_cancelled "
        "or unowned_job_cancelled), or only report it (audit unowned_job_found, once) and leave it running.",
    )
    enable_state_recovery: bool = Field(
        True, description="Kept for compatibility: recovery always comes from Temporal's workflow history."
    )
    vanished_job_grace: Duration = Field(
        timedelta(minutes=2),
        description="How long a job may be missing from both queue and accounting before it is failed as vanished "
        "(accounting lags the queue by seconds).",
    )
    state_store_path: Path = Field(
        Path("/var/lib/virtengine/hpc-state"),
        description="Local state (LocalLedger file, local adapter jobs).",
    )
    continue_as_new_after_events: int = Field(
        5000,
        ge=200,
        le=9000,
        description="A job's workflow starts a fresh run (continue-as-new, state carried) once its history "
        "holds this many events, or earlier when Temporal suggests it (4,096 events on a default server). "
        "Keeps every run well below Temporal's 10,240-event warning, whatever the job's duration.",
    )


class UsageReportingConfig(Section):
    """Signed usage records and final accounting (seed: ``hpc.usage_reporting``)."""

    enabled: bool = Field(
        True, description="Emit signed usage records while jobs run and final accounting when they end."
    )
    report_interval: Duration = Field(timedelta(minutes=5), description="Period of signed usage records.")
    batch_size: int = Field(50, ge=1, le=10_000, description="Usage records per chain submission.")
    retry_on_failure: bool = Field(
        True, description="Retry failed usage submissions (records are never dropped)."
    )


class RetryConfig(Section):
    """Retry policy of the job workflow's activities (scheduler and chain calls)."""

    max_retries: int = Field(
        3,
        ge=0,
        le=100,
        description="Retries of a failed activity (scheduler or chain call) before the error is final.",
    )
    initial_backoff: Duration = Field(timedelta(seconds=1), description="Wait before the first retry.")
    max_backoff: Duration = Field(timedelta(seconds=30), description="Longest wait between two retries.")
    backoff_multiplier: float = Field(
        2.0, ge=1.0, le=10.0, description="Each wait is the previous one times this, up to max_backoff."
    )


class AuditConfig(Section):
    """The append-only, hash-chained audit log and which event categories it records."""

    enabled: bool = Field(True, description="Write the hash-chained audit log; false writes nothing at all.")
    log_path: Path = Field(
        Path("/var/log/virtengine/hpc-audit.log"),
        description="The audit log file (JSON lines); its directory is created.",
    )
    log_job_events: bool = Field(
        True,
        description="Record job events (submitted, lifecycle, validation and submission failures, status).",
    )
    log_security_events: bool = Field(
        True,
        description="Record security, routing and node events (routing violations, bad signatures, rejected heartbeats).",
    )
    log_usage_reports: bool = Field(True, description="Record usage, accounting and settlement events.")


class SlurmConfig(Section):
    """SLURM: transports cli (local commands), ssh, rest (slurmrestd + JWT) or pyslurm."""

    cluster_name: str = Field(
        "virtengine-hpc",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="The SLURM cluster name (ClusterName in slurm.conf).",
    )
    controller_host: str = Field(
        "localhost",
        pattern=r"^[A-Za-z0-9_.:-]{1,253}$",
        description="Host of slurmctld (and of slurmrestd unless rest_url says otherwise).",
    )
    controller_port: int = Field(6817, ge=1, le=65535, description="slurmctld port.")
    auth_method: Literal["munge", "jwt"] = Field(
        "munge",
        description="munge (commands run as a munge-authenticated user) or jwt (slurmrestd with the token from SLURM_JWT_TOKEN).",
    )
    transport: Literal["cli", "ssh", "rest", "pyslurm"] | None = Field(
        None,
        description="cli (local commands), ssh (commands over SSH), rest (slurmrestd), pyslurm. "
        "Default: rest for jwt auth, cli for munge.",
    )
    default_partition: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Partition for jobs that name none."
    )
    job_poll_interval: Duration = Field(
        timedelta(seconds=10),
        description="How often the status of all of the cluster's active jobs is fetched (one query per interval).",
    )
    connection_timeout: Duration = Field(
        timedelta(seconds=30), description="Longest wait for one scheduler command or request."
    )
    max_retries: int = Field(
        3, ge=0, le=100, description="Retries of a transient scheduler failure inside one adapter call."
    )
    slurm_conf: Path | None = Field(None, description="SLURM_CONF for the commands (cli transport).")
    rest_url: str | None = Field(
        None, description="slurmrestd base URL; default http://controller_host:6820."
    )
    rest_user: str | None = Field(
        None,
        pattern=_ACCOUNT,
        description="The provider's own Slurm account on slurmrestd (X-SLURM-USER-NAME of status, accounting and "
        "cancel requests); required for the rest transport, never root. With per-tenant accounts jobs are "
        "submitted as the tenant's account instead, which needs SLURM_JWT_TOKEN to be a token of SlurmUser "
        "(docs/security.md), and this account must be a Slurm operator to cancel them.",
    )
    api_version: str = Field(
        "v0.0.38", pattern=r"^v\d+\.\d+\.\d+$", description="slurmrestd API version in the URL path."
    )
    ssh_host: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:-]{1,253}$", description="Login host for the ssh transport."
    )
    ssh_port: int = Field(22, ge=1, le=65535, description="SSH port of ssh_host.")
    ssh_user: str | None = Field(
        None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="Account on ssh_host that submits the jobs."
    )
    ssh_key_path: Path | None = Field(None, description="Private key file for ssh_user (never a password).")
    known_hosts_path: Path | None = Field(
        None, description="known_hosts file used to check the host key; default ~/.ssh/known_hosts."
    )
    tenant_key_dir: Path | None = Field(
        None,
        description="ssh transport with per-tenant accounts: directory holding one private key per tenant "
        "account, named after the account (<dir>/<account>); jobs are submitted by logging in as the tenant's "
        "account with its key (host key checked as for ssh_user).",
    )
    switch_user: Literal["runuser", "setpriv", "sudo"] = Field(
        "runuser",
        description="cli transport with per-tenant accounts: how the worker runs sbatch as the tenant's account "
        "(argv, no shell). runuser and setpriv need the worker to run as root; sudo needs a sudoers rule letting "
        "the worker's account run sbatch as each tenant account without a password (docs/security.md).",
    )
    remote_env: dict[str, str] = Field(default_factory=dict, description="Environment for remote commands.")
    work_dir: Path | None = Field(
        None,
        description="Default working directory of jobs on the cluster. With per-tenant accounts each job runs in "
        "<work_dir>/<account>, which must be the account's own directory, mode 0700, not a symbolic link; "
        "work_dir itself (given by its real path) must be owned by root or the provider's account and writable "
        "by no one else. Checked before every submission over cli and ssh (a root cli worker makes a missing "
        "<work_dir>/<account>; elsewhere the operator does); a job whose directory fails the check is refused "
        "(code work_dir_unsafe). Required by the rest transport.",
    )
    account: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Slurm account jobs are charged to (--account)."
    )
    qos: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Slurm QOS of jobs (--qos).")
    accounting_lookback: Duration = Field(
        timedelta(days=30),
        description="How far back accounting (sacct, slurmdbd) is searched for a job or a workflow's job.",
    )
    accounting_grace: Duration = Field(
        timedelta(seconds=60),
        description="How long a job the controller reports ended waits for accounting (its exit code) before "
        "its end is reported without it.",
    )

    @field_validator("rest_user")
    @classmethod
    def _rest_user_not_root(cls, value: str | None) -> str | None:
        if value == "root":
            raise ValueError(
                "root is refused: name the provider's own unprivileged Slurm account (a Slurm operator)"
            )
        return value


class MoabConfig(Section):
    """MOAB: commands over SSH or MOAB Web Services."""

    server: str = Field(
        "localhost", pattern=r"^[A-Za-z0-9_.:-]{1,253}$", description="Host of the MOAB server."
    )
    port: int = Field(42559, ge=1, le=65535, description="MOAB server port.")
    transport: Literal["ssh", "rest"] = Field(
        "ssh", description="ssh (msub, checkjob, showq, mjobctl over SSH) or rest (MOAB Web Services)."
    )
    mws_url: str | None = Field(
        None,
        description="MOAB Web Services base URL (rest transport); credentials come from MOAB_USERNAME / MOAB_PASSWORD.",
    )
    ssh_host: str | None = Field(None, description="Login host for the ssh transport.")
    ssh_port: int = Field(22, ge=1, le=65535, description="SSH port of ssh_host.")
    ssh_user: str | None = Field(None, description="Account on ssh_host that submits the jobs.")
    ssh_key_path: Path | None = Field(None, description="Private key file for ssh_user (never a password).")
    known_hosts_path: Path | None = Field(
        None, description="known_hosts file used to check the host key; default ~/.ssh/known_hosts."
    )
    default_queue: str = Field(
        "batch", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Queue (class) for jobs that name none."
    )
    job_poll_interval: Duration = Field(
        timedelta(seconds=10),
        description="How often the status of all of the cluster's active jobs is fetched (one query per interval).",
    )
    connection_timeout: Duration = Field(
        timedelta(seconds=30), description="Longest wait for one scheduler command or request."
    )
    max_retries: int = Field(
        3, ge=0, le=100, description="Retries of a transient scheduler failure inside one adapter call."
    )
    bin_dir: Path | None = Field(
        None,
        description="Directory of the MOAB client commands on the login host (e.g. /opt/moab/bin); default: the "
        "commands are found on the SSH session's PATH.",
    )
    remote_env: dict[str, str] = Field(
        default_factory=dict, description="Environment for the remote commands (e.g. MOABHOMEDIR)."
    )
    work_dir: Path | None = Field(
        None,
        description="Default working directory of jobs on the cluster (msub -d). With per-tenant accounts each "
        "job runs in <work_dir>/<account>, which the operator makes the account's own, mode 0700; work_dir itself "
        "is owned by root or ssh_user and writable by no one else. Over ssh both are checked before every msub "
        "(code work_dir_unsafe when they are not so).",
    )
    account: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Account jobs are charged to (msub -A)."
    )
    mws_ca_cert: Path | None = Field(
        None,
        description="CA bundle that verifies the MOAB Web Services certificate (rest transport); default: the "
        "system's roots. Verification cannot be turned off.",
    )
    mws_job_user: str | None = Field(
        None,
        pattern=_ACCOUNT,
        description="Cluster user MWS submits the jobs as (credentials.user) when tenants are not isolated "
        "(hpc.tenants.isolation none); default: MOAB_USERNAME's own account. With per-tenant accounts each job "
        "names its tenant's account instead.",
    )
    tenant_key_dir: Path | None = Field(
        None,
        description="ssh transport with per-tenant accounts: directory holding one private key per tenant "
        "account, named after the account (<dir>/<account>); msub runs logged in as the tenant's account.",
    )


class OODConfig(Section):
    """Open OnDemand: OIDC client credentials, submission through the cluster's own scheduler."""

    @model_validator(mode="before")
    @classmethod
    def _user_mapping_moved(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "user_mapping" in data:
            raise ValueError(
                "user_mapping moved to hpc.tenants.accounts (the one mapping of tenants to cluster accounts, "
                "used by every scheduler): move its entries there"
            )
        return data

    dashboard_url: str | None = Field(None, description="Open OnDemand dashboard base URL.")
    oidc_token_url: str | None = Field(
        None,
        description="OIDC token endpoint for the client-credentials grant (secret from OOD_OIDC_CLIENT_SECRET).",
    )
    oidc_client_id: str | None = Field(None, description="OIDC client id (not a secret).")
    underlying_scheduler: Literal["slurm", "moab", "local"] = Field(
        "slurm", description="The scheduler OOD submits to on this cluster."
    )
    job_poll_interval: Duration = Field(
        timedelta(seconds=10),
        description="How often the status of all of the cluster's active jobs is fetched (one query per interval).",
    )
    connection_timeout: Duration = Field(timedelta(seconds=30), description="Longest wait for one request.")
    oidc_issuer: str | None = Field(
        None,
        description="The identity provider's issuer URL; tokens must carry it as iss. Its "
        "/.well-known/openid-configuration names the JWKS unless oidc_jwks_url is set.",
    )
    oidc_jwks_url: str | None = Field(
        None, description="JWKS URL of the identity provider; default: from the issuer's discovery document."
    )
    oidc_audience: str | None = Field(
        None, description="Audience tokens must be issued for (aud); default: oidc_client_id."
    )
    oidc_scope: str = Field(
        "openid",
        pattern=r"^[\x21\x23-\x5b\x5d-\x7e ]{1,512}$",
        description="Scope asked for in the token request.",
    )
    oidc_users_claim: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:/-]{1,128}$",
        description="Claim of the token listing the cluster users this client may submit as; when set, a mapped "
        "user the identity provider does not list is refused.",
    )
    ca_cert: Path | None = Field(
        None,
        description="CA bundle that verifies the identity provider's TLS certificate; default: the system's roots.",
    )


class LocalSchedulerConfig(Section):
    """The embedded local executor: runs batch scripts as process groups on this host."""

    allow_unisolated: bool = Field(
        False,
        description="Opt in to the local executor. It runs tenants' scripts on the worker's own host and is no "
        "multi-tenant sandbox (docs/security.md says what does and does not isolate its jobs): it is for demos, "
        "tests and single-tenant hosts. A worker that would run a local cluster without this refuses to start.",
    )
    state_dir: Path | None = Field(None, description="Default: <state_store_path>/local-jobs.")
    max_parallel_jobs: int = Field(
        64, ge=1, le=10_000, description="Jobs running at once; the rest wait in the local queue."
    )
    job_poll_interval: Duration = Field(
        timedelta(seconds=2), description="How often the status of all local jobs is read."
    )
    kill_wait: Duration = Field(
        timedelta(seconds=10),
        description="Grace between SIGTERM and SIGKILL when a job hits its walltime or is cancelled "
        "(SLURM's KillWait).",
    )
    max_walltime: Duration | None = Field(
        None,
        description="Upper bound on the walltime the local executor enforces: a job is stopped at "
        "min(its walltime, this). For demos and tests, where the model's 60 s minimum walltime is too long; "
        "leave unset in production.",
    )
    gpus: int | None = Field(
        None,
        ge=0,
        description="GPUs on this host that jobs may ask for; a job asking for more is refused. Default: the "
        "NVIDIA devices present (/dev/nvidia0, /dev/nvidia1, ...).",
    )


class TenantsConfig(Section):
    """Which cluster account runs each tenant's jobs (docs/security.md): one unprivileged account per tenant,
    never shared by two tenants, never root, never the provider's own submit account."""

    isolation: Literal["per_tenant", "none"] = Field(
        "per_tenant",
        description="per_tenant: every job runs as its tenant's account (accounts, else one from pool); a tenant "
        "with neither has its jobs refused. none: every job runs as the provider's submit account, so tenants "
        "can read and cancel each other's jobs; only for a single-tenant cluster or a demo, never with root.",
    )
    accounts: dict[str, str] = Field(
        default_factory=dict,
        description="Tenant address -> cluster account, fixed by the operator; wins over the pool. Two tenants "
        "never share an account.",
    )
    pool: list[str] = Field(
        default_factory=list,
        description="Accounts handed out to tenants that accounts does not name, one per tenant, in this order, "
        "on the tenant's first job; the assignment is kept for good in assignments_path, so it survives "
        "restarts and is the same on every worker that shares the file. A pool account the cluster shows jobs "
        "of that no assignment explains is never handed out (SLURM, MOAB).",
    )
    assignments_path: Path | None = Field(
        None,
        description="SQLite file of the pool's assignments; default <state_store_path>/tenant-accounts.db. "
        "Workers and pollers on several hosts must share it (storage with working locks) or use accounts alone; "
        "back it up with the ledger.",
    )

    @field_validator("accounts")
    @classmethod
    def _accounts_ok(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, account in value.items():
            if not ADDRESS_PATTERN.fullmatch(tenant):
                raise ValueError(f"{tenant[:80]!r} is not a tenant address")
            _check_tenant_account(account)
        shared = sorted({a for a in value.values() if list(value.values()).count(a) > 1})
        if shared:
            raise ValueError(
                f"account {shared[0]} is mapped to more than one tenant: tenants never share one"
            )
        return value

    @field_validator("pool")
    @classmethod
    def _pool_ok(cls, value: list[str]) -> list[str]:
        for account in value:
            _check_tenant_account(account)
        twice = sorted({a for a in value if value.count(a) > 1})
        if twice:
            raise ValueError(f"account {twice[0]} is in the pool more than once")
        return value

    @model_validator(mode="after")
    def _pool_apart_from_fixed(self) -> TenantsConfig:
        both = sorted(set(self.pool) & set(self.accounts.values()))
        if both:
            raise ValueError(
                f"account {both[0]} is both in pool and fixed for a tenant in accounts: the pool could hand it to "
                "another tenant"
            )
        return self


def _check_tenant_account(account: str) -> None:
    if not re.fullmatch(_ACCOUNT, account):
        raise ValueError(f"{account[:40]!r} is not a valid account name ({_ACCOUNT})")
    if account == "root":
        raise ValueError("root can never be a tenant's account: tenant jobs run unprivileged")
    if account in SERVICE_ACCOUNTS:
        raise ValueError(f"{account} can never be a tenant's account: {SERVICE_ACCOUNTS[account]}")


SchedulerType = Literal["slurm", "moab", "ood", "local"]
_CLUSTER_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class ClusterConfig(Section):
    """One of the provider's clusters in ``hpc.clusters``: its id, scheduler and whether this worker serves it.

    What an entry leaves out comes from the ``hpc`` section: ``scheduler_type``, and every key of ``slurm``,
    ``moab``, ``ood`` and ``local`` (an entry's section is merged key by key over the ``hpc`` one), so clusters
    that share most settings repeat only what differs. See docs/production.md.
    """

    cluster_id: str = Field(pattern=_CLUSTER_ID, description="The cluster's id on chain.")
    scheduler_type: SchedulerType | None = Field(
        None, description="Scheduler adapter of this cluster; default: hpc.scheduler_type."
    )
    serve: bool = Field(
        True,
        description="Run this cluster's task queue (<temporal.task_queue>.<cluster_id>) in this worker. false: "
        "workers on another host serve it; this one only routes jobs to it.",
    )
    slurm: SlurmConfig | None = Field(
        None, description="SLURM settings of this cluster, merged key by key over hpc.slurm."
    )
    moab: MoabConfig | None = Field(
        None, description="MOAB settings of this cluster, merged key by key over hpc.moab."
    )
    ood: OODConfig | None = Field(
        None, description="Open OnDemand settings of this cluster, merged key by key over hpc.ood."
    )
    local: LocalSchedulerConfig | None = Field(
        None,
        description="Local executor settings of this cluster, merged key by key over hpc.local; its state_dir "
        "defaults to <state_store_path>/local-jobs/<cluster_id>.",
    )


class HPCConfig(Section):
    """The seed's ``hpc:`` section: which cluster this worker serves and with which scheduler."""

    enabled: bool = Field(
        True,
        description="false: the poller takes no new jobs from the chain (they stay pending for another provider "
        "host or until it is switched back on); running jobs go on and tenant cancellations are still forwarded.",
    )
    scheduler_type: SchedulerType = Field(
        "local",
        description="Which scheduler adapter runs this cluster's jobs: slurm, moab, ood or local (the embedded "
        "executor, for demos and single-tenant hosts: it runs only with hpc.local.allow_unisolated).",
    )
    cluster_id: str = Field(
        "local-cluster",
        pattern=_CLUSTER_ID,
        description="This cluster's id on chain; the worker serves it and takes only its jobs. With hpc.clusters: "
        "the default cluster of commands that take --cluster (default: the first listed).",
    )
    job_service: JobServiceConfig = Field(default_factory=JobServiceConfig)
    usage_reporting: UsageReportingConfig = Field(default_factory=UsageReportingConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    moab: MoabConfig = Field(default_factory=MoabConfig)
    ood: OODConfig = Field(default_factory=OODConfig)
    local: LocalSchedulerConfig = Field(default_factory=LocalSchedulerConfig)
    tenants: TenantsConfig = Field(default_factory=TenantsConfig)
    clusters: list[ClusterConfig] = Field(
        default_factory=list,
        description="Several clusters per provider: one task queue per cluster, each with its own scheduler "
        "settings. Empty: the one cluster above (hpc.cluster_id with hpc.scheduler_type).",
    )

    @model_validator(mode="before")
    @classmethod
    def _clusters_inherit_the_hpc_sections(cls, data: Any) -> Any:
        """Merge each entry's scheduler sections over the ``hpc`` ones; the default cluster is the first."""
        if not isinstance(data, Mapping) or not isinstance(data.get("clusters"), list):
            return data
        clusters = []
        for entry in data["clusters"]:
            if isinstance(entry, Mapping):
                entry = dict(entry)
                for section in ("slurm", "moab", "ood", "local"):
                    base, own = data.get(section), entry.get(section)
                    if isinstance(base, Mapping) and isinstance(own, Mapping):
                        entry[section] = {**base, **own}
            clusters.append(entry)
        data = {**data, "clusters": clusters}
        if "cluster_id" not in data and clusters and isinstance(clusters[0], Mapping):
            first = clusters[0].get("cluster_id")
            if isinstance(first, str):
                data["cluster_id"] = first
        return data

    @model_validator(mode="after")
    def _clusters_are_unique(self) -> HPCConfig:
        ids = [c.cluster_id for c in self.clusters]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"hpc.clusters lists {', '.join(duplicates)} more than once")
        if ids and self.cluster_id not in ids:
            raise ValueError(
                f"hpc.cluster_id {self.cluster_id} is not one of hpc.clusters ({', '.join(ids)})"
            )
        return self

    @property
    def scheduler_poll_interval(self) -> timedelta:
        """The poll interval of the configured scheduler's section."""
        section = getattr(self, self.scheduler_type)
        interval: timedelta = section.job_poll_interval
        return interval


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


def package_version() -> str:
    """The installed virtengine-hpc package's version (pyproject.toml): the build id unless one is configured."""
    try:
        return importlib.metadata.version("virtengine-hpc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def default_build_id() -> str:
    """The build id a worker uses unless one is configured: the package version and a digest of the code that
    decides what a workflow does (``workflows/`` and the messages and states it carries), so two builds whose
    workflow code differs never share an id even when nobody bumped the version."""
    digest = hashlib.sha256()
    for path in _workflow_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{package_version()}+wf.{digest.hexdigest()[:12]}"


def _workflow_sources() -> list[Path]:
    here = Path(__file__).resolve().parent
    found = [here / "messages.py", here / "states.py", here / "models.py"]
    spec = importlib.util.find_spec("workflows")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found.extend(sorted(Path(location).glob("*.py")))
    return [path for path in found if path.is_file()]


class TemporalConfig(Section):
    """Where the workers find Temporal. An API key, if any, comes from the variable named in api_key_env."""

    address: str = Field("127.0.0.1:7233", description="Temporal frontend host:port.")
    namespace: str = Field("default", description="Temporal namespace.")
    task_queue: str = Field(
        "virtengine-hpc",
        pattern=r"^[A-Za-z0-9._-]{1,200}$",
        description="Prefix of the task queues; the worker of a cluster polls <task_queue>.<cluster_id>.",
    )
    tls: bool = Field(False, description="Connect with TLS (implied by tls_client_cert).")
    tls_server_ca_cert: Path | None = Field(
        None, description="CA certificate (PEM) that signed the server's certificate."
    )
    tls_client_cert: Path | None = Field(None, description="Client certificate (PEM) for mutual TLS.")
    tls_client_key: Path | None = Field(None, description="Private key (PEM file) of tls_client_cert.")
    tls_server_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]{1,253}$",
        description="Name the server's certificate is checked against (and TLS SNI), when it differs from the "
        "host in address.",
    )
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="Name of the environment variable holding an API key (Temporal Cloud); the key is sent "
        "only over TLS, which it turns on.",
    )
    graceful_shutdown_timeout: Duration = Field(
        timedelta(seconds=10),
        description="On SIGTERM, how long running activities may finish before they are cancelled and handed "
        "to another worker (systemd's TimeoutStopSec must be longer).",
    )
    deployment_name: str | None = Field(
        "virtengine-hpc",
        pattern=r"^[A-Za-z0-9_-]{1,200}$",  # Temporal refuses a '.' in a deployment name
        description="Worker Deployment the workers belong to (worker versioning, docs/deploys.md): each build is "
        "a version of it, a job stays on the build that started it and moves to the current build at its next "
        "continue-as-new. null: unversioned workers (upgrades then rely on patching alone).",
    )
    build_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._+-]{1,200}$",
        description="This build's id: its version in the Worker Deployment, and a label of its metrics, logs and "
        "audit records. Unset: the installed virtengine-hpc package's version and a digest of its workflow code "
        "(<version>+wf.<12 hex>), so builds whose workflow code differs never share an id. Set it only to ids "
        "that keep that rule.",
    )
    promote_first_build: bool = Field(
        True,
        description="When the Worker Deployment has no current version yet (a first install), a starting worker "
        "makes its own build current, so jobs run at once. Every later build is made current by the operator "
        "(docs/deploys.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _build_id_from_the_package(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("build_id") is None:
            return {**data, "build_id": default_build_id()}
        return data

    @model_validator(mode="after")
    def _client_cert_needs_key(self) -> TemporalConfig:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("temporal.tls_client_cert and temporal.tls_client_key go together (mutual TLS)")
        return self

    @property
    def uses_tls(self) -> bool:
        """TLS is on when asked for, with a client certificate or CA, or with an API key (never sent in clear)."""
        return bool(
            self.tls
            or self.tls_client_cert
            or self.tls_server_ca_cert
            or self.tls_server_name
            or self.api_key_env
        )


class MetricsConfig(Section):
    """The worker's HTTP endpoint: Prometheus ``/metrics`` and the ``/healthz`` and ``/readyz`` probes."""

    listen: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:\[\]-]{1,253}:[0-9]{1,5}$",
        description="host:port of the endpoint (e.g. 127.0.0.1:9464); unset: no endpoint. Each process "
        "(worker, poller) needs its own port.",
    )
    sdk_metrics: bool = Field(
        True, description="Include the Temporal SDK's own metrics (temporal_*: polls, task latencies, slots)."
    )
    jobs_refresh_interval: Duration = Field(
        timedelta(seconds=30),
        description="How often the jobs-by-state gauge is read from Temporal's visibility store; 0s: never.",
    )
    readiness_timeout: Duration = Field(
        timedelta(seconds=5), description="Longest wait for Temporal's health check behind /readyz."
    )


class LoggingConfig(Section):
    """How the long-running processes log (docs/production.md)."""

    format: Literal["text", "json"] = Field(
        "text",
        description="text (one readable line) or json (one object per line with job_id, workflow_id, "
        "activity, cluster_id for log collectors).",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None = Field(
        None, description="Log level; unset: the command line's --log-level (INFO)."
    )


class TracingConfig(Section):
    """OpenTelemetry tracing of workflows and activities through the Temporal SDK's interceptor (optional)."""

    enabled: bool = Field(
        False, description="Trace workflow starts, workflows and activities (needs the tracing extra)."
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces); unset: the process's "
        "global tracer provider (e.g. from opentelemetry-instrument).",
    )
    service_name: str = Field(
        "virtengine-hpc", pattern=r"^[A-Za-z0-9._-]{1,100}$", description="service.name of the spans."
    )


class ChainConfig(Section):
    """The chain client."""

    type: Literal["local"] = Field(
        "local", description="Chain client: local (the embedded LocalLedger, docs/ledger.md)."
    )
    ledger_path: Path | None = Field(
        None, description="LocalLedger SQLite file; default <state_store_path>/ledger.db"
    )
    seconds_per_block: float = Field(
        6.0, gt=0, description="Block time of a new LocalLedger file (an existing file keeps its own)."
    )


class ProviderConfig(Section):
    """Who this provider is on chain."""

    address: str = Field(
        "virtengine1provider0local",
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="The provider's account on chain; only its jobs are taken.",
    )


class NodesConfig(Section):
    """The provider's node API and the node lifecycle (``docs/node-agent.md``)."""

    listen_host: str = Field(
        "127.0.0.1", pattern=r"^[A-Za-z0-9_.:-]{1,253}$", description="Node API bind address."
    )
    listen_port: int = Field(8081, ge=1, le=65535, description="Node API port.")
    stale_after: Duration = Field(
        timedelta(seconds=120), description="Silence after which an active node becomes stale (drained)."
    )
    offline_after: Duration = Field(
        timedelta(seconds=300), description="Silence after which a node becomes offline."
    )
    max_clock_skew: Duration = Field(
        timedelta(seconds=60), description="How far a heartbeat's timestamp may be from the provider's clock."
    )
    metadata_interval: Duration = Field(
        timedelta(minutes=5),
        description="At most one metadata update per node per interval (plus state changes).",
    )
    drain_poll_interval: Duration = Field(
        timedelta(seconds=30), description="How often a draining node is checked for running jobs."
    )
    audit_rate_window: Duration = Field(
        timedelta(seconds=10),
        description="Rejected registrations and heartbeats are audited once per window for each sender address "
        "(IPv6: its /64) and reason, with a count of those left out.",
    )
    max_body_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024, description="Largest accepted request.")
    tls_cert_file: Path | None = Field(
        None,
        description="Server certificate (PEM, any intermediates after it): the node API serves HTTPS. Needs "
        "tls_key_file; unset: plain HTTP. Both files are read when the API starts.",
    )
    tls_key_file: Path | None = Field(
        None,
        description="Private key (PEM, unencrypted) of tls_cert_file; refused if others (world) can read it.",
    )
    tls_client_ca_file: Path | None = Field(
        None,
        description="CA bundle (PEM): when set, every client must present a certificate signed by it (mutual "
        "TLS). Needs tls_cert_file and tls_key_file.",
    )

    @model_validator(mode="after")
    def _offline_after_stale(self) -> NodesConfig:
        if self.offline_after <= self.stale_after:
            raise ValueError("nodes.offline_after must be longer than nodes.stale_after")
        return self

    @model_validator(mode="after")
    def _tls_files(self) -> NodesConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "nodes.tls_cert_file and nodes.tls_key_file go together (HTTPS needs the certificate and its key)"
            )
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "nodes.tls_client_ca_file (mutual TLS) needs nodes.tls_cert_file and nodes.tls_key_file: "
                "the node API must serve HTTPS to ask for client certificates"
            )
        return self

    @property
    def tls(self) -> Literal["off", "tls", "mutual"]:
        """``off`` (plain HTTP), ``tls`` (HTTPS) or ``mutual`` (HTTPS, client certificates required)."""
        if self.tls_cert_file is None:
            return "off"
        return "mutual" if self.tls_client_ca_file is not None else "tls"


class Config(Section):
    """The whole configuration file."""

    hpc: HPCConfig = Field(default_factory=HPCConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    temporal: TemporalConfig = Field(default_factory=TemporalConfig)
    chain: ChainConfig = Field(default_factory=ChainConfig)
    provider: ProviderConfig = Field(default_factory=ProviderConfig)
    nodes: NodesConfig = Field(default_factory=NodesConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @model_validator(mode="after")
    def _jwt_needs_rest(self) -> Config:
        for where, slurm in self._sections("slurm"):
            assert isinstance(slurm, SlurmConfig)
            if slurm.auth_method == "jwt" and slurm.transport not in (None, "rest"):
                raise ValueError(f"{where}.auth_method jwt works only with transport rest (slurmrestd)")
        return self

    @model_validator(mode="after")
    def _submit_accounts_are_not_tenants(self) -> Config:
        """The provider's own accounts (SSH login, slurmrestd user, MWS job user) never run a tenant's job."""
        tenants = set(self.hpc.tenants.pool) | set(self.hpc.tenants.accounts.values())
        for name in ("slurm", "moab"):
            for where, section in self._sections(name):
                for key in ("ssh_user", "rest_user", "mws_job_user"):
                    user = getattr(section, key, None)
                    if user is not None and user in tenants:
                        raise ValueError(
                            f"{where}.{key} {user} is also a tenant account in hpc.tenants: the provider's own "
                            "account must never run a tenant's job"
                        )
        return self

    def _sections(self, name: str) -> list[tuple[str, Section]]:
        found: list[tuple[str, Section]] = [(f"hpc.{name}", getattr(self.hpc, name))]
        for i, cluster in enumerate(self.hpc.clusters):
            own = getattr(cluster, name)
            if own is not None:
                found.append((f"hpc.clusters[{i}].{name}", own))
        return found

    # ---- several clusters -------------------------------------------------------------------------------------

    def cluster_ids(self) -> list[str]:
        """Every cluster of the provider this config knows (each has a task queue), served here or elsewhere."""
        return [c.cluster_id for c in self.hpc.clusters] or [self.hpc.cluster_id]

    def served_cluster_ids(self) -> list[str]:
        """The clusters whose task queues this worker runs."""
        if not self.hpc.clusters:
            return [self.hpc.cluster_id]
        return [c.cluster_id for c in self.hpc.clusters if c.serve]

    def for_cluster(self, cluster_id: str) -> Config:
        """This config as a single-cluster one for ``cluster_id``: ``hpc.cluster_id``, ``hpc.scheduler_type`` and
        the scheduler sections are that cluster's, so adapters and pollers read ``hpc.*`` unchanged.

        A single-cluster config answers for any id with its own sections (one worker may serve an extra cluster
        id with the same scheduler); a multi-cluster config refuses an id it does not list.
        """
        hpc = self.hpc
        if not hpc.clusters:
            if cluster_id == hpc.cluster_id:
                return self
            return self.model_copy(update={"hpc": hpc.model_copy(update={"cluster_id": cluster_id})})
        entry = next((c for c in hpc.clusters if c.cluster_id == cluster_id), None)
        if entry is None:
            raise ConfigError(
                f"cluster {cluster_id} is not in hpc.clusters ({', '.join(self.cluster_ids())})"
            )
        local = entry.local or hpc.local
        if local.state_dir is None:
            # Two local executors on one host must not share a job directory.
            local = local.model_copy(update={"state_dir": self.state_dir / "local-jobs" / cluster_id})
        update: dict[str, Any] = {
            "cluster_id": cluster_id,
            "scheduler_type": entry.scheduler_type or hpc.scheduler_type,
            "slurm": entry.slurm or hpc.slurm,
            "moab": entry.moab or hpc.moab,
            "ood": entry.ood or hpc.ood,
            "local": local,
        }
        return self.model_copy(update={"hpc": hpc.model_copy(update=update)})

    @property
    def state_dir(self) -> Path:
        return self.hpc.job_service.state_store_path

    @property
    def ledger_path(self) -> Path:
        return self.chain.ledger_path or self.state_dir / "ledger.db"

    @property
    def local_state_dir(self) -> Path:
        return self.hpc.local.state_dir or self.state_dir / "local-jobs"


class Secrets(BaseModel):
    """Credentials, read only from the environment. ``SecretStr`` keeps them out of reprs and logs."""

    model_config = ConfigDict(frozen=True)

    slurm_jwt_token: SecretStr | None = None
    moab_username: str | None = None
    moab_password: SecretStr | None = None
    ood_oidc_client_secret: SecretStr | None = None
    provider_signing_key_path: Path | None = None
    marker_secret: SecretStr | None = None
    """Keys the adoption markers of scheduler jobs (``virtengine_hpc.markers``); default: derived from the
    provider's signing key."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Secrets:
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value else None

        key_path = get("PROVIDER_SIGNING_KEY_PATH")
        return cls(
            slurm_jwt_token=SecretStr(v) if (v := get("SLURM_JWT_TOKEN")) else None,
            moab_username=get("MOAB_USERNAME"),
            moab_password=SecretStr(v) if (v := get("MOAB_PASSWORD")) else None,
            ood_oidc_client_secret=SecretStr(v) if (v := get("OOD_OIDC_CLIENT_SECRET")) else None,
            provider_signing_key_path=Path(key_path) if key_path else None,
            marker_secret=SecretStr(v) if (v := get("PROVIDER_MARKER_SECRET")) else None,
        )


SECRET_ENV_VARS = (
    "SLURM_JWT_TOKEN",
    "MOAB_USERNAME",
    "MOAB_PASSWORD",
    "OOD_OIDC_CLIENT_SECRET",
    "PROVIDER_SIGNING_KEY_PATH",
    "PROVIDER_MARKER_SECRET",
)


def _refuse_secrets(data: Any, path: str = "") -> None:
    """Refuse a credential-like key at any depth (inside lists too); the message names the key, never the value."""
    if isinstance(data, Mapping):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SECRET_KEY.search(key) and key not in _ALLOWED_SECRETISH:
                raise ConfigError(
                    f"{where}: credentials are not allowed in the configuration; set them in the environment "
                    f"({', '.join(SECRET_ENV_VARS)})"
                )
            _refuse_secrets(value, where)
    elif isinstance(data, list | tuple):
        for index, item in enumerate(data):
            _refuse_secrets(item, f"{path}[{index}]")


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with another override")
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"{name}: conflicts with another override")
        node[parts[-1]] = _env_value(raw)
    return tree


def _env_value(raw: str) -> Any:
    """An override's value: YAML for mappings, lists, null and quoted strings; any other scalar stays text.

    YAML would read ``0123`` as the number 83, ``no`` as false and ``1:30`` as 90; handing such scalars over as
    text lets the key's own type decide (``0123`` stays a cluster id, becomes 123 for a number), exactly as
    pydantic converts them.
    """
    if not raw.strip():
        return ""
    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError, ValueError):  # ValueError: an integer past int()'s digit limit
        return raw
    if value is None or isinstance(value, str | dict | list):
        return value
    return raw.strip()


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _empty_sections_as_defaults(data: Any, model: type[BaseModel]) -> Any:
    """A section whose keys are all commented out (``routing:`` and nothing under it) is YAML null: read it as
    an empty section with every default, not as a type error."""
    if not isinstance(data, Mapping):
        return data
    out: dict[Any, Any] = {}
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        sub = field.annotation if field is not None else None
        if isinstance(sub, type) and issubclass(sub, Section):
            if value is None:
                continue
            value = _empty_sections_as_defaults(value, sub)
        out[key] = value
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return type(exc).__name__


def check_config_size(data: Any, where: str) -> None:
    """Refuse a tree with more than ``MAX_CONFIG_VALUES`` values or deeper than ``MAX_CONFIG_DEPTH``, counting
    each alias every time it is reached: what every later walk of the tree would have to visit. Iterative, so
    the check itself cannot exhaust the stack."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{where} holds more than {MAX_CONFIG_VALUES:,} values once YAML aliases are expanded; "
                "a configuration is never that large"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(node, Mapping):
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list | tuple):
            stack.extend((value, depth + 1) for value in node)


def _format_errors(err: PydanticValidationError) -> str:
    lines = []
    errors = err.errors()
    for item in errors[:MAX_ERRORS_SHOWN]:
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling against docs/configuration.md)"
        lines.append(f"{where}: {msg}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "invalid configuration: " + "; ".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    data: Mapping[str, Any] | None = None,
) -> Config:
    """Load the YAML file at ``path`` (or ``data``), apply environment overrides, validate.

    Raises ``ConfigError`` naming every bad key.
    """
    env = os.environ if env is None else env
    raw: Any = dict(data) if data is not None else {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from exc
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            # Not str(exc): PyYAML quotes the offending line, which may hold a credential.
            raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} is nested too deeply to read") from None
        except ValueError as exc:  # PyYAML's int(): a number past Python's 4,300-digit limit
            raise ConfigError(f"config file {path} holds a value that cannot be read: {exc}"[:300]) from None
        if raw is None:  # an empty file (or only comments): every default
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    check_config_size(raw, f"config file {path}" if path is not None else "the configuration")
    _refuse_secrets(raw)
    overrides = _env_overrides(env)
    check_config_size(overrides, "the VIRTENGINE_HPC__* environment overrides")
    _refuse_secrets(overrides)
    merged = _empty_sections_as_defaults(_merge(dict(raw), overrides), Config)
    try:
        return Config.model_validate(merged)
    except PydanticValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
