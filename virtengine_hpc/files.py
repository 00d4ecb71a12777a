"""Files that hold tenants' data (the ledger with every job's script and environment, the audit log, its anchor)
are private to the account the provider's services run as.

They are created with mode 0600 whatever the umask. A file that already exists (written by an earlier version,
or created by hand) keeps its owner and group bits, but loses every bit for others: a site that wants a read-only
group (an auditors' group, say) sets mode 0640 and that group itself, and the services leave it so.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_MODE = 0o600
"""Mode of every state file the services create."""


def ensure_private(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` empty with mode 0600 if it is missing; drop the bits for others of an existing file.

    Its directory is created if missing. Returns the path.
    """
    target = Path(path)
    if target.parent.exists() and not target.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target.parent))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_MODE)
    except FileExistsError:
        _drop_other_bits(target)
        return target
    try:
        os.fchmod(fd, PRIVATE_MODE)  # the umask may have taken bits away; never added any
    finally:
        os.close(fd)
    return target


def _drop_other_bits(target: Path) -> None:
    try:
        info = target.stat()
    except OSError:
        return
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode) or not mode & stat.S_IRWXO or info.st_uid != os.geteuid():
        return
    try:
        os.chmod(target, mode & ~stat.S_IRWXO)
    except OSError as exc:
        log.warning("%s is readable by every local account and cannot be restricted: %s", target, exc)
        return
    log.warning(
        "%s was readable by every local account (mode %o); now %o", target, mode, mode & ~stat.S_IRWXO
    )


__all__ = ["PRIVATE_MODE", "ensure_private"]
