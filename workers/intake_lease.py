"""The intake lease: of the pollers serving one cluster, one at a time starts jobs, so that together they never
run more than ``max_concurrent_jobs``.

Counting open workflows in Temporal's visibility store is cheap but eventually consistent: two pollers that count
at the same moment both see the same free slots and both fill them. So only the poller holding the cluster's
lease starts jobs; it knows the starts it made that visibility does not show yet, and adds them to the count. The
others forward cancellations and reconcile, and take over when the holder goes away.

The lease needs nothing but Temporal. Time is cut into terms of ``hpc.job_service.intake_lease``; term ``k`` of a
cluster is the workflow id ``intake-lease-<k>@<cluster>`` (a chain job id never holds an ``@``). Whoever starts
that workflow first holds term ``k``: Temporal lets one start of an id win (conflict policy FAIL, reuse policy
REJECT_DUPLICATE), strongly consistent, whatever visibility shows. The workflow is started on a task queue no
worker polls, so it runs no code, and with a run timeout of two terms, so it closes on its own. The holder takes
the next term from half-way through its own, so it keeps the lease while it lives; if it dies, another poller
takes the first term the holder did not take, at most two terms later.

A poller that takes over from another holder (the term before was someone else's) waits ``SETTLE_SECONDS`` into
its first term before it starts anything, so the last starts of the previous holder have reached visibility; a
holder stops starting the moment its term ends on its clock unless it holds the next one. Pollers' clocks must
agree to within ``SETTLE_SECONDS`` (NTP keeps them to milliseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

log = logging.getLogger(__name__)

LEASE_WORKFLOW_TYPE = "IntakeLease"
"""The type of the lease workflows (no worker registers it: they never run code)."""
LEASE_TASK_QUEUE = "vehpc-intake-lease"
"""The task queue of the lease workflows; no worker polls it."""
SETTLE_SECONDS = 5.0
"""How long into its first term a new holder waits before it starts jobs: visibility shows the previous holder's
last starts by then, and the pollers' clocks may differ by less."""
PROCESS = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
"""This process, as a lease holder: pollers of one process share a lease."""


def lease_id(cluster_id: str, term: int) -> str:
    return f"intake-lease-{term}@{cluster_id}"


class IntakeLease:
    """The lease of one cluster's intake, as seen by one poller."""

    def __init__(
        self,
        client: Client,
        cluster_id: str,
        *,
        term: timedelta,
        holder: str = PROCESS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.cluster_id = cluster_id
        self.term = max(term.total_seconds(), 2 * SETTLE_SECONDS)
        self.holder = holder
        self.clock = clock
        self._held: set[int] = set()
        self._refused: set[int] = set()
        self._settle: set[int] = set()  # held terms that follow another holder's

    def _term(self, at: float | None = None) -> int:
        return int((self.clock() if at is None else at) // self.term)

    def valid(self) -> bool:
        """Whether this poller may start jobs now: it holds the current term and, if another poller held the one
        before, is ``SETTLE_SECONDS`` into it (no I/O: checked before every start)."""
        now = self.clock()
        term = self._term(now)
        if term not in self._held:
            return False
        return term not in self._settle or now - term * self.term >= SETTLE_SECONDS

    async def refresh(self) -> bool:
        """Take the current term if nobody has, and the next one once half-way through a held term; then
        ``valid()``. Temporal unreachable: not held (nothing is started without the lease anyway)."""
        now = self.clock()
        term = self._term(now)
        self._held = {t for t in self._held if t >= term - 1}
        self._refused = {t for t in self._refused if t >= term}
        self._settle = {t for t in self._settle if t >= term - 1}
        if term not in self._held and term not in self._refused:
            await self._take(term)
        if term in self._held and now - term * self.term >= self.term / 2 and term + 1 not in self._held:
            await self._take(term + 1)
        return self.valid()

    async def _take(self, term: int) -> None:
        wf_id = lease_id(self.cluster_id, term)
        try:
            await self.client.start_workflow(
                LEASE_WORKFLOW_TYPE,
                id=wf_id,
                task_queue=LEASE_TASK_QUEUE,
                run_timeout=timedelta(seconds=2 * self.term),
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                memo={"holder": self.holder},
            )
        except WorkflowAlreadyStartedError:
            if await self._holder_of(wf_id) == self.holder:
                # Ours: another loop or poller of this process, or an answer we never got.
                await self._hold(term)
            else:
                self._refused.add(term)
            return
        except RPCError as exc:
            log.warning(
                "cannot take the intake lease %s: %s", wf_id, exc, extra={"cluster_id": self.cluster_id}
            )
            return
        await self._hold(term)
        log.info("intake lease %s taken", wf_id, extra={"cluster_id": self.cluster_id})

    async def _hold(self, term: int) -> None:
        """Count ``term`` as held; one that follows another holder's term starts with the settle time. That is
        decided first: the poller's loops refresh side by side, and none may see the term held without it."""
        if (
            term - 1 not in self._held
            and await self._holder_of(lease_id(self.cluster_id, term - 1)) is not None
        ):
            self._settle.add(term)
        self._held.add(term)

    async def _holder_of(self, wf_id: str) -> str | None:
        """The holder named by a lease workflow; ``None`` when there is none (or Temporal cannot say)."""
        try:
            memo = await (await self.client.get_workflow_handle(wf_id).describe()).memo()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                return "unknown"  # cannot tell: assume another holder (wait the settle time)
            return None
        holder = memo.get("holder")
        return holder if isinstance(holder, str) else None

    async def keep(self, stop: asyncio.Event) -> None:
        """Refresh four times a term until ``stop``, so the next term is taken before this one ends."""
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.term / 4)


__all__ = ["LEASE_TASK_QUEUE", "LEASE_WORKFLOW_TYPE", "PROCESS", "SETTLE_SECONDS", "IntakeLease", "lease_id"]
