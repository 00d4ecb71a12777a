"""The shared base of batch-scheduler adapters (SLURM, MOAB): what every such adapter must get right once, so each
scheduler only contributes command builders, parsers and a state table.

* **Running commands.** A ``CommandRunner`` (local processes, SSH) runs argv lists (never a shell string) with a
  timeout; ``CommandExecutor`` turns a failure into a ``SchedulerError`` that carries the command, exit code, stdout
  and stderr, classified as transient (``SchedulerUnavailable``: the controller is down or slow) or not.
* **Retries.** ``Backoff`` + ``retrying``: transient errors are retried inside the adapter with the configured
  exponential backoff, up to ``max_retries``, before the last error is raised to the activity.
* **Exactly-once submission.** A retried submit first looks for a job carrying the workflow id (``find``) and
  adopts it; it looks again before every retry inside the adapter, because a submission whose answer was lost
  (timeout, dropped connection, a worker killed between "accepted" and "returned") may well have created the
  job. A first attempt (nothing before it can have created a job) submits without looking; a retry that knows
  the job id its predecessor heartbeated adopts it once it sees that job carry the marker.
* **Markers a tenant cannot forge.** Tenants can submit jobs too, named as they like. A job's name is
  ``vehpc-<workflow id>.<tag>``, the tag an HMAC under the provider's secret over cluster, account and workflow
  id (``virtengine_hpc.markers``); only a job whose name carries the tag for the account the job must run as,
  and which runs as that account, is ever adopted, kept or counted as a duplicate. Anything else under the
  workflow's names is a look-alike: refused and reported (``SchedulerAdapter.refuse_adoption``), never adopted.
* **Reconciliation after every submit.** Two attempts of one submission can race (a timed-out attempt still
  running beside its retry, on another worker) and both submit. So after every submission or adoption the
  adapter asks which jobs carry the workflow id, keeps the oldest and cancels the others. Scheduler job ids grow
  with submission order, so whichever attempt checks last sees every older job, and all attempts keep the same
  one. The check runs to its end even if the attempt is cancelled meanwhile, and an attempt cancelled while its
  submission was in flight (the command killed, the job perhaps created) runs the check in the background.
  One submission needs no check: a first attempt's first try whose job the scheduler accepted while the attempt
  still ran alone (``SubmitRequest.alone_until``, before any retry of it can have started). A retry looks first
  and so finds that job; only an attempt that outlived its window (a zombie) can race one, and it checks.
* **Lookups coalesce.** Concurrent lookups share one scheduler query (group commit), so neither the lookup of a
  retry nor the check after each submit multiplies the scheduler's load when many jobs are submitted at once.
  The check after a submit asks only what the scheduler still holds (``_lookup_live``: a racing duplicate is
  seconds old), not its accounting.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Generic, Protocol, TypeVar

from activities.group_commit import GroupCommit
from activities.schedulers.base import (
    FILES_SHOWN,
    ListedJob,
    RefusedAdoption,
    SchedulerAdapter,
    SubmitRequest,
    SubmitResult,
    files_left_message,
)
from activities.schedulers.batch.workdir import TenantDirs, remote_tenant_dirs
from virtengine_hpc.config import RetryConfig
from virtengine_hpc.errors import SchedulerError, SchedulerUnavailable
from virtengine_hpc.markers import MarkerKey, bare_name, claimed_workflow, marked_name, marked_workflow
from virtengine_hpc.tenancy import TenantAccountError

log = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

_TAIL = 2000
_JOB_NUMBER = re.compile(r"(\d{1,18})")


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    seconds: float = 0.0

    @property
    def message(self) -> str:
        """The most useful line of the error output (``sbatch: error: ...``), for humans."""
        lines = [line.strip() for line in (self.stderr or self.stdout).splitlines() if line.strip()]
        failed = [line for line in lines if "failed" in line.lower() or "error" in line.lower()]
        return (failed or lines or [f"exit code {self.exit_code}"])[-1][:500]


class CommandRunner(Protocol):
    """Runs a scheduler command given as an argv list; stdin (the batch script) is passed as data, never argv."""

    description: str

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        """Run and return the result whatever the exit code; raise ``SchedulerUnavailable`` if it cannot run."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Backoff:
    """Retry schedule for transient scheduler errors: ``max_retries`` retries, exponential delays."""

    max_retries: int = 3
    initial: float = 1.0
    maximum: float = 30.0
    multiplier: float = 2.0

    @classmethod
    def from_config(cls, retry: RetryConfig, max_retries: int) -> Backoff:
        return cls(
            max_retries=max_retries,
            initial=retry.initial_backoff.total_seconds(),
            maximum=retry.max_backoff.total_seconds(),
            multiplier=retry.backoff_multiplier,
        )

    def delays(self) -> Iterator[float]:
        delay = self.initial
        for _ in range(self.max_retries):
            yield min(delay, self.maximum)
            delay *= self.multiplier


async def retrying(operation: Callable[[], Awaitable[T]], backoff: Backoff, what: str) -> T:
    """Run ``operation``; on ``SchedulerUnavailable`` wait and try again, up to ``backoff.max_retries`` times."""
    delays = backoff.delays()
    while True:
        try:
            return await operation()
        except SchedulerUnavailable as exc:
            delay = next(delays, None)
            if delay is None:
                raise
            log.warning("%s: %s; retrying in %.1f s", what, exc, delay)
            await asyncio.sleep(delay)


class Coalescer(Generic[K, V]):
    """Group commit for lookups (``GroupCommit``): concurrent ``get`` calls made while a batch is in flight share
    the next batch.

    One caller alone pays one query; a hundred concurrent callers pay one or two. ``fetch`` gets the distinct keys
    and returns the answers it has (a key it leaves out is answered ``None``); if it raises, every caller of that
    batch gets the error. A query no caller waits for any more is stopped.
    """

    def __init__(self, fetch: Callable[[list[K]], Awaitable[dict[K, V]]], max_batch: int = 200) -> None:
        self._fetch = fetch
        self._group: GroupCommit[K, V | None] = GroupCommit(
            self._answers, max_batch=max_batch, dedupe=True, stop_unwanted=True
        )

    @property
    def batches(self) -> int:
        """Queries started."""
        return self._group.batches

    async def get(self, key: K) -> V | None:
        return await self._group.submit(key)

    async def _answers(self, keys: list[K]) -> list[V | None]:
        answers = await self._fetch(keys)
        return [answers.get(key) for key in keys]


@dataclass(frozen=True)
class Candidate:
    """A scheduler job whose name claims a workflow (what the name lookups found).

    ``name`` and ``user`` are what the scheduler says the job is called and runs as: the base adopts it only if
    the name carries the workflow's marker for the account it expects and the job runs as that very account."""

    scheduler_job_id: str
    final: bool = False
    name: str = ""
    user: str = ""

    @property
    def order(self) -> tuple[int, str]:
        """Submission order: the number in the id (``4711``, MOAB's ``Moab.4711``), else after every numbered id."""
        number = _JOB_NUMBER.search(self.scheduler_job_id)
        return (int(number.group(1)), self.scheduler_job_id) if number else (1 << 62, self.scheduler_job_id)


@dataclass(frozen=True)
class Owner:
    """Whose job a lookup asks for: the workflow, and the account its job must run as (None: any account this
    adapter's jobs may run as, for a lookup that does not know the workflow's tenant)."""

    workflow_id: str
    account: str | None


@dataclass
class Lookup:
    """What the scheduler holds under a workflow's names: its own jobs, and look-alikes never to adopt."""

    adoptable: list[Candidate] = field(default_factory=list)
    lookalikes: list[tuple[Candidate, str]] = field(default_factory=list)


class CommandExecutor:
    """Runs commands through a runner and turns failures into typed errors that carry the whole story.

    ``transient_patterns`` are the scheduler's ways of saying "try again later" (controller down, timeouts); a
    failure matching none of them is final (``rejected``, e.g. ``SubmissionRejected`` for ``sbatch``).
    """

    def __init__(
        self, runner: CommandRunner, transient_patterns: Sequence[re.Pattern[str]], timeout: float
    ) -> None:
        self.runner = runner
        self.transient_patterns = tuple(transient_patterns)
        self.timeout = timeout

    def is_transient(self, text: str) -> bool:
        return any(p.search(text) for p in self.transient_patterns)

    async def run(
        self,
        argv: Sequence[str],
        *,
        what: str,
        stdin: str | None = None,
        ok: Callable[[CommandResult], bool] | None = None,
        rejected: type[SchedulerError] = SchedulerError,
    ) -> CommandResult:
        """Run ``argv``; a failure becomes ``SchedulerUnavailable`` (transient output, timeout) or ``rejected``.

        ``ok`` decides what counts as success (default: exit code 0), for commands whose "error" is an answer
        (``squeue`` of a purged job id).
        """
        result = await self.runner.run(argv, stdin=stdin, timeout=self.timeout)
        if (ok or (lambda r: r.exit_code == 0))(result):
            return result
        raise self.error(result, what, rejected)

    def error(
        self, result: CommandResult, what: str, rejected: type[SchedulerError] = SchedulerError
    ) -> SchedulerError:
        text = f"{result.stdout}\n{result.stderr}"
        kind: type[SchedulerError]
        if result.exit_code in (126, 127):
            kind = SchedulerError
            message = (
                f"{what}: {result.argv[0]} is not installed or not executable there "
                f"(exit {result.exit_code}): {result.message}"
            )
        elif self.is_transient(text):
            kind, message = SchedulerUnavailable, f"{what}: scheduler unavailable: {result.message}"
        else:
            kind, message = rejected, f"{what} failed: {result.message}"
        return kind(
            message,
            command=list(result.argv),
            exit_code=result.exit_code,
            stdout=result.stdout[-_TAIL:],
            stderr=result.stderr[-_TAIL:],
        )


@dataclass
class _Gate:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class BatchSchedulerAdapter(SchedulerAdapter, abc.ABC):
    """Base of batch-scheduler adapters: retries, exactly-once submission, coalesced lookups, reconciliation.

    Subclasses implement ``_jobs_named`` (every job, queued, running or ended, from queue *and* accounting, with
    one of several names), ``_submit_new`` (one submission, no lookup), ``_cancel_many``, ``_submit_account``
    and the status/usage methods; ``_live_jobs_named`` (the jobs the scheduler still holds) when that is cheaper.
    The base decides which of the jobs found are a workflow's own (``virtengine_hpc.markers``).
    """

    cluster_id: str = ""
    #: The provider's other clusters (``hpc.clusters``): a job marked for one of them is that cluster's sweep's.
    sibling_clusters: tuple[str, ...] = ()
    #: Cancelled in one command by ``cancel_many``.
    CANCEL_CHUNK = 500

    def __init__(self, *, backoff: Backoff, markers: MarkerKey | None = None) -> None:
        self.backoff = backoff
        self.markers = markers or MarkerKey.ephemeral()
        self._finder: Coalescer[Owner, Lookup] = Coalescer(lambda owners: self._lookup(owners, live=False))
        self._live_finder: Coalescer[Owner, Lookup] = Coalescer(
            lambda owners: self._lookup(owners, live=True)
        )
        # Submits of one workflow id in this process run one at a time (an attempt that outlived its timeout
        # and its retry on the same worker need not race each other).
        self._submitting: dict[str, _Gate] = {}
        # Reconciliations that outlive the attempt that started them (see ``_submit_then_check``).
        self._background: set[asyncio.Task[SubmitResult | None]] = set()
        self._refused_seen: set[str] = set()

    # ---- hooks ---------------------------------------------------------------------------------------------
    @abc.abstractmethod
    async def _jobs_named(self, names: list[str]) -> list[Candidate]:
        """Every job (queued, running or ended) with one of ``names``; raises ``SchedulerUnavailable``."""

    async def _live_jobs_named(self, names: list[str]) -> list[Candidate]:
        """The jobs with one of ``names`` that the scheduler itself still holds (ended ones for a while).

        Enough for the check after a submit: a duplicate from a racing attempt was submitted seconds ago.
        Defaults to ``_jobs_named``; override when the scheduler's own view is cheaper than its accounting."""
        return await self._jobs_named(names)

    @abc.abstractmethod
    async def _submit_new(self, request: SubmitRequest) -> str:
        """Submit once, without looking up; the scheduler's job id."""

    @abc.abstractmethod
    async def _cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        """Cancel jobs; ended or unknown jobs are not an error."""

    @abc.abstractmethod
    def _submit_account(self) -> str:
        """The account this adapter's commands run as on the scheduler (its jobs run as it too)."""

    # ---- markers -------------------------------------------------------------------------------------------
    def expected_account(self, tenant: str) -> str | None:
        """Today every job of a batch scheduler runs as the submit account, whatever its tenant."""
        return self._submit_account()

    def account_for(self, tenant: str | None) -> str | None:
        """The account a job of ``tenant`` runs as, hence the account its marker is bound to and its job must
        run under to be adopted: the one place adoption asks (``expected_account``, else the submit account).
        None for an unknown tenant: then a job running as any of ``_adoptable_accounts`` may be adopted, if
        its marker was made for the account it runs as."""
        if tenant is None:
            return None
        return self.expected_account(tenant) or self._submit_account()

    def _adoptable_accounts(self) -> list[str]:
        """Every account this adapter's jobs may run as."""
        return [self._submit_account()]

    def owner(self, workflow_id: str, tenant: str | None = None) -> Owner:
        return Owner(workflow_id, self.account_for(tenant))

    def _tenant_accounts(self) -> frozenset[str]:
        """The accounts that run tenants' jobs and nothing else (empty without per-tenant accounts: then the
        provider's own account runs them, and its other jobs are the operator's business)."""
        return frozenset()

    def listed(self, job_id: str, *, name: str, user: str, final: bool) -> ListedJob | None:
        """What the sweep judges of one live job: a job marked for one of this provider's accounts, or any job of
        a tenant's account; None for anyone else's job."""
        workflow = None
        if user in self._adoptable_accounts():
            workflow = marked_workflow(self.markers, cluster_id=self.cluster_id, account=user, name=name)
        if workflow is None and user not in self._tenant_accounts():
            return None
        elsewhere = workflow is None and any(
            marked_workflow(self.markers, cluster_id=cluster, account=user, name=name) is not None
            for cluster in self.sibling_clusters
        )
        return ListedJob(
            scheduler_job_id=job_id,
            workflow_id=workflow,
            marked_elsewhere=elsewhere,
            claims=claimed_workflow(name),
            final=final,
            name=name,
            user=user,
        )

    async def cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        for chunk in chunked(scheduler_job_ids, self.CANCEL_CHUNK):
            await retrying(self._canceller(chunk), self.backoff, f"cancel {len(chunk)} jobs")

    def _canceller(self, ids: list[str]) -> Callable[[], Awaitable[None]]:
        return lambda: self._cancel_many(ids)

    def job_name(self, owner: Owner, account: str | None = None) -> str:
        """The name of the owner's job: ``vehpc-<workflow id>.<tag>``, the tag binding cluster and account."""
        account = account or owner.account
        if account is None:
            raise ValueError(f"workflow {owner.workflow_id}: a job name needs the account the job runs as")
        return marked_name(
            self.markers, cluster_id=self.cluster_id, account=account, workflow_id=owner.workflow_id
        )

    async def _lookup(self, owners: list[Owner], *, live: bool) -> dict[Owner, Lookup]:
        """The jobs of each owner, and the look-alikes under its bare name (``vehpc-<workflow id>``, untagged)."""
        by_name: dict[str, list[Owner]] = {}
        for owner in owners:
            accounts = [owner.account] if owner.account is not None else self._adoptable_accounts()
            for account in accounts:
                by_name.setdefault(self.job_name(owner, account), []).append(owner)
            by_name.setdefault(bare_name(owner.workflow_id), []).append(owner)
        names = list(by_name)
        jobs = await (self._live_jobs_named(names) if live else self._jobs_named(names))
        out: dict[Owner, Lookup] = {owner: Lookup() for owner in owners}
        for job in jobs:
            for owner in dict.fromkeys(by_name.get(job.name, [])):
                why = self._refusal(owner, job)
                if why is None:
                    out[owner].adoptable.append(job)
                else:
                    out[owner].lookalikes.append((job, why))
        return out

    def _refusal(self, owner: Owner, job: Candidate) -> str | None:
        """Why ``job`` is not the owner's own (``None``: it is)."""
        marked_for = owner.account or job.user
        if (
            marked_workflow(self.markers, cluster_id=self.cluster_id, account=marked_for, name=job.name)
            != owner.workflow_id
        ):
            return "its name carries no valid marker of the workflow"
        if owner.account is not None and job.user != owner.account:
            return f"it runs as {job.user or 'an unknown account'!r}, not as {owner.account!r}"
        if owner.account is None and job.user not in self._adoptable_accounts():
            return f"it runs as {job.user or 'an unknown account'!r}, none of the accounts this provider's jobs run as"
        return None

    async def _looked_up(self, owner: Owner, *, live: bool) -> list[Candidate]:
        """The owner's own jobs; every look-alike found on the way is refused (logged, audited once)."""
        lookup = await (self._live_finder if live else self._finder).get(owner) or Lookup()
        for job, why in lookup.lookalikes:
            self._refuse(owner, job, why)
        # A job both views know is listed twice (accounting, then the controller): the later record wins.
        return list({c.scheduler_job_id: c for c in lookup.adoptable}.values())

    def _refuse(self, owner: Owner, job: Candidate, why: str) -> None:
        if job.scheduler_job_id in self._refused_seen:
            return
        if len(self._refused_seen) >= 10_000:
            self._refused_seen.clear()
        self._refused_seen.add(job.scheduler_job_id)
        self.refuse_adoption(
            RefusedAdoption(
                workflow_id=owner.workflow_id,
                cluster_id=self.cluster_id,
                scheduler_job_id=job.scheduler_job_id,
                job_name=job.name[:300],
                user=job.user[:64],
                expected_account=owner.account or "",
                reason=why,
            )
        )

    # ---- exactly-once submission ---------------------------------------------------------------------------
    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        """Adopt the workflow's job if an attempt made one, else submit it; then reconcile duplicates.

        A retry looks the job up first (and again before every retry inside the adapter); a first attempt does
        not, and a retry that knows its job (``known_job_id``) adopts it once it is seen carrying the marker."""
        owner = await asyncio.to_thread(self.owner, request.workflow_id, request.job.tenant)
        if request.known_job_id is not None:
            known = await retrying(
                lambda: self._known(owner, request.known_job_id or ""),
                self.backoff,
                f"check {request.workflow_id}",
            )
            if known is not None:
                return known
        look_first = not request.first_attempt or request.known_job_id is not None

        async def attempt() -> SubmitResult:
            nonlocal look_first
            if look_first:
                existing = await self._find_once(owner)
                if existing is not None:
                    log.info("workflow %s: adopting scheduler job %s", request.workflow_id, existing)
                    return await self._check(owner, existing, adopted=True)
            alone_until = None if look_first else request.alone_until
            look_first = True  # a failed submission may have created the job: look before trying again
            return await self._submit_then_check(request, owner, on_submitted, alone_until)

        gate = self._submitting.setdefault(request.workflow_id, _Gate())
        gate.users += 1
        try:
            async with gate.lock:
                return await retrying(attempt, self.backoff, f"submit {request.workflow_id}")
        finally:
            gate.users -= 1
            if gate.users == 0:
                del self._submitting[request.workflow_id]

    async def _known(self, owner: Owner, job_id: str) -> SubmitResult | None:
        """The job an earlier attempt heartbeated, adopted once it is seen carrying the owner's marker (the
        controller's view, else accounting's); ``None`` when it is not the owner's (refused, audited)."""
        for live in (True, False):
            own = await self._looked_up(owner, live=live)
            if any(c.scheduler_job_id == job_id for c in own):
                log.info("workflow %s: adopting scheduler job %s (heartbeated)", owner.workflow_id, job_id)
                # The controller's view just read is the check's own: no second query.
                return await self._check(owner, job_id, adopted=True, found=own if live else None)
        self._refuse(
            owner,
            Candidate(job_id),
            "the job an earlier attempt heartbeated is not found carrying the workflow's marker",
        )
        return None

    async def _submit_then_check(
        self,
        request: SubmitRequest,
        owner: Owner,
        on_submitted: Callable[[str], None] | None,
        alone_until: datetime | None = None,
    ) -> SubmitResult:
        """Submit, then reconcile; the reconciliation is not given up with a cancelled attempt.

        Once a job may exist, the check that cancels a duplicate must run: if the attempt is cancelled while
        the submission is in flight (its command killed, perhaps after the scheduler took the job), a lookup
        runs in the background; if it is cancelled during the check, the check runs on. A job accepted before
        ``alone_until`` is not checked: no other attempt can have submitted yet, and any later one finds it."""
        try:
            job_id = await self._submit_new(request)
        except asyncio.CancelledError:
            self._in_background(self._reconcile_workflow(owner))
            raise
        if on_submitted is not None:
            on_submitted(job_id)
        if alone_until is not None and datetime.now(UTC) < alone_until:
            return SubmitResult(scheduler_job_id=job_id)
        check = self._in_background(self._check(owner, job_id, adopted=False))
        result = await asyncio.shield(check)
        assert result is not None
        return result

    def _in_background(self, work: Awaitable[SubmitResult | None]) -> asyncio.Task[SubmitResult | None]:
        task: asyncio.Task[SubmitResult | None] = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[SubmitResult | None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # nobody may be waiting for it any more
            log.warning("reconciliation after a submit failed: %s", task.exception())

    async def _reconcile_workflow(self, owner: Owner) -> None:
        """After a submission cancelled in flight: whatever it created is reconciled with its siblings."""
        try:
            await retrying(lambda: self._find_once(owner), self.backoff, f"reconcile {owner.workflow_id}")
        except SchedulerError as exc:  # a retry's own lookup or check reconciles later
            log.warning(
                "workflow %s: could not look for duplicates after a cancelled submit: %s",
                owner.workflow_id,
                exc,
            )
        return None

    async def _check(
        self, owner: Owner, job_id: str, *, adopted: bool, found: list[Candidate] | None = None
    ) -> SubmitResult:
        """The job this attempt submitted or adopted, checked against every job of the owner the scheduler
        holds (``found``: the controller's view, when the caller just read it): the oldest is kept (and
        returned), the others are cancelled. Look-alikes take no part."""
        if found is None:
            found = await self._looked_up(owner, live=True)
        by_id = {c.scheduler_job_id: c for c in found}
        by_id.setdefault(job_id, Candidate(job_id))
        keep, *extra = sorted(by_id.values(), key=lambda c: c.order)
        cancelled = await self._reconcile(owner.workflow_id, keep, extra) if extra else []
        return SubmitResult(
            scheduler_job_id=keep.scheduler_job_id,
            adopted=adopted or keep.scheduler_job_id != job_id,
            duplicates_cancelled=cancelled,
        )

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        owner = await asyncio.to_thread(self.owner, workflow_id, tenant)
        return await retrying(lambda: self._find_once(owner), self.backoff, f"find {workflow_id}")

    async def _find_once(self, owner: Owner) -> str | None:
        candidates = await self._looked_up(owner, live=False)
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda c: c.order)
        keep, extra = ordered[0], ordered[1:]
        if extra:
            await self._reconcile(owner.workflow_id, keep, extra)
        return keep.scheduler_job_id

    async def _reconcile(self, workflow_id: str, keep: Candidate, extra: list[Candidate]) -> list[str]:
        """Duplicates of one workflow (a race between attempts): keep the oldest, cancel the rest; the ids
        cancelled now (none if the cancel failed: the next lookup or check tries again)."""
        to_cancel = [c.scheduler_job_id for c in extra if not c.final]
        log.error(
            "workflow %s has %d scheduler jobs (%s); keeping %s, cancelling %s",
            workflow_id,
            len(extra) + 1,
            ", ".join(c.scheduler_job_id for c in [keep, *extra]),
            keep.scheduler_job_id,
            ", ".join(to_cancel) or "none (already ended)",
        )
        if not to_cancel:
            return []
        try:
            await self._cancel_many(to_cancel)
        except SchedulerError as exc:
            log.warning("could not cancel duplicate jobs %s: %s", to_cancel, exc)
            return []
        return to_cancel

    async def close(self) -> None:
        """Stop reconciliations still running in the background (the worker is going away)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def chunked_by_length(ids: Iterable[str], budget: int) -> Iterator[list[str]]:
    """``ids`` in lists whose comma-joined length stays within ``budget`` characters: one scheduler query per
    list, so the number of queries follows the length of the command line, never a fixed count of ids."""
    batch: list[str] = []
    used = 0
    for job_id in ids:
        if batch and used + 1 + len(job_id) > budget:
            yield batch
            batch, used = [], 0
        used += len(job_id) + (1 if batch else 0)
        batch.append(job_id)
    if batch:
        yield batch


#: ``find`` as another account starts in ``/``: it must return to its starting directory, and the worker's own
#: is usually closed to that account.
_FROM_ROOT = ("env", "-C", "/")


class AccountExecutors:
    """The provider's own command executor and, built on first use, one per tenant account.

    ``factory(account)`` makes an executor whose commands run as that account (a local ``AccountRunner``, an SSH
    login with the account's own key); None: this transport cannot act as another account, and asking it to is a
    ``TenantAccountError``. ``dirs`` checks tenants' job directories (default: with ``stat`` as the provider's
    own account, wherever its commands run).
    """

    def __init__(
        self,
        own: CommandExecutor,
        *,
        user: str,
        factory: Callable[[str], CommandExecutor] | None = None,
        dirs: TenantDirs | None = None,
        calls: Counter[str] | None = None,
    ) -> None:
        """``calls`` counts the ``stat`` commands of the directory checks (the backend's query counter)."""
        self.own = own
        self.user = user
        self._factory = factory
        self._accounts: dict[str, CommandExecutor] = {}
        self.dirs = dirs or remote_tenant_dirs(self.stat, user)
        self.calls: Counter[str] = Counter() if calls is None else calls

    def get(self, account: str | None) -> CommandExecutor:
        if account is None or account == self.user:
            return self.own
        executor = self._accounts.get(account)
        if executor is None:
            if self._factory is None:
                raise TenantAccountError(
                    f"{self.own.runner.description} cannot run commands as another account ({account})"
                )
            executor = self._accounts[account] = self._factory(account)
        return executor

    async def tenant_dir(self, work_dir: str, account: str) -> str:
        """``<work_dir>/<account>`` once it is the account's own private directory (``workdir.TenantDirs``)."""
        return await self.dirs.ensure(work_dir, account)

    def _outside_login(self, account: str) -> CommandExecutor | None:
        """The account's executor if any command runs as the account outside its own login (``setpriv``,
        ``runuser``: no shell, no startup files); None over SSH, where the startup files its tenant wrote could
        answer anything, and with ``sudo``, whose rule allows ``sbatch`` alone."""
        if self._factory is None or account == self.user:
            return None
        executor = self.get(account)
        return executor if getattr(executor.runner, "runs_any_command", False) else None

    async def account_files(self, work_dir: str, account: str) -> list[str] | None:
        """The entries of ``<work_dir>/<account>`` (at most ``FILES_SHOWN``; ``[]``: empty or missing), listed as
        the account by a fixed argv; None where no listing can be trusted (``_outside_login``)."""
        executor = self._outside_login(account)
        if executor is None:
            return None
        path = f"{work_dir.rstrip('/')}/{account}"
        result = await executor.run(
            [*_FROM_ROOT, "find", path, "-mindepth", "1", "-maxdepth", "1", "-printf", "%P\\0"],
            what=f"listing of {path} as {account}",
            ok=lambda r: r.exit_code == 0 or "No such file or directory" in r.stderr,
        )
        names = [name for name in result.stdout.split("\0") if name] if result.exit_code == 0 else []
        return names[:FILES_SHOWN]

    async def remove_account_files(self, work_dir: str, account: str) -> None:
        """Empty ``<work_dir>/<account>`` as the account (fixed argvs: ``find`` gives the account's search and
        write bits back to its own directories, each before it descends, then deletes depth first, never
        following a link); ``SchedulerError`` if anything is left (files of another owner: only root can remove
        them)."""
        executor = self._outside_login(account)
        path = f"{work_dir.rstrip('/')}/{account}"
        if executor is None:
            raise SchedulerError(
                f"{self.own.runner.description} cannot remove {account}'s files without its login, whose startup "
                f"files its tenant wrote: remove them on the cluster (runuser -u {account} -- find {path} "
                "-mindepth 1 -delete)",
                transient=False,
            )
        for what, argv in (
            # The directory itself too (before find reads it): its last tenant may have left it unreadable.
            ("chmod u+rwx", ["-type", "d", "-exec", "chmod", "u+rwx", "{}", ";"]),
            ("removal", ["-mindepth", "1", "-delete"]),
        ):
            await executor.run(
                [*_FROM_ROOT, "find", path, *argv],
                what=f"{what} in {path} as {account}",
                ok=lambda r: True,  # what is left is checked below
            )
        left = await self.account_files(work_dir, account)
        if left:
            raise SchedulerError(
                f"{path}: {files_left_message(left)} after its removal as {account} (files of another owner: "
                "remove them as root)",
                transient=False,
            )

    async def stat(self, argv: list[str]) -> tuple[int, str]:
        """``stat`` as the provider's own account: exit 1 names a path that does not exist, an answer."""
        self.calls["stat"] += 1
        result = await self.own.run(
            argv, what="stat of the work directory", ok=lambda r: r.exit_code in (0, 1)
        )
        return result.exit_code, result.stdout

    async def close(self) -> None:
        for executor in self._accounts.values():
            await executor.runner.close()
        await self.own.runner.close()
