"""What a batch submission says, scheduler-neutral: the job name and comment that carry the workflow id, and the
validated plan (resources, walltime, environment) every scheduler's script builder renders.

The job name is the workflow's marker (``vehpc-<workflow id>.<tag>``, ``virtengine_hpc.markers``), which the adapter
computes and passes in: a retried submit finds the job an earlier attempt made (``find``) and adopts it instead of
submitting again (invariant 2 in docs/architecture.md), and no tenant can name a job so that it is adopted. Environment values become ``export NAME='value'`` lines quoted with ``shlex.quote``.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

from activities.schedulers.base import SubmitRequest
from virtengine_hpc.errors import ValidationError
from virtengine_hpc.markers import bare_name

COMMENT_PREFIX = "vehpc"
#: The environment every job starts from (sbatch runs with --export=NONE; slurmrestd takes exactly what it gets).
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIRECTIVE_VALUE = re.compile(r"^[A-Za-z0-9_.:/;=%+-]{1,1024}$")


def job_comment(workflow_id: str, storage_gb: int) -> str:
    """``vehpc;wf=<id>;storage_gb=<n>``: for people reading the queue. Nothing is ever read back from it (the
    job's owner can edit it); the workflow's marker is in the name."""
    return f"{COMMENT_PREFIX};wf={workflow_id};storage_gb={storage_gb}"


@dataclass(frozen=True)
class SubmitPlan:
    """Everything a submission says, as validated values, before any transport renders it."""

    job_name: str
    comment: str
    file_stem: str
    """Output files are ``<file_stem>-<job id>.out``/``.err`` (``vehpc-<workflow id>``, without the tag)."""
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
        return f"{self.file_stem}-%j.out"

    @property
    def error_file(self) -> str:
        return f"{self.file_stem}-%j.err"

    @property
    def gres(self) -> str | None:
        if self.gpus_per_node <= 0:
            return None
        return f"gpu:{self.gpu_type}:{self.gpus_per_node}" if self.gpu_type else f"gpu:{self.gpus_per_node}"


def plan_submission(
    request: SubmitRequest,
    *,
    name: str,
    cluster_id: str,
    default_partition: str,
    account: str | None = None,
    qos: str | None = None,
    work_dir: str | None = None,
    hold: bool = False,
) -> SubmitPlan:
    job, res = request.job, request.job.resources
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
        file_stem=bare_name(request.workflow_id),
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
