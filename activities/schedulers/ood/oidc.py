"""OIDC client credentials against the site's identity provider, with the token's signature checked.

Open OnDemand authenticates people through the site's OIDC provider; a service acting for tenants authenticates
itself the same way, with the client-credentials grant (RFC 6749 section 4.4): client id from the config, secret
from ``OOD_OIDC_CLIENT_SECRET`` (sent as HTTP Basic client authentication, never in a URL or a log). The token is
verified before it is trusted: signature against the provider's JWKS (from its discovery document, or
``oidc_jwks_url``), ``iss``, ``aud``, ``exp``/``nbf``, and, with ``oidc_users_claim``, that the provider lists the
cluster user the job is about to run as. Tokens are cached until shortly before they expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
from pydantic import SecretStr

from activities.schedulers.batch.transports import tls_context
from virtengine_hpc.errors import ConfigError, SchedulerUnavailable, SecurityError

log = logging.getLogger(__name__)

ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256"]
_LEEWAY = 30


@dataclass(frozen=True)
class Token:
    claims: dict[str, Any]
    expires_at: float


class OIDCClient:
    def __init__(
        self,
        *,
        token_url: str,
        issuer: str,
        client_id: str,
        client_secret: SecretStr,
        audience: str | None = None,
        scope: str = "openid",
        jwks_url: str | None = None,
        users_claim: str | None = None,
        ca_cert: Path | None = None,
        timeout: float = 30,
    ) -> None:
        for name, url in (
            ("oidc_token_url", token_url),
            ("oidc_issuer", issuer),
            ("oidc_jwks_url", jwks_url),
        ):
            if url is not None and not url.lower().startswith("https://"):
                raise ConfigError(f"hpc.ood.{name} {url!r}: the identity provider must be reached over https")
        self.token_url = token_url
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self._secret = client_secret
        self.audience = audience or client_id
        self.scope = scope
        self.jwks_url = jwks_url
        self.users_claim = users_claim
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout), verify=tls_context(ca_cert))
        self._keys: dict[str, Any] = {}
        self._token: Token | None = None
        self._lock = asyncio.Lock()
        self.requests = 0

    async def _get_json(self, url: str, what: str) -> dict[str, Any]:
        try:
            response = await self._http.get(url)
        except httpx.ConnectError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise SecurityError(f"identity provider {url}: certificate does not verify: {exc}") from None
            raise SchedulerUnavailable(f"identity provider unreachable ({what}): {exc}") from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable(f"identity provider unreachable ({what}): {exc}") from exc
        if response.status_code >= 500:
            raise SchedulerUnavailable(f"identity provider answered {what} with HTTP {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200 or not isinstance(body, dict):
            raise SecurityError(f"identity provider answered {what} with HTTP {response.status_code}")
        return body

    async def _load_keys(self) -> None:
        url = self.jwks_url
        if url is None:
            discovery = await self._get_json(f"{self.issuer}/.well-known/openid-configuration", "discovery")
            if str(discovery.get("issuer", "")).rstrip("/") != self.issuer:
                raise SecurityError(
                    f"the discovery document names issuer {discovery.get('issuer')!r}, not {self.issuer!r}"
                )
            found = discovery.get("jwks_uri")
            if not isinstance(found, str) or not found.lower().startswith("https://"):
                raise SecurityError("the identity provider's discovery document names no https jwks_uri")
            url = found
        jwks = await self._get_json(url, "JWKS")
        keys: dict[str, Any] = {}
        entries = jwks.get("keys")
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
                continue
            try:
                keys[str(entry.get("kid", ""))] = jwt.PyJWK(entry).key
            except (jwt.PyJWKError, jwt.InvalidKeyError) as exc:
                log.warning("ignoring an unusable JWKS key %s: %s", entry.get("kid"), exc)
        if not keys:
            raise SecurityError(f"the identity provider's JWKS at {url} holds no usable signing key")
        self._keys = keys

    async def _request_token(self) -> str:
        self.requests += 1
        try:
            response = await self._http.post(
                self.token_url,
                data={"grant_type": "client_credentials", "scope": self.scope},
                auth=httpx.BasicAuth(self.client_id, self._secret.get_secret_value()),
                headers={"Accept": "application/json"},
            )
        except httpx.ConnectError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise SecurityError(
                    f"identity provider {self.token_url}: certificate does not verify"
                ) from None
            raise SchedulerUnavailable(f"identity provider unreachable (token): {exc}") from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable(f"identity provider unreachable (token): {exc}") from exc
        if response.status_code >= 500:
            raise SchedulerUnavailable(
                f"identity provider answered the token request with HTTP {response.status_code}"
            )
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):  # a list or a string where the token response belongs
            body = {}
        if response.status_code != 200 or not isinstance(body.get("access_token"), str):
            error = body.get("error", "") if isinstance(body, dict) else ""
            raise SecurityError(
                f"the identity provider refused client {self.client_id} (HTTP {response.status_code} {error}): "
                "check hpc.ood.oidc_client_id and OOD_OIDC_CLIENT_SECRET"
            )
        return str(body["access_token"])

    def _verify(self, raw: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(raw)
        except jwt.PyJWTError as exc:
            raise SecurityError(f"the identity provider's token is not a JWT: {exc}") from None
        if header.get("alg") not in ALGORITHMS:
            raise SecurityError(
                f"token signed with {header.get('alg')!r}; only {', '.join(ALGORITHMS)} are accepted"
            )
        key = self._keys.get(str(header.get("kid", "")))
        if key is None:
            raise LookupError(header.get("kid"))
        try:
            claims: dict[str, Any] = jwt.decode(
                raw,
                key=key,
                algorithms=ALGORITHMS,
                audience=self.audience,
                issuer=self.issuer,
                leeway=_LEEWAY,
                options={"require": ["exp", "iat", "iss", "aud"]},
            )
        except jwt.PyJWTError as exc:
            raise SecurityError(f"the identity provider's token was refused: {exc}") from None
        return claims

    async def token(self) -> Token:
        """A verified token, from the cache while it has more than a minute left."""
        async with self._lock:
            if self._token is not None and self._token.expires_at - time.time() > 60:
                return self._token
            raw = await self._request_token()
            if not self._keys:
                await self._load_keys()
            try:
                claims = self._verify(raw)
            except LookupError:  # a key the cached JWKS does not have: the provider rotated its keys
                await self._load_keys()
                try:
                    claims = self._verify(raw)
                except LookupError:
                    raise SecurityError(
                        "the token's signing key (kid) is not in the identity provider's JWKS"
                    ) from None
            self._token = Token(claims, float(claims["exp"]))
            return self._token

    async def authorize(self, user: str) -> Token:
        """A verified token that (with ``oidc_users_claim``) lists ``user`` as one this client may act for."""
        token = await self.token()
        if self.users_claim:
            listed = token.claims.get(self.users_claim)
            users = listed.split() if isinstance(listed, str) else listed if isinstance(listed, list) else []
            if user not in users:
                raise SecurityError(
                    f"the identity provider does not let client {self.client_id} act as cluster user {user} "
                    f"(claim {self.users_claim})"
                )
        return token

    async def close(self) -> None:
        await self._http.aclose()
