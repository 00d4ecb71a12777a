"""Activity attempts that never overlap in effect.

Temporal retries an activity when an attempt fails, when its worker dies, or when it misses its heartbeat timeout
(an overloaded worker or server). A timed-out attempt may still be running when its retry starts, on another
worker. Two rules keep such attempts from doubling a side effect (a second ``sbatch``, a second reading signed
under one record id):

* **The wrapped call is cancelled with its attempt.** ``heartbeating`` awaits a call while heartbeating; when
  Temporal cancels the attempt (a cancel request, a heartbeat timeout the worker learns of on its next heartbeat,
  worker shutdown) it cancels the call and waits for it to wind down, so a scheduler command in flight is killed
  (``LocalRunner``) rather than left to finish behind the retry's back.
* **What an attempt did is heartbeated the moment it exists** (``Attempt.record``): the scheduler job id of a
  submission, the signed usage record before it is sent, since when a watched job has been missing. Temporal
  keeps the details of an attempt's last heartbeat and hands them to the next attempt
  (``activity.info().heartbeat_details``), which resumes from them instead of redoing the work.

Temporal keeps only the latest heartbeat's details, so every heartbeat of an attempt repeats all of its progress.
Heartbeats are throttled (at most one per 0.8 heartbeat timeout reaches the server): an attempt lost within that
window leaves its retry without the latest details, which is why each activity still has a fallback (a submit
retried without a job id looks the job up; a usage retry without a record looks it up on chain).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from pydantic import Field, ValidationError
from temporalio import activity

from virtengine_hpc.models import Model, UsageRecord
from virtengine_hpc.states import JobState

log = logging.getLogger(__name__)
T = TypeVar("T")

HEARTBEAT_EVERY = 2.0
"""Seconds between heartbeats while a call runs; the short activities' heartbeat timeout is several times this."""

LOST_ATTEMPTS: Counter[tuple[str, str]] = Counter()
"""Attempts this process saw cancelled by Temporal, by (activity type, reason): ``timed_out`` and ``not_found``
mean the server had already given the attempt up (heartbeat timeout) while this worker was still running it."""


class AttemptProgress(Model):
    """What the attempts of one activity have done so far: the heartbeat details a retry resumes from."""

    scheduler_job_id: str | None = Field(
        None, description="submit_job: the scheduler job this activity submitted or adopted."
    )
    usage_record: UsageRecord | None = Field(
        None, description="report_usage, watch_job: the record signed for this report (sent, or about to be)."
    )
    last_state: JobState | None = Field(None, description="watch_job: the state the scheduler last reported.")
    found: bool | None = Field(None, description="watch_job: whether the scheduler found the job last time.")
    missing_since: datetime | None = Field(
        None,
        description="watch_job: since when the scheduler has not found the job (the vanished-job grace).",
    )
    queued_reported: bool = Field(
        False,
        description="submit_job: the job was reported queued (chain, audit, monitor) with its submission.",
    )
    error: str | None = Field(None, max_length=200, description="The last scheduler error, for operators.")


class Attempt:
    """The current activity attempt: its number and the progress it (and the attempts before it) made."""

    def __init__(
        self,
        number: int,
        activity_type: str,
        progress: AttemptProgress,
        *,
        started: datetime | None = None,
        timeouts: tuple[timedelta | None, ...] = (),
        rescheduled: bool = False,
    ) -> None:
        self.number = number
        self.activity_type = activity_type
        self.progress = progress
        self.resumed = progress != AttemptProgress()
        self.rescheduled = rescheduled
        self._started = started
        self._timeouts = [t for t in timeouts if t]

    @classmethod
    def current(cls) -> Attempt:
        """This attempt, resumed from the details the previous attempt heartbeated (if any)."""
        info = activity.info()
        return cls(
            info.attempt,
            info.activity_type,
            _resume(info.heartbeat_details),
            started=info.started_time,
            timeouts=(info.heartbeat_timeout, info.start_to_close_timeout),
            rescheduled=_rescheduled(info),
        )

    @property
    def first(self) -> bool:
        """No earlier attempt ran: nothing this activity does can have been done before. An attempt 1 whose
        attempt was scheduled after the activity itself (``rescheduled``) is not the first: an operator's
        ``temporal activity reset`` starts the count over after other attempts ran."""
        return self.number == 1 and not self.resumed and not self.rescheduled

    @property
    def alone_until(self) -> datetime | None:
        """Until when no other attempt of this activity can be running: ``None`` unless this is the first.

        Temporal starts a retry only once this attempt has failed or timed out, and it times out at the earliest
        its shortest timeout (heartbeat or start-to-close) after its start, both on the server's clock. Half that
        timeout is kept as a margin for the difference between this worker's clock and the server's (and for the
        retry's own start): what this attempt does before the instant returned, a retry finds done.

        A worker that sees its start in the future has a clock lagging the server's by more than the attempt has
        run: it cannot tell how long ago the attempt started (Temporal may have given it up already), so it has
        no window. A smaller lag is covered only while it stays under the margin.
        """
        if not self.first or self._started is None or not self._timeouts:
            return None
        if datetime.now(UTC) < self._started:
            return None
        return self._started + min(self._timeouts) / 2

    def record(self, **fields: Any) -> None:
        """Add to the progress and heartbeat it now (field names are checked against ``AttemptProgress``)."""
        self.progress = AttemptProgress.model_validate({**self.progress.model_dump(), **fields})
        self.beat()

    def submitted(self, scheduler_job_id: str) -> None:
        """The scheduler job exists: a retry adopts it without looking it up."""
        self.record(scheduler_job_id=scheduler_job_id)

    def beat(self) -> None:
        if activity.info().is_local:
            return  # a local activity has no heartbeats: its retries look up what an attempt did instead
        if self.progress == AttemptProgress():
            activity.heartbeat()
        else:
            activity.heartbeat(self.progress)


def _rescheduled(info: activity.Info) -> bool:
    """The current attempt was scheduled later than the activity: attempts ran before it, whatever its number says
    (``temporal activity reset`` sets it back to 1, e.g. after ``temporal activity pause`` stopped one)."""
    if info.is_local:  # no operator resets a local activity; its retries count on
        return False
    scheduled, current = info.scheduled_time, info.current_attempt_scheduled_time
    return scheduled is not None and current is not None and current != scheduled


def _resume(details: Any) -> AttemptProgress:
    """The progress in heartbeat details; details this build cannot read (another release's) count as none."""
    if not details:
        return AttemptProgress()
    try:
        return AttemptProgress.model_validate(details[0])
    except ValidationError as exc:
        log.warning("ignoring heartbeat details of an earlier attempt that do not parse: %s", exc)
        return AttemptProgress()


async def heartbeating(call: Awaitable[T], attempt: Attempt | None = None) -> T:
    """Await ``call`` while heartbeating; cancel it when the attempt is cancelled.

    Heartbeats let Temporal notice a dead worker in seconds, not at start-to-close, and they are how a running
    attempt hears that it was cancelled or timed out. Then the call is cancelled too, and awaited until it has
    wound down (its command killed), before the cancellation goes on.
    """
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY)
            if done:
                return task.result()
            if attempt is not None:
                attempt.beat()
            elif not activity.info().is_local:
                activity.heartbeat()
    except asyncio.CancelledError:
        _note_cancelled()
        task.cancel()
        await asyncio.wait({task})  # the call winds down (a command in flight is killed) before we go on
        if not task.cancelled():
            task.exception()  # retrieved: the attempt's outcome is the cancellation
        raise


def _note_cancelled() -> None:
    info = activity.info()
    details = activity.cancellation_details()
    reason = "cancelled"
    if details is not None:
        reason = next(
            (
                name
                for name in ("timed_out", "not_found", "worker_shutdown", "reset", "paused")
                if getattr(details, name)
            ),
            "cancelled",
        )
    LOST_ATTEMPTS[(info.activity_type, reason)] += 1
    level = logging.INFO if reason == "cancelled" else logging.WARNING
    log.log(
        level,
        "attempt %d of %s (%s) %s by Temporal: stopping its call",
        info.attempt,
        info.activity_type,
        info.workflow_id,
        reason.replace("_", " "),
    )


__all__ = ["HEARTBEAT_EVERY", "LOST_ATTEMPTS", "Attempt", "AttemptProgress", "heartbeating"]
