"""The provider's node API and the node lifecycle (``nodes``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from virtengine_hpc.config.base import Duration, Section


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
