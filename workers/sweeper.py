"""The sweep: scheduler jobs that no workflow names are found and stopped.

Exactly-once submission reconciles duplicates after every submit (``activities/schedulers/batch/base.py``): the
attempt that checks last sees every older job. One window stays open: a worker killed while its ``sbatch`` waited
on a stalled controller, whose request the controller completes only after the retry's check. That job carries
the workflow's marker, but the workflow names another one, and nothing would ever look at it again: it would run
to its end, unwatched and unbilled. The same holds for any marked job whose workflow has closed, and for every job
a tenant submits itself from inside its job (``sbatch`` runs as the tenant's own account): it carries no valid
marker, so no workflow will ever adopt, watch or bill it.

So every ``hpc.job_service.sweep_interval`` the sweep of a cluster lists, **in one scheduler query**
(``SchedulerAdapter.swept_jobs``), the live jobs that carry this provider's marker and every live job of a
tenant's account. Marked jobs are grouped by workflow id, and Temporal's visibility store says which job each
workflow names (``VeSchedulerJobId`` on ``VeClusterId``; one query per page of workflows). A job the workflow does
not name is a finding, confirmed before anything is done:

* **duplicate**: the workflow is open and names another job. ``describe`` (strongly consistent, unlike
  visibility) must still show it open and naming that job.
* **unowned**: no workflow is open for the job's workflow id, and the chain shows the chain job of that id, this
  provider's, final: the job is settled and nothing will ever watch or bill what runs on.
* **unmarked**: a job of a tenant's account whose name carries no marker that verifies for this cluster and that
  account: no workflow can own it. The one exception is a job an open workflow names (``describe`` of the
  workflow its name claims), such as a job submitted under a marker key since rotated: it is watched and billed,
  and left alone. A job whose claimed workflow is open but names no job yet is given one more round. Its audit
  record names the account and tenant, never the workflow its name claims (anyone may write any name).
* **ended between rounds**: a job of a tenant's account, unmarked or under the name (and so the marker) of one of
  its tenant's chain jobs, that started after one round and ended before the next, never live at a round.
  Each round reads the tenants' accounts' jobs that ended since the previous round began from accounting
  (``SchedulerAdapter.swept_ended``, one query) and audits those that ran, that no round listed and no run of a
  workflow ever named (``unowned_job_found``, ``ended: true``): they ran unbilled, and the provider learns of
  them. A poller's first round reads back to the last round this host's pollers made (``SweepCheckpoint``), at
  most ``sweep_lookback``, and leaves out what the audit log shows an earlier poller already audited.

What happens to a finding is ``hpc.job_service.unowned_jobs``: ``cancel`` (the default) cancels it and audits
``duplicate_job_cancelled`` or ``unowned_job_cancelled``; ``report`` only audits ``unowned_job_found``, once per
job and sweep process. Anything else is left alone: a workflow that names no job yet (its submit is under way and
reconciles by itself), a marked job whose chain job is not final while no workflow is open (the reconciler's
recovery run stops it and settles its usage; the next sweep sees the rest), a marked job of a workflow id the
chain does not know (not this provider's job), and a job marked for another cluster of this provider that shares
the scheduler (that cluster's sweep judges it).

The sweep runs beside the chain poller, and only in the poller that holds the cluster's intake lease
(``workers/intake_lease.py``): a cluster served by several pollers is still listed once per interval, and a
duplicate is cancelled and audited once. Its scheduler load does not grow with the number of workers or
pollers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.audit import AuditLog, events_since
from activities.chain.client import ChainClient
from activities.schedulers.base import ListedJob, SchedulerAdapter
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.config import Config
from virtengine_hpc.errors import HPCError
from virtengine_hpc.files import PRIVATE_MODE
from virtengine_hpc.messages import JOB_WORKFLOW_NAME
from workers.intake_lease import IntakeLease
from workers.metrics import WorkerMetrics
from workflows.hpc_job import SA_CLUSTER, SA_SCHEDULER_JOB

log = logging.getLogger(__name__)

PAGE_SIZE = 200
"""Workflow ids looked up in one visibility query."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SWEEP_EVENTS = (AuditEvent.UNOWNED_JOB_FOUND, AuditEvent.UNOWNED_JOB_CANCELLED)
"""The audit events of the sweep's findings on a tenant's account's job, which a poller's first round reads back."""
ENDED_MARGIN = 120
"""Seconds the accounting read of ended jobs reaches back before the previous round began: slurmdbd records a
job's end a moment after the controller (a job the previous round's read missed is in this one's), accounting
times are whole seconds, and the controller's clock may differ from the poller's."""


class SweepCheckpoint:
    """When the last round of a cluster's sweep on this host read the ended jobs (a JSON file in the state
    directory, 0600, replaced whole): a poller's first round reads back to it, so that what ran while no poller
    swept (a restart, an outage) is found."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def last_round(self) -> float | None:
        try:
            kept = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("cannot read the sweep's last round from %s: %s", self.path, exc)
            return None
        value = kept.get("last_round") if isinstance(kept, dict) else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def keep(self, when: float) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_MODE)
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps({"last_round": when}))
            os.replace(partial, self.path)
        except OSError as exc:  # the next round tries again; a first round then reads back further
            log.warning("cannot keep the sweep's last round in %s: %s", self.path, exc)


@dataclass(frozen=True)
class Named:
    """What a workflow's open run names: its scheduler job and the cluster it is on (None: no open run)."""

    open: bool
    cluster_id: str | None = None
    scheduler_job_id: str | None = None


@dataclass
class SweepStats:
    listed: int = 0
    duplicates: list[str] = field(default_factory=list)
    unowned: list[str] = field(default_factory=list)
    unmarked: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)  # unmarked jobs that ran and ended between two rounds
    left: int = 0  # live jobs no workflow names, left alone (see the module's docstring)
    standby: bool = (
        False  # another poller holds the cluster's intake lease: it sweeps, this one listed nothing
    )


class JobSweep:
    """Finds, on one cluster, the marked scheduler jobs that no workflow names, and stops or reports them."""

    def __init__(
        self,
        client: Client,
        chain: ChainClient,
        adapter: SchedulerAdapter,
        config: Config,
        audit: AuditLog,
        *,
        metrics: WorkerMetrics | None = None,
        lease: IntakeLease | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.chain = chain
        self.adapter = adapter
        self.audit = audit
        self.metrics = metrics
        self.lease = lease  # None: this sweep is the cluster's only one
        self.clock = clock
        self.cluster_id = config.hpc.cluster_id
        self.provider = config.provider.address
        job_service = config.hpc.job_service
        self.interval = job_service.sweep_interval.total_seconds() if job_service.sweep_interval else None
        self.cancel = job_service.unowned_jobs == "cancel"
        self.lookback = job_service.sweep_lookback.total_seconds()
        self.checkpoint = SweepCheckpoint(config.state_dir / f"sweep-{self.cluster_id}.json")
        self.rounds = 0  # rounds completed (tests wait on it)
        self._stopping: set[str] = set()  # cancelled by an earlier round, still ending (COMPLETING)
        self._reported: set[str] = set()  # reported (unowned_jobs: report) by an earlier round: audited once
        self._waiting: set[str] = set()  # unmarked, claiming an open workflow that named no job last round
        self._last_round: float | None = None  # when the last round that read accounting began
        self._seen: dict[str, float] = {}  # job id -> when a round last listed it live, or audited it ended
        self._ended_listed = True  # False: the adapter cannot list ended jobs (logged once)

    async def run(self, stop: asyncio.Event) -> None:
        if self.interval is None:
            return
        while not stop.is_set():
            try:
                await self.sweep_once()
            except NotImplementedError as exc:
                log.info(
                    "no sweep for unnamed scheduler jobs: %s", exc, extra={"cluster_id": self.cluster_id}
                )
                return
            except HPCError as exc:  # scheduler or chain unreachable: next round
                log.warning("sweep failed: %s", exc, extra={"cluster_id": self.cluster_id})
            except RPCError as exc:
                log.warning(
                    "sweep failed talking to Temporal: %s", exc, extra={"cluster_id": self.cluster_id}
                )
            except Exception:  # a bug must not end the loop: log it, go on
                log.exception("sweep round failed", extra={"cluster_id": self.cluster_id})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)

    async def sweep_once(self) -> SweepStats:
        """One round: one scheduler listing, one visibility query per page of workflows, then the findings; none
        on a poller that stands by (another holds the cluster's intake lease and sweeps)."""
        stats = SweepStats()
        if self.lease is not None and not await self.lease.refresh():
            # Another poller sweeps meanwhile: when this one holds the lease again, its first round reads back and
            # leaves out what the audit log shows the other already audited, as a poller's very first round does.
            self._last_round = None
            stats.standby = True
            return stats
        started = self.clock()
        jobs = [job for job in await self._listed() if not job.final and not job.marked_elsewhere]
        stats.listed = len(jobs)
        live = {job.scheduler_job_id for job in jobs}
        self._seen.update(dict.fromkeys(live, started))
        self._stopping &= live
        self._reported &= live
        jobs = [job for job in jobs if job.scheduler_job_id not in self._stopping | self._reported]
        by_workflow: dict[str, list[ListedJob]] = {}
        for job in jobs:
            if job.workflow_id is not None:
                by_workflow.setdefault(job.workflow_id, []).append(job)
        unmarked = [job for job in jobs if job.workflow_id is None]
        claims = {c for c in (_claim(job) for job in unmarked) if c is not None and c not in by_workflow}
        named = await self._named([*by_workflow, *sorted(claims)])
        for workflow_id, marked in by_workflow.items():
            await self._check(workflow_id, marked, named.get(workflow_id, Named(open=False)), stats)
        await self._check_unmarked(unmarked, named, stats)
        await self._check_ended(started, stats)
        self.rounds += 1
        if self.metrics is not None:
            self.metrics.last_sweep.labels(self.cluster_id).set(self.clock())
        return stats

    async def _listed(self) -> list[ListedJob]:
        """What the scheduler holds that this sweep judges (one query)."""
        return await self.adapter.swept_jobs()

    async def _ended(self, seconds: int) -> list[ListedJob]:
        """The tenants' accounts' jobs that ran and ended within the last ``seconds`` (one accounting query)."""
        return await self.adapter.swept_ended(seconds)

    async def _check_ended(self, started: float, stats: SweepStats) -> None:
        """A job a tenant submits itself right after a round and that ends before the next was never live at a
        round: read from accounting since the previous round (plus ``ENDED_MARGIN``), every such job without a
        valid marker, or with a marker (a tenant may name its own job after one of its chain jobs), that no run of the
        workflow its name claims named, and that no round listed, is audited once
        (``unowned_job_found``, ``ended: true``, with its run time and allocation): it ran unbilled and the
        provider learns of it. A poller's first round reads back to the last round this host's pollers made
        (``SweepCheckpoint``), at most ``sweep_lookback``, and leaves out what the audit log already holds."""
        if not self._ended_listed:
            return
        first = self._last_round is None
        last = self._last_round if self._last_round is not None else self._first_window_start(started)
        window = started - last + ENDED_MARGIN
        # A job listed live once is listed again every round while it runs: one that ended within the window
        # was last listed after started - 2 * window.
        self._seen = {i: t for i, t in self._seen.items() if t >= started - 2 * window}
        try:
            ended = await self._ended(int(window) + 1)
        except NotImplementedError as exc:
            log.info("no sweep of ended jobs: %s", exc, extra={"cluster_id": self.cluster_id})
            self._ended_listed = False
            return
        # A marked job counts too: its tenant can give its own job the name (and so the marker) of one of its
        # earlier chain jobs; only a job some run of that workflow named was watched and billed.
        ran = [job for job in ended if not job.marked_elsewhere and job.scheduler_job_id not in self._seen]
        if first and ran:
            ran = await self._not_yet_audited(ran, last)
        claims = sorted({c for c in (_claim(job) for job in ran) if c is not None})
        watched = await self._ever_named(claims) if claims else set()
        ran = [job for job in ran if (_claim(job), job.scheduler_job_id) not in watched]
        if ran:
            log.error(
                "scheduler jobs %s on %s (accounts %s) ran and ended between two sweep rounds and no workflow "
                "named them: no workflow watched or billed them",
                ", ".join(job.scheduler_job_id for job in ran),
                self.cluster_id,
                ", ".join(sorted({job.user for job in ran})),
                extra={"cluster_id": self.cluster_id},
            )
        for job in ran:
            self._seen[job.scheduler_job_id] = started
            stats.ran.append(job.scheduler_job_id)
            self._audit_ran(job)
        self._last_round = started
        await asyncio.to_thread(self.checkpoint.keep, started)

    def _first_window_start(self, started: float) -> float:
        """Where a poller's first read of ended jobs begins: the last round kept for this cluster, or
        ``sweep_lookback`` back when none is kept or it is older."""
        kept = self.checkpoint.last_round()
        floor = started - self.lookback
        return floor if kept is None else min(started, max(kept, floor))

    async def _not_yet_audited(self, jobs: list[ListedJob], window_start: float) -> list[ListedJob]:
        """The jobs this host's audit log holds no sweep record of on this cluster: an earlier poller cancelled
        or reported them (live or ended). Nothing can have audited a job before it was submitted, so the log is
        read back only that far, and never more than ``sweep_lookback`` before the window read."""
        submitted = [job.submitted_at.timestamp() for job in jobs if job.submitted_at is not None]
        since = min([*submitted, window_start]) - ENDED_MARGIN
        since = max(since, window_start - ENDED_MARGIN - self.lookback)
        events = await asyncio.to_thread(
            events_since, self.audit.path, datetime.fromtimestamp(since, UTC), SWEEP_EVENTS
        )
        audited = {
            str(e["details"].get("scheduler_job_id"))
            for e in events
            if e.get("cluster_id") == self.cluster_id and isinstance(e.get("details"), dict)
        }
        return [job for job in jobs if job.scheduler_job_id not in audited]

    async def _ever_named(self, workflow_ids: list[str]) -> set[tuple[str, str]]:
        """(workflow id, scheduler job) for every run, open or closed, of these workflows that named a job on this
        cluster: a job some run named was watched and billed by it (a marker made under a key since rotated)."""
        out: set[tuple[str, str]] = set()
        safe = [w for w in workflow_ids if _SAFE_ID.fullmatch(w)]
        for start in range(0, len(safe), PAGE_SIZE):
            quoted = ", ".join(f"'{w}'" for w in safe[start : start + PAGE_SIZE])
            query = f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND WorkflowId IN ({quoted})"
            async for execution in self.client.list_workflows(query):
                attributes = execution.typed_search_attributes
                named = attributes.get(SA_SCHEDULER_JOB)
                if attributes.get(SA_CLUSTER) == self.cluster_id and named:
                    out.add((execution.id, named))
        return out

    def _audit_ran(self, job: ListedJob) -> None:
        allocated = job.allocated.model_dump(exclude_none=True) if job.allocated is not None else None
        self.audit.record(
            AuditEvent.UNOWNED_JOB_FOUND,
            job_id=None,
            cluster_id=self.cluster_id,
            details={
                "scheduler_job_id": job.scheduler_job_id,
                "kept": None,
                "kind": "unmarked" if job.workflow_id is None else "unowned",
                "ended": True,
                "elapsed_seconds": job.elapsed_seconds,
                "allocated": allocated,
                "found_by": "sweep",
                "why": "it ran and ended between two sweep rounds as a tenant's account "
                + (
                    "without a valid marker"
                    if job.workflow_id is None
                    else "under a marker no run of its workflow named it by"
                )
                + ": no workflow watched or billed it",
                "account": job.user,
                "tenant": self.adapter.tenant_of(job.user) if job.user else None,
                "claims": _claim(job),
            },
        )

    async def _named(self, workflow_ids: list[str]) -> dict[str, Named]:
        """What each workflow's open run names, as visibility sees it (it lags: findings are confirmed)."""
        out: dict[str, Named] = {}
        safe = [w for w in workflow_ids if _SAFE_ID.fullmatch(w)]
        for start in range(0, len(safe), PAGE_SIZE):
            quoted = ", ".join(f"'{w}'" for w in safe[start : start + PAGE_SIZE])
            query = f"WorkflowType = '{JOB_WORKFLOW_NAME}' AND WorkflowId IN ({quoted})"
            async for execution in self.client.list_workflows(query):
                if execution.status == WorkflowExecutionStatus.RUNNING:
                    attributes = execution.typed_search_attributes
                    out[execution.id] = Named(
                        open=True,
                        cluster_id=attributes.get(SA_CLUSTER),
                        scheduler_job_id=attributes.get(SA_SCHEDULER_JOB),
                    )
        return out

    @staticmethod
    def _unnamed(marked: list[ListedJob], named: Named) -> list[ListedJob]:
        """The jobs here that the workflow's open run does not name."""
        return [job for job in marked if job.scheduler_job_id != named.scheduler_job_id]

    def _names_a_job_here(self, named: Named | None) -> bool:
        """The open run names a job on this cluster. A workflow whose job is on another cluster is that cluster's
        sweep's to judge: two cluster ids may share one scheduler, whose job ids mean nothing to the other."""
        return (
            named is not None
            and named.open
            and named.cluster_id == self.cluster_id
            and bool(named.scheduler_job_id)
        )

    async def _check(self, workflow_id: str, marked: list[ListedJob], seen: Named, stats: SweepStats) -> None:
        if seen.open:
            if not self._names_a_job_here(seen) or not self._unnamed(marked, seen):
                return  # names its job, none yet (a submit under way reconciles by itself), or one elsewhere
            confirmed = await self._describe(workflow_id)
            if not self._names_a_job_here(confirmed):
                stats.left += len(marked)
                return
            assert confirmed is not None
            await self._found(workflow_id, self._unnamed(marked, confirmed), "duplicate", confirmed, stats)
            return
        if not await self._settled_on_chain(workflow_id):
            stats.left += len(marked)
            return
        confirmed = await self._describe(workflow_id)
        if confirmed is None or confirmed.open:
            stats.left += len(marked)
            return
        await self._found(workflow_id, marked, "unowned", confirmed, stats)

    async def _describe(self, workflow_id: str) -> Named | None:
        """The workflow's latest run, strongly consistent; None when Temporal cannot tell right now."""
        try:
            description = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return Named(open=False)
            log.warning(
                "cannot look up workflow %s: %s", workflow_id, exc, extra={"cluster_id": self.cluster_id}
            )
            return None
        if description.status != WorkflowExecutionStatus.RUNNING:
            return Named(open=False)
        attributes = description.typed_search_attributes
        return Named(
            open=True,
            cluster_id=attributes.get(SA_CLUSTER),
            scheduler_job_id=attributes.get(SA_SCHEDULER_JOB),
        )

    async def _settled_on_chain(self, workflow_id: str) -> bool:
        """The chain job of this id is this provider's and final (a workflow id is its chain job's id)."""
        job = await self.chain.get_job(workflow_id)
        return job is not None and job.raw_spec.get("provider") == self.provider and job.state.final

    async def _check_unmarked(
        self, jobs: list[ListedJob], named: dict[str, Named], stats: SweepStats
    ) -> None:
        """Jobs of tenants' accounts without a valid marker: unowned, unless an open workflow names them.

        Only a job whose name claims a workflow that visibility shows open costs a ``describe`` (once per
        workflow), which confirms what it names before anything is cancelled."""
        waiting: set[str] = set()
        found: list[ListedJob] = []
        confirmed: dict[str, Named | None] = {}
        for job in jobs:
            claimed = _claim(job)
            seen: Named | None = named.get(claimed, Named(open=False)) if claimed else Named(open=False)
            if claimed is not None and seen is not None and seen.open and not self._names(seen, job):
                if claimed not in confirmed:
                    confirmed[claimed] = await self._describe(claimed)
                seen = confirmed[claimed]
            verdict = self._unmarked_verdict(job, seen)
            if verdict == "left":
                stats.left += 1
            elif verdict == "wait":
                waiting.add(job.scheduler_job_id)
                stats.left += 1
            else:
                found.append(job)
        self._waiting = waiting
        if found:
            await self._found_unmarked(found, stats)

    def _names(self, seen: Named, job: ListedJob) -> bool:
        """The workflow's open run names this very job, on this cluster."""
        return self._names_a_job_here(seen) and seen.scheduler_job_id == job.scheduler_job_id

    def _unmarked_verdict(self, job: ListedJob, seen: Named | None) -> str:
        """``left`` (an open workflow names it, or Temporal cannot tell now), ``wait`` (the workflow its name
        claims is open and names no job here yet: one more round) or ``unowned``."""
        if seen is None:
            return "left"
        if self._names(seen, job):
            log.warning(
                "scheduler job %s on %s is named by workflow %s but its marker does not verify for account %s: "
                "was the adoption marker key changed, or does this poller hold another one than the workers?",
                job.scheduler_job_id,
                self.cluster_id,
                job.claims,
                job.user,
                extra={"cluster_id": self.cluster_id},
            )
            return "left"
        if seen.open and not self._names_a_job_here(seen) and job.scheduler_job_id not in self._waiting:
            return "wait"
        return "unowned"

    async def _found(
        self, workflow_id: str, jobs: list[ListedJob], kind: str, named: Named, stats: SweepStats
    ) -> None:
        ids = [job.scheduler_job_id for job in jobs]
        why = (
            f"the workflow names scheduler job {named.scheduler_job_id}"
            if kind == "duplicate"
            else "no workflow is open for it and its chain job is final"
        )
        log.error(
            "workflow %s: scheduler jobs %s on %s are not its own (%s); %s",
            workflow_id,
            ", ".join(ids),
            self.cluster_id,
            why,
            self._action(),
            extra={"workflow_id": workflow_id, "job_id": workflow_id, "cluster_id": self.cluster_id},
        )
        await self._stop(ids)
        (stats.duplicates if kind == "duplicate" else stats.unowned).extend(ids)
        for job in jobs:
            self._audit(job, workflow_id, kind=kind, kept=named.scheduler_job_id, why=why)

    async def _found_unmarked(self, jobs: list[ListedJob], stats: SweepStats) -> None:
        """Jobs no workflow owns under tenants' accounts: audited under the account and its tenant, never under
        the workflow a name claims (a tenant may write any name, another tenant's workflow id included)."""
        ids = [job.scheduler_job_id for job in jobs]
        why = "it runs as a tenant's account and carries no valid marker of a workflow: no workflow watches or bills it"
        log.error(
            "scheduler jobs %s on %s (accounts %s) belong to no workflow (%s); %s",
            ", ".join(ids),
            self.cluster_id,
            ", ".join(sorted({job.user for job in jobs})),
            why,
            self._action(),
            extra={"cluster_id": self.cluster_id},
        )
        await self._stop(ids)
        stats.unmarked.extend(ids)
        for job in jobs:
            self._audit(job, None, kind="unmarked", kept=None, why=why)

    def _action(self) -> str:
        return "cancelling them" if self.cancel else "reporting them (hpc.job_service.unowned_jobs: report)"

    async def _stop(self, ids: list[str]) -> None:
        """Cancel (a failure raises: the round ends, the next one finds the jobs again), or mark as reported."""
        if self.cancel:
            await self.adapter.cancel_many(ids)
            self._stopping.update(ids)
        else:
            self._reported.update(ids)

    def _audit(
        self, job: ListedJob, workflow_id: str | None, *, kind: str, kept: str | None, why: str
    ) -> None:
        event = (
            (AuditEvent.UNOWNED_JOB_CANCELLED if kind != "duplicate" else AuditEvent.DUPLICATE_JOB_CANCELLED)
            if self.cancel
            else AuditEvent.UNOWNED_JOB_FOUND
        )
        details: dict[str, object] = {
            "scheduler_job_id": job.scheduler_job_id,
            "kept": kept,
            "kind": kind,
            "found_by": "sweep",
            "why": why,
            "account": job.user,
            "tenant": self.adapter.tenant_of(job.user) if job.user else None,
        }
        if kind == "unmarked":
            details["claims"] = _claim(job)
        self.audit.record(event, job_id=workflow_id, cluster_id=self.cluster_id, details=details)


def _claim(job: ListedJob) -> str | None:
    """The workflow an unmarked job's name claims, if it is a well-formed id (anything else is no claim)."""
    return job.claims if job.claims and _SAFE_ID.fullmatch(job.claims) else None
