"""The agent's heartbeat sequence, persisted next to its key so that it survives restarts.

The next number is written (and fsynced) *before* the heartbeat carrying it is sent, so a crash can skip a
number but never reuse one: the provider accepts only strictly increasing sequences and the reference's agent,
which restarted at 1, was refused after every restart. A lock file keeps two agents from sharing one key and
sequence.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from virtengine_hpc.errors import ConfigError


class SequenceStore:
    def __init__(self, path: Path, *, lock: bool = True) -> None:
        self.path = path
        self._lock_fd: int | None = None
        if lock:
            self._lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._lock_fd)
                self._lock_fd = None
                raise ConfigError(
                    f"another hpc-node-agent holds {path}.lock: one agent per key file"
                ) from None
        self.current = self.read(path)

    @staticmethod
    def read(path: Path) -> int:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit():
            raise ConfigError(f"sequence file {path} is corrupt ({text[:20]!r}); remove it to start over")
        return int(text)

    def _write(self, value: int) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{value}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.current = value

    def next(self) -> int:
        """Reserve and persist the next sequence number."""
        self._write(self.current + 1)
        return self.current

    def advance_past(self, value: int) -> None:
        """Jump ahead after the provider said it already saw ``value`` (e.g. the file was lost)."""
        if value >= self.current:
            self._write(value)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
