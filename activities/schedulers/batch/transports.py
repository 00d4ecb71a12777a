"""Ways to reach a batch scheduler that every scheduler shares: commands over one persistent SSH connection, and
the verified TLS context of its HTTPS services (MOAB Web Services, an OIDC provider).

``SSHRunner`` keeps one paramiko connection (key auth, host key checked against known_hosts with ``RejectPolicy``)
and opens a channel per command; every argument is ``shlex``-quoted, the script goes on the channel's stdin.
``TCP_NODELAY`` on the socket removes the Nagle/delayed-ACK stall that otherwise costs ~40 ms per command
(measured on the project machine: 20 -> ~200 commands/s). The environment the commands need (``SLURM_TIME_FORMAT``,
``MOABHOMEDIR``, ...) is passed as ``env K=V`` words of the one quoted command line, because a non-interactive SSH
session reads no profile.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import paramiko
from paramiko.common import cMSG_CHANNEL_REQUEST

from activities.schedulers.batch.base import CommandResult
from virtengine_hpc.errors import SchedulerUnavailable, SecurityError


def check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    args = tuple(argv)
    if not args:
        raise ValueError("empty command")
    for arg in args:
        if "\x00" in arg or "\n" in arg or "\r" in arg:
            raise ValueError(f"refusing a command argument with a NUL or newline: {arg[:80]!r}")
    return args


class SSHRunner:
    """Scheduler commands on a login node over one persistent, host-key-checked SSH connection."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        user: str,
        key_path: Path | None,
        known_hosts: Path | None,
        timeout: float,
        env: Mapping[str, str] | None = None,
        max_sessions: int = 8,
    ) -> None:
        self.host, self.port, self.user = host, port, user
        self.key_path, self.known_hosts = key_path, known_hosts
        self.timeout = timeout
        self.env = dict(env or {})
        for key in self.env:
            if not key.replace("_", "a").isalnum():
                raise ValueError(f"remote environment name {key!r} is not a valid name")
        self.description = f"ssh {user}@{host}:{port}"
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._slots = asyncio.Semaphore(max_sessions)
        self.connects = 0
        #: Remote commands started (each an SSH session on the remote host: a new process tree there).
        self.commands = 0

    def command_line(self, argv: Sequence[str]) -> str:
        """The one string the remote shell parses: ``env K=V ... cmd args``, every word quoted."""
        args = check_argv(argv)
        return shlex.join(["env", *(f"{k}={v}" for k, v in self.env.items()), *args])

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        """Run ``argv`` on the remote host; if the caller is cancelled (its activity attempt was), the remote
        command is killed (an SSH ``signal`` request, then the channel is closed)."""
        line = self.command_line(argv)
        session = _Session()
        async with self._slots:
            try:
                return await asyncio.to_thread(self._run, tuple(argv), line, stdin, timeout, session)
            except asyncio.CancelledError:
                session.kill()
                raise

    # ---- blocking part (worker threads) --------------------------------------------------------------------
    def _connect(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        try:
            if self.known_hosts is not None:
                client.load_host_keys(str(self.known_hosts))
            else:
                client.load_system_host_keys()
        except OSError as exc:
            raise SecurityError(f"cannot read known_hosts {self.known_hosts}: {exc.strerror}") from exc
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                hostname=self.host,
                port=self.port,
                username=self.user,
                key_filename=str(self.key_path) if self.key_path else None,
                look_for_keys=self.key_path is None,
                allow_agent=False,
                timeout=self.timeout,
                banner_timeout=self.timeout,
                auth_timeout=self.timeout,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise SecurityError(
                f"SSH host key of {self.host}:{self.port} does not match known_hosts: refusing to connect"
            ) from exc
        except paramiko.AuthenticationException as exc:
            client.close()
            raise SecurityError(f"SSH authentication as {self.user}@{self.host} failed: {exc}") from exc
        except paramiko.SSHException as exc:
            client.close()
            if "known_hosts" in str(exc):
                raise SecurityError(
                    f"SSH host {self.host}:{self.port} is not in known_hosts "
                    f"({self.known_hosts or 'system'}): refusing to connect"
                ) from exc
            raise SchedulerUnavailable(f"SSH to {self.host}:{self.port} failed: {exc}") from exc
        except (OSError, EOFError) as exc:
            client.close()
            raise SchedulerUnavailable(f"SSH to {self.host}:{self.port} failed: {exc}") from exc
        transport = client.get_transport()
        if transport is None:  # pragma: no cover - connect() always leaves one
            raise SchedulerUnavailable(f"SSH to {self.host}:{self.port} has no transport")
        sock = transport.sock
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_keepalive(30)
        self.connects += 1
        return client

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            client = self._client
            transport = client.get_transport() if client is not None else None
            if transport is None or not transport.is_active():
                if client is not None:
                    client.close()
                self._client = client = self._connect()
                transport = client.get_transport()
            assert transport is not None
            return transport

    def _drop(self, transport: paramiko.Transport) -> None:
        with self._lock:
            if self._client is not None and self._client.get_transport() is transport:
                self._client.close()
                self._client = None

    def _open(self, timeout: float) -> paramiko.Channel:
        """A new channel; reconnects once if the kept connection died (sshd restart, idle timeout)."""
        for attempt in (1, 2):
            transport = self._transport()
            try:
                return transport.open_session(timeout=timeout)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                self._drop(transport)
                if attempt == 2:
                    raise SchedulerUnavailable(f"SSH channel to {self.host} failed: {exc}") from exc
        raise AssertionError("unreachable")

    def start(self, argv: Sequence[str], timeout: float) -> paramiko.Channel:
        """A long-lived remote command (blocking: call it from a thread): its channel, to which the caller writes
        requests and from which it reads the answers, for a command that answers many requests in one process."""
        line = self.command_line(argv)
        channel = self._open(timeout)
        try:
            channel.settimeout(timeout)
            channel.exec_command(line)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            channel.close()
            raise SchedulerUnavailable(f"SSH command {argv[0]} failed: {exc}", command=list(argv)) from exc
        self.commands += 1
        return channel

    def _run(
        self, argv: tuple[str, ...], line: str, stdin: str | None, timeout: float, session: _Session
    ) -> CommandResult:
        started = time.monotonic()
        channel = session.start(lambda: self._open(timeout))
        self.commands += 1
        try:
            channel.settimeout(timeout)
            channel.exec_command(line)
            if stdin is not None:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            out = read_all(channel.recv, started + timeout)
            err = read_all(channel.recv_stderr, started + timeout)
            if not channel.status_event.wait(max(0.0, started + timeout - time.monotonic())):
                raise TimeoutError
            code = channel.recv_exit_status()
        except TimeoutError:
            raise SchedulerUnavailable(
                f"{argv[0]} over SSH did not answer within {timeout:.0f} s", command=list(argv)
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SchedulerUnavailable(f"SSH command {argv[0]} failed: {exc}", command=list(argv)) from exc
        finally:
            channel.close()
        return CommandResult(
            argv, code, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - started
        )

    async def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class _Session:
    """The channel of one remote command, killable from the event loop while a thread waits on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channel: paramiko.Channel | None = None
        self._killed = False

    def start(self, open_channel: Callable[[], paramiko.Channel]) -> paramiko.Channel:
        with self._lock:
            if self._killed:
                raise SchedulerUnavailable("the command was cancelled before it started")
            self._channel = open_channel()
            return self._channel

    def kill(self) -> None:
        """Ask sshd to SIGKILL the command's process group (OpenSSH 7.9+ honours ``signal`` requests), then close
        the channel: the command must not finish behind the back of the attempt that gave it up."""
        with self._lock:
            self._killed = True
            channel = self._channel
            if channel is None or channel.closed:
                return
            request = paramiko.Message()
            request.add_byte(cMSG_CHANNEL_REQUEST)
            request.add_int(channel.remote_chanid)
            request.add_string("signal")
            request.add_boolean(False)
            request.add_string("KILL")
            send = getattr(channel.get_transport(), "_send_user_message", None)  # paramiko has no public call
            if send is not None:
                with contextlib.suppress(paramiko.SSHException, OSError, EOFError):
                    send(request)
            channel.close()


def read_all(recv: Any, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        data = recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def tls_context(ca_cert: Path | None) -> ssl.SSLContext:
    """Verified TLS: the given CA bundle, else the system's roots. Verification is never turned off."""
    try:
        return ssl.create_default_context(cafile=str(ca_cert) if ca_cert else None)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(f"cannot load the CA certificate {ca_cert}: {exc}") from None
