"""Credentials: read only from the environment, refused in a configuration at any depth."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr

from virtengine_hpc.errors import ConfigError

# Keys that look like credentials; a config file holding one is refused.
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api_key|apikey|private_key|credential)", re.I)
# Keys whose names look like credentials but hold only a location or the name of a variable.
_ALLOWED_SECRETISH = {"token_file_env", "signing_key_path_env", "api_key_env", "oidc_token_url"}


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
