"""A hostile or broken identity provider: the Open OnDemand adapter's OIDC client, fed any answer, must raise a
typed error (``SecurityError`` for what it must not trust, ``SchedulerUnavailable`` for what may pass), never
another exception.

The IdP answers three requests (token, discovery, JWKS); Hypothesis chooses each answer's HTTP status and body:
JSON of any shape (also lists, strings, numbers where objects belong), non-JSON bytes, JWT-looking tokens with
garbage or ``alg: none`` headers, JWKS entries of every wrong shape.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from activities.schedulers.ood.oidc import OIDCClient
from tests.test_fuzz_parsers import TRICKY
from virtengine_hpc.errors import HPCError

pytestmark = pytest.mark.timeout(120)
ISSUER = "https://idp.invalid/realms/hpc"


def _b64(data: Any) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | TRICKY,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "access_token",
                    "keys",
                    "kid",
                    "kty",
                    "use",
                    "alg",
                    "n",
                    "e",
                    "crv",
                    "x",
                    "issuer",
                    "jwks_uri",
                ]
            )
            | st.text(max_size=5),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)
TOKENS = st.one_of(
    TRICKY,
    st.builds(
        lambda header, claims, sig: f"{_b64(header)}.{_b64(claims)}.{sig}",
        JSON | st.just({"alg": "none"}) | st.just({"alg": "RS256", "kid": "k1"}) | st.just({"alg": "HS256"}),
        JSON | st.just({"iss": ISSUER, "aud": "client", "exp": 2**40, "iat": 0}),
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", max_size=40),
    ),
)
BODIES = st.one_of(
    JSON,
    st.builds(lambda token: {"access_token": token, "token_type": "Bearer"}, TOKENS),
    st.builds(lambda keys: {"keys": keys}, JSON),
    st.builds(
        lambda entries: {"keys": entries},
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "kty": st.sampled_from(["RSA", "EC", "oct", "OKP", "x"]) | JSON,
                    "kid": TRICKY,
                    "use": st.sampled_from(["sig", "enc"]) | JSON,
                    "n": TRICKY,
                    "e": TRICKY,
                    "crv": TRICKY,
                    "x": TRICKY,
                    "k": TRICKY,
                },
            ),
            max_size=3,
        ),
    ),
    st.builds(lambda uri: {"issuer": ISSUER, "jwks_uri": uri}, TRICKY | st.just("https://idp.invalid/jwks")),
)
ANSWER = st.tuples(st.sampled_from([200, 200, 200, 400, 401, 500, 503]), BODIES | st.binary(max_size=40))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(token=ANSWER, discovery=ANSWER, jwks=ANSWER, with_jwks_url=st.booleans())
@example(token=(200, [1, 2]), discovery=(200, {}), jwks=(200, {}), with_jwks_url=True)
@example(
    token=(200, {"access_token": "a.b.c"}), discovery=(200, {}), jwks=(200, {"keys": 5}), with_jwks_url=True
)
@example(
    token=(200, {"access_token": f"{_b64({'alg': 'RS256', 'kid': 'k'})}.{_b64({})}.x"}),
    discovery=(200, {}),
    jwks=(200, {"keys": [{"kty": "RSA", "kid": "k", "n": "AQAB", "e": "AQAB"}]}),
    with_jwks_url=True,
)
def test_any_identity_provider_answer_is_a_typed_error_or_a_verified_token(
    token: tuple[int, Any], discovery: tuple[int, Any], jwks: tuple[int, Any], with_jwks_url: bool
) -> None:
    answers = {"/token": token, "/realms/hpc/.well-known/openid-configuration": discovery, "/jwks": jwks}

    def answer(request: httpx.Request) -> httpx.Response:
        status, body = answers.get(request.url.path, (404, {}))
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=content, headers={"Content-Type": "application/json"})

    async def scenario() -> None:
        client = OIDCClient(
            token_url="https://idp.invalid/token",
            issuer=ISSUER,
            client_id="client",
            client_secret=SecretStr("s3cret"),
            jwks_url="https://idp.invalid/jwks" if with_jwks_url else None,
            users_claim="ood_users",
        )
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            await asyncio.wait_for(client.authorize("alice"), 20)
        except HPCError as exc:
            assert "s3cret" not in str(exc), "the client secret never appears in an error"
        finally:
            await client.close()

    asyncio.run(scenario())
