"""The SLURM adapter: one class, four interchangeable transports (local CLI, CLI over SSH, slurmrestd, pyslurm).

What it promises (``activities/schedulers/base.py``), and how:

* **Exactly once.** The job's name is the workflow's marker (``vehpc-<id>.<tag>``, adopted only if the tag verifies
  for the account the job runs as: ``BatchSchedulerAdapter``). ``find`` asks the
  controller (``squeue -t all --name``: every job it holds, ended ones for ``MinJobAge``) *and* accounting
  (``sacct --name`` over ``accounting_lookback``) at once: the controller covers the seconds before accounting
  hears of a new job (4-5 s here), accounting covers jobs the controller has forgotten. ``submit`` looks first,
  and again before every retry (``BatchSchedulerAdapter``).
* **One query per poll.** ``status_batch`` asks the controller once for all ids; only ids it no longer holds, or
  that it reports ended (their exit code and "CANCELLED by N" live in accounting), cost one more windowed
  ``sacct``. A job the controller reports ended is held at its last live state until accounting confirms the end
  (at most ``accounting_grace``), so the workflow sees the end once, complete with exit code. A job found nowhere
  is ``found=False``, never "completed". A failed query raises ``SchedulerUnavailable``: never a state change.
* **Pending forever is failure.** A pending reason that means "never starts" (``states.NEVER_START_REASONS``)
  fails the job at once, and the job is cancelled so it cannot start behind the workflow's back.
* **One account per tenant.** A job runs as its tenant's account (``hpc.tenants``; never root, never the
  provider's own account): ``sbatch`` through ``setpriv``/``runuser``/``sudo`` (cli), an SSH login as that account
  with its own key (ssh), ``X-SLURM-USER-NAME`` with a SlurmUser token (rest); pyslurm cannot, and refuses to run
  with isolation. Its output goes to ``<work_dir>/<account>``, the account's own and 0700, checked before every
  submission (cli, ssh: ``batch.workdir``; a root cli worker makes it, elsewhere the operator does). Lookups by
  name search the tenants' accounts only; status, usage and cancel run as the provider's account, which must be a
  Slurm operator (docs/security.md).
* **Usage** is a raw reading, cumulative and monotone (``virtengine_hpc.metering`` meters it): run time = Slurm's
  elapsed; allocation = ``AllocTRES`` (nodes, CPUs, memory, GPUs); measured, summed over the steps (``sstat`` for
  running steps, ``sacct`` for ended ones): CPU time, peak RSS, disk bytes read and written (``fs/disk``),
  interconnect bytes (``ic/*``) and energy (the job's ``ConsumedEnergyRaw``) where the site gathers them. A
  requeued job runs again under the same id, and every run held its allocation: accounting keeps one record per
  run (``sacct --duplicates``), and the reading adds them all up, its earlier runs' while the latest one runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from activities.schedulers.base import (
    Accounting,
    ListedJob,
    NativeStatus,
    SubmitRequest,
    hold_back_taken,
)
from activities.schedulers.batch.workdir import local_tenant_dirs
from activities.schedulers.slurm import parsers as p
from activities.schedulers.slurm.backends import (
    TRANSIENT_PATTERNS,
    AccountingDisabled,
    CliBackend,
    ClusterInfo,
    PyslurmBackend,
    RestBackend,
    SlurmBackend,
    check_node,
)
from activities.schedulers.slurm.base import (
    Backoff,
    BatchSchedulerAdapter,
    Candidate,
    CommandExecutor,
    Owner,
    chunked_by_length,
    retrying,
)
from activities.schedulers.slurm.script import plan_submission
from activities.schedulers.slurm.states import Mapped, map_state
from activities.schedulers.slurm.transports import (
    AccountRunner,
    JobRecords,
    LocalRunner,
    RestClient,
    SSHRunner,
    load_pyslurm,
)
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import Config, Secrets, SlurmConfig
from virtengine_hpc.errors import ConfigError, JobNotFound, SchedulerError
from virtengine_hpc.markers import MarkerKey, load_key
from virtengine_hpc.metering import Allocated, Reading, highest
from virtengine_hpc.states import JobState

log = logging.getLogger(__name__)

#: Characters of comma-joined ids per ``squeue -j`` / ``sacct -j`` call. Linux takes at most 128 KiB in one
#: argument (over SSH the whole command is one argument of the remote shell), so 100,000 leaves room for the rest
#: of the command: 10,000 watched jobs with ids up to 9 digits are one query, where a fixed 5,000 ids made two.
MAX_ID_CHARS_PER_QUERY = 100_000
_RUNNING_LIKE = (JobState.RUNNING, JobState.SUSPENDED)
_USAGE_CACHE = 20_000


def _is_job_id(value: str) -> bool:
    return value.isdigit() and len(value) <= 12


def _require_job_id(value: str) -> str:
    if not _is_job_id(value):
        raise JobNotFound(f"{value[:80]!r} is not a Slurm job id", transient=False)
    return value


class SlurmAdapter(BatchSchedulerAdapter):
    """SLURM through a ``SlurmBackend``; build it with ``from_config`` (or directly, in tests and benchmarks)."""

    name = "slurm"

    mpi_launcher = "srun"

    def __init__(
        self,
        backend: SlurmBackend,
        *,
        cluster_id: str,
        config: SlurmConfig,
        backoff: Backoff,
        tenants: TenantAccounts,
        hold: bool = False,
        verify_cluster: bool = True,
        markers: MarkerKey | None = None,
    ) -> None:
        """``hold`` submits jobs held (``--hold``), for tests and benchmarks that need jobs which never start.
        ``tenants`` says which account runs each tenant's jobs (``TenantAccounts.shared()``: the backend's own).
        ``markers``: the provider's marker key (``from_config`` loads it; default a key of this process alone)."""
        super().__init__(backoff=backoff, markers=markers)
        self.backend = backend
        self.tenants = tenants
        self.cluster_id = cluster_id
        self.config = config
        self.hold = hold
        self.accounting_grace = config.accounting_grace.total_seconds()
        self._verify_cluster = verify_cluster
        self._checked = False
        self._check_lock = asyncio.Lock()
        self._accounting_enabled = True
        self._high_water: dict[str, Reading] = {}
        self._steps: dict[str, _RunSteps] = {}

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Config, secrets: Secrets, cluster_id: str) -> SlurmAdapter:
        s = config.hpc.slurm
        transport = s.transport or ("rest" if s.auth_method == "jwt" else "cli")
        timeout = s.connection_timeout.total_seconds()
        lookback_days = max(1, int(s.accounting_lookback.total_seconds() // 86400))
        tenants = TenantAccounts.from_config(config)
        lookup_users = sorted(tenants.accounts())
        tenants.warn_if_unusable(cluster_id)
        backend: SlurmBackend
        if transport == "cli":
            runner = LocalRunner(slurm_conf=s.slurm_conf, extra_env=s.remote_env)
            user = pwd.getpwuid(os.getuid()).pw_name

            def as_local(account: str) -> CommandExecutor:
                return CommandExecutor(
                    AccountRunner(runner, account, s.switch_user), TRANSIENT_PATTERNS, timeout
                )

            backend = CliBackend(
                CommandExecutor(runner, TRANSIENT_PATTERNS, timeout),
                cluster=s.cluster_name,
                user=user,
                lookback_days=lookback_days,
                executor_as=as_local if tenants.isolated else None,
                lookup_users=lookup_users,
                tenant_dirs=local_tenant_dirs(user),
                local_clock=True,
            )
        elif transport == "ssh":
            backend = cls._ssh_backend(s, tenants, timeout, lookback_days)
        elif transport == "rest":
            if secrets.slurm_jwt_token is None:
                raise ConfigError("SLURM_JWT_TOKEN is not set: the rest transport authenticates with a JWT")
            if s.work_dir is None:
                raise ConfigError(
                    "hpc.slurm.work_dir: required for the rest transport (slurmrestd needs one)"
                )
            if s.rest_user is None:
                raise ConfigError(
                    "hpc.slurm.rest_user: required for the rest transport (the provider's own unprivileged "
                    "Slurm account, never root)"
                )
            client = RestClient(
                base_url=s.rest_url or f"http://{s.controller_host}:6820",
                user=s.rest_user,
                token=secrets.slurm_jwt_token,
                timeout=timeout,
            )
            backend = RestBackend(
                client,
                api_version=s.api_version,
                cluster=s.cluster_name,
                user=s.rest_user,
                lookback_days=lookback_days,
                lookup_users=lookup_users,
            )
        else:
            if tenants.isolated:
                raise ConfigError(
                    "hpc.slurm.transport pyslurm cannot submit as each tenant's own account (hpc.tenants): use "
                    "the cli, ssh or rest transport, or hpc.tenants.isolation none for a single trusted tenant"
                )
            module = load_pyslurm()
            if module is None:
                raise ConfigError(
                    "hpc.slurm.transport pyslurm: pyslurm is not installed (no PyPI release matches Slurm 22.05; "
                    "install the release matching your Slurm, or use cli, ssh or rest)"
                )
            user = pwd.getpwuid(os.getuid()).pw_name
            sacct = CliBackend(
                CommandExecutor(
                    LocalRunner(slurm_conf=s.slurm_conf, extra_env=s.remote_env), TRANSIENT_PATTERNS, timeout
                ),
                cluster=s.cluster_name,
                user=user,
                lookback_days=lookback_days,
                local_clock=True,  # pyslurm counts a running job's run_time on this host too, as squeue does
            )
            backend = PyslurmBackend(module, cluster=s.cluster_name, user=user, sacct=sacct)
        adapter = cls(
            backend,
            cluster_id=cluster_id,
            config=s,
            backoff=Backoff.from_config(config.hpc.retry, s.max_retries),
            tenants=tenants,
            markers=load_key(secrets, config.state_dir),
        )
        adapter.sibling_clusters = tuple(c for c in config.cluster_ids() if c != cluster_id)
        return adapter

    @staticmethod
    def _ssh_backend(
        s: SlurmConfig, tenants: TenantAccounts, timeout: float, lookback_days: int
    ) -> CliBackend:
        """Queries and cancels as ``ssh_user``; each tenant's ``sbatch`` over its own login and key."""
        if not s.ssh_user:
            raise ConfigError("hpc.slurm.ssh_user: required for the ssh transport")
        key_dir = s.tenant_key_dir
        if tenants.isolated and key_dir is None:
            raise ConfigError(
                "hpc.slurm.tenant_key_dir: required for the ssh transport with per-tenant accounts (one private "
                "key per tenant account, named after it)"
            )

        def runner(user: str, key: Path | None) -> SSHRunner:
            return SSHRunner(
                host=s.ssh_host or s.controller_host,
                port=s.ssh_port,
                user=user,
                key_path=key,
                known_hosts=s.known_hosts_path,
                timeout=timeout,
                extra_env=s.remote_env,
            )

        def as_tenant(account: str) -> CommandExecutor:
            assert key_dir is not None
            return CommandExecutor(runner(account, key_dir / account), TRANSIENT_PATTERNS, timeout)

        own = runner(s.ssh_user, s.ssh_key_path)
        return CliBackend(
            CommandExecutor(own, TRANSIENT_PATTERNS, timeout),
            cluster=s.cluster_name,
            user=s.ssh_user,
            lookback_days=lookback_days,
            executor_as=as_tenant if tenants.isolated else None,
            lookup_users=sorted(tenants.accounts()),
            tenant_shell=tenants.isolated,
            job_records=JobRecords(own, timeout) if tenants.isolated else None,
        )

    def expected_account(self, tenant: str) -> str | None:
        if not self.tenants.isolated:
            return self.backend.user
        return self.tenants.assigned(tenant)

    async def _account(self, tenant: str) -> str:
        """The account the tenant's job runs as (``TenantAccountError`` when it has none or a privileged one).

        Before the pool hands a tenant its account, the cluster is asked whether any still unassigned pool
        account has jobs: such an account is some tenant's in an assignments file this one does not know (lost
        and recreated, or another host's own), and is never handed out here; nor is one whose job directory
        holds files (``hold_back_taken``)."""
        await hold_back_taken(self, self.tenants, tenant, cluster_id=self.cluster_id)
        return await asyncio.to_thread(self.tenants.account_for, tenant, submit_account=self.backend.user)

    async def accounts_in_use(self, accounts: Sequence[str]) -> dict[str, str]:
        return await self.backend.users_with_jobs(list(accounts))

    async def account_files(self, account: str) -> list[str] | None:
        if self.config.work_dir is None or not self.tenants.isolated:
            return None
        return await self.backend.account_files(str(self.config.work_dir), account)

    async def remove_account_files(self, account: str) -> None:
        if self.config.work_dir is None or not self.tenants.isolated:
            await super().remove_account_files(account)
        await self.backend.remove_account_files(str(self.config.work_dir), account)

    @property
    def calls(self) -> dict[str, int]:
        """Scheduler queries made so far, by kind (``squeue``, ``sacct``, ``jobs``, ...)."""
        return dict(self.backend.calls)

    async def _ready(self) -> None:
        """Once per adapter: check that the scheduler we reach is the cluster the config names."""
        if self._checked or not self._verify_cluster:
            return
        async with self._check_lock:
            if self._checked:
                return
            info = await self.backend.cluster_info()
            if info.cluster_name != self.config.cluster_name:
                raise ConfigError(
                    f"hpc.slurm.cluster_name is {self.config.cluster_name!r} but {self.backend.description} "
                    f"reaches cluster {info.cluster_name or '(unknown)'!r}"
                )
            if info.controller_port and info.controller_port != self.config.controller_port:
                log.warning(
                    "hpc.slurm.controller_port %s differs from the cluster's SlurmctldPort %s",
                    self.config.controller_port,
                    info.controller_port,
                )
            if info.controller_hosts and self.config.controller_host not in info.controller_hosts:
                log.warning(
                    "hpc.slurm.controller_host %s is not among the cluster's SlurmctldHost entries %s",
                    self.config.controller_host,
                    ", ".join(info.controller_hosts),
                )
            await self._learn_privileged(info)
            self._checked = True

    async def _learn_privileged(self, info: ClusterInfo) -> None:
        """What the cluster says is privileged (SlurmUser, operators, administrators) is never a tenant's
        account (``hpc.tenants``): a job that would run as one is refused."""
        if not self.tenants.isolated:
            return
        privileged: dict[str, str] = {}
        if info.slurm_user:
            privileged[info.slurm_user] = "the cluster's SlurmUser (Slurm's own daemon account)"
        try:
            levels = await self.backend.administrators()
        except SchedulerError as exc:  # the provider's account may not read them: the other checks stand
            log.warning(
                "cannot read the Slurm operators and administrators of %s, so tenant accounts are not checked "
                "against them: %s",
                self.cluster_id,
                exc,
            )
            levels = {}
        for user, level in levels.items():
            privileged[user] = f"a Slurm {level} (sacctmgr AdminLevel): it may act on every user's jobs"
        self.tenants.refuse(privileged, cluster_id=self.cluster_id)

    # ---- submission ----------------------------------------------------------------------------------------
    async def _submit_new(self, request: SubmitRequest) -> str:
        account = await self._account(request.job.tenant)  # a refusal needs no scheduler
        if not self._checked:
            await self._ready()  # learns which accounts the cluster holds privileged: check again
            account = await self._account(request.job.tenant)
        work_dir = str(self.config.work_dir) if self.config.work_dir else None
        if work_dir is not None and self.tenants.isolated and request.job.working_directory is None:
            # the tenant's own, 0700, checked for this job (now, or in sbatch's own command over a tenant's
            # login: CliBackend.tenant_dir): no other tenant reads it or links it away
            work_dir = await self.backend.tenant_dir(work_dir, account)
        plan = plan_submission(
            request,
            name=self.job_name(Owner(request.workflow_id, account)),
            cluster_id=self.cluster_id,
            default_partition=self.config.default_partition,
            account=self.config.account,
            qos=self.config.qos,
            work_dir=work_dir,
            hold=self.hold,
        )
        job_id = await self.backend.submit(plan, account if self.tenants.isolated else None)
        log.info("workflow %s submitted as Slurm job %s (account %s)", request.workflow_id, job_id, account)
        return job_id

    def _submit_account(self) -> str:
        return self.backend.user

    def _adoptable_accounts(self) -> list[str]:
        return sorted(self.tenants.accounts()) if self.tenants.isolated else [self.backend.user]

    async def _jobs_named(self, names: list[str]) -> list[Candidate]:
        await self._ready()
        queued, accounted = await asyncio.gather(
            self.backend.queue_by_names(names), self._accounting_by_names(names)
        )
        return _candidates([*accounted, *queued])  # the controller's view wins for a job both know

    async def _live_jobs_named(self, names: list[str]) -> list[Candidate]:
        """The controller alone (one ``squeue``, a few ms; ``sacct`` costs ~90 ms): it holds every job that has
        not ended, and ended ones for ``MinJobAge``, so every duplicate a racing attempt can have made."""
        await self._ready()
        return _candidates(await self.backend.queue_by_names(names))

    async def _accounting_by_names(self, names: list[str]) -> list[p.AcctJob]:
        if not self._accounting_enabled:
            return []
        try:
            return await self.backend.accounting_by_names(names)
        except AccountingDisabled:
            self._accounting_disabled()
            return []

    def _accounting_disabled(self) -> None:
        if self._accounting_enabled:
            log.error(
                "Slurm accounting is disabled on %s: jobs the controller forgets (after MinJobAge) cannot be "
                "found, exit codes of ended jobs are unknown, and final usage is the controller's last view",
                self.cluster_id,
            )
        self._accounting_enabled = False

    async def _cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        await self.backend.cancel(list(scheduler_job_ids))

    async def swept_jobs(self) -> list[ListedJob]:
        """The live jobs of every account this provider's jobs run as (one ``squeue``): those marked for one of
        them, and with per-tenant accounts every job of a tenant's account, marked or not."""
        await self._ready()
        out: list[ListedJob] = []
        for job in await self.backend.queue_live():
            if job.het_leader is not None:
                continue  # a heterogeneous job is judged (and cancelled, whole) by its leader, listed too
            final = map_state(job.state).state.final
            listed = self.listed(job.job_id, name=job.name, user=job.user, final=final)
            if listed is not None:
                out.append(listed)
        return out

    async def swept_ended(self, seconds: int) -> list[ListedJob]:
        """The tenants' accounts' jobs that ran (a run time above zero) and ended within ``seconds`` (one
        ``sacct``), each as the sweep judges it."""
        if not self.tenants.isolated:
            return []
        await self._ready()
        out: list[ListedJob] = []
        for job in await self.backend.ended_since(seconds):
            listed = self.listed(job.job_id, name=job.name, user=job.user, final=True)
            if listed is not None and job.elapsed_seconds > 0:
                out.append(
                    listed.model_copy(
                        update={
                            "elapsed_seconds": job.elapsed_seconds,
                            "allocated": _allocated(job.alloc_tres),
                            "submitted_at": job.submit_time,
                        }
                    )
                )
        return out

    def _tenant_accounts(self) -> frozenset[str]:
        return self.tenants.accounts() if self.tenants.isolated else frozenset()

    def tenant_of(self, account: str) -> str | None:
        return self.tenants.tenant_of(account)

    # ---- status --------------------------------------------------------------------------------------------
    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        ids = list(dict.fromkeys(scheduler_job_ids))
        out: dict[str, NativeStatus] = {
            i: NativeStatus(scheduler_job_id=i, found=False, reason=f"{i[:40]!r} is not a Slurm job id")
            for i in ids
            if not _is_job_id(i)
        }
        valid = [i for i in ids if _is_job_id(i)]
        if not valid:
            return out
        await self._ready()
        never_start: list[str] = []
        for chunk in chunked_by_length(valid, MAX_ID_CHARS_PER_QUERY):
            queue = {job.job_id: job for job in await self.backend.queue(chunk)}
            need = [i for i in chunk if i not in queue or map_state(queue[i].state).state.final]
            accounting: dict[str, p.AcctJob] = {}
            if need and self._accounting_enabled:
                try:
                    accounting = {job.job_id: job for job in await self.backend.accounting(need, steps=False)}
                except AccountingDisabled:
                    self._accounting_disabled()
            for job_id in chunk:
                status, never = self._status_of(job_id, queue.get(job_id), accounting.get(job_id))
                out[job_id] = status
                if never:
                    never_start.append(job_id)
        if never_start:
            try:
                await self.backend.cancel(never_start)
            except SchedulerError as exc:  # reported failed anyway; the next poll cancels again
                log.warning("could not cancel jobs that will never start %s: %s", never_start, exc)
        return out

    def _status_of(
        self, job_id: str, queued: p.QueueJob | None, accounted: p.AcctJob | None
    ) -> tuple[NativeStatus, bool]:
        if queued is None and accounted is None:
            return NativeStatus(
                scheduler_job_id=job_id,
                found=False,
                reason=f"Slurm job {job_id} is in neither the controller's queue nor accounting",
            ), False
        if queued is not None:
            mapped = map_state(queued.state, queued.reason)
            if not mapped.state.final:
                return self._from_queue(job_id, queued, mapped), False
            if mapped.never_starts:
                return self._from_queue(job_id, queued, mapped), True
            if accounted is not None and map_state(accounted.state).state.final:
                if queued.exit_code is not None:  # slurmrestd's controller view has the reliable exit code
                    accounted.exit_code = queued.exit_code
                return self._from_accounting(job_id, accounted), False
            return self._ended_in_queue(job_id, queued, mapped), False
        assert accounted is not None
        if self._requeued_then_gone(accounted, None):
            return self._gone_after_requeue(job_id, accounted), False
        return self._from_accounting(job_id, accounted), False

    @staticmethod
    def _gone_after_requeue(job_id: str, job: p.AcctJob) -> NativeStatus:
        """Requeued, then no longer in the controller nor recorded ended by accounting (cancelled the moment it was
        requeued): it will not run again. Its runs were recorded; it ends cancelled."""
        return NativeStatus(
            scheduler_job_id=job_id,
            state=JobState.CANCELLED,
            native_state=f"{job.state.split()[0]} (then removed)",
            reason="requeued, then removed before it ran again (accounting never recorded its end)",
            start_time=job.start_time if _started(job) else None,
            end_time=job.end_time,
        )

    def _from_queue(self, job_id: str, job: p.QueueJob, mapped: Mapped) -> NativeStatus:
        started = mapped.state in _RUNNING_LIKE or (mapped.state.final and (job.elapsed_seconds or 0) > 0)
        return NativeStatus(
            scheduler_job_id=job_id,
            state=mapped.state,
            native_state=mapped.native_state,
            reason=mapped.reason,
            exit_code=job.exit_code if mapped.state.final else None,
            start_time=job.start_time if started or job.exit_code is not None else None,
            end_time=job.end_time if mapped.state.final else None,
        )

    def _ended_in_queue(self, job_id: str, job: p.QueueJob, mapped: Mapped) -> NativeStatus:
        """The controller says the job ended; accounting has not caught up (or is off, or cannot be waited for)."""
        ended = job.end_time or datetime.now(UTC)
        waited = (datetime.now(UTC) - ended).total_seconds()
        if job.exit_code is None and self._accounting_enabled and waited < self.accounting_grace:
            ran = job.start_time is not None and (job.elapsed_seconds is None or job.elapsed_seconds > 0)
            state = (
                JobState.RUNNING if ran and job.start_time and job.start_time <= ended else JobState.QUEUED
            )
            return NativeStatus(
                scheduler_job_id=job_id,
                state=state,
                native_state=f"{mapped.native_state} (awaiting accounting)",
                reason="ended; waiting for accounting to record how",
                start_time=job.start_time if state == JobState.RUNNING else None,
            )
        status = self._from_queue(job_id, job, mapped)
        return status.model_copy(update={"reason": _final_reason(mapped.reason, job.exit_code, job.reason)})

    def _from_accounting(self, job_id: str, job: p.AcctJob) -> NativeStatus:
        mapped = map_state(job.state, job.reason)
        final = mapped.state.final
        return NativeStatus(
            scheduler_job_id=job_id,
            state=mapped.state,
            native_state=mapped.native_state,
            reason=_final_reason(mapped.reason, job.exit_code, job.reason) if final else mapped.reason,
            exit_code=job.exit_code if final else None,
            start_time=job.start_time if _started(job) or mapped.state in _RUNNING_LIKE else None,
            end_time=job.end_time if final else None,
        )

    # ---- usage ---------------------------------------------------------------------------------------------
    async def usage(self, scheduler_job_id: str) -> Accounting:
        job_id = _require_job_id(scheduler_job_id)
        await self._ready()
        return await retrying(lambda: self._usage(job_id), self.backoff, f"usage of {job_id}")

    async def _usage(self, job_id: str) -> Accounting:
        # Read before the job: a run time counted to this instant never reaches past the job's end.
        clock = await self._controller_clock()
        queued = next(iter(await self.backend.queue([job_id])), None)
        mapped = map_state(queued.state) if queued is not None else None
        if queued is not None and mapped is not None and not mapped.state.final:
            if mapped.state not in _RUNNING_LIKE:
                return Accounting(scheduler_job_id=job_id)  # not started (or requeued): nothing more used yet
            return await self._running_usage(job_id, queued, clock)
        accounted: p.AcctJob | None = None
        if self._accounting_enabled:
            try:
                accounted = next(iter(await self.backend.accounting([job_id], steps=True)), None)
            except AccountingDisabled:
                self._accounting_disabled()
        if accounted is not None and self._accounting_closed(accounted, queued):
            return self._final_usage(job_id, accounted)
        if queued is None and accounted is None:
            raise JobNotFound(f"Slurm job {job_id} is in neither the controller's queue nor accounting")
        if queued is not None and not self._accounting_enabled:
            # No accounting to wait for: the controller's last view is all there will ever be.
            return self._queue_usage(job_id, queued, final=True)
        # Ended in the controller, not yet in accounting (or accounting still says running): not final yet.
        if queued is not None:
            return self._queue_usage(job_id, queued, final=False)
        assert accounted is not None
        reading = self._accounting_reading(accounted, taken_at=datetime.now(UTC))
        return self._monotone(job_id, reading, accounted, final=False)

    async def _controller_clock(self) -> datetime | None:
        """The controller's clock where the adapter must count a running job's run time itself (slurmrestd). A
        worker's clock ahead of the controller's billed the difference in every running reading, and the final
        record, which cannot be negative, never took it back. A controller that will not tell (a transient error
        is retried): the worker's clock, with a warning."""
        try:
            return await self.backend.controller_clock()
        except SchedulerError as exc:
            if exc.transient:
                raise
            log.warning(
                "cannot read the controller's clock of %s (%s): run time by this worker's",
                self.cluster_id,
                exc,
            )
            return None

    async def _clock_ahead(self) -> int:
        """How far the clock ``squeue`` counted a running job's TimeUsed to is ahead of the controller's: a worker
        ahead billed the difference in every running reading, which the final record never took back. One that
        cannot tell (a transient error is retried): 0, with a warning."""
        try:
            return await self.backend.clock_ahead()
        except SchedulerError as exc:
            if exc.transient:
                raise
            log.warning(
                "cannot compare this worker's clock with the controller's of %s (%s)", self.cluster_id, exc
            )
            return 0

    async def _running_usage(self, job_id: str, job: p.QueueJob, clock: datetime | None) -> Accounting:
        live_task = asyncio.create_task(self.backend.live_steps(job_id))
        try:
            ended = await self.backend.accounting([job_id], steps=True) if self._accounting_enabled else []
        except AccountingDisabled:
            self._accounting_disabled()
            ended = []
        except SchedulerError as exc:  # the live reading still counts; ended steps show up next time
            log.info("usage of %s: accounting unavailable (%s); live steps only", job_id, exc)
            ended = []
        live = await live_task
        earlier, current = _split_runs([run for a in ended for run in a.runs], job.start_time)
        # Per step of the current run, the highest reading seen (live from sstat, ended from sacct): their sum is
        # monotone. A requeued job's run starts over with steps of the same names: its readings start afresh.
        run = self._steps.get(job_id)
        if run is None or run.start != job.start_time:
            run = self._steps[job_id] = _RunSteps(job.start_time)
        seen = run.steps
        for step in [s for r in current for s in r.steps]:
            self._see(seen, step.step_id, _acct_step(step))
        for step_live in live or []:
            self._see(seen, step_live.step_id, _live_step(step_live))
        now = datetime.now(UTC)
        elapsed = job.elapsed_seconds
        if elapsed is None:  # slurmrestd gives no run time: derive it as the controller does, on its clock
            elapsed = _run_time(job, clock or now)
        elif (job.state.split() or [""])[0] == "RUNNING":
            # squeue counted it to the clock of the host it ran on, ahead of the controller's by as much
            elapsed = max(0, elapsed - await self._clock_ahead())
        reading = _job_reading(list(seen.values()), Decimal(elapsed), job.alloc_tres, taken_at=now)
        if earlier:  # a requeued job: its earlier runs, closed in accounting, are billed as well
            reading = _runs_reading([*(_run_reading(r, taken_at=now) for r in earlier), reading])
        return self._monotone(job_id, reading, job, final=False)

    @staticmethod
    def _see(seen: dict[str, Reading], step_id: str, reading: Reading) -> None:
        previous = seen.get(step_id)
        seen[step_id] = reading if previous is None else highest(reading, previous)

    def _accounting_closed(self, job: p.AcctJob, queued: p.QueueJob | None = None) -> bool:
        """The job ended in accounting and so did each of its steps (a step's record lands a moment after the job's
        line, first without its usage). A step stuck "running" after ``accounting_grace`` is not waited for.

        A job cancelled right after a requeue, before slurmdbd recorded its pending run, ends with accounting's
        last word "REQUEUED" for ever: once the controller says it ended (or no longer holds it) and
        ``accounting_grace`` has passed, its runs in accounting are all it ran."""
        if not map_state(job.state).state.final:
            return self._requeued_then_gone(job, queued)
        open_steps = [s.step_id for r in job.runs for s in r.steps if not map_state(s.state).state.final]
        if not open_steps:
            return True
        ended = job.end_time or datetime.now(UTC)
        if (datetime.now(UTC) - ended).total_seconds() >= self.accounting_grace:
            log.warning(
                "job %s ended but accounting still shows steps %s open; closing it", job.job_id, open_steps
            )
            return True
        return False

    def _requeued_then_gone(self, job: p.AcctJob, queued: p.QueueJob | None) -> bool:
        """Accounting's last record of the job ended in a requeue, and the controller says the job ended since (or
        holds it no more) at least ``accounting_grace`` ago: it will not run again, and accounting will not say so."""
        if not _requeue_end(job.state):
            return False
        if queued is not None and not map_state(queued.state).state.final:
            return False  # pending again (or running): not over
        ended = (queued.end_time if queued is not None else None) or job.end_time
        return ended is not None and (datetime.now(UTC) - ended).total_seconds() >= self.accounting_grace

    @staticmethod
    def _accounting_reading(job: p.AcctJob, *, taken_at: datetime | None) -> Reading:
        """What accounting says of the job, every run of it (a requeued job ran more than once, and each run
        held its allocation): its steps' measurements and its elapsed time, added up over the runs."""
        return _runs_reading([_run_reading(run, taken_at=taken_at) for run in job.runs])

    def _final_usage(self, job_id: str, job: p.AcctJob) -> Accounting:
        self._high_water.pop(job_id, None)
        self._steps.pop(job_id, None)
        first = next((run for run in job.runs if _started(run)), None)
        return Accounting(
            scheduler_job_id=job_id,
            final=True,
            reading=self._accounting_reading(job, taken_at=job.end_time),
            start_time=first.start_time if first is not None else None,
            end_time=job.end_time,
        )

    def _queue_usage(self, job_id: str, job: p.QueueJob, *, final: bool) -> Accounting:
        elapsed = job.elapsed_seconds
        if elapsed is None and job.start_time is not None and job.end_time is not None:
            elapsed = _run_time(job, job.end_time)
        # The controller says the job ended but not when (slurmrestd right after a cancel): never extrapolate to
        # "now", which would bill time the job did not run; the last reading stands until accounting closes it.
        run = self._steps.get(job_id)
        steps = list(run.steps.values()) if run is not None and run.start == job.start_time else []
        taken = job.end_time if job.end_time is not None else datetime.now(UTC)
        reading = _job_reading(steps, Decimal(elapsed or 0), job.alloc_tres, taken_at=taken)
        return self._monotone(job_id, reading, job, final=final)

    def _monotone(
        self, job_id: str, reading: Reading, job: p.QueueJob | p.AcctJob, *, final: bool
    ) -> Accounting:
        """A running reading never goes below an earlier one (a step that just ended is in neither sstat nor,
        for a few seconds, sacct)."""
        previous = self._high_water.get(job_id)
        if previous is not None:
            reading = highest(reading, previous)
        if len(self._high_water) >= _USAGE_CACHE:
            self._high_water.clear()
            self._steps.clear()
        if final:
            self._high_water.pop(job_id, None)
            self._steps.pop(job_id, None)
        else:
            self._high_water[job_id] = reading
        return Accounting(
            scheduler_job_id=job_id,
            final=final,
            reading=reading,
            start_time=job.start_time,
            end_time=job.end_time if final else None,
        )

    # ---- cancel and nodes ----------------------------------------------------------------------------------
    async def cancel(self, scheduler_job_id: str) -> None:
        job_id = _require_job_id(scheduler_job_id)
        await self._ready()
        await retrying(lambda: self.backend.cancel([job_id]), self.backoff, f"cancel {job_id}")

    async def drain_node(self, node: str, reason: str) -> None:
        check_node(node)
        clean = " ".join(reason.split())[:256] or "drained by virtengine-hpc"
        await retrying(lambda: self.backend.drain(node, clean), self.backoff, f"drain {node}")

    async def resume_node(self, node: str) -> None:
        check_node(node)
        await retrying(lambda: self.backend.resume(node), self.backoff, f"resume {node}")

    async def node_busy(self, node: str) -> bool:
        check_node(node)
        return await retrying(lambda: self.backend.node_busy(node), self.backoff, f"jobs on {node}")

    async def close(self) -> None:
        await super().close()
        await self.backend.close()


@dataclass
class _RunSteps:
    """The steps of a job's current run, by step id: the highest reading of each seen so far."""

    start: datetime | None
    steps: dict[str, Reading] = field(default_factory=dict)


def _candidates(records: Sequence[p.QueueJob | p.AcctJob]) -> list[Candidate]:
    """The jobs among ``records``, as the base judges them: id, name, the account they run as, ended or not."""
    return [
        Candidate(r.job_id, final=map_state(r.state).state.final, name=r.name, user=r.user) for r in records
    ]


def _final_reason(mapped_reason: str, exit_code: int | None, slurm_reason: str) -> str:
    reason = mapped_reason
    if exit_code not in (None, 0):
        reason = f"{reason}; exit code {exit_code}"
    extra = slurm_reason.strip()
    if extra and extra not in ("None", "NonZeroExitCode", "OutOfMemory", "TimeLimit") and extra not in reason:
        reason = f"{reason} ({extra})"
    return reason


def _started(job: p.AcctJob) -> bool:
    """Whether accounting says the job started: it has a start time and ran, or at least got an allocation
    (a job that fails at once ran for 0 s; a job cancelled while pending has no allocation)."""
    return job.start_time is not None and (job.elapsed_seconds > 0 or bool(job.alloc_tres))


def _run_time(job: p.QueueJob, now: datetime) -> int:
    """The seconds a job the controller holds has run by ``now``, suspended time excluded, as Slurm counts them
    (``squeue``'s TimeUsed): the run time it had when last suspended, and, unless it is suspended now, the time
    since it last started or resumed, up to its end when the controller already has one (COMPLETING after a
    cancel: the processes are still exiting, the clock stopped; for a running job ``end_time`` is its limit, in
    the future)."""
    if map_state(job.state).state == JobState.SUSPENDED:
        return job.pre_suspend_seconds
    end = min(now, job.end_time) if job.end_time is not None else now
    since = job.suspend_time or job.start_time or end
    return job.pre_suspend_seconds + max(0, int((end - since).total_seconds()))


def _requeue_end(state: str) -> bool:
    """Accounting's state of a run that Slurm requeued (the job runs again, or was removed right after)."""
    return (state.split() or [""])[0] in ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def _split_runs(
    runs: list[p.AcctJob], current_start: datetime | None
) -> tuple[list[p.AcctJob], list[p.AcctJob]]:
    """Accounting's runs of a running job, oldest first: those before the current run (closed, billed in full)
    and the current run's (its steps that ended). Right after a requeue accounting may not have heard of the new
    run yet: then every run it holds is an earlier one."""
    if current_start is None:
        return runs[:-1], runs[-1:]
    earlier = [r for r in runs if r.start_time is None or r.start_time < current_start]
    return earlier, [r for r in runs if r not in earlier]


def _run_reading(run: p.AcctJob, *, taken_at: datetime | None) -> Reading:
    """One run of a job as accounting recorded it: its steps' measurements, elapsed time and allocation."""
    steps = [_acct_step(s) for s in run.steps]
    if not steps and run.total_cpu_seconds is not None:
        steps = [Reading(cpu_time_seconds=run.total_cpu_seconds)]
    reading = _job_reading(steps, Decimal(_run_seconds(run)), run.alloc_tres, taken_at=taken_at)
    if run.energy_joules:  # the run's own figure (steps overlap in time: theirs would count twice)
        reading = reading.model_copy(update={"energy_joules": run.energy_joules})
    return reading


def _run_seconds(run: p.AcctJob) -> int:
    """The seconds a run held its allocation: accounting's elapsed time, unless Slurm rewrote it.

    A batch job can be requeued after it ended (``scontrol requeue``, which its owner may run while the controller
    still holds the job, ``MinJobAge``): Slurm then rewrites the record of the run that had ended, its end moved to
    the requeue (seconds to minutes later) or its start dropped (0 s), and runs the job again. That run's batch step
    ended on its own before (a requeue while it runs cancels it) and keeps its record: the run held its allocation
    for the batch step's time, never more than its record says."""
    batch = next((s for s in run.steps if s.step_id.rsplit(".", 1)[-1] == "batch"), None)
    if batch is None or not _requeue_end(run.state):
        return run.elapsed_seconds
    ended = map_state(batch.state).state
    if not ended.final or ended == JobState.CANCELLED:
        return run.elapsed_seconds  # requeued while it ran
    if run.start_time is None:
        return batch.elapsed_seconds
    return min(run.elapsed_seconds, batch.elapsed_seconds)


def _runs_reading(runs: list[Reading]) -> Reading:
    """The runs of one job (oldest first) as one reading: run time and measurements added up (runs follow each
    other, so energy adds too), peak memory the largest, the latest run's time and allocation."""
    if len(runs) == 1:
        return runs[0]

    def total(name: str) -> Decimal | None:
        values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
        return sum(values, Decimal(0)) if values else None

    counts = {
        name: None if (value := total(name)) is None else int(value)
        for name in ("network_bytes_in", "network_bytes_out", "disk_bytes_read", "disk_bytes_written")
    }
    peaks = [r.memory_bytes_max for r in runs if r.memory_bytes_max is not None]
    return Reading(
        wall_clock_seconds=sum((r.wall_clock_seconds for r in runs), Decimal(0)),
        taken_at=runs[-1].taken_at,
        allocated=runs[-1].allocated,
        cpu_time_seconds=total("cpu_time_seconds"),
        memory_byte_seconds=total("memory_byte_seconds"),
        memory_bytes_max=max(peaks) if peaks else None,
        energy_joules=total("energy_joules"),
        **counts,
    )


def _count(value: Decimal | None) -> int | None:
    return None if value is None else int(value)


def _network(usage: dict[str, Decimal]) -> int | None:
    """Interconnect bytes (``ic/ofed``, ``ic/sysfs``...: whichever interconnect plugin the site runs)."""
    values = [v for k, v in usage.items() if k.startswith("ic/")]
    return int(sum(values, Decimal(0))) if values else None


def _step_reading(
    cpu: Decimal | None, rss: int | None, usage_in: dict[str, Decimal], usage_out: dict[str, Decimal]
) -> Reading:
    """One step's measurements from its TRES usage (``TRESUsageInTot``/``TRESUsageOutTot``, or slurmdbd's lists).

    ``energy`` is in every TRES list, as 0 where no ``acct_gather_energy`` plugin runs: 0 J means "not measured"
    (no job that ran consumed no energy). ``fs/disk`` in is bytes read, out bytes written; ``ic/*`` in and out are
    interconnect bytes received and sent.
    """
    energy = usage_in.get("energy")
    return Reading(
        cpu_time_seconds=cpu,
        memory_bytes_max=rss,
        energy_joules=energy if energy else None,
        network_bytes_in=_network(usage_in),
        network_bytes_out=_network(usage_out),
        disk_bytes_read=_count(usage_in.get("fs/disk")),
        disk_bytes_written=_count(usage_out.get("fs/disk")),
    )


def _acct_step(step: p.AcctStep) -> Reading:
    return _step_reading(step.total_cpu_seconds, step.max_rss_bytes, step.usage_in, step.usage_out)


def _live_step(step: p.LiveStep) -> Reading:
    return _step_reading(step.usage_in.get("cpu"), step.max_rss_bytes, step.usage_in, step.usage_out)


def _allocated(alloc: dict[str, Decimal]) -> Allocated:
    """Slurm's allocation (``AllocTRES``): nodes, CPUs, memory bytes and GPUs (``gres/gpu``, or the sum of its
    typed forms ``gres/gpu:a100`` when only those are accounted). Storage is not a Slurm resource."""
    gpus = alloc.get("gres/gpu")
    if gpus is None:
        typed = [v for k, v in alloc.items() if k.startswith("gres/gpu:")]
        gpus = sum(typed, Decimal(0)) if typed else None
    return Allocated(
        nodes=_count(alloc.get("node")),
        cpus=_count(alloc.get("cpu")),
        gpus=_count(gpus),
        memory_bytes=_count(alloc.get("mem")),
    )


def _job_reading(
    steps: list[Reading], elapsed: Decimal, alloc: dict[str, Decimal], *, taken_at: datetime | None
) -> Reading:
    """A job's reading: its steps' measurements summed (peak memory: the largest), Slurm's elapsed time and
    allocation. A quantity no step measured stays ``None``."""

    def total(name: str) -> Decimal | None:
        values = [getattr(s, name) for s in steps if getattr(s, name) is not None]
        return sum(values, Decimal(0)) if values else None

    peaks = [s.memory_bytes_max for s in steps if s.memory_bytes_max]
    # Steps overlap in time on the same nodes (the batch and extern steps last the whole job): their energy
    # readings cannot be added up. The job's own figure replaces this once accounting has it.
    energies = [s.energy_joules for s in steps if s.energy_joules is not None]
    counts = {
        name: None if (value := total(name)) is None else int(value)
        for name in ("network_bytes_in", "network_bytes_out", "disk_bytes_read", "disk_bytes_written")
    }
    return Reading(
        wall_clock_seconds=elapsed,
        taken_at=taken_at,
        allocated=_allocated(alloc),
        cpu_time_seconds=total("cpu_time_seconds") or Decimal(0),
        memory_bytes_max=max(peaks) if peaks else None,
        energy_joules=max(energies) if energies else None,
        **counts,
    )
