"""The raw MOAB operations behind the adapter, one class per way of reaching MOAB.

Each backend answers the same few questions with ``MoabJob`` records: submit, the jobs with these ids (one query),
the jobs with these names (for exactly-once submission), one job in detail (accounting), cancel, hold, release.
The adapter (``adapter.py``) owns the meaning. ``calls`` counts scheduler queries by kind, for the batching tests.

* ``CliBackend``: ``msub`` / ``showq --xml`` / ``checkjob --xml`` / ``mjobctl`` through a ``CommandRunner`` (SSH to
  a login node). A status round is one ``showq --xml``; only ids it does not list cost one ``showq -c --xml``
  (the completed queue, where ended jobs stay for MOAB's ``JOBCPURGETIME``). A tenant's ``msub`` runs logged in
  as the tenant's account with its own key; queries and cancels as the provider's account (a MOAB administrator).
* ``MwsBackend``: MOAB Web Services, ``/rest/jobs?api-version=3``, HTTP Basic with ``MOAB_USERNAME`` /
  ``MOAB_PASSWORD`` over verified TLS. A status round is one ``GET`` with a ``query`` on the job names; MWS keeps
  completed jobs in its database, so the same answer covers ended ones. A tenant's job names the tenant's
  account in ``credentials.user`` (MWS submits as that user).
"""

from __future__ import annotations

import abc
import asyncio
import json
import re
import ssl
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from activities.schedulers.batch.base import AccountExecutors, CommandExecutor, CommandResult
from activities.schedulers.batch.plan import SubmitPlan
from activities.schedulers.batch.transports import tls_context
from activities.schedulers.moab import parsers as p
from activities.schedulers.moab.script import msub_argv, render_mws_job, render_script
from virtengine_hpc.errors import (
    SchedulerError,
    SchedulerUnavailable,
    SecurityError,
    SubmissionRejected,
)

#: Output that means "try again later": the MOAB server is down, busy or unreachable.
TRANSIENT_PATTERNS = tuple(
    re.compile(pattern, re.I)
    for pattern in (
        r"cannot connect to (the )?(moab )?server",
        r"cannot contact (the )?(moab )?server",
        r"connection refused",
        r"connection (timed out|reset)",
        r"timed out",
        r"server is busy",
        r"server (is )?not responding",
        r"communication (error|failure)",
        r"lost connection",
        r"no route to host",
        r"temporarily unavailable",
    )
)
#: ``checkjob``/``mjobctl`` answers that mean "no such job" (purged, never existed): an answer, not a failure.
UNKNOWN_JOB = re.compile(r"cannot locate job|invalid job|job .{0,80}(not found|does not exist)", re.I)
#: ``mjobctl -c`` of a job that already ended.
ALREADY_ENDED = re.compile(r"already (completed|removed|cancell?ed|ended)|is not active", re.I)


class MoabBackend(abc.ABC):
    description: str = ""
    user: str = ""
    #: Whose jobs a lookup by name searches: the tenants' accounts, or the provider's own with no isolation.
    lookup_users: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    @abc.abstractmethod
    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        """Submit as ``account`` (None: the provider's own account); the job id."""

    async def tenant_dir(self, work_dir: str, account: str) -> str:
        """``<work_dir>/<account>``, checked to be the account's own private directory where this transport can
        see the file system (``CliBackend``); MWS cannot: the operator makes it."""
        return f"{work_dir.rstrip('/')}/{account}"

    @abc.abstractmethod
    async def by_ids(self, job_ids: Sequence[str]) -> list[p.MoabJob]:
        """These jobs, live or completed, in as few queries as the transport allows (absent: unknown or purged)."""

    @abc.abstractmethod
    async def by_names(self, names: Sequence[str]) -> list[p.MoabJob]:
        """This user's jobs with these names, live or completed."""

    @abc.abstractmethod
    async def job(self, job_id: str) -> p.MoabJob | None:
        """One job in detail (``checkjob``), or ``None`` when MOAB no longer knows it."""

    @abc.abstractmethod
    async def live(self) -> list[p.MoabJob]:
        """Every job of the accounts lookups search (``lookup_users``) that MOAB holds live, in one query."""

    @abc.abstractmethod
    async def all_jobs(self) -> list[p.MoabJob]:
        """Every job MOAB still lists, live or completed."""

    @abc.abstractmethod
    async def completed(self) -> list[p.MoabJob]:
        """The completed jobs of the accounts lookups search (``lookup_users``) that MOAB still lists (it keeps
        them for ``JOBCPURGETIME``), in one query."""

    async def ended_since(self, seconds: int) -> list[p.MoabJob]:
        """The lookup accounts' jobs that MOAB lists completed with a completion time within ``seconds``."""
        since = datetime.now(UTC) - timedelta(seconds=max(1, seconds))
        return [job for job in await self.completed() if job.end_time is not None and job.end_time >= since]

    async def users_with_jobs(self, users: Sequence[str]) -> dict[str, str]:
        """Which of ``users`` have jobs MOAB still lists, live or completed (user -> what shows it)."""
        counts = Counter(job.user for job in await self.all_jobs() if job.user in users)
        return {user: f"{n} job(s) MOAB still lists" for user, n in counts.items()}

    @abc.abstractmethod
    async def cancel(self, job_ids: Sequence[str]) -> None: ...

    @abc.abstractmethod
    async def hold(self, job_id: str, *, release: bool = False) -> None: ...

    async def close(self) -> None:
        return None


# ---- commands over SSH -----------------------------------------------------------------------------------------


class CliBackend(MoabBackend):
    def __init__(
        self,
        executor: CommandExecutor,
        *,
        user: str,
        bin_dir: Path | None = None,
        executor_as: Callable[[str], CommandExecutor] | None = None,
        lookup_users: Sequence[str] = (),
    ) -> None:
        """``executor_as(account)``: commands as a tenant's account (an SSH login with its own key)."""
        super().__init__()
        self.ex = executor
        self.user = user
        self.lookup_users = tuple(lookup_users) or (user,)
        self.bin_dir = bin_dir
        self.description = executor.runner.description
        self.executors = AccountExecutors(executor, user=user, factory=executor_as)

    def _cmd(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else name

    async def _run(
        self,
        argv: list[str],
        *,
        what: str,
        stdin: str | None = None,
        ok: Any = None,
        rejected: type[SchedulerError] = SchedulerError,
        account: str | None = None,
    ) -> CommandResult:
        executor = self.executors.get(account)
        self.calls[Path(argv[0]).name + (" -c" if "-c" in argv[1:2] else "")] += 1
        return await executor.run(argv, what=what, stdin=stdin, ok=ok, rejected=rejected)

    def _parse(self, parse: Any, result: CommandResult, what: str) -> list[p.MoabJob]:
        try:
            jobs: list[p.MoabJob] = parse(result.stdout)
        except p.ParseError as exc:
            # A half-written answer (the server restarting) is worth another try, not a state change.
            raise SchedulerUnavailable(
                f"{what}: {exc}", command=list(result.argv), stdout=result.stdout[-2000:]
            ) from exc
        return jobs

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        argv = msub_argv(plan, command=self._cmd("msub"))
        result = await self._run(
            argv,
            what="msub" if account is None else f"msub as {account}",
            stdin=render_script(plan),
            rejected=SubmissionRejected,
            account=account,
        )
        try:
            job_id = p.parse_msub(result.stdout)
        except p.ParseError as exc:
            # msub said yes but printed no id: the job may exist; the next lookup finds it.
            raise SchedulerUnavailable(
                f"msub: {exc}", command=list(result.argv), stdout=result.stdout
            ) from exc
        if account is not None and account != self.user:
            await self._check_answer(job_id, account, plan.job_name)
        return job_id

    async def _check_answer(self, job_id: str, account: str, name: str) -> None:
        """The job ``msub`` named through the tenant's login (whose shell startup files its jobs can write) is
        the one just submitted: MOAB, asked as the provider (``checkjob``), holds it under that account and
        name. Otherwise the answer is not adopted: it may name another tenant's job, to have it watched, billed
        or cancelled as this one."""
        held = await self.job(job_id)
        if held is None or held.user != account or held.name != name:
            seen = "unknown to MOAB" if held is None else f"{held.name!r} of {held.user}"
            raise SecurityError(
                f"msub as {account} answered job {job_id}, which is {seen}, not this submission ({name}): "
                "the account's login shell altered the answer"
            )

    async def _showq(self, completed: bool) -> list[p.MoabJob]:
        argv = [self._cmd("showq"), *(["-c"] if completed else []), "--xml"]
        result = await self._run(argv, what="showq -c --xml" if completed else "showq --xml")
        return self._parse(p.parse_showq, result, "showq")

    async def by_ids(self, job_ids: Sequence[str]) -> list[p.MoabJob]:
        wanted = set(job_ids)
        live = [job for job in await self._showq(False) if job.job_id in wanted]
        missing = wanted - {job.job_id for job in live}
        if not missing:
            return live
        done = [job for job in await self._showq(True) if job.job_id in missing]
        return live + done

    async def by_names(self, names: Sequence[str]) -> list[p.MoabJob]:
        wanted = set(names)
        live, done = await asyncio.gather(self._showq(False), self._showq(True))
        return [job for job in [*done, *live] if job.name in wanted and job.user in self.lookup_users]

    async def live(self) -> list[p.MoabJob]:
        return [job for job in await self._showq(False) if job.user in self.lookup_users]

    async def all_jobs(self) -> list[p.MoabJob]:
        live, done = await asyncio.gather(self._showq(False), self._showq(True))
        return [*live, *done]

    async def completed(self) -> list[p.MoabJob]:
        return [job for job in await self._showq(True) if job.user in self.lookup_users]

    async def tenant_dir(self, work_dir: str, account: str) -> str:
        return await self.executors.tenant_dir(work_dir, account)

    async def job(self, job_id: str) -> p.MoabJob | None:
        result = await self._run(
            [self._cmd("checkjob"), "--xml", job_id],
            what=f"checkjob {job_id}",
            ok=lambda r: r.exit_code == 0 or bool(UNKNOWN_JOB.search(r.stdout + r.stderr)),
        )
        if result.exit_code != 0:
            return None
        jobs = self._parse(p.parse_checkjob, result, "checkjob")
        return next((job for job in jobs if job.job_id == job_id), None)

    async def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:  # mjobctl takes one job expression per call
            await self._run(
                [self._cmd("mjobctl"), "-c", job_id],
                what=f"mjobctl -c {job_id}",
                ok=lambda r: (
                    r.exit_code == 0
                    or bool(
                        UNKNOWN_JOB.search(r.stdout + r.stderr) or ALREADY_ENDED.search(r.stdout + r.stderr)
                    )
                ),
            )

    async def hold(self, job_id: str, *, release: bool = False) -> None:
        flag = "-u" if release else "-h"
        await self._run([self._cmd("mjobctl"), flag, "user", job_id], what=f"mjobctl {flag} {job_id}")

    async def close(self) -> None:
        await self.executors.close()


# ---- MOAB Web Services -------------------------------------------------------------------------------------------

_API = {"api-version": "3"}


class MwsBackend(MoabBackend):
    def __init__(
        self,
        *,
        base_url: str,
        username: str,
        password: SecretStr,
        job_user: str | None,
        timeout: float,
        ca_cert: Path | None = None,
        max_connections: int = 8,
        lookup_users: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if not base_url.lower().startswith("https://"):
            raise SecurityError(
                f"hpc.moab.mws_url {base_url!r}: MOAB Web Services must be reached over https (Basic credentials)"
            )
        self.base_url = base_url.rstrip("/")
        self.user = job_user or username
        self.job_user = job_user
        self.lookup_users = tuple(lookup_users) or (self.user,)
        self.description = f"MWS {self.base_url} as {username}"
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            auth=httpx.BasicAuth(username, password.get_secret_value()),
            headers={"Accept": "application/json"},
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            verify=tls_context(ca_cert),
        )

    async def _request(
        self,
        kind: str,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        rejected: type[SchedulerError] = SchedulerError,
        missing_ok: bool = False,
    ) -> Any:
        """The JSON answer; ``None`` for a 404 when ``missing_ok``. Never puts the credentials in an error."""
        self.calls[kind] += 1
        command = [method, f"{self.base_url}{path}"]
        try:
            response = await self._http.request(method, path, params={**_API, **(params or {})}, json=body)
        except httpx.TimeoutException as exc:
            raise SchedulerUnavailable(
                f"MWS did not answer {method} {path} in time", command=command
            ) from exc
        except httpx.ConnectError as exc:
            if isinstance(exc.__cause__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
                exc
            ):
                raise SecurityError(
                    f"MWS at {self.base_url} presented a certificate that does not verify: {exc}"
                ) from None
            raise SchedulerUnavailable(
                f"MWS unreachable ({type(exc).__name__}: {exc})", command=command
            ) from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable(
                f"MWS unreachable ({type(exc).__name__}: {exc})", command=command
            ) from exc
        status = response.status_code
        try:
            data = response.json() if response.content else {}
        except ValueError:
            data = {"messages": [response.text.strip()[:300]]}
        if status in (401, 403):
            raise SecurityError(
                f"MWS refused the credentials (HTTP {status}): check MOAB_USERNAME and MOAB_PASSWORD"
            )
        if status == 404 and missing_ok:
            return None
        if status >= 500 or status == 429:
            raise SchedulerUnavailable(
                f"MWS {method} {path}: HTTP {status}: {p.mws_messages(data)}",
                command=command,
                exit_code=status,
                stdout=p.mws_messages(data),
            )
        if status >= 400:
            raise rejected(
                f"MWS {method} {path}: HTTP {status}: {p.mws_messages(data)}",
                command=command,
                exit_code=status,
                stdout=p.mws_messages(data),
            )
        return data

    def _jobs(self, body: Any) -> list[p.MoabJob]:
        try:
            return p.parse_mws_jobs(body if isinstance(body, dict) else {})
        except p.ParseError as exc:
            raise SchedulerUnavailable(f"MWS jobs: {exc}") from exc

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        body = await self._request(
            "POST jobs",
            "POST",
            "/rest/jobs",
            body=render_mws_job(plan, user=account or self.job_user),
            rejected=SubmissionRejected,
        )
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not p.is_job_id(name):
            raise SchedulerUnavailable(f"MWS accepted the job but named none: {str(body)[:200]}")
        return name

    async def _query(self, query: dict[str, Any]) -> list[p.MoabJob]:
        body = await self._request("GET jobs", "GET", "/rest/jobs", params={"query": json.dumps(query)})
        return self._jobs(body)

    async def by_ids(self, job_ids: Sequence[str]) -> list[p.MoabJob]:
        return await self._query({"name": {"$in": list(job_ids)}})

    async def by_names(self, names: Sequence[str]) -> list[p.MoabJob]:
        jobs = await self._query({"customName": {"$in": list(names)}})
        return [job for job in jobs if job.user in self.lookup_users]

    async def live(self) -> list[p.MoabJob]:
        return [
            job for job in await self._query({}) if job.user in self.lookup_users and job.queue != "completed"
        ]

    async def all_jobs(self) -> list[p.MoabJob]:
        return await self._query({})

    async def completed(self) -> list[p.MoabJob]:
        return [
            job for job in await self._query({}) if job.user in self.lookup_users and job.queue == "completed"
        ]

    async def job(self, job_id: str) -> p.MoabJob | None:
        body = await self._request("GET job", "GET", f"/rest/jobs/{job_id}", missing_ok=True)
        if body is None:
            return None
        try:
            return p.parse_mws_job(body)
        except p.ParseError as exc:
            raise SchedulerUnavailable(f"MWS job {job_id}: {exc}") from exc

    async def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            try:
                await self._request("DELETE job", "DELETE", f"/rest/jobs/{job_id}", missing_ok=True)
            except SchedulerUnavailable:
                raise
            except SchedulerError as exc:  # MOAB's own "already completed" answer, relayed by MWS
                if not ALREADY_ENDED.search(exc.stdout):
                    raise

    async def hold(self, job_id: str, *, release: bool = False) -> None:
        await self._request(
            "PUT job", "PUT", f"/rest/jobs/{job_id}", body={"holds": [] if release else ["USER"]}
        )

    async def close(self) -> None:
        await self._http.aclose()
