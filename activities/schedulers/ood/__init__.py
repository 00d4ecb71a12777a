"""The Open OnDemand adapter (``scheduler_type: ood``); ``OODAdapter`` is imported on first use.

Modules: ``adapter`` (tenant -> cluster user, submission through the underlying scheduler as that user, session
URLs), ``oidc`` (client credentials against the site's identity provider, token verified against its JWKS). See
``docs/ood.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from activities.schedulers.registry import lazy

if TYPE_CHECKING:
    from activities.schedulers.ood.adapter import OODAdapter

__all__ = ["OODAdapter"]


def __getattr__(name: str) -> type[OODAdapter]:
    """``from activities.schedulers.ood import OODAdapter`` imports the adapter now, not with the package (PEP 562)."""
    return lazy(__name__, "ood", "OODAdapter", name)  # type: ignore[return-value]
