"""What a batch submission says, scheduler-neutral: the job name and comment that carry the workflow id, and the
validated plan (resources, walltime, environment) every scheduler's script builder renders.

The workflow id is in the job name (``vehpc-<workflow id>``) and, where the scheduler keeps one, in the comment, so
that a retried submit finds the job an earlier attempt made (``find``) and adopts it instead of submitting again
(invariant 2 in docs/architecture.md). Environment values become ``export NAME='value'`` lines quoted with ``shlex.quote``.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

from activities.schedulers.base import SubmitRequest
from virtengine_hpc.errors import ValidationError

JOB_NAME_PREFIX = "vehpc-"
COMMENT_PREFIX = "vehpc"
#: The environment every job starts from (sbatch runs with --export=NONE; slurmrestd takes exactly what it gets).
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.:/;=%+-]{1,1024}$")
_WORKFLOW_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def job_name(workflow_id: str) -> str:
    """The Slurm job name that marks a workflow's job (``squeue --name`` / ``sacct --name`` find it)."""
    if not _WORKFLOW_ID.fullmatch(workflow_id):
        raise ValidationError(f"workflow id {workflow_id[:80]!r} is not a valid identifier")
    return JOB_NAME_PREFIX + workflow_id


def job_comment(workflow_id: str, storage_gb: int) -> str:
    """``vehpc;wf=<id>;storage_gb=<n>``: the marker, plus what accounting needs later and cannot tell."""
    return f"{COMMENT_PREFIX};wf={workflow_id};storage_gb={storage_gb}"


def parse_comment(comment: str) -> dict[str, str]:
    """The ``key=value`` items of a comment written by ``job_comment`` (empty for anyone else's)."""
    parts = comment.strip().split(";")
    if not parts or parts[0] != COMMENT_PREFIX:
        return {}
    out: dict[str, str] = {}
    for item in parts[1:]:
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def workflow_of(name: str, comment: str) -> str | None:
    """The workflow id a job carries: from its comment, else from its name (sites that do not store comments)."""
    marked = parse_comment(comment).get("wf")
    if marked:
        return marked
    if name.startswith(JOB_NAME_PREFIX):
        return name[len(JOB_NAME_PREFIX) :]
    return None


@dataclass(frozen=True)
class SubmitPlan:
    """Everything a submission says, as validated values, before any transport renders it."""

    job_name: str
    comment: str
    partition: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem_mb_per_node: int
    time_minutes: int
    body: str
    environment: dict[str, str]
    gpus_per_node: int = 0
    gpu_type: str | None = None
    account: str | None = None
    qos: str | None = None
    workdir: str | None = None
    hold: bool = False
    exclusive: bool = False  # whole nodes, shared with no other job
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def output_file(self) -> str:
        return f"{self.job_name}-%j.out"

    @property
    def error_file(self) -> str:
        return f"{self.job_name}-%j.err"

    @property
    def gres(self) -> str | None:
        if self.gpus_per_node <= 0:
            return None
        return f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"


def plan_submission(
    request: SubmitRequest,
    *,
    cluster_id: str,
    default_partition: str,
    account: str | None = None,
    qos: str | None = None,
    work_dir: str | None = None,
    hold: bool = False,
) -> SubmitPlan:
    job, res = request.job, request.job.resources
    name = job_name(request.workflow_id)
    workdir = job.working_directory or work_dir
    env = {
        "VIRTENGINE_JOB_ID": job.job_id,
        "VIRTENGINE_WORKFLOW_ID": request.workflow_id,
        "VIRTENGINE_CLUSTER_ID": cluster_id,
        "VIRTENGINE_JOB_NAME": job.name,
        "VIRTENGINE_NNODES": str(res.nodes),
        "VIRTENGINE_NTASKS": str(res.nodes * res.tasks_per_node),
        "VIRTENGINE_NTASKS_PER_NODE": str(res.tasks_per_node),
        "VIRTENGINE_CPUS_PER_TASK": str(res.cpus_per_task),
        "VIRTENGINE_GPUS_PER_NODE": str(res.gpus_per_node),
        "VIRTENGINE_MEM_PER_NODE_MB": str(res.memory_mb_per_node),
        "VIRTENGINE_WALLTIME_SECONDS": str(job.walltime_seconds),
    }
    tenant_env = dict(job.environment)
    clash = set(tenant_env) & set(env)
    if clash:  # the model already refuses VIRTENGINE_*; this keeps it true if the model changes
        raise ValidationError(f"environment names {sorted(clash)} are reserved")
    env.update(tenant_env)
    return SubmitPlan(
        job_name=name,
        comment=job_comment(request.workflow_id, res.storage_gb),
        partition=request.partition or job.partition or default_partition,
        nodes=res.nodes,
        tasks_per_node=res.tasks_per_node,
        cpus_per_task=res.cpus_per_task,
        mem_mb_per_node=res.memory_mb_per_node,
        time_minutes=max(1, math.ceil(job.walltime_seconds / 60)),
        body=request.body,
        environment=env,
        gpus_per_node=res.gpus_per_node,
        gpu_type=res.gpu_type,
        account=account,
        qos=qos,
        workdir=workdir,
        hold=hold,
        exclusive=request.exclusive,
    )


def export_line(name: str, value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", name):
        raise ValidationError(f"environment name {name[:80]!r} is not a valid name")
    if "\n" in value or "\x00" in value or "\r" in value:
        raise ValidationError(f"environment value of {name} has a newline or NUL byte")
    return f"export {name}={shlex.quote(value)}"
