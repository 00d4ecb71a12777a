"""The raw Slurm operations behind the adapter, one class per way of reaching Slurm.

Each backend answers the same few questions with the records of ``parsers`` (``QueueJob``, ``AcctJob``,
``LiveStep``): submit a plan, list jobs from the controller (one query), from accounting (one windowed query), the
live steps of a running job, cancel, drain/resume a node. The adapter (``adapter.py``) owns the meaning: state
mapping, exactly-once submission, usage arithmetic. ``calls`` counts scheduler queries by kind, for the batching
benchmark and tests.

* ``CliBackend``: ``sbatch``/``squeue``/``sacct``/``sstat``/``scancel``/``scontrol`` through a ``CommandRunner``
  (local or SSH); ``munge`` auth. ``sbatch`` of a tenant's job runs as the tenant's account (``executor_as``: a
  local ``AccountRunner`` or an SSH login as that account); queries and cancels run as the provider's account,
  a Slurm operator.
* ``RestBackend``: slurmrestd ``/slurm/<v>/...`` and ``/slurmdb/<v>/...``; JWT auth; a tenant's job is submitted
  with ``X-SLURM-USER-NAME`` set to the tenant's account (a token of SlurmUser may do that). slurmrestd v0.0.38 has no
  sstat (live usage is wall clock and allocation; CPU arrives with the final accounting) and no run time of a running
  job (the adapter counts it from the job's times on the controller's clock, ``/diag``), no node update (drain
  needs the CLI or SSH transport) and no job-id filter on ``/slurmdb/<v>/jobs`` (vanished jobs are looked up one by
  one — they are rare: only jobs the controller forgot).
* ``PyslurmBackend``: pyslurm's 22.5 API for the controller, ``sacct`` for accounting (pyslurm's cannot read a
  requeued job's earlier runs), for sites whose Slurm matches a pyslurm release.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from activities.schedulers.batch.base import AccountExecutors
from activities.schedulers.batch.workdir import CHANGED, CHANGED_EXIT, TenantDirs, Verified, guarded
from activities.schedulers.slurm import parsers as p
from activities.schedulers.slurm.base import CommandExecutor, CommandResult
from activities.schedulers.slurm.script import SubmitPlan, render_batch_script, render_rest_job
from activities.schedulers.slurm.transports import JobRecords, RestClient
from virtengine_hpc.errors import (
    HPCError,
    SchedulerError,
    SchedulerUnavailable,
    SecurityError,
    SubmissionRejected,
)
from virtengine_hpc.tenancy import TenantAccountError

log = logging.getLogger(__name__)

#: Error output that means "try again later": the controller or slurmdbd is down, slow or restarting.
TRANSIENT_PATTERNS = tuple(
    re.compile(p, re.I)
    for p in (
        r"Socket timed out",
        r"Unable to contact slurm controller",
        r"Connection refused",
        r"Connection timed out",
        r"Connection reset",
        r"Communication connection failure",
        r"Zero Bytes were transmitted or received",
        r"Transport endpoint is not connected",
        r"backup controller in standby mode",
        r"temporarily unable to accept job",
        r"Resource temporarily unavailable",
        r"Problem talking to the database",
        r"Unable to establish (a )?connection",
        r"slurm_persist_conn_open",
        r"slurmdbd.*(unavailable|not responding|down)",
        r"[Mm]unge.*(failed|error|socket)",
        r"Slurmctld is not responding",
        r"Slurm controller not responding",
        r"Unable to connect",
        r"No route to host",
    )
)
_ACCOUNTING_DISABLED = re.compile(r"accounting storage is disabled", re.I)
_SDIAG_TIME = re.compile(
    r"^sdiag output at .*\((\d+)\)\s*$", re.M
)  # the controller's req_time, epoch seconds
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ClusterInfo:
    cluster_name: str
    controller_hosts: tuple[str, ...] = ()
    controller_port: int | None = None
    min_job_age_seconds: int | None = None
    slurm_user: str | None = None


class AccountingDisabled(SchedulerError):
    """The cluster keeps no accounting (``AccountingStorageType=accounting_storage/none``)."""

    transient = False
    code = "accounting_disabled"


class SlurmBackend(abc.ABC):
    description: str = ""
    user: str = ""
    #: Whose jobs a lookup by name searches: the tenants' accounts, or the provider's own with no isolation.
    lookup_users: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    @abc.abstractmethod
    async def cluster_info(self) -> ClusterInfo: ...

    @abc.abstractmethod
    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        """Submit as ``account`` (None: the provider's own account); the job id."""

    async def tenant_dir(self, work_dir: str, account: str) -> str:
        """``<work_dir>/<account>``, checked to be the account's own private directory where this transport can
        see the file system (``CliBackend``); slurmrestd and pyslurm cannot: the operator makes it."""
        return f"{work_dir.rstrip('/')}/{account}"

    async def account_files(self, work_dir: str, account: str) -> list[str] | None:
        """What ``account`` left in ``<work_dir>/<account>`` (``SchedulerAdapter.account_files``); None here:
        slurmrestd and pyslurm give no view of the file system."""
        return None

    async def remove_account_files(self, work_dir: str, account: str) -> None:
        raise SchedulerError(f"{self.description} cannot remove {account}'s files", transient=False)

    @abc.abstractmethod
    async def queue(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        """The controller's view of these jobs, in one query (purged or unknown ids are simply absent)."""

    @abc.abstractmethod
    async def queue_by_names(self, names: Sequence[str]) -> list[p.QueueJob]:
        """This user's jobs with these names, in any state the controller still holds."""

    async def administrators(self) -> dict[str, str]:
        """Slurm accounts with an administrative level (user -> ``Operator``/``Administrator``), where the
        provider's account may read them; raises ``SchedulerError`` when it may not."""
        return {}

    async def users_with_jobs(self, users: Sequence[str]) -> dict[str, str]:
        """Which of ``users`` have jobs the controller still holds (user -> what shows it)."""
        wanted = set(users)
        counts = Counter(job.user for job in await self.queue_live() if job.user in wanted)
        return {user: f"{n} live job(s)" for user, n in counts.items()}

    async def queue_live(self) -> list[p.QueueJob]:
        """Every job of the accounts lookups search (``lookup_users``) that has not ended, in one query."""
        raise NotImplementedError(f"{self.description}: cannot list the accounts' jobs")

    async def ended_since(self, seconds: int) -> list[p.AcctJob]:
        """Every job of the accounts lookups search that ended within the last ``seconds`` (accounting)."""
        raise NotImplementedError(f"{self.description}: cannot list the accounts' ended jobs")

    @abc.abstractmethod
    async def accounting(self, job_ids: Sequence[str], *, steps: bool) -> list[p.AcctJob]:
        """Accounting records of these jobs (with their steps if asked); raises ``AccountingDisabled``."""

    @abc.abstractmethod
    async def accounting_by_names(self, names: Sequence[str]) -> list[p.AcctJob]: ...

    async def live_steps(self, job_id: str) -> list[p.LiveStep] | None:
        """Usage so far of a running job's steps; ``None`` when this transport cannot tell."""
        return None

    async def controller_clock(self) -> datetime | None:
        """The controller's clock, where this transport gives no run time of a running job and the adapter derives
        it from the job's start (slurmrestd); ``None`` where the controller's own count comes with the job."""
        return None

    async def clock_ahead(self) -> int:
        """Seconds the clock of the host that counts a running job's run time (``squeue``'s TimeUsed is counted
        there, to its own clock, from the job's start on the controller's) is ahead of the controller's; 0 where
        the count is the controller's own or the host's clock is not ahead."""
        return 0

    @abc.abstractmethod
    async def cancel(self, job_ids: Sequence[str]) -> None: ...

    async def drain(self, node: str, reason: str) -> None:
        raise NotImplementedError(f"{self.description}: cannot drain nodes; use the cli or ssh transport")

    async def resume(self, node: str) -> None:
        raise NotImplementedError(f"{self.description}: cannot resume nodes; use the cli or ssh transport")

    @abc.abstractmethod
    async def node_busy(self, node: str) -> bool: ...

    async def close(self) -> None:
        return None


def check_node(node: str) -> str:
    if not _NODE_NAME.fullmatch(node):
        raise SchedulerError(f"{node[:80]!r} is not a valid node name", transient=False)
    return node


_ENDED_STATES = "CA,CD,F,TO,OOM,NF,PR,DL,BF"
"""``sacct -s``: every final state of a job."""


# ---- CLI (local or SSH) --------------------------------------------------------------------------------------


class CliBackend(SlurmBackend):
    def __init__(
        self,
        executor: CommandExecutor,
        *,
        cluster: str,
        user: str,
        lookback_days: int,
        executor_as: Callable[[str], CommandExecutor] | None = None,
        lookup_users: Sequence[str] = (),
        tenant_shell: bool = False,
        tenant_dirs: TenantDirs | None = None,
        local_clock: bool = False,
        job_records: JobRecords | None = None,
    ) -> None:
        """``executor_as(account)`` runs commands as a tenant's account (None: this backend cannot).
        ``tenant_dirs`` checks (and may make) each tenant's job directory: default ``stat`` through ``executor``.

        ``tenant_shell``: those commands go through the tenant account's own login shell (SSH), whose startup
        files its jobs can write. Then what ``sbatch`` answers is checked with the provider's own ``squeue``, and
        running steps are not read (``sstat`` as the provider's operator account is refused by slurmd, and as
        the tenant's it would be the tenant's word): CPU time arrives with the final accounting. ``job_records``
        answers that check from a ``scontrol`` kept running on the provider's login (else: one ``squeue``).

        ``local_clock``: the commands run on this worker's host, whose clock ``squeue`` counts a running job's
        TimeUsed to (``clock_ahead``)."""
        super().__init__()
        self.tenant_shell = tenant_shell
        self.local_clock = local_clock
        self.job_records = job_records
        self.ex = executor
        self.cluster = cluster
        self.user = user
        self.lookup_users = tuple(lookup_users) or (user,)
        self.lookback = f"now-{lookback_days}days"
        self.description = executor.runner.description
        self.executors = AccountExecutors(
            executor, user=user, factory=executor_as, dirs=tenant_dirs, calls=self.calls
        )

    async def _run(
        self,
        argv: list[str],
        *,
        what: str,
        stdin: str | None = None,
        ok: Any = None,
        rejected: type[SchedulerError] = SchedulerError,
        account: str | None = None,
        kind: str | None = None,
    ) -> CommandResult:
        executor = self.executors.get(account)
        self.calls[kind or argv[0]] += 1
        return await executor.run(argv, what=what, stdin=stdin, ok=ok, rejected=rejected)

    async def cluster_info(self) -> ClusterInfo:
        result = await self._run(["scontrol", "show", "config"], what="scontrol show config")
        config = p.parse_scontrol_config(result.stdout)
        hosts: list[str] = []
        for key, value in config.items():
            if key.startswith("SlurmctldHost"):
                name, _, addr = value.partition("(")
                hosts.extend(h for h in (name.strip(), addr.rstrip(")").strip()) if h)
        port = config.get("SlurmctldPort", "").split("-")[0]
        age = config.get("MinJobAge", "").split()[0] if config.get("MinJobAge") else ""
        return ClusterInfo(
            cluster_name=config.get("ClusterName", ""),
            controller_hosts=tuple(hosts),
            controller_port=p.parse_int(port),  # ASCII digits only: "²".isdigit() is True, int("²") fails
            min_job_age_seconds=p.parse_int(age),
            slurm_user=config.get("SlurmUser", "").partition("(")[0].strip() or None,  # "slurm(64030)"
        )

    async def clock_ahead(self) -> int:
        """``sdiag`` tells when the controller answered (whole seconds); this host's clock read after that answer
        can only overstate how far it is ahead, so a running reading corrected by it is never above the
        controller's count (the final accounting adds what it left out)."""
        if not self.local_clock:
            return 0
        result = await self._run(["sdiag"], what="sdiag")
        after = datetime.now(UTC).timestamp()
        answered = _SDIAG_TIME.search(result.stdout)
        if answered is None:
            raise SchedulerError("sdiag: no time of the controller's answer", stdout=result.stdout[:2000])
        return max(0, math.ceil(after) - int(answered.group(1)))

    async def administrators(self) -> dict[str, str]:
        result = await self._run(
            ["sacctmgr", "-n", "-P", "show", "user", "format=User,AdminLevel"], what="sacctmgr show user"
        )
        return p.parse_admin_levels(result.stdout)

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        verified = self._deferred_check(plan, account)
        try:
            # the directory's check rides in sbatch's own round trip, or was done just before (tenant_dir)
            result = await self._sbatch(plan, account, verified)
        except _NotAsChecked:  # nothing submitted: the provider's own check, then sbatch, as the first time
            assert verified is not None and account is not None
            log.info("%s is not as last checked: checking it again before submitting", verified.path)
            await self.executors.tenant_dir(str(Path(verified.path).parent), account)
            result = await self._sbatch(plan, account, None)
        try:
            job_id = p.parse_job_id(result.stdout)
        except p.ParseError as exc:
            # sbatch said yes but printed no id: the job may exist; the next lookup finds it.
            raise SchedulerUnavailable(
                f"sbatch: {exc}", command=list(result.argv), stdout=result.stdout
            ) from exc
        if account is not None and account != self.user and self.tenant_shell:
            await self._check_answer(job_id, account, plan.job_name)
        return job_id

    def _deferred_check(self, plan: SubmitPlan, account: str | None) -> Verified | None:
        """What the provider's last check found of the job's directory, when ``tenant_dir`` left the check of
        this submission to ``sbatch``'s own round trip (a tenant's login over SSH)."""
        if not self.tenant_shell or account is None or account == self.user or plan.workdir is None:
            return None
        if Path(plan.workdir).name != account:  # a directory of the job's own (never checked)
            return None
        return self.executors.dirs.verified(plan.workdir)

    async def _sbatch(
        self, plan: SubmitPlan, account: str | None, verified: Verified | None
    ) -> CommandResult:
        """``sbatch --parsable`` of the plan as ``account``, guarded by ``verified`` if given (``_NotAsChecked``:
        the directory is not as verified, nothing was submitted)."""
        argv = ["sbatch", "--parsable"]
        result = await self._run(
            guarded(verified, argv) if verified is not None else argv,
            what="sbatch" if account is None else f"sbatch as {account}",
            stdin=render_batch_script(plan),
            rejected=SubmissionRejected,
            account=account,
            ok=lambda r: r.exit_code == 0 or (verified is not None and _changed(r)),
            kind=argv[0],
        )
        if result.exit_code != 0:
            raise _NotAsChecked
        return result

    async def _check_answer(self, job_id: str, account: str, name: str) -> None:
        """The job ``sbatch`` named through the tenant's shell is the one just submitted: the controller (asked
        as the provider) holds it under that account and name. A brand-new job is always held."""
        seen = await self._not_held_as(job_id, account, name)
        if seen is not None:
            raise SecurityError(
                f"sbatch as {account} answered job {job_id}, which is {seen}, not this submission ({name}): "
                "the account's login shell altered the answer"
            )

    async def _not_held_as(self, job_id: str, account: str, name: str) -> str | None:
        """What the controller holds as ``job_id`` when it is not ``account``'s job ``name`` (``None``: it is).
        Asked of the provider's running ``scontrol`` (no new SSH command), else with the provider's ``squeue``."""
        if self.job_records is not None:
            self.calls["scontrol show job"] += 1
            try:
                answer = await self.job_records.show_job(job_id)
            except SchedulerUnavailable as exc:
                log.warning("checking sbatch's answer %s with squeue: %s", job_id, exc)
            else:
                return p.job_record_mismatch(answer, job_id, account, name)
        held = next(iter(await self._queue_named([job_id])), None)
        if held is None or held.user != account or held.name != name:
            return "not held by the controller" if held is None else f"{held.name!r} of {held.user}"
        return None

    async def queue(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        # Status: no field the job's owner can write; a separator of this query's own, every line checked.
        sep, fields = p.new_separator(), p.SQUEUE_STATUS_FIELDS
        result = await self._run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-O", p.squeue_format(fields, sep)],
            what="squeue",
            # A single id the controller no longer holds is an "error" (exit 1); several are an empty answer.
            ok=lambda r: r.exit_code == 0 or "Invalid job id specified" in r.stderr,
        )
        return p.parse_squeue(result.stdout, fields, sep=sep) if result.exit_code == 0 else []

    async def _queue_named(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        """``queue`` with each job's name, parsed strictly (a name its owner rewrote breaks only its own line)."""
        sep, fields = p.new_separator(), p.SQUEUE_LOOKUP_FIELDS
        result = await self._run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-O", p.squeue_format(fields, sep)],
            what="squeue",
            ok=lambda r: r.exit_code == 0 or "Invalid job id specified" in r.stderr,
        )
        return p.parse_squeue(result.stdout, fields, sep=sep) if result.exit_code == 0 else []

    async def tenant_dir(self, work_dir: str, account: str) -> str:
        """Checked now; or, over a tenant's login (SSH) once the provider's own check has passed, checked again
        by ``submit`` in ``sbatch``'s own round trip against what that check found (``workdir.guarded``)."""
        if self.tenant_shell and account != self.user:
            path = self.executors.dirs.path_of(work_dir, account)
            if self.executors.dirs.verified(path) is not None:
                return path
        return await self.executors.tenant_dir(work_dir, account)

    async def account_files(self, work_dir: str, account: str) -> list[str] | None:
        return await self.executors.account_files(work_dir, account)

    async def remove_account_files(self, work_dir: str, account: str) -> None:
        await self.executors.remove_account_files(work_dir, account)

    async def queue_by_names(self, names: Sequence[str]) -> list[p.QueueJob]:
        users = ",".join(self.lookup_users)
        sep, fields = p.new_separator(), p.SQUEUE_LOOKUP_FIELDS
        result = await self._run(
            [
                "squeue",
                "-h",
                "-t",
                "all",
                "-u",
                users,
                "-n",
                ",".join(names),
                "-O",
                p.squeue_format(fields, sep),
            ],
            what="squeue",
        )
        return p.parse_squeue(result.stdout, fields, sep=sep)

    async def queue_live(self) -> list[p.QueueJob]:
        users = ",".join(self.lookup_users)
        sep, fields = p.new_separator(), p.SQUEUE_SWEEP_FIELDS
        result = await self._run(
            ["squeue", "-h", "-u", users, "-O", p.squeue_format(fields, sep)], what="squeue"
        )
        return p.parse_squeue(result.stdout, fields, sep=sep)

    async def ended_since(self, seconds: int) -> list[p.AcctJob]:
        # -s with -S/-E: the jobs that ended within the window. A job that ended in the current second is not
        # before "-E now" (seen on 22.05): the window reaches a minute ahead, where no job has ended yet.
        sep, fields = p.new_separator(), p.SACCT_LOOKUP_FIELDS
        argv = [
            "sacct",
            "-X",
            "-P",
            "-n",
            "--noconvert",
            "-M",
            self.cluster,
            "-u",
            ",".join(self.lookup_users),
        ]
        argv += ["-S", f"now-{max(1, seconds)}seconds", "-E", "now+60", "-s", _ENDED_STATES]
        return await self._accounting([*argv, f"--delimiter={sep}", "-o", ",".join(fields)], fields, sep)

    def _sacct(self, *selection: str, steps: bool, fields: Sequence[str], sep: str) -> list[str]:
        # --duplicates: every run of a requeued job (one line each), not only the latest: they are all billed.
        argv = ["sacct", "-P", "-n", "--noconvert", "--duplicates", "-M", self.cluster, "-S", self.lookback]
        if not steps:
            argv.append("-X")
        return [*argv, *selection, f"--delimiter={sep}", "-o", ",".join(fields)]

    async def _accounting(self, argv: list[str], fields: Sequence[str], sep: str) -> list[p.AcctJob]:
        try:
            result = await self._run(argv, what="sacct")
        except SchedulerError as exc:
            if _ACCOUNTING_DISABLED.search(f"{exc.stdout}\n{exc.stderr}"):
                raise AccountingDisabled(
                    "Slurm accounting storage is disabled on this cluster",
                    command=exc.command,
                    exit_code=exc.exit_code,
                ) from exc
            raise
        return p.parse_sacct(result.stdout, fields, sep=sep)

    async def accounting(self, job_ids: Sequence[str], *, steps: bool) -> list[p.AcctJob]:
        sep, fields = p.new_separator(), p.SACCT_STATUS_FIELDS
        argv = self._sacct("-j", ",".join(job_ids), steps=steps, fields=fields, sep=sep)
        return await self._accounting(argv, fields, sep)

    async def accounting_by_names(self, names: Sequence[str]) -> list[p.AcctJob]:
        users = ",".join(self.lookup_users)
        sep, fields = p.new_separator(), p.SACCT_LOOKUP_FIELDS
        argv = self._sacct("-u", users, "--name", ",".join(names), steps=False, fields=fields, sep=sep)
        return await self._accounting(argv, fields, sep)

    async def users_with_jobs(self, users: Sequence[str]) -> dict[str, str]:
        """Jobs the controller holds or accounting knows within the lookback (one ``squeue``, one ``sacct``)."""
        out = await super().users_with_jobs(users)
        sep, fields = p.new_separator(), p.SACCT_LOOKUP_FIELDS
        argv = self._sacct("-u", ",".join(users), steps=False, fields=fields, sep=sep)
        try:
            counts = Counter(
                job.user for job in await self._accounting(argv, fields, sep) if job.user in users
            )
        except AccountingDisabled:
            return out
        for user, n in counts.items():
            out.setdefault(user, f"{n} job(s) in accounting since {self.lookback}")
        return out

    async def live_steps(self, job_id: str) -> list[p.LiveStep] | None:
        if self.tenant_shell:
            return None
        result = await self._run(
            ["sstat", "-P", "-n", "-a", "--noconvert", "-j", job_id, "-o", p.SSTAT_FORMAT],
            what="sstat",
            ok=lambda r: r.exit_code == 0 or not self.ex.is_transient(r.stderr),
        )
        return p.parse_sstat(result.stdout) if result.exit_code == 0 else []

    async def cancel(self, job_ids: Sequence[str]) -> None:
        # scancel exits 0 for jobs that already ended or that the controller forgot: that is success here.
        await self._run(
            ["scancel", *job_ids],
            what="scancel",
            ok=lambda r: (
                r.exit_code == 0
                or bool(re.search(r"Invalid job id|already completing or completed", r.stderr))
            ),
        )

    async def drain(self, node: str, reason: str) -> None:
        await self._run(
            ["scontrol", "update", f"nodename={check_node(node)}", "state=drain", f"reason={reason}"],
            what=f"drain {node}",
        )

    async def resume(self, node: str) -> None:
        # "Invalid node state specified": the node is not drained or down, so there is nothing to resume.
        await self._run(
            ["scontrol", "update", f"nodename={check_node(node)}", "state=resume"],
            what=f"resume {node}",
            ok=lambda r: r.exit_code == 0 or "Invalid node state specified" in r.stderr,
        )

    async def node_busy(self, node: str) -> bool:
        result = await self._run(
            [
                "squeue",
                "-h",
                "-w",
                check_node(node),
                "-t",
                "CONFIGURING,RUNNING,COMPLETING,SUSPENDED,STOPPED,SIGNALING,STAGE_OUT,RESIZING",
                "-O",
                "JobID:|",
            ],
            what=f"squeue -w {node}",
        )
        return any(line.strip() for line in result.stdout.splitlines())

    async def close(self) -> None:
        if self.job_records is not None:
            await self.job_records.close()
        await self.executors.close()


class _NotAsChecked(Exception):
    """A ``guarded`` submission found the job directory changed since the provider's check and ran nothing."""


def _changed(result: CommandResult) -> bool:
    """A ``guarded`` command that ran nothing: the directory is not as the provider checked it."""
    return result.exit_code == CHANGED_EXIT and CHANGED in result.stderr


# ---- slurmrestd ----------------------------------------------------------------------------------------------

_HELD = 2042  # "Job is in held state, pending scheduler release": the job was created
_INVALID_JOB_ID = 2017
_NOTHING_FOUND = 9003
_ALREADY_DONE = 2021
_AUTH_FAILED = 1007  # "Protocol authentication error": slurmdbd refused the token


class RestBackend(SlurmBackend):
    def __init__(
        self,
        client: RestClient,
        *,
        api_version: str,
        cluster: str,
        user: str,
        lookback_days: int,
        max_parallel: int = 16,
        lookup_users: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.http = client
        self.slurm = f"/slurm/{api_version}"
        self.slurmdb = f"/slurmdb/{api_version}"
        self.cluster = cluster
        self.user = user
        self.lookup_users = tuple(lookup_users) or (user,)
        self.lookback = f"now-{lookback_days}days"
        self.description = client.description
        self._parallel = asyncio.Semaphore(max_parallel)

    async def _fail(
        self, errors: list[dict[str, Any]], what: str, rejected: type[SchedulerError]
    ) -> HPCError:
        """The error to raise for slurmrestd's ``errors``.

        slurmrestd 22.05 answers "Unspecified error" (-1) both when slurmctld is down and when the JWT is bad; the
        accounting side tells them apart (it checks the token without the controller), so ask it.
        """
        text = "; ".join(p.rest_error_text(e) for e in errors) or "no answer"
        if any(pattern.search(text) for pattern in TRANSIENT_PATTERNS):
            return SchedulerUnavailable(f"{what}: {text}", stdout=text[:2000])
        codes = {p.rest_error_code(e) for e in errors}
        if _AUTH_FAILED in codes or (-1 in codes and await self._token_rejected()):
            return SecurityError(
                f"slurmrestd rejected the JWT of {self.user} ({what}: {text}): set a valid SLURM_JWT_TOKEN "
                "(tokens expire; see scontrol token lifespan=...)"
            )
        if -1 in codes:
            return SchedulerUnavailable(f"{what}: the controller does not answer slurmrestd ({text})")
        return rejected(f"{what}: {text}", stdout=text[:2000])

    async def _token_rejected(self) -> bool:
        self.calls["cluster"] += 1
        async with self._parallel:
            _status, body = await self.http.request("GET", f"{self.slurmdb}/cluster/{self.cluster}")
        return any(p.rest_error_code(e) == _AUTH_FAILED for e in p.rest_errors(body))

    async def _get(self, kind: str, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        self.calls[kind] += 1
        async with self._parallel:
            _status, body = await self.http.request("GET", path, params=params)
        return body

    async def cluster_info(self) -> ClusterInfo:
        body = await self._get("ping", f"{self.slurm}/ping")
        pings = body.get("pings") or []
        if not any(isinstance(x, dict) and str(x.get("ping", "")).upper() == "UP" for x in pings):
            raise await self._fail(p.rest_errors(body), "slurmrestd ping", SchedulerUnavailable)
        body = await self._get("cluster", f"{self.slurmdb}/cluster/{self.cluster}")
        names = [c.get("name") for c in body.get("clusters") or [] if isinstance(c, dict)]
        return ClusterInfo(cluster_name=self.cluster if self.cluster in names else ",".join(map(str, names)))

    async def administrators(self) -> dict[str, str]:
        body = await self._get("slurmdb/users", f"{self.slurmdb}/users")
        errors = p.rest_errors(body)
        if errors and not body.get("users"):
            raise await self._fail(errors, "slurmdbd users", SchedulerError)
        return p.parse_rest_admin_levels(body)

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        self.calls["job/submit"] += 1
        as_other = account if account is not None and account != self.user else None
        async with self._parallel:
            _status, body = await self.http.request(
                "POST", f"{self.slurm}/job/submit", json=render_rest_job(plan), user=as_other
            )
        errors = [e for e in p.rest_errors(body) if p.rest_error_code(e) != _HELD]
        job_id = body.get("job_id")
        if isinstance(job_id, int) and job_id > 0:
            return str(job_id)
        if as_other is not None and await self._cannot_act_as(as_other):
            raise SecurityError(
                f"slurmrestd refused to act as the tenant's account {as_other}: with per-tenant accounts "
                "SLURM_JWT_TOKEN must be a token of SlurmUser (scontrol token username=<SlurmUser>), see "
                "docs/security.md"
            )
        raise await self._fail(errors, "slurmrestd job/submit", SubmissionRejected)

    async def _cannot_act_as(self, account: str) -> bool:
        """slurmrestd 22.05 answers a token that may not act as another user with "Zero Bytes were transmitted"
        (like a controller that went away): a ping as that account fails then while the provider's own works."""
        self.calls["ping"] += 2
        async with self._parallel:
            _s, as_account = await self.http.request("GET", f"{self.slurm}/ping", user=account)
            _s, as_self = await self.http.request("GET", f"{self.slurm}/ping")
        return bool(p.rest_errors(as_account)) and not p.rest_errors(as_self)

    async def _all_jobs(self) -> list[p.QueueJob]:
        body = await self._get("jobs", f"{self.slurm}/jobs")
        errors = p.rest_errors(body)
        if errors and not body.get("jobs"):
            raise await self._fail(errors, "slurmrestd jobs", SchedulerError)
        return p.parse_rest_jobs(body)

    async def queue(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        wanted = set(job_ids)
        return [job for job in await self._all_jobs() if job.job_id in wanted]

    async def queue_by_names(self, names: Sequence[str]) -> list[p.QueueJob]:
        wanted = set(names)
        users = set(self.lookup_users)
        return [job for job in await self._all_jobs() if job.name in wanted and job.user in users]

    async def queue_live(self) -> list[p.QueueJob]:
        users = set(self.lookup_users)
        return [job for job in await self._all_jobs() if job.user in users]

    async def controller_clock(self) -> datetime | None:
        """slurmctld's clock (``/diag``: ``req_time``, when it answered, in whole seconds): a running job's start
        and suspend times are on this clock, the worker's may be ahead of it."""
        body = await self._get("diag", f"{self.slurm}/diag")
        statistics = body.get("statistics")
        stamp = statistics.get("req_time") if isinstance(statistics, dict) else None
        if isinstance(stamp, int) and not isinstance(stamp, bool) and stamp > 0:
            return datetime.fromtimestamp(stamp, UTC)
        raise await self._fail(p.rest_errors(body), "slurmrestd diag", SchedulerError)

    async def _db_job(self, job_id: str) -> list[p.AcctJob]:
        body = await self._get("slurmdb/job", f"{self.slurmdb}/job/{job_id}")
        errors = [e for e in p.rest_errors(body) if p.rest_error_code(e) != _NOTHING_FOUND]
        if errors and not body.get("jobs"):
            raise await self._fail(errors, f"slurmdbd job {job_id}", SchedulerError)
        return p.parse_rest_db_jobs(body)

    async def accounting(self, job_ids: Sequence[str], *, steps: bool) -> list[p.AcctJob]:
        wanted = set(job_ids)
        found = await asyncio.gather(*(self._db_job(job_id) for job_id in wanted))
        return [job for jobs in found for job in jobs if job.job_id in wanted]

    async def _db_by_name(self, name: str) -> list[p.AcctJob]:
        # 22.05 parses only one job_name per query, and start_time only as "now-N<unit>".
        body = await self._get(
            "slurmdb/jobs",
            f"{self.slurmdb}/jobs",
            params={"job_name": name, "start_time": self.lookback, "skip_steps": "true"},
        )
        errors = [e for e in p.rest_errors(body) if p.rest_error_code(e) != _NOTHING_FOUND]
        if errors and not body.get("jobs"):
            raise await self._fail(errors, "slurmdbd jobs", SchedulerError)
        users = set(self.lookup_users)
        return [job for job in p.parse_rest_db_jobs(body) if job.name == name and job.user in users]

    async def ended_since(self, seconds: int) -> list[p.AcctJob]:
        # 22.05 takes no user filter and start_time only as "now-N<unit>": every job active in the window, kept
        # here when it is a lookup account's and ended within it.
        minutes = -(-max(1, seconds) // 60)
        body = await self._get(
            "slurmdb/jobs",
            f"{self.slurmdb}/jobs",
            params={"start_time": f"now-{minutes}minutes", "skip_steps": "true"},
        )
        errors = [e for e in p.rest_errors(body) if p.rest_error_code(e) != _NOTHING_FOUND]
        if errors and not body.get("jobs"):
            raise await self._fail(errors, "slurmdbd jobs", SchedulerError)
        users, since = set(self.lookup_users), datetime.now(UTC) - timedelta(seconds=seconds)
        return [
            job
            for job in p.parse_rest_db_jobs(body)
            if job.user in users and job.end_time is not None and job.end_time >= since
        ]

    async def accounting_by_names(self, names: Sequence[str]) -> list[p.AcctJob]:
        found = await asyncio.gather(*(self._db_by_name(name) for name in names))
        return [job for jobs in found for job in jobs]

    async def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            self.calls["job/delete"] += 1
            async with self._parallel:
                _status, body = await self.http.request("DELETE", f"{self.slurm}/job/{job_id}")
            errors = [
                e for e in p.rest_errors(body) if p.rest_error_code(e) not in (_INVALID_JOB_ID, _ALREADY_DONE)
            ]
            errors = [e for e in errors if "already completing or completed" not in p.rest_error_text(e)]
            if errors:
                raise await self._fail(errors, f"slurmrestd cancel {job_id}", SchedulerError)

    async def node_busy(self, node: str) -> bool:
        body = await self._get("node", f"{self.slurm}/node/{check_node(node)}")
        nodes = [n for n in body.get("nodes") or [] if isinstance(n, dict)]
        if not nodes:
            raise await self._fail(p.rest_errors(body), f"slurmrestd node {node}", SchedulerError)
        state = " ".join(
            [str(nodes[0].get("state", ""))] + [str(f) for f in nodes[0].get("state_flags") or []]
        ).upper()
        return (nodes[0].get("alloc_cpus") or 0) > 0 or any(
            word in state for word in ("ALLOCATED", "MIXED", "COMPLETING")
        )

    async def close(self) -> None:
        await self.http.close()


# ---- pyslurm (optional) --------------------------------------------------------------------------------------


class PyslurmBackend(SlurmBackend):
    """pyslurm 22.5's object API for the controller (run in threads: libslurm calls block), ``sacct`` for accounting.

    pyslurm cannot read a requeued job's earlier runs: its database filter (``pyslurm.db.JobFilter``) never asks
    slurmdbd for them (it sets ``JOBCOND_FLAG_NO_TRUNC`` alone, never ``JOBCOND_FLAG_DUP``, and takes no flags), and
    both its database APIs key their answer by job id (``db.Jobs`` and the old ``slurmdb_jobs().get(flags=...)``),
    so a run hides the others. Every run held its allocation and is billed, so accounting comes from
    ``sacct --duplicates`` on the worker's host (``sacct``: the client commands of the Slurm whose libslurm pyslurm
    links, with the same ``slurm.conf``), as on the cli transport.

    Not exercised with pyslurm itself by this project's CI: no pyslurm release on PyPI matches the Slurm 22.05 it
    runs. Its accounting is the cli transport's, tested on the real cluster.
    """

    def __init__(self, pyslurm: ModuleType, *, cluster: str, user: str, sacct: CliBackend) -> None:
        super().__init__()
        self.pyslurm = pyslurm
        self.cluster = cluster
        self.user = user
        self.lookup_users = (user,)
        self.description = f"pyslurm {getattr(pyslurm, '__version__', '?')}"
        self.sacct = sacct
        self.sacct.calls = self.calls  # one count of this transport's queries

    async def clock_ahead(self) -> int:
        """pyslurm's ``run_time`` of a running job is counted here, to this host's clock, as ``squeue``'s is."""
        return await self.sacct.clock_ahead()

    async def _call(self, kind: str, fn: Any, *args: Any) -> Any:
        self.calls[kind] += 1
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:  # pyslurm raises RPCError / ValueError with Slurm's message
            text = str(exc)
            if any(pattern.search(text) for pattern in TRANSIENT_PATTERNS):
                raise SchedulerUnavailable(f"pyslurm {kind}: {text}") from exc
            raise SchedulerError(f"pyslurm {kind}: {text}") from exc

    async def cluster_info(self) -> ClusterInfo:
        return ClusterInfo(cluster_name=self.cluster)

    async def submit(self, plan: SubmitPlan, account: str | None = None) -> str:
        if account is not None and account != self.user:
            raise TenantAccountError(
                f"pyslurm cannot submit as another account ({account}): use the cli, ssh or rest transport"
            )

        def run() -> int:
            desc = self.pyslurm.JobSubmitDescription(
                name=plan.job_name,
                comment=plan.comment,
                partitions=plan.partition,
                nodes=plan.nodes,
                ntasks_per_node=plan.tasks_per_node,
                cpus_per_task=plan.cpus_per_task,
                memory_per_node=f"{plan.mem_mb_per_node}M",
                time_limit=str(plan.time_minutes),
                working_directory=plan.workdir,
                standard_output=plan.output_file,
                standard_error=plan.error_file,
                environment=plan.environment,
                script=render_batch_script(plan),
            )
            if plan.account:
                desc.account = plan.account
            if plan.gres:
                desc.gres_per_node = plan.gres
            if plan.hold:
                desc.priority = 0
            return int(desc.submit())

        try:
            return str(await self._call("submit", run))
        except SchedulerUnavailable:
            raise
        except SchedulerError as exc:
            raise SubmissionRejected(str(exc)) from exc

    def _queue_job(self, job: Any) -> p.QueueJob:
        def when(value: Any) -> datetime | None:
            return datetime.fromtimestamp(int(value), UTC) if value else None

        return p.QueueJob(
            job_id=str(job.id),
            state=str(job.state or ""),
            reason=str(getattr(job, "state_reason", "") or ""),
            submit_time=when(getattr(job, "submit_time", None)),
            start_time=when(getattr(job, "start_time", None)),
            end_time=when(getattr(job, "end_time", None)),
            elapsed_seconds=getattr(job, "run_time", None),
            alloc_tres=p.parse_tres(str(getattr(job, "allocated_tres", "") or ""), usage=False),
            user=str(getattr(job, "user_name", "") or ""),
            name=str(job.name or ""),
            comment=str(getattr(job, "comment", "") or ""),
            exit_code=p.exit_code_from_pair(str(getattr(job, "exit_code", "") or "")),
            het_leader=p.component_of(str(job.id), str(getattr(job, "het_job_id", "") or "")),
        )

    async def _all(self) -> list[p.QueueJob]:
        jobs = await self._call("jobs", lambda: self.pyslurm.Jobs.load())
        return [self._queue_job(job) for job in jobs.values()]

    async def queue(self, job_ids: Sequence[str]) -> list[p.QueueJob]:
        wanted = set(job_ids)
        return [job for job in await self._all() if job.job_id in wanted]

    async def queue_by_names(self, names: Sequence[str]) -> list[p.QueueJob]:
        wanted = set(names)
        return [job for job in await self._all() if job.name in wanted and job.user in self.lookup_users]

    async def queue_live(self) -> list[p.QueueJob]:
        users = set(self.lookup_users)
        return [job for job in await self._all() if job.user in users]

    async def accounting(self, job_ids: Sequence[str], *, steps: bool) -> list[p.AcctJob]:
        return await self.sacct.accounting(job_ids, steps=steps)

    async def accounting_by_names(self, names: Sequence[str]) -> list[p.AcctJob]:
        return await self.sacct.accounting_by_names(names)

    async def ended_since(self, seconds: int) -> list[p.AcctJob]:
        return await self.sacct.ended_since(seconds)

    async def cancel(self, job_ids: Sequence[str]) -> None:
        for job_id in job_ids:
            try:
                await self._call("cancel", lambda j=job_id: self.pyslurm.Job(int(j)).cancel())
            except SchedulerUnavailable:
                raise
            except SchedulerError as exc:
                if not re.search(r"Invalid job id|already completing or completed", str(exc)):
                    raise

    async def node_busy(self, node: str) -> bool:
        loaded = await self._call("node", lambda: self.pyslurm.Node.load(check_node(node)))
        return bool(getattr(loaded, "allocated_cpus", 0))

    async def close(self) -> None:
        await self.sacct.close()
