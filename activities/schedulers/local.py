"""The ``local`` scheduler: runs a job's batch script as a process group on this host (demos, tests, one tenant).

Each job has a directory ``<state_dir>/jobs/<scheduler job id>``, the id being ``local-`` plus 20 hex digits
of the SHA-256 of the workflow id, so a retried submit finds the job from the workflow id alone (invariant 2 in
docs/architecture.md). The directory holds ``job.sh`` (``#!/bin/bash`` + the body, mode 0700, run as ``bash <path>``:
the script never travels through a shell command line), ``meta.json`` (workflow id, job summary, limits, the
rendered environment), ``stdout``, ``stderr``, and ``status.json``, which a detached supervisor process
(``activities/schedulers/local_supervisor.py``) rewrites atomically as the job moves and as usage is sampled.

Exactly once, even when the worker is SIGKILLed at any instant inside ``submit``: the submitter takes the
job's ``lock`` with a non-blocking flock. If it is held, or the ``started`` marker exists, the job is adopted.
Otherwise the submitter spawns the supervisor with the locked fd in ``pass_fds`` (the lock passes to it
without ever being free) and waits until the supervisor has written the marker. The supervisor holds the lock
for its whole life; a job whose status is not final while its lock is free lost its supervisor (host reboot,
kill -9) and is reported failed, never completed. See ``docs/local-executor.md`` for the crash windows, the
environment and the usage measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from activities.schedulers import local_supervisor as sup
from activities.schedulers.base import (
    FILES_SHOWN,
    Accounting,
    NativeStatus,
    RefusedAdoption,
    SchedulerAdapter,
    SubmitRequest,
    SubmitResult,
)
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import Config, LocalSchedulerConfig, Secrets
from virtengine_hpc.errors import (
    ConfigError,
    JobNotFound,
    SchedulerError,
    SchedulerUnavailable,
    SubmissionRejected,
)
from virtengine_hpc.markers import MarkerKey, load_key, marker_tag, verify_marker
from virtengine_hpc.metering import Reading
from virtengine_hpc.models import Resources
from virtengine_hpc.states import JobState

JOB_ID_PREFIX = "local-"
_JOB_ID_RE = re.compile(r"^local-[0-9a-f]{20}$")
_SUPERVISOR = Path(sup.__file__).resolve()
# The supervisor gets no environment of the worker's (which may hold SLURM_JWT_TOKEN and friends).
_SUPERVISOR_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
JOB_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_STALE_TMP_SECONDS = 3600
_META_CACHE_SIZE = 4096
#: A job's processes may each map this many times the memory it asked for (``RLIMIT_AS``): programs reserve more
#: address space than they touch (thread stacks, allocator arenas); what they really hold is measured and billed.
ADDRESS_SPACE_FACTOR = 2
#: Processes (and threads) one account may have at once (``RLIMIT_NPROC``), per core of the job and at least: the
#: kernel counts every process of the account, so this is the budget of all of a tenant's jobs on the host
#: together. It stops a fork bomb well before the host runs out of process ids, not a tenant running many jobs.
PROCESSES_PER_CORE = 64
MIN_PROCESSES = 4096
#: Seconds between SIGXCPU and SIGKILL once a process used its CPU time (``RLIMIT_CPU``).
CPU_KILL_GRACE = 10


def resource_limits(resources: Resources, walltime: float, *, own_account: bool) -> dict[str, list[int]]:
    """The ``RLIMIT_*`` (soft, hard) of a job's processes, sized from what it asked for.

    Each is per process (``NPROC``: per account), so they bound what one process can take, not the job: ``AS``
    the address space (``ADDRESS_SPACE_FACTOR`` x the memory per node), ``CPU`` the CPU seconds of the whole
    allocation over the walltime, ``FSIZE`` a file it writes (its output too) to the scratch storage it asked
    for (at least 1 GB), no core files; ``NPROC`` only when the job has an account of its own (the worker's
    account runs more than the job).
    """
    memory = resources.memory_mb_per_node * 2**20 * ADDRESS_SPACE_FACTOR
    cpu = max(1, math.ceil(walltime * resources.cpus_per_node))
    size = max(resources.storage_gb, 1) * 10**9
    limits = {
        "AS": [memory, memory],
        "CPU": [cpu, cpu + CPU_KILL_GRACE],
        "FSIZE": [size, size],
        "CORE": [0, 0],
    }
    if own_account:
        processes = max(MIN_PROCESSES, PROCESSES_PER_CORE * resources.cpus_per_node)
        limits["NPROC"] = [processes, processes]
    return limits


def closed_directory(path: Path) -> Path | None:
    """The first existing directory from ``path`` up that other accounts may not pass through (no o+x), if any."""
    for directory in [path, *path.parents]:
        with contextlib.suppress(FileNotFoundError):
            if not directory.stat().st_mode & 0o001:
                return directory
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def scheduler_job_id(workflow_id: str) -> str:
    """The local job id of a workflow: deterministic, so a retried submit finds what an earlier one did."""
    return JOB_ID_PREFIX + hashlib.sha256(workflow_id.encode()).hexdigest()[:20]


def host_gpus() -> int:
    """NVIDIA GPUs present on this host (``/dev/nvidia<N>`` devices)."""
    with contextlib.suppress(OSError):
        return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia[0-9]+", name))
    return 0


def host_cpus() -> int:
    """CPU cores this host lets the worker's processes use (its affinity mask; the jobs inherit it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory_bytes() -> int | None:
    """Physical memory of this host, if the system says."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _utc(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(float(timestamp), UTC)


def _dec(value: Any) -> Decimal:
    return Decimal(str(value)) if value is not None else Decimal(0)


class LocalAdapter(SchedulerAdapter):
    """Runs jobs on this host under detached supervisors; ``max_parallel_jobs`` at once, the rest queue.

    Not a sandbox (docs/security.md). A worker running as root runs each job as its tenant's unprivileged
    account (``accounts``), with resource limits; one that is not root can only run jobs as itself, which it does
    only with ``hpc.tenants.isolation: none``. The job never inherits the worker's environment.
    """

    name = "local"

    mpi_launcher = "mpirun"
    #: How long ``submit`` waits for a concurrent submit's supervisor to claim the job before giving up (transient).
    launch_timeout: float = 30.0

    def __init__(
        self,
        config: LocalSchedulerConfig,
        state_dir: Path,
        cluster_id: str,
        accounts: TenantAccounts | None = None,
        markers: MarkerKey | None = None,
    ) -> None:
        """``markers``: the provider's marker key (``from_config`` loads it; default: the one generated in
        ``state_dir``, which every adapter of that directory shares)."""
        if not config.allow_unisolated:
            raise ConfigError(
                f"cluster {cluster_id} uses the local executor, which is no multi-tenant sandbox: it runs only "
                "when the configuration opts in with hpc.local.allow_unisolated: true (for demos, tests and "
                "single-tenant hosts; docs/security.md). For tenants you do not trust, use hpc.scheduler_type "
                "slurm, moab or ood."
            )
        self.config = config
        self.cluster_id = cluster_id
        self.accounts = accounts
        self.switches_users = os.geteuid() == 0
        self.worker_user = _user_name(os.geteuid())
        if accounts is not None and accounts.isolated and not self.switches_users:
            raise ConfigError(
                f"cluster {cluster_id}: the worker runs as {self.worker_user}, not root, so the local executor "
                "cannot run jobs as the tenants' own accounts (hpc.tenants). Run the worker as root, or set "
                f"hpc.tenants.isolation: none to run every job as {self.worker_user}, with access to all it can "
                "read (demos on a developer's machine only; docs/security.md)."
            )
        self.state_dir = Path(state_dir)
        self.markers = markers or load_key(Secrets(), self.state_dir)
        self.account = pwd.getpwuid(os.getuid()).pw_name
        self._jobs = self.state_dir / "jobs"
        self._slots = self.state_dir / "slots"
        self._tmp = self.state_dir / "tmp"
        # Jobs' accounts pass through the state directory and jobs/ (0711: no listing) to their own work
        # directories; slots and staging are the supervisors' alone.
        for path, mode in (
            (self.state_dir, 0o711),
            (self._jobs, 0o711),
            (self._slots, 0o700),
            (self._tmp, 0o700),
        ):
            path.mkdir(mode=mode, parents=True, exist_ok=True)
            if (
                path.stat().st_uid == os.geteuid()
            ):  # the umask may have taken bits; an earlier release made 0700
                os.chmod(path, mode)
        if self.switches_users:
            self._check_reachable(self._jobs)
        self._meta_cache: dict[str, dict[str, Any]] = {}
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._spawned_lock = threading.Lock()
        self._remove_stale_tmp()

    @classmethod
    def from_config(cls, config: Config, secrets: Secrets, cluster_id: str) -> LocalAdapter:
        """The worker's local executor: ``hpc.local`` settings, jobs under ``Config.local_state_dir``, each run as
        its tenant's account (``hpc.tenants``)."""
        state_dir = config.local_state_dir
        markers = load_key(secrets or Secrets(), state_dir)
        return cls(config.hpc.local, state_dir, cluster_id, TenantAccounts.from_config(config), markers)

    @staticmethod
    def _check_reachable(path: Path) -> None:
        """Every directory above the job directories must let other accounts through (search permission)."""
        closed = closed_directory(path)
        if closed is not None:
            mode = closed.stat().st_mode & 0o7777
            raise ConfigError(
                f"hpc.local.state_dir {path.parent}: the tenants' accounts cannot reach their job directories, "
                f"because {closed} (mode {mode:o}) lets no other account through; give it search permission for "
                "others (chmod o+x) or choose a state_dir they can reach"
            )

    # ---- public helpers ------------------------------------------------------------------------------------
    def cannot_provide(self, resources: Resources) -> str | None:
        """Why this host cannot give a job ``resources`` (``None`` if it can).

        Every job runs on this one host: a job asking for more nodes than one, more cores, GPUs or memory than
        the host has would run on a fraction of what it bought, and be billed for the rest. It is refused instead,
        before anything runs, as a scheduler refuses a job no node of it can hold.
        """
        problems = []
        if resources.nodes > 1:
            problems.append(f"{resources.nodes} nodes (it runs every job on this one host)")
        cores = host_cpus()
        if resources.cpus_per_node > cores:
            problems.append(f"{resources.cpus_per_node} cores per node (this host has {cores})")
        gpus = self.config.gpus if self.config.gpus is not None else host_gpus()
        if resources.gpus_per_node > gpus:
            problems.append(f"{resources.gpus_per_node} GPUs per node (this host has {gpus})")
        memory = host_memory_bytes()
        asked = resources.memory_mb_per_node * 1024 * 1024
        if memory is not None and asked > memory:
            problems.append(
                f"{resources.memory_mb_per_node} MiB of memory per node (this host has {memory // 2**20} MiB)"
            )
        if not problems:
            return None
        return f"the local executor cannot provide {' and '.join(problems)}; the job is refused, not billed"

    def job_dir(self, scheduler_job_id: str) -> Path:
        """The job's directory (its ``stdout`` and ``stderr`` files are there). Raises ``JobNotFound``."""
        if not _JOB_ID_RE.fullmatch(scheduler_job_id):
            raise JobNotFound(f"{scheduler_job_id[:80]!r} is not a local job id")
        return self._jobs / scheduler_job_id

    def work_dir(self, scheduler_job_id: str) -> Path:
        """The directory the job's account owns: its default working directory, ``HOME`` and ``TMPDIR``'s parent."""
        return self.job_dir(scheduler_job_id) / sup.WORK

    # ---- the interface -------------------------------------------------------------------------------------
    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        # The job id is derived from the workflow id and its directory is claimed by one rename: two attempts
        # cannot make two jobs, so there is nothing to reconcile.
        result = await asyncio.to_thread(self._submit, request)
        if on_submitted is not None:
            on_submitted(result.scheduler_job_id)
        return result

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        return await asyncio.to_thread(self._find, workflow_id)

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        ids = list(scheduler_job_ids)
        return await asyncio.to_thread(lambda: {sid: self._status(sid) for sid in ids})

    async def cancel(self, scheduler_job_id: str) -> None:
        await asyncio.to_thread(self._cancel, scheduler_job_id)

    async def usage(self, scheduler_job_id: str) -> Accounting:
        return await asyncio.to_thread(self._usage, scheduler_job_id)

    async def close(self) -> None:
        """Supervisors are detached on purpose and outlive the adapter; only reap what already exited."""
        self._reap_spawned()

    # ---- submit --------------------------------------------------------------------------------------------
    def _submit(self, request: SubmitRequest) -> SubmitResult:
        refusal = self.cannot_provide(request.job.resources)
        if refusal is not None:
            raise SubmissionRejected(refusal)
        job_id = scheduler_job_id(request.workflow_id)
        jobdir = self._jobs / job_id
        if jobdir.is_dir() and not self._owned(request.workflow_id, job_id):
            self._set_aside(jobdir, job_id)
        if not jobdir.is_dir():
            self._create_job_dir(request, job_id, jobdir, self._run_as(request.job.tenant))
        meta = self._meta(job_id)
        if meta.get("workflow_id") != request.workflow_id:
            raise SubmissionRejected(
                f"local job {job_id} belongs to workflow {meta.get('workflow_id')!r}, not "
                f"{request.workflow_id!r} (hash collision or a damaged state directory)"
            )
        return self._launch(jobdir, job_id)

    def _tag(self, workflow_id: str) -> str:
        return marker_tag(
            self.markers, cluster_id=self.cluster_id, account=self.account, workflow_id=workflow_id
        )

    def _owned(self, workflow_id: str, job_id: str) -> bool:
        """Whether the job directory carries the workflow's marker; a look-alike is refused and reported."""
        try:
            meta = self._meta(job_id)
        except SchedulerError:
            meta = {}
        tag = meta.get("adoption_marker")
        if meta.get("workflow_id") == workflow_id and verify_marker(
            self.markers,
            cluster_id=self.cluster_id,
            account=self.account,
            workflow_id=workflow_id,
            tag=tag if isinstance(tag, str) else "",
        ):
            return True
        self.refuse_adoption(
            RefusedAdoption(
                workflow_id=workflow_id,
                cluster_id=self.cluster_id,
                scheduler_job_id=job_id,
                user=self.account,
                expected_account=self.account,
                reason="its job directory carries no valid marker of the workflow",
            )
        )
        return False

    def _set_aside(self, jobdir: Path, job_id: str) -> None:
        """Move a look-alike's directory out of the way (kept for inspection under ``tmp/``), so the workflow's
        own job can be made under its id."""
        aside = self._tmp / f"{job_id}.lookalike-{time.time_ns()}"
        self._meta_cache.pop(job_id, None)
        try:
            os.rename(jobdir, aside)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot set aside the look-alike local job {job_id}: {exc}") from exc

    def _run_as(self, tenant: str) -> dict[str, Any] | None:
        """The account a job of ``tenant`` runs as (``None``: the worker's own, with isolation none).

        Raises a non-transient error, so the job is refused and nothing runs, when the tenant has no account, the
        account is privileged (uid 0, group 0) or unknown on this host, or the worker cannot switch to it.
        """
        if self.accounts is None:
            if self.switches_users:
                raise SubmissionRejected(
                    f"no unprivileged account to run tenant {tenant}'s job as: the worker runs as root and "
                    "hpc.tenants maps no accounts; jobs never run as root",
                    code="tenant_account_missing",
                )
            return None
        if self.accounts.needs_assignment(tenant) and (free := self.accounts.unassigned_pool()):
            # As on a cluster: a pool account with job directories here is an earlier tenant's (its files, maybe
            # its running job), whatever an assignments file says (lost and recreated, or released with --force).
            self.accounts.hold_back(self._accounts_in_use(free), cluster_id=self.cluster_id)
        account = self.accounts.account_for(tenant, submit_account=self.worker_user)
        if account == self.worker_user and not self.switches_users:
            return None
        if not self.switches_users:
            raise SubmissionRejected(
                f"tenant {tenant}'s account {account} cannot be used: the worker runs as {self.worker_user}, "
                "not root, and cannot switch users",
                code="tenant_account_refused",
            )
        try:
            entry = pwd.getpwnam(account)
        except KeyError:
            raise SubmissionRejected(
                f"tenant {tenant}'s account {account} does not exist on this host",
                code="tenant_account_missing",
            ) from None
        groups = sorted(set(os.getgrouplist(account, entry.pw_gid)))
        if entry.pw_uid == 0 or 0 in groups:
            raise SubmissionRejected(
                f"refusing to run tenant {tenant}'s job as {account}: it has uid 0 or is in group 0",
                code="tenant_account_refused",
            )
        return {"user": account, "uid": entry.pw_uid, "gid": entry.pw_gid, "groups": groups}

    def _create_job_dir(
        self, request: SubmitRequest, job_id: str, jobdir: Path, run_as: dict[str, Any] | None
    ) -> None:
        """Write the job's files into a private directory, then rename it into place: all or nothing.

        The directory and what the billing reads (``meta.json``, ``status.json``) stay the worker's; the job's
        account owns only its script and its ``work`` directory (with ``tmp``), the default working directory.
        """
        staging = Path(tempfile.mkdtemp(prefix=f"{job_id}.", dir=self._tmp))
        try:
            body = request.body if request.body.endswith("\n") else request.body + "\n"
            self._write_file(staging / sup.SCRIPT, ("#!/bin/bash\n" + body).encode(), 0o500)
            meta = self._render_meta(request, job_id, jobdir, run_as)
            self._write_file(staging / sup.META, json.dumps(meta, indent=1, sort_keys=True).encode(), 0o600)
            work = staging / sup.WORK
            work.mkdir(mode=0o700)
            (work / sup.JOB_TMP).mkdir(mode=0o700)
            if run_as is not None:
                for path in (staging / sup.SCRIPT, work, work / sup.JOB_TMP):
                    os.chown(path, run_as["uid"], run_as["gid"])
            os.chmod(staging, 0o711)  # noqa: S103 - others may pass through to work/, never list or read
            sup.fsync_dir(staging)
            try:
                os.rename(staging, jobdir)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                return  # a concurrent submit of the same workflow won the race; use its directory
            sup.fsync_dir(self._jobs)
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot write the local job directory for {job_id}: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _write_file(path: Path, data: bytes, mode: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            sup.write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _render_meta(
        self, request: SubmitRequest, job_id: str, jobdir: Path, run_as: dict[str, Any] | None
    ) -> dict[str, Any]:
        job = request.job
        walltime = float(job.walltime_seconds)
        if self.config.max_walltime is not None:
            walltime = min(walltime, self.config.max_walltime.total_seconds())
        workdir = job.working_directory or str(jobdir / sup.WORK)
        return {
            "version": 1,
            "workflow_id": request.workflow_id,
            "adoption_marker": self._tag(request.workflow_id),
            "scheduler_job_id": job_id,
            "cluster_id": self.cluster_id,
            "submit_time": time.time(),
            "job": {
                "job_id": job.job_id,
                "tenant": job.tenant,
                "provider": job.provider,
                "offering_id": job.offering_id,
                "name": job.name,
                "partition": request.partition or job.partition,
                "job_class": job.job_class,
                "resources": job.resources.model_dump(mode="json"),
                "walltime_seconds": job.walltime_seconds,
            },
            "limits": {
                "walltime_seconds": walltime,
                "kill_wait_seconds": self.config.kill_wait.total_seconds(),
                "rlimits": resource_limits(job.resources, walltime, own_account=run_as is not None),
            },
            "slots": {"dir": str(self._slots), "count": self.config.max_parallel_jobs},
            "working_directory": workdir,
            "run_as": run_as,
            "env": self._environment(request, job_id, jobdir, workdir, walltime, run_as),
        }

    def _environment(
        self,
        request: SubmitRequest,
        job_id: str,
        jobdir: Path,
        workdir: str,
        walltime: float,
        run_as: dict[str, Any] | None,
    ) -> dict[str, str]:
        """A clean environment: a minimal base, the tenant's variables, then ours (reserved names)."""
        job, res = request.job, request.job.resources
        user = run_as["user"] if run_as is not None else self.worker_user
        env = {
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "LOGNAME": user,
            "SHELL": "/bin/bash",
            "TMPDIR": str(jobdir / sup.WORK / sup.JOB_TMP),
            "USER": user,
        }
        env.update(job.environment)
        counts = {
            "NNODES": res.nodes,
            "NTASKS": res.nodes * res.tasks_per_node,
            "NTASKS_PER_NODE": res.tasks_per_node,
            "CPUS_PER_TASK": res.cpus_per_task,
        }
        env.update({f"VIRTENGINE_{k}": str(v) for k, v in counts.items()})
        env.update(
            {
                "PATH": JOB_PATH,
                "VIRTENGINE_JOB_ID": job.job_id,
                "VIRTENGINE_WORKFLOW_ID": request.workflow_id,
                "VIRTENGINE_SCHEDULER_JOB_ID": job_id,
                "VIRTENGINE_CLUSTER_ID": self.cluster_id,
                "VIRTENGINE_JOB_NAME": job.name,
                "VIRTENGINE_JOB_DIR": str(jobdir / sup.WORK),
                "VIRTENGINE_GPUS_PER_NODE": str(res.gpus_per_node),
                "VIRTENGINE_MEM_PER_NODE_MB": str(res.memory_mb_per_node),
                "VIRTENGINE_WALLTIME_SECONDS": str(math.ceil(walltime)),
                # Task counts under their SLURM names, so that templates written for SLURM run unchanged.
                # Never SLURM_JOB_ID/SLURM_JOBID: MPI launchers take those as "inside a SLURM allocation" and
                # call srun.
                "SLURM_NNODES": str(res.nodes),
                "SLURM_JOB_NUM_NODES": str(res.nodes),
                "SLURM_NTASKS": str(counts["NTASKS"]),
                "SLURM_NPROCS": str(counts["NTASKS"]),
                "SLURM_NTASKS_PER_NODE": str(res.tasks_per_node),
                "SLURM_CPUS_PER_TASK": str(res.cpus_per_task),
            }
        )
        return env

    def _launch(self, jobdir: Path, job_id: str) -> SubmitResult:
        """Start the job's supervisor unless one already took the job (then adopt it)."""
        deadline = time.monotonic() + self.launch_timeout
        started = jobdir / sup.STARTED
        while True:
            fd = os.open(jobdir / sup.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if started.exists():
                        return SubmitResult(scheduler_job_id=job_id, adopted=True)
                    # A concurrent submit is launching it (or a status probe holds the lock for a moment).
                else:
                    if started.exists():
                        return SubmitResult(scheduler_job_id=job_id, adopted=True)
                    adopted = self._spawn_supervisor(jobdir, fd)
                    return SubmitResult(scheduler_job_id=job_id, adopted=adopted)
            finally:
                os.close(fd)  # the supervisor, if spawned, holds the lock through its own copy of the fd
            if time.monotonic() > deadline:
                raise SchedulerUnavailable(f"local job {job_id} is locked but was not started; try again")
            time.sleep(0.02)

    def _spawn_supervisor(self, jobdir: Path, lock_fd: int) -> bool:
        """Spawn the supervisor holding ``lock_fd`` and commit it as the job's owner; returns ``adopted``.

        Once this returns, the ``started`` marker is on disk: a retried submit adopts, whatever happens next.
        """
        self._reap_spawned()
        try:
            log_fd = os.open(
                jobdir / sup.SUPERVISOR_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            with open(log_fd, "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_SUPERVISOR), "--lock-fd", str(lock_fd), str(jobdir)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(lock_fd,),
                    start_new_session=True,
                    env=_SUPERVISOR_ENV,
                    cwd="/",
                )
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot start the local job supervisor: {exc}") from exc
        with self._spawned_lock:
            self._spawned.append(proc)
        return self._commit(jobdir, proc.pid)

    def _commit(self, jobdir: Path, pid: int) -> bool:
        """Write the marker naming supervisor ``pid`` (unless it already did). False: a fresh submission."""
        # A marker naming another pid cannot appear while we hold the lock; if it did, that supervisor owns
        # the job, and this one exits without running it: adopt.
        return not sup.claim_marker(jobdir, pid)

    def _reap_spawned(self) -> None:
        """Reap the processes we spawned: each forks the real supervisor and exits within milliseconds."""
        with self._spawned_lock:
            self._spawned = [proc for proc in self._spawned if proc.poll() is None]

    # ---- lookups -------------------------------------------------------------------------------------------
    def _find(self, workflow_id: str) -> str | None:
        job_id = scheduler_job_id(workflow_id)
        jobdir = self._jobs / job_id
        # Only a launched job counts: a directory left by a submit that died before launching is not a job
        # yet, and the caller's submit will launch it.
        if not (jobdir / sup.STARTED).exists():
            return None
        return job_id if self._owned(workflow_id, job_id) else None

    def _meta(self, job_id: str) -> dict[str, Any]:
        meta = self._meta_cache.get(job_id)
        if meta is None:
            meta = sup.read_json(self._jobs / job_id / sup.META)
            if meta is None:
                raise SchedulerError(f"local job {job_id}: {sup.META} is missing or damaged", transient=False)
            if len(self._meta_cache) >= _META_CACHE_SIZE:
                self._meta_cache.clear()
            self._meta_cache[job_id] = meta
        return meta

    def _current_status(self, job_id: str) -> dict[str, Any] | None:
        """The job's status file, reconciled: a non-final status whose supervisor is gone becomes failed.

        Raises ``JobNotFound`` for an unknown job. ``None`` for a job whose supervisor has not started yet.
        """
        jobdir = self.job_dir(job_id)
        # Plain string paths: this runs for every job of every status_batch; pathlib would cost more than I/O.
        prefix = f"{jobdir}/"
        status = sup.read_json(prefix + sup.STATUS)
        if status is not None and status.get("state") in sup.FINAL_STATES:
            return status
        if status is None and not os.path.isdir(jobdir):
            raise JobNotFound(f"no local job {job_id}")
        if not os.path.exists(prefix + sup.STARTED):
            return None  # not launched (a submit died before launching it); a retried submit launches it
        if status is None:  # launched; the supervisor has not written its first status yet
            status = {"state": "queued", "native_state": "STARTING", "reason": "the supervisor is starting"}
        return self._reconcile(jobdir, status)

    def _reconcile(self, jobdir: Path, status: dict[str, Any]) -> dict[str, Any]:
        """``status`` if the supervisor lives (it holds the lock); if it died, the job recorded as failed."""
        fd = os.open(jobdir / sup.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return status  # the supervisor is alive
            # The supervisor is gone. It may have written a final state just before exiting: read again.
            status = sup.read_json(jobdir / sup.STATUS) or {}
            if status.get("state") in sup.FINAL_STATES:
                return status
            killed = status.get("boot_id") == sup.boot_id() and sup.kill_orphaned_group(
                status.get("job_pid"), status.get("job_start_ticks")
            )
            reason = (
                "the job's supervisor died without recording an end state (host reboot or the supervisor was "
                "killed); the job's outcome is unknown"
            )
            if killed:
                reason += "; its remaining processes were killed"
            if log := self._tail(jobdir / sup.SUPERVISOR_LOG, 300):
                reason += f" (supervisor log: {log})"
            status.update(
                state="failed",
                native_state="SUPERVISOR_LOST",
                reason=reason,
                end_time=status.get("updated_time") or time.time(),
                updated_time=time.time(),
            )
            sup.write_json_atomic(jobdir / sup.STATUS, status, durable=True)
            return status
        finally:
            os.close(fd)

    def _status(self, job_id: str) -> NativeStatus:
        try:
            status = self._current_status(job_id)
        except JobNotFound as exc:
            return NativeStatus(scheduler_job_id=job_id, found=False, reason=str(exc))
        if status is None:
            return NativeStatus(
                scheduler_job_id=job_id,
                state=JobState.QUEUED,
                native_state="SUBMITTING",
                reason="submitted; its supervisor has not started yet (a retried submit starts it)",
            )
        return NativeStatus(
            scheduler_job_id=job_id,
            state=JobState(status["state"]),
            native_state=str(status.get("native_state", "")),
            reason=str(status.get("reason", "")),
            exit_code=status.get("exit_code"),
            start_time=_utc(status.get("start_time")),
            end_time=_utc(status.get("end_time")),
        )

    # ---- cancel and usage ----------------------------------------------------------------------------------
    def _cancel(self, job_id: str) -> None:
        jobdir = self.job_dir(job_id)
        if not jobdir.is_dir():
            raise JobNotFound(f"no local job {job_id}")
        status = self._current_status(job_id)
        if status is not None and status.get("state") in sup.FINAL_STATES:
            return  # already ended: nothing to do
        # The file makes the request durable: a supervisor that starts later, or misses the signal, still sees
        # it.
        with contextlib.suppress(FileExistsError):
            fd = os.open(jobdir / sup.CANCEL, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.write(fd, f"{time.time():.6f}\n".encode())
            os.close(fd)
        if status is None:
            return
        pid, start = status.get("supervisor_pid"), status.get("supervisor_start_ticks")
        if (
            isinstance(pid, int)
            and status.get("boot_id") == sup.boot_id()
            and sup.is_same_process(pid, start)
        ):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)

    def _usage(self, job_id: str) -> Accounting:
        status = self._current_status(job_id)
        if status is None:
            return Accounting(scheduler_job_id=job_id)
        raw = status.get("usage") or {}
        wall = _dec(raw.get("wall_clock_seconds"))
        start = _utc(status.get("start_time"))
        if "memory_byte_seconds" in raw:
            byte_seconds = _dec(raw["memory_byte_seconds"])
        else:  # written by a supervisor of an earlier release, which kept GiB-seconds
            byte_seconds = _dec(raw.get("memory_gib_seconds")) * 2**30
        reading = Reading(
            wall_clock_seconds=wall,
            # The supervisor clocks the run time from the start; the reading describes that moment.
            taken_at=start + timedelta(seconds=float(wall)) if start is not None else None,
            cpu_time_seconds=_dec(raw.get("cpu_seconds")),
            memory_byte_seconds=byte_seconds,
            memory_bytes_max=raw.get("memory_bytes_max"),
        )
        return Accounting(
            scheduler_job_id=job_id,
            final=status.get("state") in sup.FINAL_STATES,
            reading=reading,
            start_time=start,
            end_time=_utc(status.get("end_time")),
        )

    # ---- accounts ------------------------------------------------------------------------------------------
    async def accounts_in_use(self, accounts: Sequence[str]) -> dict[str, str]:
        return await asyncio.to_thread(self._accounts_in_use, accounts)

    async def account_files(self, account: str) -> list[str] | None:
        """The job directories of ``account`` (its files are in their ``work/``)."""
        jobs = await asyncio.to_thread(self._jobs_of, {account})
        return [job_id for job_id, _ in jobs.get(account, [])][:FILES_SHOWN]

    async def remove_account_files(self, account: str) -> None:
        await asyncio.to_thread(self._remove_account_files, account)

    def _remove_account_files(self, account: str) -> None:
        """Remove every job directory of ``account``: what its jobs wrote (``work/``) emptied as the account by
        fixed argvs, then the rest, the worker's own. Refused while one of its jobs has not ended."""
        jobs = [job_id for job_id, _ in self._jobs_of({account}).get(account, [])]
        running = [j for j in jobs if (self._current_status(j) or {}).get("state") not in sup.FINAL_STATES]
        if running:
            raise SchedulerError(
                f"{account} still has local jobs that have not ended ({', '.join(running[:3])}); cancel them first",
                transient=False,
            )
        entry = pwd.getpwnam(account)
        for job_id in jobs:
            work = self._jobs / job_id / sup.WORK
            # work/ itself too (before find reads it): its last tenant may have left it unreadable.
            for argv in (["-type", "d", "-exec", "chmod", "u+rwx", "{}", ";"], ["-mindepth", "1", "-delete"]):
                subprocess.run(
                    ["find", str(work), *argv],
                    user=entry.pw_uid,
                    group=entry.pw_gid,
                    extra_groups=[],
                    env=_SUPERVISOR_ENV,
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=300,
                    check=False,
                )
            self._meta_cache.pop(job_id, None)
            shutil.rmtree(self._jobs / job_id)  # fd-based: never follows a link out of the directory

    def _accounts_in_use(self, accounts: Iterable[str]) -> dict[str, str]:
        """The local executor's registry is its job directories: an account has jobs here while any of its job
        directories is kept, running or ended (they hold its outputs until the operator removes them)."""
        found = {}
        for account, jobs in self._jobs_of(set(accounts)).items():
            live = sum(1 for _, ended in jobs if not ended)
            found[account] = (
                f"{len(jobs)} local job directories in {self._jobs} ({live} not ended), which hold its files"
            )
        return found

    def _jobs_of(self, accounts: Collection[str]) -> dict[str, list[tuple[str, bool]]]:
        """``account -> [(job id, ended)]``: every job directory whose job runs as one of ``accounts``."""
        found: dict[str, list[tuple[str, bool]]] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self._jobs):
                if not _JOB_ID_RE.fullmatch(entry.name):
                    continue
                meta = sup.read_json(f"{entry.path}/{sup.META}") or {}
                run_as = meta.get("run_as")
                user = run_as.get("user") if isinstance(run_as, dict) else None
                if isinstance(user, str) and user in accounts:
                    status = sup.read_json(f"{entry.path}/{sup.STATUS}") or {}
                    found.setdefault(user, []).append((entry.name, status.get("state") in sup.FINAL_STATES))
        return found

    # ---- housekeeping --------------------------------------------------------------------------------------
    @staticmethod
    def _tail(path: Path, limit: int = 400) -> str:
        try:
            return path.read_bytes()[-limit:].decode(errors="replace").strip()
        except OSError:
            return ""

    def _remove_stale_tmp(self) -> None:
        """Remove staging directories that crashed submits left behind (they are never renamed into place)."""
        cutoff = time.time() - _STALE_TMP_SECONDS
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._tmp):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        shutil.rmtree(entry.path, ignore_errors=True)
