"""Wire models of the node API and their canonical signing (``docs/node-agent.md``, "Canonical form").

A signed document (heartbeat or registration) is a JSON object. The signature covers the bytes

    <domain tag> "\\n" <the object without "signature", JSON with sorted keys, "," and ":" separators, UTF-8>

built from the JSON *as received*: the provider parses the request body into plain JSON values and
re-serialises exactly those, never a model of its own (the reference re-marshalled a different struct, so no
real heartbeat ever verified). To make that form unambiguous, every JSON number in a signed document is an
integer; fractional values (load averages, percentages) travel as decimal strings, and a body holding a float,
``NaN`` or a duplicate key is refused before any signature check.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from virtengine_hpc.errors import ValidationError
from virtengine_hpc.models import Address, Identifier
from virtengine_hpc.signing import Signer, canonical_bytes, verify

HEARTBEAT_DOMAIN = "virtengine-hpc/node-heartbeat/v1"
REGISTRATION_DOMAIN = "virtengine-hpc/node-registration/v1"
AGENT_VERSION = "0.1.0"

_LABEL = r"^[A-Za-z0-9][A-Za-z0-9 ._:/-]{0,63}$"
_TARGET = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?$"
_B64_SIGNATURE = r"^[A-Za-z0-9+/]{86}==$"
_B64_KEY = r"^[A-Za-z0-9+/]{43}=$"

Percent = Annotated[Decimal, Field(ge=0, le=100, max_digits=7, decimal_places=2)]
Load = Annotated[Decimal, Field(ge=0, le=1_000_000, max_digits=12, decimal_places=2)]
Label = Annotated[str, Field(pattern=_LABEL)]


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamp must carry a time zone (RFC 3339 with Z or an offset)")
    return value


AwareDatetime = Annotated[datetime, AfterValidator(_aware)]


class WireModel(BaseModel):
    """Unknown fields are errors: a field the provider does not know could not be checked, only signed."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeCapacity(WireModel):
    cpu_cores_total: int = Field(ge=1, le=1_000_000, description="Logical CPUs of the node.")
    cpu_cores_available: int = Field(ge=0, le=1_000_000, description="CPUs idle over the last interval.")
    memory_mb_total: int = Field(ge=1, le=1 << 40)
    memory_mb_available: int = Field(ge=0, le=1 << 40)
    gpus_total: int = Field(0, ge=0, le=1024)
    gpus_available: int = Field(0, ge=0, le=1024, description="GPUs with no compute process on them.")
    gpu_type: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._()/-]{0,127}$")
    storage_gb_total: int = Field(0, ge=0, le=1 << 40)
    storage_gb_available: int = Field(0, ge=0, le=1 << 40)

    @model_validator(mode="after")
    def _available_within_total(self) -> NodeCapacity:
        for name in ("cpu_cores", "memory_mb", "gpus", "storage_gb"):
            if getattr(self, f"{name}_available") > getattr(self, f"{name}_total"):
                raise ValueError(f"{name}_available exceeds {name}_total")
        return self


class NodeHealth(WireModel):
    status: Literal["healthy", "degraded", "unhealthy"]
    uptime_seconds: int = Field(ge=0, le=1 << 40)
    load_1m: Load = Decimal(0)
    load_5m: Load = Decimal(0)
    load_15m: Load = Decimal(0)
    cpu_utilization_percent: Percent = Decimal(0)
    memory_utilization_percent: Percent = Decimal(0)
    disk_utilization_percent: Percent = Decimal(0)
    gpu_utilization_percent: Percent | None = None
    services: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")], bool] = Field(
        default_factory=dict, max_length=16, description="Whether each watched daemon (slurmd, munged) runs."
    )
    problems: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=16)


class LatencySample(WireModel):
    """Round-trip time to one target, measured by TCP connection set-up (see ``latency.py``)."""

    target: str = Field(pattern=_TARGET)
    latency_us: int | None = Field(None, ge=0, le=60_000_000, description="Median of the answered probes.")
    probes: int = Field(ge=0, le=100)
    lost: int = Field(ge=0, le=100, description="Probes with no answer (timeout, unreachable).")
    error: str | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _lost_within_probes(self) -> LatencySample:
        if self.lost > self.probes:
            raise ValueError("lost exceeds probes")
        return self


class NodePlacement(WireModel):
    """Physical placement for topology-aware scheduling (seed keys region..position)."""

    region: Label | None = None
    datacenter: Label | None = None
    zone: Label | None = None
    rack: Label | None = None
    row: Label | None = None
    position: Label | None = None


class HeartbeatBody(WireModel):
    """What an agent signs every ``heartbeat-interval``."""

    node_id: Identifier
    cluster_id: Identifier
    provider_address: Address
    sequence_number: int = Field(
        ge=1, le=(1 << 63) - 1, description="Strictly increasing, persisted by the agent."
    )
    timestamp: AwareDatetime
    agent_version: str = Field(pattern=r"^[A-Za-z0-9._+-]{1,32}$")
    capacity: NodeCapacity
    health: NodeHealth
    placement: NodePlacement = Field(default_factory=NodePlacement)
    latency: list[LatencySample] = Field(default_factory=list, max_length=64)


class SignedHeartbeat(HeartbeatBody):
    signature: str = Field(
        pattern=_B64_SIGNATURE, description="Base64 Ed25519 signature of the canonical form."
    )


class RegistrationBody(WireModel):
    """Proves possession of the node key the provider allowed (``virtengine-hpc nodes allow``)."""

    node_id: Identifier
    cluster_id: Identifier
    provider_address: Address
    public_key: str = Field(pattern=_B64_KEY, description="Base64 of the raw 32-byte Ed25519 public key.")
    timestamp: AwareDatetime
    agent_version: str = Field(pattern=r"^[A-Za-z0-9._+-]{1,32}$")
    hostname: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
    capacity: NodeCapacity
    placement: NodePlacement = Field(default_factory=NodePlacement)


class SignedRegistration(RegistrationBody):
    signature: str = Field(pattern=_B64_SIGNATURE)


class RegistrationAck(WireModel):
    node_id: str
    cluster_id: str
    state: str
    last_sequence: int = Field(
        description="Highest heartbeat sequence accepted so far; the next must be larger."
    )
    server_time: datetime


class HeartbeatAck(WireModel):
    accepted: bool = True
    sequence_number: int
    state: str | None = Field(
        None, description="The node's lifecycle state as last recorded by the provider."
    )
    server_time: datetime


class APIError(WireModel):
    error: str = Field(
        description="Stable machine-readable reason (signature_invalid, sequence_replayed, ...)."
    )
    message: str
    last_sequence: int | None = Field(
        None, description="On sequence_replayed: the highest accepted sequence."
    )


def sign_document(body: BaseModel, domain: str, signer: Signer) -> dict[str, Any]:
    """The JSON object to send: ``body`` as plain JSON values plus the signature over their canonical form."""
    data: dict[str, Any] = body.model_dump(mode="json")
    data["signature"] = signer.sign(canonical_bytes(data, domain))
    return data


def _no_float(text: str) -> Any:
    raise ValueError(f"fractional number {text} (signed documents carry fractions as decimal strings)")


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number a signed document may carry")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def parse_signed_json(raw: bytes) -> dict[str, Any]:
    """Parse a request body into plain JSON values, refusing what would make the canonical form ambiguous."""
    try:
        data = json.loads(
            raw.decode("utf-8"),
            parse_float=_no_float,
            parse_constant=_no_constant,
            object_pairs_hook=_no_duplicates,
        )
    except UnicodeDecodeError:
        raise ValidationError("body is not UTF-8") from None
    except RecursionError:
        raise ValidationError("body is nested too deeply") from None
    except ValueError as exc:
        raise ValidationError(f"body is not acceptable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError("body must be a JSON object")
    return data


def signature_valid(data: dict[str, Any], domain: str, public_key: Any) -> bool:
    """Check ``data["signature"]`` over the canonical form of ``data`` itself (the JSON as received)."""
    signature = data.get("signature")
    if not isinstance(signature, str):
        return False
    try:
        payload = canonical_bytes(data, domain)
    except (TypeError, ValueError):
        return False
    return verify(public_key, payload, signature)


def two_places(value: float) -> Decimal:
    """A reading as a two-place decimal string value (no float ever enters a signed document)."""
    return Decimal(str(round(max(value, 0.0), 2))).quantize(Decimal("0.01"))
