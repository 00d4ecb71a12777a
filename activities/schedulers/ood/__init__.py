"""The Open OnDemand adapter (``scheduler_type: ood``); importing this package registers it.

Modules: ``adapter`` (tenant -> cluster user, submission through the underlying scheduler as that user, session
URLs), ``oidc`` (client credentials against the site's identity provider, token verified against its JWKS). See
``docs/ood.md``.
"""

from activities.schedulers.ood.adapter import OODAdapter

__all__ = ["OODAdapter"]
