"""The chain client (``chain``) and who this provider is on chain (``provider``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from virtengine_hpc.config.base import Section


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
