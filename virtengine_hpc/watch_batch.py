"""Many jobs' registrations with their cluster's monitor in one signal (``watch_many``).

A worker process sends the registrations that wait while it sends to a monitor together: one signal for hundreds of
jobs, where one signal each made 10,000 jobs wait half an hour for the one monitor workflow, to which Temporal
applies signals one at a time. Only a monitor run that says so in its memo is sent the batch: an older build's run
knows the ``watch`` signal only.
"""

from __future__ import annotations

from pydantic import Field

from virtengine_hpc.messages import WatchRegistration
from virtengine_hpc.models import Model

WATCH_MANY = "watch_many"
"""The monitor's signal that carries a ``WatchBatch``."""
MONITOR_TAKES_BATCHES = "takes_watch_many"
"""Memo key of a monitor run that handles ``watch_many``; its value is that run's id (a memo is carried across
continue-as-new, and the next run may be an older build's)."""
MAX_WATCH_BATCH = 500
"""Registrations one ``watch_many`` signal carries at most (about 200 KB)."""


class WatchBatch(Model):
    """Registrations of several jobs, in the order their worker process received them."""

    registrations: list[WatchRegistration] = Field(min_length=1, max_length=MAX_WATCH_BATCH)
