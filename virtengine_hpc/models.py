"""Domain models: jobs, clusters, priced queues, scheduling decisions, usage records.

Every string a tenant controls is validated here against a strict pattern before anything else sees it
(invariant 9 in docs/architecture.md): identifiers, partitions, environment names, paths. Amounts and usage quantities are
``Decimal`` so that sums are exact (no float drift in settlement).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from virtengine_hpc.states import JobState

MAX_SCRIPT_BYTES = 1024 * 1024
MAX_ENV_VALUE = 4096
MAX_ENV_ENTRIES = 64
"""Environment variables a job may set (each name at most 128 characters, each value at most ``MAX_ENV_VALUE``)."""
MAX_TEMPLATE_PARAMETERS = 64
"""Template parameters a job may give (each string value at most ``MAX_ENV_VALUE`` characters)."""

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9._/-]{0,1023}$")
_ADDRESS_RE = re.compile(r"^[a-z0-9]{1,20}1[a-z0-9]{6,90}$|^[A-Za-z0-9_.-]{1,128}$")
# Environment names a tenant may not set: they would change how the scheduler or the loader treats the job.
_RESERVED_ENV = re.compile(
    r"^(SLURM_|SBATCH_|SALLOC_|SRUN_|PBS_|MOAB_|LD_|VIRTENGINE_)|^(PATH|IFS|BASH_ENV|ENV)$"
)


def _check(pattern: re.Pattern[str], what: str) -> Any:
    def validate(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{what} {value[:80]!r} must match {pattern.pattern}")
        return value

    return AfterValidator(validate)


Identifier = Annotated[str, _check(_ID_RE, "identifier")]
"""Chain ids (jobs, clusters, offerings, decisions, templates): letters, digits and ``._:-``, at most 128."""
Name = Annotated[str, _check(_NAME_RE, "name")]
"""Scheduler-facing names (partitions, queues, job classes, accounts): letters, digits, ``_.-``, at most 64."""
Address = Annotated[str, _check(_ADDRESS_RE, "address")]
"""A chain account address (bech32 such as ``virtengine1...``) or a local account name."""
AbsPath = Annotated[str, _check(_PATH_RE, "path")]


class Model(BaseModel):
    """Base of all models: unknown fields are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(Model):
    nodes: int = Field(1, ge=1, le=10_000, description="Number of nodes.")
    tasks_per_node: int = Field(1, ge=1, le=1024, description="MPI tasks (processes) per node.")
    cpus_per_task: int = Field(1, ge=1, le=1024, description="CPU cores per task.")
    memory_mb_per_node: int = Field(1024, ge=1, le=64 * 1024 * 1024, description="Memory per node in MiB.")
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node.")
    gpu_type: Name | None = Field(None, description="GPU model (gres type), e.g. a100.")
    storage_gb: int = Field(0, ge=0, le=10_000_000, description="Scratch storage in GB.")

    @property
    def cpus_per_node(self) -> int:
        return self.tasks_per_node * self.cpus_per_task

    @property
    def total_cpus(self) -> int:
        return self.nodes * self.cpus_per_node

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class JobSpec(Model):
    """An HPC job as the tenant submitted it on chain.

    Exactly one of ``script`` (a batch script body) or ``template_id`` (with ``template_parameters``) is given.
    The script is the tenant's program: it runs as the job, on the cluster, and travels to the scheduler by stdin or
    file, never through a shell command line of ours.
    """

    job_id: Identifier
    tenant: Address = Field(description="The tenant (customer) account that submitted and pays for the job.")
    provider: Address = Field(description="The provider account whose cluster runs the job.")
    offering_id: Identifier = Field(
        description="The provider's offering (priced queue) the job was bought from."
    )
    cluster_id: Identifier | None = Field(None, description="Cluster the tenant asked for, if any.")
    name: Name = Field("job", description="A short name for the job, shown to the tenant.")
    partition: Name | None = Field(None, description="Partition (SLURM) or queue (MOAB); default if omitted.")
    job_class: Name = Field("standard", description="Job class the price is agreed for.")
    resources: Resources = Field(default_factory=Resources)
    walltime_seconds: int = Field(3600, ge=60, le=90 * 86400, description="Maximum run time (walltime).")
    script: str | None = Field(None, description="Batch script body (bash).")
    template_id: Identifier | None = Field(None, description="A workload template instead of a script.")
    template_parameters: dict[Name, str | int | float | bool] = Field(default_factory=dict)
    environment: dict[str, str] = Field(default_factory=dict, description="Extra environment for the job.")
    working_directory: AbsPath | None = None
    max_price: Decimal = Field(
        Decimal(0), ge=0, description="Budget the tenant escrowed, in the chain's unit."
    )

    @field_validator("script")
    @classmethod
    def _script_ok(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if "\x00" in value:
            raise ValueError("script must not contain NUL bytes")
        if len(value.encode()) > MAX_SCRIPT_BYTES:
            raise ValueError(f"script is larger than {MAX_SCRIPT_BYTES} bytes")
        return value

    @field_validator("environment")
    @classmethod
    def _env_ok(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_ENV_ENTRIES:
            raise ValueError(f"{len(value)} environment variables; at most {MAX_ENV_ENTRIES} are allowed")
        for key, val in value.items():
            if not _ENV_KEY_RE.fullmatch(key):
                raise ValueError(f"environment name {key[:80]!r} must match {_ENV_KEY_RE.pattern}")
            if _RESERVED_ENV.search(key):
                raise ValueError(f"environment name {key!r} is reserved")
            if "\x00" in val or "\n" in val or len(val) > MAX_ENV_VALUE:
                raise ValueError(f"environment value of {key!r} has a NUL or newline or is too long")
        return value

    @field_validator("template_parameters")
    @classmethod
    def _params_ok(cls, value: dict[str, Any]) -> dict[str, Any]:
        if len(value) > MAX_TEMPLATE_PARAMETERS:
            raise ValueError(
                f"{len(value)} template parameters; at most {MAX_TEMPLATE_PARAMETERS} are allowed"
            )
        for key, val in value.items():
            if isinstance(val, str) and ("\x00" in val or len(val) > MAX_ENV_VALUE):
                raise ValueError(f"template parameter {key!r} has a NUL byte or is too long")
        return value

    @model_validator(mode="after")
    def _script_or_template(self) -> JobSpec:
        if (self.script is None) == (self.template_id is None):
            raise ValueError("exactly one of script or template_id must be given")
        return self


def accept_spec(raw_spec: Mapping[str, Any], default_walltime_seconds: float | None = None) -> JobSpec:
    """The job a provider accepts from a chain spec: a spec that names no walltime gets the provider's
    ``hpc.job_service.job_timeout_default`` (within the model's bounds) instead of the model's own default.

    Every reader of a chain spec (poller, routing, submission, reconciler) goes through here, so they all agree.
    """
    if default_walltime_seconds is not None and raw_spec.get("walltime_seconds") is None:
        walltime = int(min(max(default_walltime_seconds, 60), 90 * 86400))
        raw_spec = {**raw_spec, "walltime_seconds": walltime}
    return JobSpec.model_validate(raw_spec)


def spec_digest(raw_spec: Mapping[str, Any]) -> str:
    """Hex SHA-256 of a job spec as the chain holds it, in canonical JSON (sorted keys, no spaces, UTF-8).

    The poller records it when it accepts a job; the activities that read the spec back from the chain (routing,
    submission) refuse one whose digest differs, so the program submitted is the one that was accepted. It is
    taken over the tenant's document, not over our model of it, so a later release that adds a field with a
    default still finds the same digest for a job accepted before.
    """
    text = json.dumps(raw_spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class Partition(Model):
    name: Name
    nodes: int = Field(ge=0)
    max_nodes: int = Field(ge=1)
    max_runtime_seconds: int = Field(ge=60)
    default_runtime_seconds: int = Field(3600, ge=60)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_node: int = Field(1, ge=1)
    memory_mb_per_node: int = Field(1024, ge=1)
    state: str = "up"


class Cluster(Model):
    cluster_id: Identifier
    provider: Address
    name: Name
    scheduler_type: Name = "local"
    state: str = Field("active", pattern=r"^(pending|active|draining|offline|deregistered)$")
    region: Name | None = None
    partitions: tuple[Partition, ...] = ()
    total_nodes: int = Field(0, ge=0)
    available_nodes: int = Field(0, ge=0)

    def partition(self, name: str | None) -> Partition | None:
        if not self.partitions:
            return None
        if name is None:
            return self.partitions[0]
        return next((p for p in self.partitions if p.name == name), None)


class Pricing(Model):
    """Prices per hour (and per unit), in the chain's smallest unit; all ``Decimal``."""

    node_hour: Decimal = Field(Decimal(0), ge=0)
    core_hour: Decimal = Field(Decimal(0), ge=0)
    gpu_hour: Decimal = Field(Decimal(0), ge=0)
    memory_gb_hour: Decimal = Field(Decimal(0), ge=0)
    storage_gb_hour: Decimal = Field(Decimal(0), ge=0)
    minimum_charge: Decimal = Field(Decimal(0), ge=0)


class PricedQueue(Model):
    offering_id: Identifier
    cluster_id: Identifier
    partition: Name
    job_class: Name = "standard"
    pricing: Pricing = Field(default_factory=Pricing)
    min_duration_seconds: int = Field(60, ge=0)
    max_duration_seconds: int = Field(86400, ge=60)


class SchedulingDecision(Model):
    decision_id: Identifier
    job_id: Identifier
    selected_cluster_id: Identifier
    is_fallback: bool = False
    fallback_reason: str | None = Field(None, max_length=512)
    decision_reason: str = Field("", max_length=512)
    block_height: int = Field(ge=0)
    created_at: datetime


class UsageMetrics(Model):
    """Usage over one period (or, in accounting, over the whole job). ``None`` means not measured here.

    The first six are what is priced (``docs/pricing.md``): the run time, and the job's allocation held for it
    (``virtengine_hpc/metering.py``). The rest is what the scheduler measured the job using, shown and never
    priced. No quantity is negative: a record with negative usage would settle below zero and refund the tenant
    more than the escrow held (found by ``tests/test_fuzz_models.py``), so the model refuses it wherever a record
    or accounting report is read.
    """

    wall_clock_seconds: Decimal = Field(Decimal(0), ge=0)
    cpu_core_seconds: Decimal = Field(Decimal(0), ge=0)
    memory_gb_seconds: Decimal = Field(Decimal(0), ge=0)
    gpu_seconds: Decimal = Field(Decimal(0), ge=0)
    node_hours: Decimal = Field(Decimal(0), ge=0)
    storage_gb_hours: Decimal = Field(Decimal(0), ge=0)
    network_bytes_in: int | None = Field(None, ge=0)
    network_bytes_out: int | None = Field(None, ge=0)
    energy_joules: Decimal | None = Field(None, ge=0)
    memory_bytes_max: int | None = Field(None, ge=0)
    cpu_time_seconds: Decimal | None = Field(
        None, ge=0, description="CPU time used (user + system), measured."
    )
    memory_used_gb_seconds: Decimal | None = Field(
        None, ge=0, description="Resident memory integrated over time, measured (GB = 10^9 bytes)."
    )
    disk_bytes_read: int | None = Field(None, ge=0, description="Bytes the job read from disk, measured.")
    disk_bytes_written: int | None = Field(None, ge=0, description="Bytes the job wrote to disk, measured.")


#: Metrics a format-1 record cannot carry (they came with format 2).
METRICS_SINCE_V2 = ("cpu_time_seconds", "memory_used_gb_seconds", "disk_bytes_read", "disk_bytes_written")
#: The record formats this code reads and writes (``docs/usage-records.md``).
RECORD_VERSIONS = (1, 2)
Basis = Literal["measured", "allocated"]


class Allocation(Model):
    """What a job holds while it runs, in the units it is priced in: the allocation a record was priced on."""

    nodes: int = Field(0, ge=0)
    cpus: int = Field(0, ge=0, description="CPU cores.")
    gpus: int = Field(0, ge=0)
    memory_bytes: int = Field(0, ge=0, description="Memory, all nodes together, in bytes.")
    storage_gb: int = Field(0, ge=0, description="Scratch storage in GB (10^9 bytes).")

    @classmethod
    def of(cls, resources: Resources) -> Allocation:
        """What ``resources`` ask for (memory: MiB per node as bytes)."""
        return cls(
            nodes=resources.nodes,
            cpus=resources.total_cpus,
            gpus=resources.total_gpus,
            memory_bytes=resources.nodes * resources.memory_mb_per_node * 1024 * 1024,
            storage_gb=resources.storage_gb,
        )


class UsageRecord(Model):
    """A signed usage record (invariant 6 in docs/architecture.md); the canonical form is in ``docs/usage-records.md``."""

    record_id: str = Field(pattern=r"^[A-Za-z0-9._:-]+/[A-Za-z0-9._:-]+/[0-9]+$")
    job_id: Identifier
    cluster_id: Identifier
    scheduler_job_id: str = Field(max_length=64)
    provider: Address
    tenant: Address
    sequence: int = Field(ge=1)
    period_start: datetime
    period_end: datetime
    job_state: JobState
    is_final: bool
    metrics: UsageMetrics
    created_at: datetime
    key_id: str = Field(description="Hex SHA-256 of the raw Ed25519 public key that signed the record.")
    signature: str = Field("", description="Base64 Ed25519 signature over the canonical form.")
    version: int = Field(
        1, description="Record format: 1 (metrics only), 2 (with allocation, basis and measured use)."
    )
    allocation: Allocation | None = Field(None, description="Format 2: the allocation the metrics priced.")
    basis: dict[str, Basis] | None = Field(
        None, description="Format 2: per metric present, whether it is measured or allocated x time."
    )

    @model_serializer(mode="wrap")
    def _as_its_format(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A format-1 record renders as format 1 did (no format-2 keys), wherever it is written."""
        data: dict[str, Any] = handler(self)
        if self.version == 1:
            for key in ("version", "allocation", "basis"):
                data.pop(key, None)
            metrics = data.get("metrics")
            if isinstance(metrics, dict):
                for key in METRICS_SINCE_V2:
                    metrics.pop(key, None)
        return data

    @model_validator(mode="after")
    def _fits_its_format(self) -> UsageRecord:
        """A record holds exactly what its format signs: a format-1 record has nothing of format 2 (its
        signature would not cover it), a format-2 record says what it priced and on which basis."""
        if self.version not in RECORD_VERSIONS:
            raise ValueError(f"record format {self.version} is not one of {RECORD_VERSIONS}")
        if self.version == 1:
            later = [m for m in METRICS_SINCE_V2 if getattr(self.metrics, m) is not None]
            if self.allocation is not None or self.basis is not None or later:
                raise ValueError(
                    "a format-1 record carries no allocation, basis or "
                    f"{', '.join(METRICS_SINCE_V2)} (format 2 does)"
                )
        elif self.allocation is None or self.basis is None:
            raise ValueError("a format-2 record carries its allocation and basis")
        elif not set(self.basis) <= set(UsageMetrics.model_fields):
            raise ValueError(f"basis names metrics the format does not have: {sorted(self.basis)}")
        return self


class Job(Model):
    """A job as the chain holds it: the spec plus its on-chain status."""

    spec: JobSpec
    state: JobState = JobState.PENDING
    status_message: str = ""
    exit_code: int | None = None
    scheduler_job_id: str | None = None
    cancel_requested: bool = False
    escrow: Decimal = Decimal(0)
    created_at: datetime
    block_height: int = 0
