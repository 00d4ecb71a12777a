"""Where the workers find Temporal (``temporal``), and the Worker Deployment they belong to."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from virtengine_hpc.config.base import Duration, Section
from virtengine_hpc.config.build_id import default_build_id


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
