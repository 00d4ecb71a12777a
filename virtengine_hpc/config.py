"""Typed configuration: the seed's ``hpc:`` and ``routing:`` sections plus ``temporal:``, ``chain:`` and ``provider:``.

One YAML file, overridden by environment variables ``VIRTENGINE_HPC__SECTION__KEY`` (``__`` nests; values parse as
YAML scalars), validated into frozen pydantic models. Durations are written ``500ms``, ``15s``, ``5m``, ``24h``,
``1h30m`` or as plain seconds. Errors name the bad key and say why.

Credentials never come from the file (DESIGN.md invariant 8): they are read only from ``SLURM_JWT_TOKEN``,
``MOAB_USERNAME``, ``MOAB_PASSWORD``, ``OOD_OIDC_CLIENT_SECRET`` and ``PROVIDER_SIGNING_KEY_PATH``, and a file that holds
a credential-like key is refused. Only worker-side code reads configuration; workflows get what they need in their
input.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, model_validator
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.errors import ConfigError

ENV_PREFIX = "VIRTENGINE_HPC__"
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# Keys that look like credentials; a config file holding one is refused.
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api_key|apikey|private_key|credential)", re.I)
_ALLOWED_SECRETISH = {"token_file_env", "signing_key_path_env", "api_key_env"}


def parse_duration(value: Any) -> timedelta:
    """Parse ``15s``, ``5m``, ``24h``, ``1h30m``, ``500ms``, a number of seconds, or a ``timedelta``."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("a duration must be like 15s, 5m or 24h, not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration must not be negative")
        return timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip().lower()
        if re.fullmatch(r"\d+(\.\d+)?", text):
            return timedelta(seconds=float(text))
        pos, total = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos == len(text) and pos > 0:
            return timedelta(seconds=total)
    raise ValueError(f"invalid duration {value!r} (use e.g. 500ms, 15s, 5m, 24h or 1h30m)")


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobServiceConfig(Section):
    job_poll_interval: Duration = Field(timedelta(seconds=15), description="How often the chain is polled.")
    job_timeout_default: Duration = Field(
        timedelta(hours=24), description="Longest a job may take end to end when its own walltime is unknown."
    )
    max_concurrent_jobs: int = Field(
        100, ge=1, le=100_000, description="Jobs in flight at once; the rest wait."
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


class UsageReportingConfig(Section):
    enabled: bool = True
    report_interval: Duration = Field(timedelta(minutes=5), description="Period of signed usage records.")
    batch_size: int = Field(50, ge=1, le=10_000, description="Usage records per chain submission.")
    retry_on_failure: bool = Field(
        True, description="Retry failed usage submissions (records are never dropped)."
    )


class RetryConfig(Section):
    max_retries: int = Field(3, ge=0, le=100)
    initial_backoff: Duration = timedelta(seconds=1)
    max_backoff: Duration = timedelta(seconds=30)
    backoff_multiplier: float = Field(2.0, ge=1.0, le=10.0)


class AuditConfig(Section):
    enabled: bool = True
    log_path: Path = Path("/var/log/virtengine/hpc-audit.log")
    log_job_events: bool = True
    log_security_events: bool = True
    log_usage_reports: bool = True


class SlurmConfig(Section):
    cluster_name: str = Field("virtengine-hpc", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    controller_host: str = Field("localhost", pattern=r"^[A-Za-z0-9_.:-]{1,253}$")
    controller_port: int = Field(6817, ge=1, le=65535)
    auth_method: Literal["munge", "jwt"] = "munge"
    transport: Literal["cli", "ssh", "rest", "pyslurm"] | None = Field(
        None,
        description="cli (local commands), ssh (commands over SSH), rest (slurmrestd), pyslurm. "
        "Default: rest for jwt auth, cli for munge.",
    )
    default_partition: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    job_poll_interval: Duration = timedelta(seconds=10)
    connection_timeout: Duration = timedelta(seconds=30)
    max_retries: int = Field(3, ge=0, le=100)
    slurm_conf: Path | None = Field(None, description="SLURM_CONF for the commands (cli transport).")
    rest_url: str | None = Field(
        None, description="slurmrestd base URL; default http://controller_host:6820."
    )
    rest_user: str = Field("root", pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="X-SLURM-USER-NAME.")
    api_version: str = Field("v0.0.38", pattern=r"^v\d+\.\d+\.\d+$")
    ssh_host: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,253}$")
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_user: str | None = Field(None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    ssh_key_path: Path | None = None
    known_hosts_path: Path | None = None
    remote_env: dict[str, str] = Field(default_factory=dict, description="Environment for remote commands.")
    work_dir: Path | None = Field(None, description="Default working directory of jobs on the cluster.")


class MoabConfig(Section):
    server: str = Field("localhost", pattern=r"^[A-Za-z0-9_.:-]{1,253}$")
    port: int = Field(42559, ge=1, le=65535)
    transport: Literal["ssh", "rest"] = "ssh"
    mws_url: str | None = None
    ssh_host: str | None = None
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_user: str | None = None
    ssh_key_path: Path | None = None
    known_hosts_path: Path | None = None
    default_queue: str = Field("batch", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    job_poll_interval: Duration = timedelta(seconds=10)
    connection_timeout: Duration = timedelta(seconds=30)
    max_retries: int = Field(3, ge=0, le=100)


class OODConfig(Section):
    dashboard_url: str | None = None
    oidc_token_url: str | None = None
    oidc_client_id: str | None = None
    underlying_scheduler: Literal["slurm", "moab", "local"] = "slurm"
    user_mapping: dict[str, str] = Field(default_factory=dict, description="Tenant address -> cluster user.")
    job_poll_interval: Duration = timedelta(seconds=10)
    connection_timeout: Duration = timedelta(seconds=30)


class LocalSchedulerConfig(Section):
    """The embedded local executor: runs batch scripts as process groups on this host."""

    state_dir: Path | None = Field(None, description="Default: <state_store_path>/local-jobs.")
    max_parallel_jobs: int = Field(64, ge=1, le=10_000)
    job_poll_interval: Duration = timedelta(seconds=2)
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


class HPCConfig(Section):
    enabled: bool = True
    scheduler_type: Literal["slurm", "moab", "ood", "local"] = "local"
    cluster_id: str = Field("local-cluster", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    job_service: JobServiceConfig = Field(default_factory=JobServiceConfig)
    usage_reporting: UsageReportingConfig = Field(default_factory=UsageReportingConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    moab: MoabConfig = Field(default_factory=MoabConfig)
    ood: OODConfig = Field(default_factory=OODConfig)
    local: LocalSchedulerConfig = Field(default_factory=LocalSchedulerConfig)

    @property
    def scheduler_poll_interval(self) -> timedelta:
        """The poll interval of the configured scheduler's section."""
        section = getattr(self, self.scheduler_type)
        interval: timedelta = section.job_poll_interval
        return interval


class RoutingConfig(Section):
    enforcement_mode: Literal["strict", "permissive", "audit_only"] = "strict"
    require_decision_for_submission: bool = True
    allow_automatic_fallback: bool = False
    decision_max_age_blocks: int = Field(100, ge=1)
    decision_max_age: Duration = timedelta(seconds=600)


class TemporalConfig(Section):
    address: str = "127.0.0.1:7233"
    namespace: str = "default"
    task_queue: str = Field("virtengine-hpc", pattern=r"^[A-Za-z0-9._-]{1,200}$")
    tls: bool = False
    tls_server_ca_cert: Path | None = None
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None
    api_key_env: str | None = Field(None, description="Name of the environment variable holding an API key.")


class ChainConfig(Section):
    type: Literal["local"] = "local"
    ledger_path: Path | None = Field(
        None, description="LocalLedger SQLite file; default <state_store_path>/ledger.db"
    )
    seconds_per_block: float = Field(6.0, gt=0)


class ProviderConfig(Section):
    address: str = Field("virtengine1provider0local", pattern=r"^[A-Za-z0-9_.-]{1,128}$")


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
        description="Repeated identical rejections (same node, same reason) are audited once per window.",
    )
    max_body_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024, description="Largest accepted request.")

    @model_validator(mode="after")
    def _offline_after_stale(self) -> NodesConfig:
        if self.offline_after <= self.stale_after:
            raise ValueError("nodes.offline_after must be longer than nodes.stale_after")
        return self


class Config(Section):
    hpc: HPCConfig = Field(default_factory=HPCConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    temporal: TemporalConfig = Field(default_factory=TemporalConfig)
    chain: ChainConfig = Field(default_factory=ChainConfig)
    provider: ProviderConfig = Field(default_factory=ProviderConfig)
    nodes: NodesConfig = Field(default_factory=NodesConfig)

    @model_validator(mode="after")
    def _jwt_needs_rest(self) -> Config:
        slurm = self.hpc.slurm
        if slurm.auth_method == "jwt" and slurm.transport not in (None, "rest"):
            raise ValueError("hpc.slurm.auth_method jwt works only with transport rest (slurmrestd)")
        return self

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
        )


def _refuse_secrets(data: Any, path: str = "") -> None:
    if isinstance(data, Mapping):
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SECRET_KEY.search(key) and key not in _ALLOWED_SECRETISH:
                raise ConfigError(
                    f"{where}: credentials are not allowed in the config file; set them in the environment "
                    "(SLURM_JWT_TOKEN, MOAB_USERNAME, MOAB_PASSWORD, OOD_OIDC_CLIENT_SECRET, "
                    "PROVIDER_SIGNING_KEY_PATH)"
                )
            _refuse_secrets(value, where)


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
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _format_errors(err: PydanticValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling against docs/configuration.md)"
        lines.append(f"{where}: {msg}")
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
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
        _refuse_secrets(raw)
    merged = _merge(dict(raw), _env_overrides(env))
    try:
        return Config.model_validate(merged)
    except PydanticValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
