"""A real OpenSSH server for the simulators, started by the tests on a free loopback port with its own host key.

Self-contained (it does not use the SLURM stack's sshd): a fresh Ed25519 host key and client key, one
``authorized_keys`` file for the given users, ``known_hosts`` for the client, ``/usr/sbin/sshd -D`` in the
foreground. Key authentication only; no PAM, no passwords.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SSHD = Path("/usr/sbin/sshd")


def _keypair(path: Path) -> str:
    key = Ed25519PrivateKey.generate()
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return public.decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class SshServer:
    base: Path
    port: int
    client_key: Path
    known_hosts: Path
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def create(cls, base: Path) -> SshServer:
        base.mkdir(parents=True, exist_ok=True)
        host_public = _keypair(base / "host_ed25519")
        client_public = _keypair(base / "client_ed25519")
        (base / "authorized_keys").write_text(client_public + "\n")
        (base / "authorized_keys").chmod(0o644)
        port = free_port()
        (base / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_public}\n")
        (base / "sshd_config").write_text(
            "\n".join(
                [
                    f"Port {port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {base / 'host_ed25519'}",
                    f"PidFile {base / 'sshd.pid'}",
                    f"AuthorizedKeysFile {base / 'authorized_keys'}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "PermitUserEnvironment no",
                    "MaxSessions 64",
                    "MaxStartups 64",
                    "LogLevel ERROR",
                ]
            )
            + "\n"
        )
        return cls(base, port, base / "client_ed25519", base / "known_hosts")

    def start(self) -> None:
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = (self.base / "sshd.log").open("ab")
        self.process = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(self.base / "sshd_config")], stdout=log, stderr=log
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.base / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.05)
        raise RuntimeError("sshd did not listen in 10 s")

    def stop(self) -> None:
        """The login node goes away: the listener and every established session (as a host going down would)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(5)
        self.process = None
