"""The Open OnDemand section (``hpc.ood``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from virtengine_hpc.config.base import Duration, Section
from virtengine_hpc.config.scheduler import JobPollInterval


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
    job_poll_interval: JobPollInterval = timedelta(seconds=10)
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
