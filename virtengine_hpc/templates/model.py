"""The workload-template document: what a template declares, how it is signed, what the chain records about it.

A template is data, never shell code: it names one of a few fixed launchers (``direct``, ``mpi``, ``data``,
``session``), an argv template for the program, resource bounds and a typed parameter schema. The renderer
(``virtengine_hpc.templates.render``) turns it into a batch-script body in which every tenant value is validated
against the schema and then shell-quoted. That is what lets governance approve a custom template by reading it,
and what keeps a hostile parameter value from ever running as code.

Signatures (custom templates) cover the canonical form of the whole ``WorkloadTemplate`` (``signing.canonical_bytes``
under the domain tag ``virtengine-hpc/workload-template/v1``): sorted-key JSON without whitespace, ``Decimal`` as
plain strings. The chain records the approval together with the digest of the exact bytes approved, so a template
changed after approval no longer matches. See ``docs/templates.md``.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import Field, field_validator, model_validator

from virtengine_hpc.errors import SecurityError
from virtengine_hpc.models import Address, Identifier, Model, Name
from virtengine_hpc.signing import (
    Signer,
    canonical_bytes,
    key_id,
    public_key_b64,
    public_key_from_b64,
    verify,
)
from virtengine_hpc.templates.patterns import compile_pattern

TEMPLATE_DOMAIN = "virtengine-hpc/workload-template/v1"
"""Domain tag of template signatures: a signature over a template can never be replayed as another document."""

BUILTIN_PUBLISHER = "virtengine"
"""Publisher of the built-in templates, which ship with the code and need no signature."""

TemplateType = Literal["mpi", "gpu", "batch", "data_processing", "interactive", "custom"]
Launcher = Literal["direct", "mpi", "data", "session"]
ParamType = Literal[
    "string", "integer", "number", "boolean", "path", "command", "image", "argv", "modules", "enum"
]
ParamValue = str | int | bool | Decimal
ApprovalStatus = Literal["pending", "approved", "rejected", "revoked"]

_VERSION_RE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+([.-][A-Za-z0-9]+)*$")
_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MODULE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+/-]{0,127}$")
_TAG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,31}$")
_REGISTRY_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,252}[a-z0-9])?(:[0-9]{1,5})?$")
#: Placeholders a session's argv may use besides parameters: values the job itself determines at run time.
RUNTIME_PLACEHOLDERS = {"port": "SESSION_PORT", "host": "SESSION_HOST"}


class Range(Model):
    """Integer bounds with a default: ``min <= default <= max``."""

    min: int = Field(ge=0)
    max: int = Field(ge=0)
    default: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if not self.min <= self.default <= self.max:
            raise ValueError(f"need min <= default <= max, got {self.min}, {self.default}, {self.max}")
        return self

    def contains(self, value: int) -> bool:
        return self.min <= value <= self.max


class ResourceBounds(Model):
    """What a job using the template may ask for, per node unless named otherwise; defaults fill a tenant's gaps."""

    nodes: Range
    cpus_per_node: Range = Field(description="tasks_per_node x cpus_per_task.")
    memory_mb_per_node: Range
    gpus_per_node: Range = Field(default_factory=lambda: Range(min=0, max=0, default=0))
    runtime_minutes: Range = Field(
        description="Walltime bounds in minutes (default: the walltime to ask for)."
    )
    storage_gb: Range = Field(default_factory=lambda: Range(min=0, max=10_000, default=0))
    gpu_types: tuple[Name, ...] = Field((), description="Allowed GPU models (gres types); empty: any.")
    exclusive_nodes: bool = Field(False, description="The template expects whole nodes (advisory, see docs).")
    network_required: bool = False


class Runtime(Model):
    """The software environment the template expects on the cluster."""

    modules: tuple[str, ...] = Field((), description="Environment modules always loaded (module load).")
    image: str | None = Field(
        None, description="A fixed container image (else the tenant's ``image`` parameter)."
    )
    container_runtime: Literal["apptainer", "singularity"] = "apptainer"
    mpi: str | None = Field(
        None, description="MPI implementation and version, informative (e.g. openmpi-4.1)."
    )
    cuda: str | None = Field(None, description="CUDA version, informative.")
    python: str | None = Field(None, description="Python version, informative.")
    srun_mpi: Name | None = Field(None, description="srun --mpi plugin (pmix, pmi2) when launched by srun.")

    @field_validator("modules")
    @classmethod
    def _modules_ok(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for module in value:
            if not _MODULE_RE.fullmatch(module):
                raise ValueError(f"module name {module[:80]!r} must match {_MODULE_RE.pattern}")
        return value


class Security(Model):
    require_image_digest: bool = Field(
        False, description="A container image must be pinned by @sha256 digest."
    )
    allowed_registries: tuple[str, ...] = Field(
        (), description="Registries images may come from; empty: any."
    )
    network_access: bool = True
    sandbox_level: Literal["none", "standard", "strict"] = "standard"

    @field_validator("allowed_registries")
    @classmethod
    def _registries_ok(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for registry in value:
            if not _REGISTRY_RE.fullmatch(registry):
                raise ValueError(f"registry {registry[:80]!r} must match {_REGISTRY_RE.pattern}")
        return value


class ParameterSpec(Model):
    """One tenant parameter: its type, whether it is required, its default and bounds.

    Types: ``string`` (must match ``pattern``), ``integer``/``number`` (bounded by ``minimum``/``maximum``),
    ``boolean``, ``path`` (relative or absolute, no ``..``), ``command`` (a program name or path), ``image``
    (a container image reference), ``argv`` (a command line split like a shell would, each word then quoted),
    ``modules`` (module names separated by spaces or commas) and ``enum`` (one of ``choices``).
    """

    type: ParamType
    description: str = Field("", max_length=1024)
    required: bool = False
    default: ParamValue | None = None
    pattern: str | None = Field(
        None,
        max_length=512,
        description="Regular expression (RE2 syntax: no backreferences or lookaround) the whole value must match.",
    )
    choices: tuple[str, ...] = ()
    minimum: Decimal | None = None
    maximum: Decimal | None = None
    max_length: int = Field(1024, ge=1, le=4096)

    @model_validator(mode="after")
    def _consistent(self) -> ParameterSpec:
        if self.type == "enum" and not self.choices:
            raise ValueError("an enum parameter needs choices")
        if self.type == "string" and self.pattern is None:
            raise ValueError("a string parameter needs a pattern")
        if self.pattern is not None:
            compile_pattern(self.pattern)  # refused here unless RE2 can match it in linear time
        if self.required and self.default is not None:
            raise ValueError("a required parameter has no default")
        return self


class Entrypoint(Model):
    """How the job's program is started.

    ``command`` is an argv template: each item is literal text with ``{name}`` placeholders for parameters; an item
    that is exactly ``{name}`` of an ``argv`` parameter expands to that many words. Every word is shell-quoted.
    """

    launcher: Launcher
    command: tuple[str, ...] = Field((), max_length=64)
    pre: tuple[tuple[str, ...], ...] = Field((), max_length=16, description="argv templates run before.")
    post: tuple[tuple[str, ...], ...] = Field((), max_length=16, description="argv templates run after.")
    use_container: bool = Field(True, description="Run the program in the image when one is given.")

    @field_validator("command")
    @classmethod
    def _not_option(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if value and value[0].startswith("-"):
            raise ValueError("the command must not start with '-'")
        return value


class WorkloadTemplate(Model):
    """A workload template: the document a publisher signs and governance approves."""

    template_id: Identifier
    name: str = Field(min_length=1, max_length=128)
    version: str = Field(max_length=64)
    description: str = Field("", max_length=2048)
    type: TemplateType
    publisher: Address
    tags: tuple[str, ...] = ()
    runtime: Runtime = Field(default_factory=Runtime)
    resources: ResourceBounds
    security: Security = Field(default_factory=Security)
    entrypoint: Entrypoint
    parameters: dict[Name, ParameterSpec] = Field(default_factory=dict)

    @field_validator("version")
    @classmethod
    def _version_ok(cls, value: str) -> str:
        if not _VERSION_RE.fullmatch(value):
            raise ValueError(f"version {value[:40]!r} must look like 1.2.3")
        return value

    @field_validator("tags")
    @classmethod
    def _tags_ok(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for tag in value:
            if not _TAG_RE.fullmatch(tag):
                raise ValueError(f"tag {tag[:40]!r} must match {_TAG_RE.pattern}")
        return value

    @model_validator(mode="after")
    def _placeholders_known(self) -> WorkloadTemplate:
        runtime = set(RUNTIME_PLACEHOLDERS) if self.entrypoint.launcher == "session" else set()
        known = set(self.parameters) | runtime
        argvs = [self.entrypoint.command, *self.entrypoint.pre, *self.entrypoint.post]
        for argv in argvs:
            for item in argv:
                for name in _PLACEHOLDER_RE.findall(item):
                    if name not in known:
                        raise ValueError(f"entrypoint refers to unknown parameter {{{name}}}")
                    spec = self.parameters.get(name)
                    if spec is not None and spec.type in ("argv", "modules") and item != f"{{{name}}}":
                        raise ValueError(f"{{{name}}} ({spec.type}) must be a whole argv item")
        if self.entrypoint.launcher in ("direct", "mpi") and not self.entrypoint.command:
            raise ValueError(f"the {self.entrypoint.launcher} launcher needs a command")
        return self

    def digest(self) -> str:
        """Hex SHA-256 of the canonical signed bytes: what governance approves."""
        return hashlib.sha256(canonical_bytes(self, TEMPLATE_DOMAIN, exclude=())).hexdigest()


class SignedTemplate(Model):
    """A template with its publisher's public key (raw Ed25519, base64) and signature (base64)."""

    template: WorkloadTemplate
    public_key: str = Field(max_length=64)
    signature: str = Field(max_length=128)

    @property
    def key_id(self) -> str:
        return key_id(public_key_from_b64(self.public_key))

    def verify(self) -> bool:
        """True when ``signature`` is the public key's signature over the template's canonical form."""
        try:
            key = public_key_from_b64(self.public_key)
        except SecurityError:
            return False
        return verify(key, canonical_bytes(self.template, TEMPLATE_DOMAIN, exclude=()), self.signature)


def sign_template(template: WorkloadTemplate, signer: Signer) -> SignedTemplate:
    payload = canonical_bytes(template, TEMPLATE_DOMAIN, exclude=())
    return SignedTemplate(
        template=template, public_key=public_key_b64(signer.public_key), signature=signer.sign(payload)
    )


class TemplateRecord(Model):
    """What the chain holds about one published version of a custom template."""

    template_id: str
    version: str
    publisher: str
    status: ApprovalStatus
    signed: SignedTemplate
    digest: str = Field(description="Digest of the template as published.")
    approved_digest: str | None = Field(None, description="Digest governance approved (None until approved).")
    published_at: datetime
    published_height: int = 0
    decided_by: str | None = None
    decided_at: datetime | None = None
    decided_height: int | None = None
    reason: str = ""
