"""An OIDC identity provider for the tests: discovery document, JWKS, and a client-credentials token endpoint that
issues real RS256 JWTs (PyJWT), over HTTPS with the test CA.

Knobs for the refusal tests: ``secret`` (client authentication), ``users`` (the claim listing the cluster users the
client may act for), ``sign_with_stranger`` (a key the JWKS does not publish), ``lifetime`` (negative: expired),
``audience``, ``fail_with`` (an HTTP status for every request: an outage).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa


class IdP:
    def __init__(self, client_id: str, secret: str, users: list[str], users_claim: str = "ood_users") -> None:
        self.client_id = client_id
        self.secret = secret
        self.users = users
        self.users_claim = users_claim
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex[:8]
        self.issuer = ""
        self.audience: str | None = None
        self.lifetime = 300
        self.sign_with_stranger = False
        self.fail_with: int | None = None
        self.tokens_issued = 0

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        jwk.update(kid=self.kid, use="sig", alg="RS256")
        return {"keys": [jwk]}

    def issue(self) -> str:
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "sub": f"service-account-{self.client_id}",
            "aud": self.audience or self.client_id,
            "azp": self.client_id,
            "iat": now,
            "nbf": now,
            "exp": now + self.lifetime,
            "scope": "openid",
            self.users_claim: list(self.users),
        }
        key = self.stranger if self.sign_with_stranger else self.key
        self.tokens_issued += 1
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": self.kid})


class IdPHandler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        return

    @property
    def idp(self) -> IdP:
        return self.server.idp  # type: ignore[no-any-return]

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.idp.fail_with:
            self._send(self.idp.fail_with, {"error": "temporarily_unavailable"})
        elif self.path == "/.well-known/openid-configuration":
            self._send(
                200,
                {
                    "issuer": self.idp.issuer,
                    "token_endpoint": f"{self.idp.issuer}/token",
                    "jwks_uri": f"{self.idp.issuer}/jwks",
                    "grant_types_supported": ["client_credentials"],
                    "id_token_signing_alg_values_supported": ["RS256"],
                },
            )
        elif self.path == "/jwks":
            self._send(200, self.idp.jwks())
        else:
            self._send(404, {"error": "not_found"})

    def do_POST(self) -> None:
        if self.idp.fail_with:
            self._send(self.idp.fail_with, {"error": "temporarily_unavailable"})
            return
        if self.path != "/token":
            self._send(404, {"error": "not_found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode())
        header = self.headers.get("Authorization", "")
        client, secret = "", ""
        if header.startswith("Basic "):
            client, _, secret = base64.b64decode(header[6:]).decode().partition(":")
        if form.get("grant_type") != ["client_credentials"]:
            self._send(400, {"error": "unsupported_grant_type"})
        elif client != self.idp.client_id or secret != self.idp.secret:
            self._send(401, {"error": "invalid_client"})
        else:
            self._send(
                200,
                {"access_token": self.idp.issue(), "token_type": "Bearer", "expires_in": self.idp.lifetime},
            )


def setup(idp: IdP) -> Any:
    def attach(server: ThreadingHTTPServer) -> None:
        server.idp = idp  # type: ignore[attr-defined]

    return attach
