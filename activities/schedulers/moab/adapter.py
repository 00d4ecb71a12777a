"""The MOAB adapter: a thin subclass of the shared batch-scheduler base, with two transports (SSH commands, MWS).

What it promises (``activities/schedulers/base.py``), and how:

* **Exactly once.** The job is named with the workflow's marker ``vehpc-<workflow id>.<tag>`` (``msub -N``; MWS
  ``customName``; adopted only if the tag verifies for the account it runs as: ``BatchSchedulerAdapter``). ``find`` looks in
  the live queue *and* the completed queue (``showq --xml`` + ``showq -c --xml``; one MWS query) for this user's
  jobs of that name; ``submit`` looks first, and again before every retry (``BatchSchedulerAdapter``).
* **One query per poll.** ``status_batch`` asks ``showq --xml`` once for all ids; only ids it does not list cost one
  ``showq -c --xml``. Over MWS it is one ``GET /rest/jobs`` with a query on the names. A job found nowhere is
  ``found=False``, never "completed". A failed query raises ``SchedulerUnavailable``: never a state change.
* **Honest ends.** Exit codes come from ``CompletionCode`` (MWS ``completionCode``); ``Removed`` is a cancel, or a
  timeout when the job used its whole walltime or Torque reports ``-11``; ``Vacated`` is a failure
  (``states.py``). A batch hold that never clears (``RMReject``, ``NoResources``...) fails the job at once and
  cancels it.
* **One account per tenant** (``hpc.tenants``; never root, never the provider's own account): ``msub`` over an SSH
  login as the tenant's account with its own key (``tenant_key_dir``), or MWS with ``credentials.user`` set to it.
  Output goes to ``<work_dir>/<account>``, which the operator makes the account's own and 0700; over SSH it is
  checked before every submission (``batch.workdir``), under MWS it cannot be.
  Lookups by name search the tenants' accounts only.
* **Usage** from ``checkjob --xml`` (MWS: the job), a raw reading that ``virtengine_hpc.metering`` meters: run
  time = ``AWDuration``, CPU time = ``StatPSUtl`` (processor seconds utilized), peak memory from ``UtilMem``, and
  the allocation (nodes, processors, memory, GPUs). Cumulative and monotone; final once the job ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
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
from activities.schedulers.batch.base import (
    Backoff,
    BatchSchedulerAdapter,
    Candidate,
    CommandExecutor,
    Owner,
    chunked,
    retrying,
)
from activities.schedulers.batch.plan import plan_submission
from activities.schedulers.batch.transports import SSHRunner
from activities.schedulers.moab import parsers as p
from activities.schedulers.moab.backends import TRANSIENT_PATTERNS, CliBackend, MoabBackend, MwsBackend
from activities.schedulers.moab.states import Mapped, map_state
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import Config, MoabConfig, Secrets
from virtengine_hpc.errors import ConfigError, JobNotFound, SchedulerError
from virtengine_hpc.markers import MarkerKey, load_key
from virtengine_hpc.metering import Allocated, Reading, highest

log = logging.getLogger(__name__)

MAX_IDS_PER_QUERY = 2000
_MIB = 1024 * 1024
_USAGE_CACHE = 20_000
#: Environment of every MOAB command: stable number and date formats.
COMMAND_ENV = {"LC_ALL": "C"}


def _require_job_id(value: str) -> str:
    if not p.is_job_id(value):
        raise JobNotFound(f"{value[:80]!r} is not a MOAB job id", transient=False)
    return value


def mapped(job: p.MoabJob) -> Mapped:
    return map_state(
        job.state,
        completion=job.completion,
        started=job.started,
        hold_reason=job.hold_reason,
        walltime_reached=job.walltime_reached,
    )


class MoabAdapter(BatchSchedulerAdapter):
    """MOAB through a ``MoabBackend``; build it with ``from_config`` (or directly, in tests)."""

    name = "moab"

    mpi_launcher = "mpirun"

    def __init__(
        self,
        backend: MoabBackend,
        *,
        cluster_id: str,
        config: MoabConfig,
        backoff: Backoff,
        tenants: TenantAccounts,
        hold: bool = False,
        markers: MarkerKey | None = None,
    ) -> None:
        """``hold`` submits jobs held (``msub -h``), for tests that need jobs which never start. ``tenants`` says
        which account runs each tenant's jobs (``TenantAccounts.shared()``: the backend's own). ``markers``: the
        provider's marker key (``from_config`` loads it; default a key of this process alone)."""
        super().__init__(backoff=backoff, markers=markers)
        self.backend = backend
        self.tenants = tenants
        self.cluster_id = cluster_id
        self.config = config
        self.hold_jobs = hold
        self._high_water: dict[str, Reading] = {}

    @classmethod
    def from_config(cls, config: Config, secrets: Secrets, cluster_id: str) -> MoabAdapter:
        m = config.hpc.moab
        timeout = m.connection_timeout.total_seconds()
        tenants = TenantAccounts.from_config(config)
        tenants.warn_if_unusable(cluster_id)
        backend: MoabBackend
        if m.transport == "ssh":
            backend = cls._ssh_backend(m, tenants, timeout)
        else:
            if not m.mws_url:
                raise ConfigError("hpc.moab.mws_url: required for the rest transport (MOAB Web Services)")
            if not secrets.moab_username or secrets.moab_password is None:
                raise ConfigError(
                    "MOAB_USERNAME and MOAB_PASSWORD must be set: the rest transport authenticates to MWS with them"
                )
            backend = MwsBackend(
                base_url=m.mws_url,
                username=secrets.moab_username,
                password=secrets.moab_password,
                job_user=m.mws_job_user,
                timeout=timeout,
                ca_cert=m.mws_ca_cert,
                lookup_users=sorted(tenants.accounts()),
            )
        adapter = cls(
            backend,
            cluster_id=cluster_id,
            config=m,
            backoff=Backoff.from_config(config.hpc.retry, m.max_retries),
            tenants=tenants,
            markers=load_key(secrets, config.state_dir),
        )
        adapter.sibling_clusters = tuple(c for c in config.cluster_ids() if c != cluster_id)
        return adapter

    @staticmethod
    def _ssh_backend(m: MoabConfig, tenants: TenantAccounts, timeout: float) -> CliBackend:
        """Queries and cancels as ``ssh_user``; each tenant's ``msub`` over its own login and key."""
        if not m.ssh_user:
            raise ConfigError("hpc.moab.ssh_user: required for the ssh transport")
        key_dir = m.tenant_key_dir
        if tenants.isolated and key_dir is None:
            raise ConfigError(
                "hpc.moab.tenant_key_dir: required for the ssh transport with per-tenant accounts (one private "
                "key per tenant account, named after it)"
            )

        def executor(user: str, key: Path | None) -> CommandExecutor:
            runner = SSHRunner(
                host=m.ssh_host or m.server,
                port=m.ssh_port,
                user=user,
                key_path=key,
                known_hosts=m.known_hosts_path,
                timeout=timeout,
                env={**COMMAND_ENV, **m.remote_env},
            )
            return CommandExecutor(runner, TRANSIENT_PATTERNS, timeout)

        def as_tenant(account: str) -> CommandExecutor:
            assert key_dir is not None
            return executor(account, key_dir / account)

        return CliBackend(
            executor(m.ssh_user, m.ssh_key_path),
            user=m.ssh_user,
            bin_dir=m.bin_dir,
            executor_as=as_tenant if tenants.isolated else None,
            lookup_users=sorted(tenants.accounts()),
        )

    def expected_account(self, tenant: str) -> str | None:
        if not self.tenants.isolated:
            return self.backend.user
        return self.tenants.assigned(tenant)

    async def _account(self, tenant: str) -> str:
        """The account the tenant's job runs as; before the pool hands a tenant one, pool accounts no assignment
        explains but MOAB lists jobs of are held back (as on SLURM: ``SlurmAdapter._account``)."""
        await hold_back_taken(self, self.tenants, tenant, cluster_id=self.cluster_id)
        return await asyncio.to_thread(self.tenants.account_for, tenant, submit_account=self.backend.user)

    async def accounts_in_use(self, accounts: Sequence[str]) -> dict[str, str]:
        return await self.backend.users_with_jobs(list(accounts))

    @property
    def calls(self) -> dict[str, int]:
        """Scheduler queries made so far, by kind (``showq``, ``showq -c``, ``GET jobs``, ...)."""
        return dict(self.backend.calls)

    # ---- submission ----------------------------------------------------------------------------------------
    async def _submit_new(self, request: SubmitRequest) -> str:
        account = await self._account(request.job.tenant)
        work_dir = str(self.config.work_dir) if self.config.work_dir else None
        if work_dir is not None and self.tenants.isolated and request.job.working_directory is None:
            # the tenant's own, 0700, checked now (never from a cache): no other tenant reads it or links it away
            work_dir = await self.backend.tenant_dir(work_dir, account)
        plan = plan_submission(
            request,
            name=self.job_name(Owner(request.workflow_id, account)),
            cluster_id=self.cluster_id,
            default_partition=self.config.default_queue,
            account=self.config.account,
            work_dir=work_dir,
            hold=self.hold_jobs,
        )
        job_id = await self.backend.submit(plan, account if self.tenants.isolated else None)
        log.info("workflow %s submitted as MOAB job %s (account %s)", request.workflow_id, job_id, account)
        return job_id

    def _submit_account(self) -> str:
        return self.backend.user

    def _adoptable_accounts(self) -> list[str]:
        return sorted(self.tenants.accounts()) if self.tenants.isolated else [self.backend.user]

    async def _jobs_named(self, names: list[str]) -> list[Candidate]:
        return [
            Candidate(job.job_id, final=mapped(job).state.final, name=job.name, user=job.user)
            for job in await self.backend.by_names(names)
        ]

    async def _cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        await self.backend.cancel(list(scheduler_job_ids))

    async def swept_jobs(self) -> list[ListedJob]:
        """The live jobs of every account this provider's jobs run as (one ``showq --xml``, or one MWS query):
        those marked for one of them, and with per-tenant accounts every job of a tenant's account."""
        out: list[ListedJob] = []
        for job in await self.backend.live():
            listed = self.listed(job.job_id, name=job.name, user=job.user, final=mapped(job).state.final)
            if listed is not None:
                out.append(listed)
        return out

    async def swept_ended(self, seconds: int) -> list[ListedJob]:
        """The tenants' accounts' jobs that started and that MOAB lists completed within ``seconds`` (one ``showq
        -c --xml``, or one MWS query), each as the sweep judges it, with its run time and allocation."""
        if not self.tenants.isolated:
            return []
        out: list[ListedJob] = []
        for job in await self.backend.ended_since(seconds):
            listed = self.listed(job.job_id, name=job.name, user=job.user, final=True)
            if listed is None or not job.started:
                continue  # cancelled before it started: it ran nothing
            reading = self._reading(job, final=True)
            update = {
                "elapsed_seconds": int(reading.wall_clock_seconds),
                "allocated": reading.allocated,
                "submitted_at": job.submit_time,
            }
            out.append(listed.model_copy(update=update))
        return out

    def _tenant_accounts(self) -> frozenset[str]:
        return self.tenants.accounts() if self.tenants.isolated else frozenset()

    def tenant_of(self, account: str) -> str | None:
        return self.tenants.tenant_of(account)

    # ---- status --------------------------------------------------------------------------------------------
    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        ids = list(dict.fromkeys(scheduler_job_ids))
        out: dict[str, NativeStatus] = {
            i: NativeStatus(scheduler_job_id=i, found=False, reason=f"{i[:40]!r} is not a MOAB job id")
            for i in ids
            if not p.is_job_id(i)
        }
        valid = [i for i in ids if p.is_job_id(i)]
        never_start: list[str] = []
        for chunk in chunked(valid, MAX_IDS_PER_QUERY):
            jobs = {job.job_id: job for job in await self.backend.by_ids(chunk)}
            for job_id in chunk:
                job = jobs.get(job_id)
                if job is None:
                    out[job_id] = NativeStatus(
                        scheduler_job_id=job_id,
                        found=False,
                        reason=f"MOAB job {job_id} is in neither the queue nor the completed jobs",
                    )
                    continue
                status = self._status_of(job)
                out[job_id] = status
                if mapped(job).never_starts and job.queue != "completed":
                    never_start.append(job_id)
        if never_start:
            try:
                await self.backend.cancel(never_start)
            except SchedulerError as exc:  # reported failed anyway; the next poll cancels again
                log.warning("could not cancel jobs that will never start %s: %s", never_start, exc)
        return out

    def _status_of(self, job: p.MoabJob) -> NativeStatus:
        m = mapped(job)
        final = m.state.final
        reason = m.reason
        if final and job.message and job.message not in reason:
            reason = f"{reason} ({job.message})"
        return NativeStatus(
            scheduler_job_id=job.job_id,
            state=m.state,
            native_state=m.native_state,
            reason=reason,
            exit_code=m.exit_code if final else None,
            start_time=job.start_time,
            end_time=job.end_time if final else None,
        )

    # ---- usage ---------------------------------------------------------------------------------------------
    async def usage(self, scheduler_job_id: str) -> Accounting:
        job_id = _require_job_id(scheduler_job_id)
        return await retrying(lambda: self._usage(job_id), self.backoff, f"usage of {job_id}")

    async def _usage(self, job_id: str) -> Accounting:
        job = await self.backend.job(job_id)
        if job is None:  # checkjob forgot it (purged): the completed queue may still list it
            job = next(iter(await self.backend.by_ids([job_id])), None)
        if job is None:
            raise JobNotFound(f"MOAB job {job_id} is in neither the queue nor the completed jobs")
        m = mapped(job)
        final = m.state.final
        if not job.started and not final:
            return Accounting(scheduler_job_id=job_id)
        reading = self._reading(job, final=final)
        previous = self._high_water.get(job_id)
        if previous is not None:
            reading = highest(reading, previous)
        if final:
            self._high_water.pop(job_id, None)
        else:
            if len(self._high_water) >= _USAGE_CACHE:
                self._high_water.clear()
            self._high_water[job_id] = reading
        return Accounting(
            scheduler_job_id=job_id,
            final=final,
            reading=reading,
            start_time=job.start_time,
            end_time=job.end_time if final else None,
        )

    @staticmethod
    def _reading(job: p.MoabJob, *, final: bool) -> Reading:
        """MOAB's figures: run time ``AWDuration``, processor-seconds ``StatPSUtl``, peak ``UtilMem``, and the
        allocation (nodes, processors, memory, GPUs). MOAB allocates no scratch storage: the job's request stands."""
        now = datetime.now(UTC)
        wall = job.wall_seconds
        if wall is None and job.start_time is not None:
            end = job.end_time or now
            wall = max(0, int((end - job.start_time).total_seconds()))
        return Reading(
            wall_clock_seconds=Decimal(wall or 0),
            taken_at=job.end_time if final and job.end_time else now,
            allocated=Allocated(
                nodes=job.nodes,
                cpus=job.procs,
                gpus=job.gpus if job.gpus else None,
                memory_bytes=job.mem_mb * _MIB if job.mem_mb else None,
            ),
            cpu_time_seconds=job.cpu_seconds,
            memory_bytes_max=job.util_mem_mb * _MIB if job.util_mem_mb else None,
        )

    # ---- cancel, hold, release ------------------------------------------------------------------------------
    async def cancel(self, scheduler_job_id: str) -> None:
        job_id = _require_job_id(scheduler_job_id)
        await retrying(lambda: self.backend.cancel([job_id]), self.backoff, f"cancel {job_id}")

    async def hold(self, scheduler_job_id: str) -> None:
        """Put a user hold on a queued job (``mjobctl -h user``)."""
        job_id = _require_job_id(scheduler_job_id)
        await retrying(lambda: self.backend.hold(job_id), self.backoff, f"hold {job_id}")

    async def release(self, scheduler_job_id: str) -> None:
        """Release the user hold (``mjobctl -u user``)."""
        job_id = _require_job_id(scheduler_job_id)
        await retrying(lambda: self.backend.hold(job_id, release=True), self.backoff, f"release {job_id}")

    async def close(self) -> None:
        await super().close()
        await self.backend.close()


__all__ = ["MoabAdapter"]
