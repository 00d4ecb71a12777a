"""The batch script (CLI transports) and the job description (slurmrestd) built from a job.

Nothing here goes through a shell command line of ours: the script travels to ``sbatch`` on stdin and to slurmrestd
in a JSON body. Every ``#SBATCH`` value comes from a validated field (pydantic patterns in ``virtengine_hpc.models``
and ``virtengine_hpc.config``) and is checked once more against a strict pattern here. The tenant's environment is
written as ``export NAME='value'`` lines quoted with ``shlex.quote``, so ``$(...)``, backticks and ``;`` in a value
stay literal. The directives come first and the exports end the directive block, so ``#SBATCH`` lines in the
tenant's body are ignored by ``sbatch``: a tenant cannot change the partition, account or name it was priced for.

The job name is the workflow's marker (``vehpc-<workflow id>.<tag>``, ``virtengine_hpc.markers``), so that a retried
submit finds the job an earlier attempt made (``find``) and adopts it instead of submitting again (invariant 2 in
docs/architecture.md), and a job a tenant names like it is never adopted.
"""

from __future__ import annotations

from typing import Any

from activities.schedulers.batch.plan import (
    BASE_PATH,
    COMMENT_PREFIX,
    DIRECTIVE_VALUE,
    SubmitPlan,
    export_line,
    job_comment,
    plan_submission,
)
from virtengine_hpc.errors import ValidationError

# The job name, comment and plan are shared with MOAB (``activities.schedulers.batch.plan``); re-exported here.
__all__ = [
    "BASE_PATH",
    "COMMENT_PREFIX",
    "SubmitPlan",
    "job_comment",
    "plan_submission",
    "render_batch_script",
    "render_rest_job",
]


def _directive(option: str, value: object) -> str:
    text = str(value)
    if not DIRECTIVE_VALUE.fullmatch(text):
        raise ValidationError(f"refusing #SBATCH {option} with value {text[:80]!r}: unexpected characters")
    return f"#SBATCH {option}={text}"


def render_batch_script(plan: SubmitPlan) -> str:
    """The script ``sbatch`` reads on stdin: directives, then exports, then the tenant's body."""
    lines = [
        "#!/bin/bash",
        _directive("--job-name", plan.job_name),
        _directive("--comment", plan.comment),
        _directive("--partition", plan.partition),
        _directive("--nodes", plan.nodes),
        _directive("--ntasks-per-node", plan.tasks_per_node),
        _directive("--cpus-per-task", plan.cpus_per_task),
        _directive("--mem", f"{plan.mem_mb_per_node}M"),
        _directive("--time", plan.time_minutes),
        _directive("--output", plan.output_file),
        _directive("--error", plan.error_file),
        # The job gets no environment of the submitting process (which may hold credentials); it starts from
        # the user's login environment plus the exports below.
        _directive("--export", "NONE"),
    ]
    if plan.gres:
        lines.append(_directive("--gres", plan.gres))
    if plan.workdir:
        lines.append(_directive("--chdir", plan.workdir))
    if plan.account:
        lines.append(_directive("--account", plan.account))
    if plan.qos:
        lines.append(_directive("--qos", plan.qos))
    if plan.hold:
        lines.append("#SBATCH --hold")
    if plan.exclusive:
        lines.append("#SBATCH --exclusive")
    lines.append("# ---- environment (values quoted; the first command ends the #SBATCH block) ----")
    lines.extend(export_line(k, v) for k, v in plan.environment.items())
    # srun steps inside the job inherit this environment (sbatch's --export=NONE would otherwise pass down).
    lines.append("export SLURM_EXPORT_ENV=ALL")
    lines.append("# ---- job body ----")
    body = plan.body if plan.body.endswith("\n") else plan.body + "\n"
    return "\n".join(lines) + "\n" + body


def render_rest_job(plan: SubmitPlan) -> dict[str, Any]:
    """The body of ``POST /slurm/v0.0.38/job/submit``: the same request as the script, as JSON properties."""
    if not plan.workdir:
        raise ValidationError("slurmrestd needs a working directory: set hpc.slurm.work_dir or the job's own")
    for value in (
        plan.partition,
        plan.job_name,
        plan.comment,
        plan.workdir,
        plan.account,
        plan.qos,
        plan.gres,
    ):
        if value is not None and not DIRECTIVE_VALUE.fullmatch(value):
            raise ValidationError(f"refusing job property {value[:80]!r}: unexpected characters")
    environment = {"PATH": BASE_PATH, "LANG": "C.UTF-8", **plan.environment}
    job: dict[str, Any] = {
        "name": plan.job_name,
        "comment": plan.comment,
        "partition": plan.partition,
        "nodes": [plan.nodes, plan.nodes],
        "tasks": plan.nodes * plan.tasks_per_node,
        "tasks_per_node": plan.tasks_per_node,
        "cpus_per_task": plan.cpus_per_task,
        "memory_per_node": plan.mem_mb_per_node,
        "time_limit": plan.time_minutes,
        "current_working_directory": plan.workdir,
        "standard_output": f"{plan.workdir.rstrip('/')}/{plan.output_file}",
        "standard_error": f"{plan.workdir.rstrip('/')}/{plan.error_file}",
        "environment": environment,
    }
    if plan.gres:
        job["gres"] = plan.gres
    if plan.account:
        job["account"] = plan.account
    if plan.qos:
        job["qos"] = plan.qos
    if plan.hold:
        job["hold"] = True
    if plan.exclusive:
        # v0.0.38's OpenAPI lists "user" | "mcs" | "true" | "false", but slurmrestd 22.05 refuses "true" ("Invalid
        # exclusive specification") and takes sbatch's own word: "exclusive" (squeue then shows OverSubscribe NO).
        job["exclusive"] = "exclusive"
    # The body is a bash script on every transport (a tenant's own "#!" line becomes a comment, as with sbatch).
    body = plan.body if plan.body.endswith("\n") else plan.body + "\n"
    return {"script": "#!/bin/bash\n" + body, "job": job}
