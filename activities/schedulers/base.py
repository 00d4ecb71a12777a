"""The scheduler-adapter interface every scheduler (local, SLURM, MOAB, OOD) implements.

Adapters are plain async classes with injected configuration; activities call them and translate their domain
exceptions (``virtengine_hpc.errors``) into Temporal errors. The contract, which the adapter test-suites check:

* ``submit`` is idempotent by ``workflow_id``: the scheduler job carries the workflow id (job name or comment), and
  a retried submit first looks the job up and adopts it (invariant 2 in docs/architecture.md). A request that names the job an
  earlier attempt heartbeated (``known_job_id``) adopts it without a lookup; a first attempt
  (``first_attempt``) submits without one. ``on_submitted`` hears the new job's id the moment the scheduler
  answers. Adapters whose jobs can be duplicated (two attempts racing) then reconcile: of the jobs carrying the
  workflow id the oldest is kept and returned, the others are cancelled and named in ``duplicates_cancelled``;
  a first attempt whose job was accepted while it still ran alone (``alone_until``) has no one to race.
* ``status_batch`` answers for many jobs with one scheduler query (invariant 4). A job the queue no longer shows is
  looked up in accounting; a job found nowhere is reported with ``found=False`` and never assumed completed
  (invariant 5). A failed query raises ``SchedulerUnavailable``: it is never a state change.
* ``usage`` returns the job's raw cumulative reading since it started (monotone), final once the job ended, so
  that period records are differences of cumulative readings and add up to the final accounting.
* ``cancel`` of a job that already ended is not an error.
* ``swept_jobs`` (optional) lists, in one query, every live job that carries one of this provider's workflow
  markers and, with per-tenant accounts, every live job of a tenant's account, marked or not, so that jobs no
  workflow names (a late duplicate, a job a tenant submitted itself) can be found and stopped.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import SchedulerError

# The value types the interface takes and answers live in the domain (workflows wait on ``NativeStatus``);
# adapters and activities import them from here as well.
from virtengine_hpc.scheduling import (
    FILES_SHOWN,
    Accounting,
    ListedJob,
    NativeStatus,
    RefusedAdoption,
    SubmitRequest,
    SubmitResult,
    files_left_message,
)

if TYPE_CHECKING:
    from activities.tenant_accounts import TenantAccounts

log = logging.getLogger(__name__)

__all__ = [
    "FILES_SHOWN",
    "Accounting",
    "ListedJob",
    "NativeStatus",
    "RefusedAdoption",
    "SchedulerAdapter",
    "SubmitRequest",
    "SubmitResult",
    "files_left_message",
    "hold_back_taken",
]


class SchedulerAdapter(abc.ABC):
    """Base of every scheduler adapter. Each subclass carries in ``name`` the key it has in
    ``activities/schedulers/registry.py``, the one table of adapters by ``scheduler_type``."""

    name: ClassVar[str] = ""
    #: How the template renderer launches parallel tasks on this scheduler (``srun``, ``mpirun``).
    mpi_launcher: ClassVar[str] = "mpirun"

    @classmethod
    def from_config(cls, config: Config, secrets: Secrets, cluster_id: str) -> SchedulerAdapter:
        """Build the adapter for ``cluster_id`` from the worker's config and the environment's secrets."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from the config")

    @abc.abstractmethod
    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        """Submit the job, or adopt the job an earlier attempt already submitted for ``request.workflow_id``.

        ``on_submitted`` is called with the scheduler's job id as soon as it exists (the activity heartbeats it,
        so a retry adopts the job without a lookup)."""

    @abc.abstractmethod
    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        """The scheduler job id that carries ``workflow_id``'s marker, if any (queue or accounting).

        ``tenant``: whose job it is; the account its jobs run as decides which job counts (None: the provider's
        own submit account)."""

    @abc.abstractmethod
    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        """Status of all the given jobs from one scheduler query (plus one accounting query for vanished ones)."""

    @abc.abstractmethod
    async def cancel(self, scheduler_job_id: str) -> None:
        """Cancel the job; a job that already ended is not an error."""

    @abc.abstractmethod
    async def usage(self, scheduler_job_id: str) -> Accounting:
        """Cumulative usage so far (final when the job ended)."""

    def expected_account(self, tenant: str) -> str | None:
        """The cluster account the jobs of ``tenant`` were or will be submitted as (``hpc.tenants``), without
        assigning one; None when this adapter cannot tell or the tenant has none yet. Adoption checks compare it
        with the account of a job found by its workflow id."""
        return None

    async def swept_jobs(self) -> list[ListedJob]:
        """Every live job the per-cluster sweep (``workers/sweeper.py``) checks against the workflows, from one
        query: those that carry this provider's marker of a workflow and, with per-tenant accounts, every job of
        a tenant's account (a tenant's own ``sbatch`` carries no valid marker; nothing else would stop or bill it).

        Adapters that cannot list their jobs raise ``NotImplementedError``: the sweep is then off for them."""
        raise NotImplementedError(f"{self.name} cannot list its jobs")

    async def swept_ended(self, seconds: int) -> list[ListedJob]:
        """Jobs of the tenants' accounts that ran and ended within the last ``seconds``, from one accounting
        query: a tenant's own job that started after one sweep round and ended before the next was never live at
        a round, and this is where the sweep learns of it. ``NotImplementedError`` where it cannot tell."""
        raise NotImplementedError(f"{self.name} cannot list the jobs that ended")

    async def accounts_in_use(self, accounts: Sequence[str]) -> dict[str, str]:
        """Which of ``accounts`` the scheduler shows jobs of (account -> what shows it), the check made before a
        pool account is handed out and before ``tenants release`` lets one go; empty where it cannot tell."""
        return {}

    async def account_files(self, account: str) -> list[str] | None:
        """What ``account`` left in its job directory (``<work_dir>/<account>``): the names of its entries, at
        most ``FILES_SHOWN`` (``[]``: empty or missing). ``None`` where this adapter has no view of it it can
        trust (no file system, or only through the account's own login, whose startup files its tenant wrote).
        Checked before the pool hands out an account and before ``tenants release`` lets one go."""
        return None

    async def remove_account_files(self, account: str) -> None:
        """Remove everything in ``account``'s job directory, as the account, by a fixed argv; raises
        ``SchedulerError`` where this adapter cannot (``account_files`` is ``None``) or something is left."""
        raise SchedulerError(f"{self.name} cannot remove {account}'s files from here", transient=False)

    async def cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        """Cancel several jobs (the sweep's findings); one call per job unless the scheduler takes a list."""
        for scheduler_job_id in scheduler_job_ids:
            await self.cancel(scheduler_job_id)

    def tenant_of(self, account: str) -> str | None:
        """The tenant a cluster account belongs to (``hpc.tenants``), for audit records; None if unknown."""
        return None

    def on_refused_adoption(self, listener: Callable[[RefusedAdoption], None]) -> None:
        """Hear about every look-alike this adapter refuses to adopt (the job activities audit them)."""
        self.__dict__.setdefault("_refusal_listeners", []).append(listener)

    def refuse_adoption(self, refusal: RefusedAdoption) -> None:
        """Report a look-alike: logged, and passed to every listener."""
        log.warning(
            "workflow %s: not adopting scheduler job %s on %s (%s)",
            refusal.workflow_id,
            refusal.scheduler_job_id,
            refusal.cluster_id,
            refusal.reason,
        )
        self.tell_refused(refusal)

    def tell_refused(self, refusal: RefusedAdoption) -> None:
        """Pass a refusal to the listeners only (an adapter relaying its inner adapter's, already logged)."""
        for listener in self.__dict__.get("_refusal_listeners", []):
            listener(refusal)

    async def drain_node(self, node: str, reason: str) -> None:
        raise NotImplementedError(f"{self.name} cannot drain nodes")

    async def resume_node(self, node: str) -> None:
        raise NotImplementedError(f"{self.name} cannot resume nodes")

    async def node_busy(self, node: str) -> bool:
        """Whether jobs still run on ``node``; a draining node becomes drained once this is False.

        Adapters that cannot tell raise ``NotImplementedError``: the node then counts as drained as soon as the
        drain itself was accepted.
        """
        raise NotImplementedError(f"{self.name} cannot tell whether a node is busy")

    async def close(self) -> None:  # noqa: B027 - optional hook; most adapters hold nothing to release
        """Release connections (SSH sessions, HTTP pools)."""


async def hold_back_taken(
    adapter: SchedulerAdapter, tenants: TenantAccounts, tenant: str, *, cluster_id: str
) -> None:
    """Before the pool hands ``tenant`` an account, hold back the unassigned pool accounts some other tenant still
    has a claim on: those the scheduler shows jobs of (an assignments file lost and recreated, or another host's
    own), then, in the order the pool hands them out, those whose job directory holds files (an earlier tenant's
    outputs, which the new one would read and could take for its own), up to the first that is empty. Where the
    adapter cannot see the files (``account_files`` is ``None``), ``tenants release`` is the gate."""
    if not await asyncio.to_thread(tenants.needs_assignment, tenant):
        return
    free = await asyncio.to_thread(tenants.unassigned_pool)
    if not free:
        return
    tenants.hold_back(await adapter.accounts_in_use(free), cluster_id=cluster_id)
    for account in await asyncio.to_thread(tenants.unassigned_pool):
        try:
            left = await adapter.account_files(account)
        except SchedulerError as exc:
            # Its last tenant can make the directory unreadable to the account (chmod 0 on its way out): what it
            # holds is unknown, so the account is passed over like one with files, and the next one is tried.
            why = f"its job directory cannot be listed as the account ({str(exc)[:200]})"
            tenants.hold_back({account: why}, cluster_id=cluster_id, files=True)
            continue
        if not left:
            return
        tenants.hold_back({account: files_left_message(left)}, cluster_id=cluster_id, files=True)
