"""How the adapter reaches Slurm: local commands, commands over SSH, slurmrestd over HTTP, or pyslurm.

* ``LocalRunner`` runs argv lists with ``asyncio`` subprocesses (no shell), in a clean environment: the worker's own
  environment (which may hold ``SLURM_JWT_TOKEN`` and friends) never reaches ``sbatch`` and so never a job.
* ``SSHRunner`` keeps one paramiko connection (key auth, host key checked against known_hosts with
  ``RejectPolicy``) and opens a channel per command; every argument is ``shlex``-quoted, the script goes on the
  channel's stdin. ``TCP_NODELAY`` on the socket removes the Nagle/delayed-ACK stall that otherwise costs ~40 ms per
  command (ENVIRONMENT.md: 20 -> ~200 commands/s).
* ``RestClient`` talks to slurmrestd with one keep-alive ``httpx`` pool, the JWT in ``X-SLURM-USER-TOKEN`` (never in
  a URL, a log line or an error).
* ``load_pyslurm`` imports pyslurm if the site installed a release matching its Slurm (none on PyPI matches 22.05).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shlex
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import paramiko
from pydantic import SecretStr

from activities.schedulers.slurm.base import CommandResult
from virtengine_hpc.errors import SchedulerError, SchedulerUnavailable, SecurityError

log = logging.getLogger(__name__)

#: Environment of every Slurm command: epoch timestamps instead of the cluster's local time.
COMMAND_ENV = {"SLURM_TIME_FORMAT": "%s", "LC_ALL": "C"}
_LOCAL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    args = tuple(argv)
    if not args:
        raise ValueError("empty command")
    for arg in args:
        if "\x00" in arg or "\n" in arg or "\r" in arg:
            raise ValueError(f"refusing a command argument with a NUL or newline: {arg[:80]!r}")
    return args


class LocalRunner:
    """Slurm commands on this host (the worker runs where ``sbatch`` and ``slurm.conf`` are)."""

    def __init__(
        self,
        *,
        slurm_conf: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        max_concurrency: int = 8,
    ) -> None:
        env = {"PATH": _LOCAL_PATH, "LANG": "C.UTF-8", **COMMAND_ENV}
        conf = str(slurm_conf) if slurm_conf else os.environ.get("SLURM_CONF")
        if conf:
            env["SLURM_CONF"] = conf
        env.update(extra_env or {})
        self.env = env
        self.description = "local"
        self._slots = asyncio.Semaphore(max_concurrency)

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        args = _check_argv(argv)
        async with self._slots:
            started = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args,
                    stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=self.env,
                    start_new_session=True,
                )
            except FileNotFoundError:
                return CommandResult(args, 127, "", f"{args[0]}: command not found")
            except OSError as exc:
                raise SchedulerUnavailable(f"cannot run {args[0]}: {exc}", command=list(args)) from exc
            try:
                out, err = await asyncio.wait_for(
                    proc.communicate(stdin.encode() if stdin is not None else None), timeout
                )
            except (TimeoutError, asyncio.CancelledError) as exc:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise SchedulerUnavailable(
                    f"{args[0]} did not answer within {timeout:.0f} s", command=list(args)
                ) from None
            return CommandResult(
                args,
                proc.returncode if proc.returncode is not None else -1,
                out.decode(errors="replace"),
                err.decode(errors="replace"),
                time.monotonic() - started,
            )

    async def close(self) -> None:
        return None


class SSHRunner:
    """Slurm commands on a login node over one persistent, host-key-checked SSH connection."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        user: str,
        key_path: Path | None,
        known_hosts: Path | None,
        timeout: float,
        extra_env: Mapping[str, str] | None = None,
        max_sessions: int = 8,
    ) -> None:
        self.host, self.port, self.user = host, port, user
        self.key_path, self.known_hosts = key_path, known_hosts
        self.timeout = timeout
        self.env = {**COMMAND_ENV, **(extra_env or {})}
        for key in self.env:
            if not key.replace("_", "a").isalnum():
                raise ValueError(f"remote environment name {key!r} is not a valid name")
        self.description = f"ssh {user}@{host}:{port}"
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._slots = asyncio.Semaphore(max_sessions)
        self.connects = 0

    def command_line(self, argv: Sequence[str]) -> str:
        """The one string the remote shell parses: ``env K=V ... cmd args``, every word quoted."""
        args = _check_argv(argv)
        return shlex.join(["env", *(f"{k}={v}" for k, v in self.env.items()), *args])

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        line = self.command_line(argv)
        async with self._slots:
            return await asyncio.to_thread(self._run, tuple(argv), line, stdin, timeout)

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

    def _run(self, argv: tuple[str, ...], line: str, stdin: str | None, timeout: float) -> CommandResult:
        started = time.monotonic()
        channel = self._open(timeout)
        try:
            channel.settimeout(timeout)
            channel.exec_command(line)
            if stdin is not None:
                channel.sendall(stdin.encode())
            channel.shutdown_write()
            out = _read_all(channel.recv, started + timeout)
            err = _read_all(channel.recv_stderr, started + timeout)
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


def _read_all(recv: Any, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        data = recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


class RestClient:
    """slurmrestd over one keep-alive HTTP pool, authenticated with a JWT."""

    def __init__(
        self,
        *,
        base_url: str,
        user: str,
        token: SecretStr,
        timeout: float,
        max_connections: int = 8,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.description = f"slurmrestd {self.base_url} as {user}"
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={
                "X-SLURM-USER-NAME": user,
                "X-SLURM-USER-TOKEN": token.get_secret_value(),
                "Accept": "application/json",
            },
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON body)``; connection trouble is ``SchedulerUnavailable``, a refused token a
        ``SecurityError``, a body that is not JSON a ``SchedulerError`` quoting it."""
        command = [method, f"{self.base_url}{path}"]
        try:
            response = await self._http.request(method, path, json=json, params=params)
        except httpx.TimeoutException as exc:
            raise SchedulerUnavailable(
                f"slurmrestd did not answer {method} {path} in time", command=command
            ) from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable(
                f"slurmrestd unreachable ({type(exc).__name__}: {exc})", command=command
            ) from exc
        if response.status_code == 401:
            raise SecurityError(
                "slurmrestd refused the credentials (HTTP 401): check SLURM_JWT_TOKEN and hpc.slurm.rest_user"
            )
        try:
            body = response.json()
        except ValueError:
            text = response.text.strip()[:300]
            raise SchedulerError(
                f"slurmrestd answered {method} {path} with HTTP {response.status_code}: {text}",
                transient=response.status_code >= 502,
                command=command,
                exit_code=response.status_code,
                stdout=text,
            ) from None
        if not isinstance(body, dict):
            raise SchedulerError(f"slurmrestd answered {method} {path} with unexpected JSON", command=command)
        return response.status_code, body

    async def close(self) -> None:
        await self._http.aclose()


def load_pyslurm() -> ModuleType | None:
    """pyslurm if installed (an optional extra: no PyPI release matches Slurm 22.05), else ``None``."""
    try:
        return importlib.import_module("pyslurm")
    except ImportError:
        return None
