"""What a scheduler adapter takes and answers: its value types, shared by the workflows and the activities.

A workflow waits on the statuses its cluster's monitor reports (``NativeStatus``) and the job activities pass these
models to and from the adapters (``activities/schedulers/base.py``, whose interface they belong to). They hold
data only (no scheduler, no I/O), so the domain and the deterministic workflows can use them without importing
the adapter layer; ``activities.schedulers.base`` re-exports every name, the place adapters import them from.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from pydantic import Field

from virtengine_hpc.metering import Allocated, Reading
from virtengine_hpc.models import JobSpec, Model
from virtengine_hpc.states import JobState


class SubmitRequest(Model):
    workflow_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    job: JobSpec
    body: str = Field(description="The job's program: the tenant's script or the rendered template body.")
    partition: str | None = Field(None, description="Partition/queue after defaults were applied.")
    exclusive: bool = Field(
        False, description="Whole nodes: no other job may share them (the template's exclusive_nodes)."
    )
    first_attempt: bool = Field(
        False,
        description="Nothing earlier can have created this workflow's job (the submit activity's first attempt): "
        "submit without looking it up first. Retries inside the adapter still look first.",
    )
    known_job_id: str | None = Field(
        None,
        max_length=128,
        description="The job an earlier attempt of this submission created and heartbeated: adopted without a "
        "lookup (duplicates are still reconciled).",
    )
    alone_until: datetime | None = Field(
        None,
        description="A first attempt runs alone until this instant (no retry of it can have started yet): a job "
        "the scheduler accepted before then needs no check for duplicates, since any later attempt finds it when "
        "it looks first. None: check after every submission.",
    )


class SubmitResult(Model):
    scheduler_job_id: str
    adopted: bool = Field(False, description="True when a job submitted by an earlier attempt was found.")
    duplicates_cancelled: list[str] = Field(
        default_factory=list,
        description="Other jobs that carried the same workflow id (attempts that raced), found after the "
        "submission and cancelled; the oldest job is the one kept.",
    )


class ListedJob(Model):
    """A live scheduler job the sweep judges (what ``swept_jobs`` lists): one that carries this provider's marker
    of a workflow, or one that runs as a tenant's account whatever its name."""

    scheduler_job_id: str
    workflow_id: str | None = Field(
        None,
        description="The workflow whose marker the job carries, verified for this cluster and the account it runs "
        "as; None: no valid marker (a job the tenant submitted itself, a look-alike).",
    )
    marked_elsewhere: bool = Field(
        False,
        description="Its marker verifies for another cluster of this provider sharing the scheduler: that "
        "cluster's sweep judges it.",
    )
    claims: str | None = Field(None, description="The workflow its name claims, verified or not.")
    final: bool = False
    name: str = Field("", description="The job's name on the scheduler.")
    user: str = Field("", description="The account the scheduler says the job runs as.")
    elapsed_seconds: int | None = Field(
        None, description="How long it ran (jobs that ended: ``SchedulerAdapter.swept_ended``)."
    )
    submitted_at: datetime | None = Field(
        None, description="When it was submitted (jobs that ended): nothing can have audited it before."
    )
    allocated: Allocated | None = Field(
        None, description="What it held while it ran, as the scheduler recorded it (jobs that ended)."
    )


class RefusedAdoption(Model):
    """A scheduler job that looked like a workflow's own and was not adopted (a look-alike: its name carries no
    valid marker for the expected account, or it runs as another account)."""

    workflow_id: str
    cluster_id: str
    scheduler_job_id: str
    job_name: str = ""
    user: str = Field("", description="The account the scheduler says the job runs as.")
    expected_account: str = ""
    reason: str


class NativeStatus(Model):
    """One job's status as the scheduler sees it, mapped to the nine job states."""

    scheduler_job_id: str
    found: bool = True
    state: JobState = JobState.QUEUED
    native_state: str = ""
    reason: str = ""
    exit_code: int | None = None
    start_time: datetime | None = None
    end_time: datetime | None = None


class Accounting(Model):
    """Cumulative usage of a job since it started; ``final`` once the scheduler closed its record.

    ``reading`` is raw: what the scheduler clocked, allocated and measured, in base units. Turning it into a
    record's metrics is ``virtengine_hpc.metering.meter``'s job alone, the same for every scheduler.
    """

    scheduler_job_id: str
    final: bool = False
    reading: Reading = Field(default_factory=Reading)
    start_time: datetime | None = None
    end_time: datetime | None = None


#: How many entry names ``account_files`` returns at most (enough to say what is left, never a whole tree).
FILES_SHOWN = 20


def files_left_message(names: Sequence[str]) -> str:
    """``names`` (entries of a job directory) said shortly, for logs, errors and audit records."""
    shown = ", ".join(repr(name[:60]) for name in list(names)[:3])
    more = "" if len(names) <= 3 else f" and {'more' if len(names) >= FILES_SHOWN else len(names) - 3}"
    return f"its job directory holds {shown}{more}"
