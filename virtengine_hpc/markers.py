"""Adoption markers a tenant cannot forge.

Exactly-once submission adopts the scheduler job that carries a workflow's marker: a retried submit, a recovery
run, the check for duplicates after every submit. Tenants can submit scheduler jobs too (a job script may call
``sbatch``), with any name they like, so a marker anyone can write would let a tenant's job be adopted in place of
another tenant's: the victim's script never runs and her escrow pays for the look-alike. So the marker is a tag,
an HMAC-SHA256 under a provider secret over the cluster, the account the job runs as and the workflow id; a job
is adopted only if its tag verifies for the account the provider expects *and* it runs under that account.

The tag travels in the job's name, ``vehpc-<workflow id>.<tag>`` (32 hex digits, 128 bits): the one field every
scheduler keeps from submission to accounting. A name without the right tag is a look-alike: never adopted,
never billed, audited as ``adoption_refused``.

The key (``MarkerKey``) comes, in this order, from ``PROVIDER_MARKER_SECRET`` (at least 32 characters); else it is
derived from the provider's signing key (``PROVIDER_SIGNING_KEY_PATH``), which every worker of a provider holds;
else (development and tests without a key) it is generated once into ``<state_store_path>/marker.key``. Everything
here but ``load_key`` is pure: the same inputs give the same answer on every host.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from virtengine_hpc.config import Secrets
from virtengine_hpc.errors import SecurityError
from virtengine_hpc.files import PRIVATE_MODE
from virtengine_hpc.signing import Signer

log = logging.getLogger(__name__)

JOB_NAME_PREFIX = "vehpc-"
TAG_HEX = 32
"""Hex digits of a tag (128 bits): a forger's every guess costs a job submission."""
MIN_SECRET_CHARS = 32
MARKER_DOMAIN = b"virtengine-hpc/adoption-marker/v1"
KEY_DOMAIN = "virtengine-hpc/adoption-marker-key/v1"
"""What a key derived from the provider's signing key is derived for (no other use shares it)."""
KEY_FILE = "marker.key"
_WORKFLOW_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_ACCOUNT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}$")
_CLUSTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_TAG = re.compile(rf"^[0-9a-f]{{{TAG_HEX}}}$")


class MarkerKey:
    """The provider's marker secret; its bytes never appear in a repr, a log line or an error.

    A key read from a file is read when first used, so building an adapter touches no file."""

    def __init__(
        self, secret: bytes | None = None, *, source: str, loader: Callable[[], bytes] | None = None
    ) -> None:
        if secret is None and loader is None:
            raise SecurityError("an adoption marker key needs a secret")
        self._secret = secret
        self._loader = loader
        self._lock = threading.Lock()
        self.source = source
        """Where it comes from (``PROVIDER_MARKER_SECRET``, ``PROVIDER_SIGNING_KEY_PATH``, a file): for logs."""

    def __repr__(self) -> str:
        return f"MarkerKey(source={self.source!r})"

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            with self._lock:
                if self._secret is None:
                    assert self._loader is not None
                    loaded = self._loader()
                    if len(loaded) < 16:
                        raise SecurityError(f"the adoption marker key from {self.source} is too short")
                    self._secret = loaded
        return self._secret

    @classmethod
    def ephemeral(cls) -> MarkerKey:
        """A random key for this process alone (adapters built directly in tests and benchmarks)."""
        return cls(secrets.token_bytes(32), source="ephemeral")


def _check(what: str, value: str, pattern: re.Pattern[str]) -> str:
    if not pattern.fullmatch(value):
        raise SecurityError(f"{what} {value[:80]!r} cannot be bound in an adoption marker")
    return value


def marker_tag(key: MarkerKey, *, cluster_id: str, account: str, workflow_id: str) -> str:
    """The tag that binds ``workflow_id`` to the cluster and the account its job runs as."""
    message = b"\0".join(
        [
            MARKER_DOMAIN,
            _check("cluster id", cluster_id, _CLUSTER).encode(),
            _check("account", account, _ACCOUNT).encode(),
            _check("workflow id", workflow_id, _WORKFLOW_ID).encode(),
        ]
    )
    return hmac.new(key.secret, message, hashlib.sha256).hexdigest()[:TAG_HEX]


def verify_marker(key: MarkerKey, *, cluster_id: str, account: str, workflow_id: str, tag: str) -> bool:
    """Whether ``tag`` is the provider's marker of ``workflow_id`` for that cluster and account.

    Pure and constant-time; any malformed input is simply ``False``."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        return False
    try:
        expected = marker_tag(key, cluster_id=cluster_id, account=account, workflow_id=workflow_id)
    except SecurityError:
        return False
    return hmac.compare_digest(expected, tag)


def marked_name(key: MarkerKey, *, cluster_id: str, account: str, workflow_id: str) -> str:
    """The scheduler job name of a workflow's job: ``vehpc-<workflow id>.<tag>``."""
    tag = marker_tag(key, cluster_id=cluster_id, account=account, workflow_id=workflow_id)
    return f"{JOB_NAME_PREFIX}{workflow_id}.{tag}"


def bare_name(workflow_id: str) -> str:
    """The name without a tag: what a look-alike (or a job of a release before markers) is called."""
    return JOB_NAME_PREFIX + _check("workflow id", workflow_id, _WORKFLOW_ID)


def split_name(name: str) -> tuple[str, str | None] | None:
    """``(workflow id, tag)`` of a name that claims a workflow (tag ``None`` for a bare name); else ``None``."""
    if not name.startswith(JOB_NAME_PREFIX):
        return None
    rest = name[len(JOB_NAME_PREFIX) :]
    head, dot, tail = rest.rpartition(".")
    if dot and _TAG.fullmatch(tail) and _WORKFLOW_ID.fullmatch(head):
        return head, tail
    return (rest, None) if _WORKFLOW_ID.fullmatch(rest) else None


def marked_workflow(key: MarkerKey, *, cluster_id: str, account: str, name: str) -> str | None:
    """The workflow a job of this name, running as ``account`` on this cluster, verifiably belongs to; ``None``
    for anyone else's job, a look-alike, or a marker made for another account or cluster.

    For sweeps over whole queues: ``account`` must be the account the scheduler says the job runs as."""
    parts = split_name(name)
    if parts is None:
        return None
    workflow_id, tag = parts
    if tag is None:
        return None
    ok = verify_marker(key, cluster_id=cluster_id, account=account, workflow_id=workflow_id, tag=tag)
    return workflow_id if ok else None


def claimed_workflow(name: str) -> str | None:
    """The workflow a name claims, verified or not (to tell look-alikes from other jobs)."""
    parts = split_name(name)
    return parts[0] if parts is not None else None


# ---- where the key comes from ----------------------------------------------------------------------------------


def load_key(secrets_: Secrets, state_dir: Path) -> MarkerKey:
    """The provider's marker key: ``PROVIDER_MARKER_SECRET``, else derived from the provider's signing key, else
    the key generated once in ``state_dir`` (development: every process sharing that directory agrees).

    Workers that serve one cluster from several hosts must share the key: the first two sources are the same on
    every host; a generated key is not, so production sets one of them. Files are read when the key is first
    used."""
    if secrets_.marker_secret is not None:
        value = secrets_.marker_secret.get_secret_value()
        if len(value) < MIN_SECRET_CHARS:
            raise SecurityError(
                f"PROVIDER_MARKER_SECRET is too short: use at least {MIN_SECRET_CHARS} random characters "
                "(e.g. `openssl rand -hex 32`)"
            )
        return MarkerKey(value.encode(), source="PROVIDER_MARKER_SECRET")
    signing_key = secrets_.provider_signing_key_path
    if signing_key is not None:
        return MarkerKey(
            source="PROVIDER_SIGNING_KEY_PATH",
            loader=lambda: Signer.from_file(signing_key).derive_secret(KEY_DOMAIN),
        )
    path = Path(state_dir) / KEY_FILE
    return MarkerKey(source=str(path), loader=lambda: _generated(path))


def _generated(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_MODE)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as handle:  # readers racing this write retry below
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        log.warning(
            "neither PROVIDER_MARKER_SECRET nor PROVIDER_SIGNING_KEY_PATH is set: adoption markers use a key "
            "generated in %s (only processes sharing that directory can adopt each other's jobs)",
            path,
        )
    for _ in range(50):
        text = path.read_text().strip()
        if len(text) >= MIN_SECRET_CHARS:
            return text.encode()
        time.sleep(0.01)  # another process created the file a moment ago and is writing it
    raise SecurityError(
        f"{path}: the adoption marker key file is empty or damaged; remove it to make a new one"
    )
