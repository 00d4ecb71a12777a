"""How the adapter reaches Slurm: local commands, commands over SSH, slurmrestd over HTTP, or pyslurm.

* ``LocalRunner`` runs argv lists with ``asyncio`` subprocesses (no shell), in a clean environment: the worker's own
  environment (which may hold ``SLURM_JWT_TOKEN`` and friends) never reaches ``sbatch`` and so never a job.
  ``AccountRunner`` runs them as a tenant's account through it (``setpriv``, ``runuser`` or ``sudo`` before the argv).
* ``SSHRunner`` keeps one paramiko connection (key auth, host key checked against known_hosts with
  ``RejectPolicy``) and opens a channel per command; every argument is ``shlex``-quoted, the script goes on the
  channel's stdin. ``TCP_NODELAY`` on the socket removes the Nagle/delayed-ACK stall that otherwise costs ~40 ms per
  command (measured on the project machine: 20 -> ~200 commands/s).
* ``JobRecords`` keeps one interactive ``scontrol`` running on the provider's own SSH login and asks it for one
  job's record at a time: the check of what ``sbatch`` answered in a tenant's login, without a new SSH command.
* ``RestClient`` talks to slurmrestd with one keep-alive ``httpx`` pool, the JWT in ``X-SLURM-USER-TOKEN`` (never in
  a URL, a log line or an error); a request may name another account in ``X-SLURM-USER-NAME`` (a tenant's
  submission), which slurmrestd accepts only with a token of SlurmUser.
* ``load_pyslurm`` imports pyslurm if the site installed a release matching its Slurm (none on PyPI matches 22.05).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import pwd
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import paramiko
from pydantic import SecretStr

from activities.schedulers.batch import transports as batch_transports
from activities.schedulers.batch.transports import check_argv
from activities.schedulers.slurm.base import CommandResult
from virtengine_hpc.errors import SchedulerError, SchedulerUnavailable, SecurityError
from virtengine_hpc.tenancy import TenantAccountError

log = logging.getLogger(__name__)

#: Environment of every Slurm command: epoch timestamps instead of the cluster's local time.
COMMAND_ENV = {"SLURM_TIME_FORMAT": "%s", "LC_ALL": "C"}
_LOCAL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _Child:
    """The process of one command, killable from the event loop while a pool thread waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._killed = False

    def start(self, spawn: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._killed:
                raise SchedulerUnavailable("the command was cancelled before it started")
            self._proc = spawn()
            return self._proc

    def kill(self) -> None:
        """Kill the command and whatever it started (its own session), or keep it from starting."""
        with self._lock:
            self._killed = True
            if self._proc is not None and self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)


class LocalRunner:
    """Slurm commands on this host (the worker runs where ``sbatch`` and ``slurm.conf`` are).

    Commands run in a small thread pool with ``subprocess`` (``vfork``/``posix_spawn``): measured here, that
    starts ``sbatch`` at 1.3-1.6x the rate of asyncio's subprocess transport (whose child watcher costs a thread
    per command) once several run at once.
    """

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
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="slurm-cmd")

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        """Run ``argv``; if the caller is cancelled (its activity attempt was), the command is killed."""
        args = check_argv(argv)
        child = _Child()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._run, args, stdin, timeout, child)
        except asyncio.CancelledError:
            child.kill()
            raise

    def _run(self, args: tuple[str, ...], stdin: str | None, timeout: float, child: _Child) -> CommandResult:
        started = time.monotonic()
        try:
            proc = child.start(
                lambda: subprocess.Popen(
                    args,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=self.env,
                    start_new_session=True,
                )
            )
        except FileNotFoundError:
            return CommandResult(args, 127, "", f"{args[0]}: command not found")
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot run {args[0]}: {exc}", command=list(args)) from exc
        try:
            out, err = proc.communicate(stdin.encode() if stdin is not None else None, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise SchedulerUnavailable(
                f"{args[0]} did not answer within {timeout:.0f} s", command=list(args)
            ) from None
        return CommandResult(
            args,
            proc.returncode,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            time.monotonic() - started,
        )

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AccountRunner:
    """Commands of ``LocalRunner`` run as another local account: ``runuser`` (root, through PAM: the account's
    resource limits apply), ``setpriv`` (root: switches uid, gid and groups without a PAM session; measured here
    about 2.4 ms less per ``sbatch`` than ``runuser``) or ``sudo -n`` (an unprivileged worker with a sudoers rule).
    The argv is a list: no shell ever sees the account name or a job's field."""

    def __init__(self, runner: LocalRunner, account: str, how: str) -> None:
        self.runner = runner
        self.account = account
        self.description = f"local as {account} ({how})"
        #: Any command runs as the account, and no login shell does (its startup files, the tenant's to write,
        #: never see it): the listing and removal of what the account left can be trusted. Not with sudo, whose
        #: rule allows sbatch alone.
        self.runs_any_command = how in ("setpriv", "runuser")
        if how == "setpriv":
            try:
                entry = pwd.getpwnam(account)
            except KeyError:
                raise TenantAccountError(f"account {account} does not exist on this host") from None
            self.prefix: tuple[str, ...] = (
                "setpriv",
                f"--reuid={entry.pw_uid}",
                f"--regid={entry.pw_gid}",
                "--init-groups",
                "--",
            )
        elif how == "runuser":
            self.prefix = ("runuser", "-u", account, "--")
        elif how == "sudo":
            self.prefix = ("sudo", "-n", "-u", account, "--")
        else:
            raise ValueError(f"unknown way to switch user: {how}")

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        return await self.runner.run([*self.prefix, *argv], stdin=stdin, timeout=timeout)

    async def close(self) -> None:
        return None  # the shared LocalRunner is closed by its owner


class SSHRunner(batch_transports.SSHRunner):
    """Slurm commands on a login node over SSH: the shared runner with Slurm's command environment."""

    def __init__(self, *, extra_env: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(env={**COMMAND_ENV, **(extra_env or {})}, **kwargs)


class JobRecords:
    """``scontrol -o show job <id>`` answered by one long-lived interactive ``scontrol`` on the provider's own SSH
    login: the check of the job id ``sbatch`` answered through a tenant's login shell.

    A new SSH command per check costs a session on the login node (sshd's fork, the login shell, then ``squeue``
    loading Slurm's configuration and plugins: 6.5 ms a check measured here), where the running ``scontrol``
    answers each ``show job`` with one controller RPC (0.4 ms). Each answer is framed by ``show hostnames
    <token>``, which prints back a token drawn at random for that query alone: a job's name or comment (which the
    job's owner writes, newlines included) can neither end an answer early nor leave text for the next one. The
    process runs as the provider's account in the provider's own login, which no tenant reaches. Any trouble (a
    timeout, a dropped connection, a cancelled caller) ends it, and the next query starts a new one; after a
    failure, queries fail at once for ``PAUSE`` seconds (their callers ask ``squeue`` instead): queries wait for
    one another, and a controller or login node that stopped answering must not cost each of them a timeout.
    """

    PAUSE = 30.0

    def __init__(self, runner: SSHRunner, timeout: float) -> None:
        self.runner = runner
        self.timeout = timeout
        self.argv = ["scontrol", "-o"]
        self._lock = asyncio.Lock()
        self._stream: _Stream | None = None
        self._paused_until = 0.0

    async def show_job(self, job_id: str) -> str:
        """What ``scontrol`` printed for ``job_id`` up to the end of its answer (its prompt and the echo of the
        request included; a job the controller does not hold: no record, "Invalid job id" on standard error).
        ``SchedulerUnavailable`` when ``scontrol`` cannot be started, does not answer in time, or says that
        anything but the job's absence kept the record from it (a controller it cannot reach)."""
        if not job_id.isascii() or not job_id.isdigit():
            raise ValueError(f"not a job id: {job_id[:40]!r}")
        async with self._lock:
            if time.monotonic() < self._paused_until:
                raise SchedulerUnavailable("scontrol over SSH failed moments ago", command=self.argv)
            try:
                if self._stream is None:
                    self._stream = _Stream(
                        await asyncio.to_thread(self.runner.start, self.argv, self.timeout)
                    )
                return await asyncio.to_thread(self._stream.ask, job_id, self.timeout)
            except SchedulerUnavailable:
                self._paused_until = time.monotonic() + self.PAUSE
                self._end()
                raise
            except BaseException:  # cancelled or failed mid-answer: what is still to come would be the next's
                self._end()
                raise

    def _end(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.channel.close()

    async def close(self) -> None:
        """Ends the running ``scontrol`` now: a query still waiting for its answer fails at once
        (``SchedulerUnavailable``) instead of holding the close up to its timeout."""
        self._end()


class _Stream:
    """The channel of one running ``scontrol`` and what it printed past the last answer read."""

    _LIMIT = 1 << 20

    def __init__(self, channel: paramiko.Channel) -> None:
        self.channel = channel
        self.pending = b""

    def ask(self, job_id: str, timeout: float) -> str:
        # a letter last: hostlist reads trailing digits as a number, and prints 20 or more of them back changed
        token = f"vehpc-end-{secrets.token_hex(16)}z"
        end = f"\n{token}\n".encode()
        deadline = time.monotonic() + timeout
        errors = b""
        try:
            self.channel.sendall(f"show job {job_id}\nshow hostnames {token}\n".encode())
            while (at := (b"\n" + self.pending).find(end)) < 0:
                if len(self.pending) > self._LIMIT:
                    raise EOFError(f"{len(self.pending)} bytes and no end of the answer")
                self.channel.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = self.channel.recv(65536)
                if not chunk:
                    raise EOFError("scontrol ended")
                self.pending += chunk
                while self.channel.recv_stderr_ready():
                    errors += self.channel.recv_stderr(65536)
            answer = self.pending[: max(0, at - 1)]
            self.pending = self.pending[at - 1 + len(end) :]
            if b"JobId=" not in answer:
                # No record: scontrol said why on standard error, which may arrive after the end token. Only
                # "Invalid job id" means the controller does not hold the job; any other error ("Unable to
                # contact slurm controller", "Socket timed out") means nobody knows yet.
                while b"\n" not in errors:
                    self.channel.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = self.channel.recv_stderr(65536)
                    if not chunk:
                        raise EOFError("scontrol ended")
                    errors += chunk
                said = errors.decode(errors="replace").strip()
                if "Invalid job id specified" not in said:
                    raise SchedulerUnavailable(
                        f"scontrol over SSH could not answer for job {job_id}: {said[:200]}",
                        command=["scontrol", "show", "job", job_id],
                    )
        except TimeoutError:
            raise SchedulerUnavailable(
                f"scontrol over SSH did not answer within {timeout:.0f} s",
                command=["scontrol", "show", "job", job_id],
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SchedulerUnavailable(
                f"scontrol over SSH failed: {exc}", command=["scontrol", "show", "job", job_id]
            ) from exc
        return answer.decode(errors="replace")


class RestClient:
    """slurmrestd over one keep-alive HTTP pool, authenticated with a JWT."""

    def __init__(
        self,
        *,
        base_url: str,
        user: str,
        token: SecretStr,
        timeout: float,
        max_connections: int = 16,
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
        user: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON body)``; connection trouble is ``SchedulerUnavailable``, a refused token a
        ``SecurityError``, a body that is not JSON a ``SchedulerError`` quoting it. ``user`` acts as that account
        instead of the client's own (``X-SLURM-USER-NAME``)."""
        command = [method, f"{self.base_url}{path}"]
        headers = {"X-SLURM-USER-NAME": user} if user is not None else None
        try:
            response = await self._http.request(method, path, json=json, params=params, headers=headers)
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
