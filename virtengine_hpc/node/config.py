"""``hpc-node-agent`` configuration: the seed's keys, from YAML, then ``VE_NODE_*`` variables, then flags.

Keys are spelled as in the seed (``node-id``, ``heartbeat-interval``, ...); an environment variable is the key
in upper case with ``_`` for ``-`` behind ``VE_NODE_`` (``VE_NODE_NODE_ID``, ``VE_NODE_LATENCY_TARGETS=a,b``).
Errors name the key and say why. The agent holds no secret in its config: its private key lives in
``key-file`` (mode 0600), and for mutual TLS its client key in ``client-key-file``. With an ``https://``
``provider-daemon-url`` the node API's certificate is always verified (``ca-file``, default the system's CAs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.config import MAX_ERRORS_SHOWN, Duration, check_config_size
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.models import Address, Identifier
from virtengine_hpc.node.heartbeat import Label, NodePlacement

ENV_PREFIX = "VE_NODE_"
DEFAULT_CONFIG_PATH = Path("/etc/virtengine/hpc-node-agent.yaml")
DEFAULT_KEY_FILE = Path("/etc/virtengine/virtengine-agent.key")
_TARGET_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?$"


def _lower(value: Any) -> Any:
    if isinstance(value, str):
        value = value.strip().lower()
        return "warning" if value == "warn" else value
    return value


def _listish(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class NodeAgentConfig(BaseModel):
    """Every key of the seed's ``hpc-node-agent.yaml``, plus ``storage-path``."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=lambda name: name.replace("_", "-"),
        populate_by_name=True,
    )

    node_id: Identifier | None = Field(None, description="This node's id as the provider allowed it.")
    cluster_id: Identifier | None = Field(None, description="The cluster the node belongs to.")
    provider_address: Address | None = Field(None, description="The provider's chain address.")
    provider_daemon_url: str | None = Field(
        None, pattern=r"^https?://[A-Za-z0-9._:\[\]-]+(/[A-Za-z0-9._~/-]*)?$", description="The node API."
    )
    heartbeat_interval: Duration = Field(timedelta(seconds=30), description="Time between heartbeats.")
    key_file: Path = Field(DEFAULT_KEY_FILE, description="Ed25519 private key (mode 0600).")
    region: Label | None = None
    datacenter: Label | None = None
    zone: Label | None = None
    rack: Label | None = None
    row: Label | None = None
    position: Label | None = None
    latency_targets: Annotated[
        list[Annotated[str, Field(pattern=_TARGET_PATTERN)]], BeforeValidator(_listish)
    ] = Field(default_factory=list, max_length=64, description="host or host:port (default port 6818).")
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower)] = "info"
    storage_path: Path = Field(Path("/"), description="Filesystem whose size is reported as storage.")
    ca_file: Path | None = Field(
        None, description="PEM bundle that verifies the node API's certificate; default: the system's CAs."
    )
    client_cert_file: Path | None = Field(
        None, description="Client certificate (PEM) for a node API that requires mutual TLS."
    )
    client_key_file: Path | None = Field(
        None, description="Private key (PEM, unencrypted) of client-cert-file; refused if others can read it."
    )

    @field_validator("heartbeat_interval")
    @classmethod
    def _interval_bounds(cls, value: timedelta) -> timedelta:
        if not timedelta(milliseconds=200) <= value <= timedelta(hours=1):
            raise ValueError("must be between 200ms and 1h")
        return value

    @model_validator(mode="after")
    def _tls_files(self) -> NodeAgentConfig:
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("client-cert-file and client-key-file go together (mutual TLS needs both)")
        url = self.provider_daemon_url
        if url is not None and not url.startswith("https://"):
            used = [k for k in ("ca-file", "client-cert-file") if getattr(self, k.replace("-", "_"))]
            if used:
                raise ValueError(
                    f"{' and '.join(used)} {'need' if len(used) > 1 else 'needs'} an https:// "
                    f"provider-daemon-url (it is {url}): over plain HTTP no certificate would be checked"
                )
        return self

    @property
    def uses_tls(self) -> bool:
        return bool(self.provider_daemon_url and self.provider_daemon_url.startswith("https://"))

    @property
    def placement(self) -> NodePlacement:
        return NodePlacement(
            region=self.region,
            datacenter=self.datacenter,
            zone=self.zone,
            rack=self.rack,
            row=self.row,
            position=self.position,
        )

    @property
    def sequence_file(self) -> Path:
        """The persisted heartbeat sequence lives next to the key: they belong together."""
        return self.key_file.with_name(self.key_file.name + ".seq")

    @property
    def status_file(self) -> Path:
        return self.key_file.with_name(self.key_file.name + ".status.json")

    def require(self, *keys: str) -> None:
        """Fail with one clear message naming every missing key and where it can be set."""
        missing = [key for key in keys if getattr(self, key.replace("-", "_")) is None]
        if missing:
            hints = ", ".join(f"{k} ({ENV_PREFIX}{k.replace('-', '_').upper()} or --{k})" for k in missing)
            raise ConfigError(f"missing required configuration: {hints}")


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    fields = {name.replace("_", "-") for name in NodeAgentConfig.model_fields}
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower().replace("_", "-")
        if key not in fields:
            raise ConfigError(f"{name}: unknown setting (known: {', '.join(sorted(fields))})")
        if key == "latency-targets" and value.strip().startswith("["):
            try:
                out[key] = yaml.safe_load(value)
            except (yaml.YAMLError, RecursionError, ValueError):
                raise ConfigError(f"{name}: not a YAML list of targets") from None
            check_config_size(out[key], name)
        else:
            out[key] = value
    return out


def _format(err: PydanticValidationError) -> str:
    parts = []
    errors = err.errors()
    for item in errors[:MAX_ERRORS_SHOWN]:
        where = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (see docs/node-agent.md for the keys)"
        # A check across keys (client-cert-file with client-key-file) names its keys in its message.
        parts.append(f"{where}: {message}" if where else message)
    if len(errors) > MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "invalid hpc-node-agent configuration: " + "; ".join(parts)


def load_agent_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> NodeAgentConfig:
    """YAML file (if any), then ``VE_NODE_*`` variables, then ``overrides`` (flags that were given)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        except RecursionError:
            raise ConfigError(f"config file {path} is nested too deeply to read") from None
        except ValueError as exc:  # PyYAML's int(): a number past Python's 4,300-digit limit
            raise ConfigError(f"config file {path} holds a value that cannot be read: {exc}"[:300]) from None
        check_config_size(loaded, f"config file {path}")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
        data.update({str(k): v for k, v in loaded.items()})
    data.update(_env_overrides(env))
    data.update({k.replace("_", "-"): v for k, v in (overrides or {}).items() if v is not None})
    try:
        return NodeAgentConfig.model_validate(data)
    except PydanticValidationError as exc:
        raise ConfigError(_format(exc)) from None
