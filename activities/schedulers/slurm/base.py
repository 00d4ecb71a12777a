"""The batch-scheduler base SLURM shares with MOAB lives in ``activities.schedulers.batch.base`` (scheduler-neutral);
its names are re-exported here so the SLURM modules' imports stay as they were."""

from activities.schedulers.batch.base import (
    Backoff,
    BatchSchedulerAdapter,
    Candidate,
    Coalescer,
    CommandExecutor,
    CommandResult,
    CommandRunner,
    Owner,
    chunked,
    chunked_by_length,
    retrying,
)

__all__ = [
    "Backoff",
    "BatchSchedulerAdapter",
    "Candidate",
    "Coalescer",
    "CommandExecutor",
    "CommandResult",
    "CommandRunner",
    "Owner",
    "chunked",
    "chunked_by_length",
    "retrying",
]
