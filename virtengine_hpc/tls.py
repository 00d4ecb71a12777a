"""TLS material of the node API (server side) and ``hpc-node-agent`` (client side), loaded with clear errors.

Certificates and keys are files named in the configuration; they are read when a process starts, and whatever
is wrong with them (missing, unreadable, not PEM, a key that does not match its certificate, an encrypted key,
a key others can read) is a ``ConfigError`` naming the configuration key, never a traceback or a password
prompt on the terminal. Verification is never turned off: a client context always checks the server's
certificate chain and host name, and a server context with a client CA requires a client certificate.
"""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

from virtengine_hpc.errors import ConfigError

_PEM_MARK = b"-----BEGIN "


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason without the ``(_ssl.c:1234)`` tail: ``KEY_VALUES_MISMATCH`` is what the operator needs."""
    text = exc.reason or (exc.args[1] if len(exc.args) > 1 else str(exc))
    return str(text).split(" (_ssl.c:")[0]


def read_pem(path: Path, label: str, what: str) -> bytes:
    """The bytes of a PEM file; ``ConfigError`` naming ``label`` when it cannot be read or is not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {what} {path}: {exc.strerror or exc}") from None
    if _PEM_MARK not in data:
        raise ConfigError(f"{label}: {path} is not a PEM file ({what})")
    return data


def check_key_file(path: Path, label: str) -> None:
    """A private key file must exist, be PEM and not be readable by others (group access is allowed: the
    ``ssl-cert`` group convention)."""
    try:
        info = Path(path).stat()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read private key {path}: {exc.strerror or exc}") from None
    if info.st_mode & stat.S_IRWXO:
        raise ConfigError(
            f"{label}: private key {path} is accessible by others (mode {stat.S_IMODE(info.st_mode):o}); "
            "chmod 600 (or 640 with a trusted group) it"
        )
    read_pem(path, label, "private key")


def _load_chain(
    context: ssl.SSLContext, cert: Path, key: Path, cert_label: str, key_label: str, role: str
) -> None:
    read_pem(cert, cert_label, f"{role} certificate")
    check_key_file(key, key_label)

    def no_password() -> str:
        # Without a callback OpenSSL would prompt on the terminal for an encrypted key (and hang a service).
        raise ConfigError(f"{key_label}: private key {key} is encrypted; give an unencrypted key (mode 600)")

    try:
        context.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{cert_label} {cert} and {key_label} {key} are not a usable certificate and key: {_reason(exc)}"
        ) from None
    except OSError as exc:  # removed between the checks above and the load
        raise ConfigError(f"{cert_label}: cannot load {cert} / {key}: {exc.strerror or exc}") from None


def _load_cas(context: ssl.SSLContext, cafile: Path, label: str, what: str) -> None:
    read_pem(cafile, label, what)
    try:
        context.load_verify_locations(cafile=cafile)
    except ssl.SSLError as exc:
        raise ConfigError(f"{label}: {cafile} holds no usable certificate ({what}): {_reason(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {what} {cafile}: {exc.strerror or exc}") from None


def server_context(
    cert: Path,
    key: Path,
    client_ca: Path | None,
    *,
    labels: tuple[str, str, str] = ("tls_cert_file", "tls_key_file", "tls_client_ca_file"),
) -> ssl.SSLContext:
    """What a server will serve with: the certificate and key, and with ``client_ca`` required client
    certificates. Built to check the files (the server may build its own from the same files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, cert, key, labels[0], labels[1], "server")
    if client_ca is not None:
        _load_cas(context, client_ca, labels[2], "client CA bundle")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    ca_file: Path | None,
    cert: Path | None,
    key: Path | None,
    *,
    labels: tuple[str, str, str] = ("ca-file", "client-cert-file", "client-key-file"),
) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca_file`` (default: the system's CAs), checks its
    host name, and presents ``cert``/``key`` when given (mutual TLS)."""
    if ca_file is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    else:
        # Only this bundle (no system roots besides): a private CA's API must not be impersonated by any
        # publicly trusted certificate.
        read_pem(ca_file, labels[0], "CA bundle")
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{labels[0]}: {ca_file} holds no usable certificate (CA bundle): {_reason(exc)}"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"{labels[0]}: cannot read CA bundle {ca_file}: {exc.strerror or exc}"
            ) from None
    if cert is not None and key is not None:
        _load_chain(context, cert, key, labels[1], labels[2], "client")
    # create_default_context's defaults, stated: the server's chain and host name are always checked.
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    return context
