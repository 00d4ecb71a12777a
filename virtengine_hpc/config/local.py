"""The embedded local executor's section (``hpc.local``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pydantic import Field

from virtengine_hpc.config.base import Duration, Section


class LocalSchedulerConfig(Section):
    """The embedded local executor: runs batch scripts as process groups on this host."""

    allow_unisolated: bool = Field(
        False,
        description="Opt in to the local executor. It runs tenants' scripts on the worker's own host and is no "
        "multi-tenant sandbox (docs/security.md says what does and does not isolate its jobs): it is for demos, "
        "tests and single-tenant hosts. A worker that would run a local cluster without this refuses to start.",
    )
    state_dir: Path | None = Field(None, description="Default: <state_store_path>/local-jobs.")
    max_parallel_jobs: int = Field(
        64, ge=1, le=10_000, description="Jobs running at once; the rest wait in the local queue."
    )
    job_poll_interval: Duration = Field(
        timedelta(seconds=2), description="How often the status of all local jobs is read."
    )
    kill_wait: Duration = Field(
        timedelta(seconds=10),
        description="Grace between SIGTERM and SIGKILL when a job hits its walltime or is cancelled "
        "(SLURM's KillWait).",
    )
    max_walltime: Duration | None = Field(
        None,
        description="Upper bound on the walltime the local executor enforces: a job is stopped at "
        "min(its walltime, this). For demos and tests, where the model's 60 s minimum walltime is too long; "
        "leave unset in production.",
    )
    gpus: int | None = Field(
        None,
        ge=0,
        description="GPUs on this host that jobs may ask for; a job asking for more is refused. Default: the "
        "NVIDIA devices present (/dev/nvidia0, /dev/nvidia1, ...).",
    )
