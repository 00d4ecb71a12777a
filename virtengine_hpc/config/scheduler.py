"""Keys that the scheduler sections (SLURM, MOAB, and OOD's poll interval) share, as field types: one description
and one bound for all, each key keeping its place in its own section (and in the generated reference)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from virtengine_hpc.config.base import Duration

JobPollInterval = Annotated[
    Duration,
    Field(
        description="How often the status of all of the cluster's active jobs is fetched (one query per interval)."
    ),
]
"""``job_poll_interval``: write ``job_poll_interval: JobPollInterval = timedelta(seconds=10)``."""
CommandTimeout = Annotated[Duration, Field(description="Longest wait for one scheduler command or request.")]
"""``connection_timeout`` of a batch scheduler: ``connection_timeout: CommandTimeout = timedelta(seconds=30)``."""
AdapterRetries = Annotated[
    int, Field(ge=0, le=100, description="Retries of a transient scheduler failure inside one adapter call.")
]
"""``max_retries``: write ``max_retries: AdapterRetries = 3``."""
