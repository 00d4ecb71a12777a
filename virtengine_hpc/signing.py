"""Canonical serialization and Ed25519 signatures (usage records, heartbeats, templates).

The canonical form (documented in ``docs/usage-records.md``) is deliberately simple so that anyone can rebuild it
with any JSON library and any Ed25519 library:

* the object with its ``signature`` field removed;
* ``Decimal`` numbers as JSON strings in plain notation (no exponent, no trailing zeros: ``"1.5"``, ``"0"``);
* datetimes as UTC RFC 3339 strings with microseconds and ``Z`` (``"2026-11-30T12:00:00.000000Z"``);
* JSON with keys sorted, separators ``,`` and ``:``, no whitespace, UTF-8, non-ASCII kept as is;
* prefixed by a domain tag and a newline (``virtengine-hpc/usage-record/v1\\n``) so that a signature over one kind
  of document can never be replayed as another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import stat
from datetime import UTC, datetime
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel

from virtengine_hpc.errors import SecurityError

USAGE_RECORD_PREFIX = "virtengine-hpc/usage-record/v"
"""Usage records are signed under ``<prefix><format version>`` (``.../v1``, ``.../v2``)."""
USAGE_RECORD_DOMAIN = f"{USAGE_RECORD_PREFIX}1"


def plain(value: Any) -> Any:
    """``value`` as plain JSON values in canonical form (decimals and times as their canonical strings)."""
    if isinstance(value, BaseModel):
        return plain(value.model_dump(mode="python"))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, Decimal):
        return canonical_decimal(value)
    if isinstance(value, datetime):
        return canonical_time(value)
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, float):
        raise TypeError("floats are not allowed in signed documents; use Decimal")
    if isinstance(value, int | str):
        return value
    raise TypeError(f"cannot canonicalize {type(value).__name__}")


def canonical_decimal(value: Decimal) -> str:
    if not value.is_finite():
        raise ValueError("non-finite numbers cannot be signed")
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "") else text


def canonical_time(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def canonical_bytes(
    document: BaseModel | dict[str, Any], domain: str, *, exclude: tuple[str, ...] = ("signature",)
) -> bytes:
    """The exact bytes that are signed for ``document`` under ``domain``."""
    data = plain(document)
    for key in exclude:
        data.pop(key, None)
    body = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return domain.encode() + b"\n" + body.encode()


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def public_key_b64(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def public_key_from_b64(text: str) -> Ed25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as exc:
        raise SecurityError(f"not a base64 Ed25519 public key: {exc}") from None


class Signer:
    """Signs canonical documents with one Ed25519 key. Never logs or returns the private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id(self.public_key)

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id[:16]}...)"

    def sign(self, payload: bytes) -> str:
        return base64.b64encode(self._key.sign(payload)).decode()

    def derive_secret(self, domain: str) -> bytes:
        """A 32-byte secret for one other purpose (``domain``), derived from the private key by HMAC-SHA256: it
        reveals nothing of the key, and every holder of the key derives the same one."""
        seed = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return hmac.new(seed, domain.encode(), hashlib.sha256).digest()

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Signer:
        return cls(load_private_key(path))


def verify(public_key: Ed25519PublicKey, payload: bytes, signature_b64: str) -> bool:
    try:
        public_key.verify(base64.b64decode(signature_b64, validate=True), payload)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def write_private_key(
    path: str | os.PathLike[str], key: Ed25519PrivateKey | None = None
) -> Ed25519PrivateKey:
    """Write a new (or the given) key as PKCS#8 PEM with mode 0600; refuses to overwrite an existing file."""
    key = key or Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    return key


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an Ed25519 private key (PKCS#8 PEM or a raw 32-byte seed); refuse a file others can read."""
    target = Path(path)
    try:
        info = target.stat()
    except OSError as exc:
        raise SecurityError(f"signing key {target}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(
            f"signing key {target} is accessible by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            "chmod 600 it"
        )
    data = target.read_bytes()
    try:
        if len(data) == 32:
            return Ed25519PrivateKey.from_private_bytes(data)
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SecurityError(f"signing key {target} is not a readable Ed25519 key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SecurityError(f"signing key {target} is not an Ed25519 key")
    return key
