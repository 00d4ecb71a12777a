"""The agent's heartbeat sequence, persisted next to its key so that it survives restarts.

The next number is written (and fsynced) *before* the heartbeat carrying it is sent, so a crash can skip a
number but never reuse one: the provider accepts only strictly increasing sequences and the reference's agent,
which restarted at 1, was refused after every restart. A lock file keeps two agents from sharing one key and
sequence.

Each number is also at least the agent's clock in milliseconds since the epoch. An agent whose sequence file was
lost or restored from an old backup is therefore above every number it sent before (unless its clock went back
meanwhile) without asking anyone: the agent never takes a sequence from the provider's answers, which are not
signed, so a forged answer cannot push it to the end of the range and silence the node for good.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from virtengine_hpc.errors import ConfigError


def clock_floor() -> int:
    """Milliseconds since the epoch: the least the next sequence number may be."""
    return time.time_ns() // 1_000_000


class SequenceStore:
    def __init__(self, path: Path, *, lock: bool = True, floor: Callable[[], int] = clock_floor) -> None:
        self.path = path
        self.floor = floor
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
        """Reserve and persist the next sequence number: one above the last, and not below the clock floor."""
        self._write(max(self.current + 1, self.floor()))
        return self.current

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
