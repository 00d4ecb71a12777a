"""The ``msub`` command line and script (SSH transport) and the MWS job description (REST transport) of a job.

Nothing tenant-controlled reaches a shell command line of ours. The scheduler options (``-N`` name, ``-q`` queue,
``-l`` resources, ``-A`` account, ``-d`` directory) are argv words built from validated values and checked once more
against a strict pattern; over SSH every word is quoted. The script travels on ``msub``'s stdin (and in MWS's
``commandScript``): the environment as ``export NAME='value'`` lines quoted with ``shlex.quote``, then the tenant's
body. Options given on the command line win over ``#MSUB``/``#PBS`` lines, and the first command of the script ends
the directive block anyway, so a tenant's directives in the body cannot change the queue, account or name it was
priced for.
"""

from __future__ import annotations

from typing import Any

from activities.schedulers.batch.plan import DIRECTIVE_VALUE, SubmitPlan, export_line
from virtengine_hpc.errors import ValidationError


def _word(option: str, value: object) -> str:
    text = str(value)
    if not DIRECTIVE_VALUE.fullmatch(text):
        raise ValidationError(f"refusing msub {option} with value {text[:80]!r}: unexpected characters")
    return text


def resource_list(plan: SubmitPlan) -> list[str]:
    """``-l`` values: nodes and processors per node (with GPUs), walltime in seconds, memory of the whole job."""
    ppn = plan.tasks_per_node * plan.cpus_per_task
    nodes = f"nodes={plan.nodes}:ppn={ppn}"
    if plan.gpus_per_node:
        nodes += f":gpus={plan.gpus_per_node}"
    values = [nodes, f"walltime={plan.time_minutes * 60}", f"mem={plan.mem_mb_per_node * plan.nodes}mb"]
    if plan.exclusive:
        values.append("naccesspolicy=singlejob")  # whole nodes: no other job shares them
    return values


def msub_argv(plan: SubmitPlan, *, command: str = "msub") -> list[str]:
    """``msub -N vehpc-<workflow id> -q <queue> -l ... [-A account] [-d dir] [-h]``; the script comes on stdin."""
    argv = [command, "-N", _word("-N", plan.job_name), "-q", _word("-q", plan.partition)]
    for value in resource_list(plan):
        argv += ["-l", _word("-l", value)]
    if plan.account:
        argv += ["-A", _word("-A", plan.account)]
    if plan.workdir:
        argv += ["-d", _word("-d", plan.workdir)]
    if plan.hold:
        argv.append("-h")
    return argv


def render_script(plan: SubmitPlan) -> str:
    """The script ``msub`` reads on stdin (and MWS gets as ``commandScript``): exports, then the tenant's body."""
    lines = [
        "#!/bin/bash",
        "# ---- environment (values quoted; the first command ends the directive block) ----",
    ]
    lines.extend(export_line(k, v) for k, v in plan.environment.items())
    lines.append("# ---- job body ----")
    body = plan.body if plan.body.endswith("\n") else plan.body + "\n"
    return "\n".join(lines) + "\n" + body


def render_mws_job(plan: SubmitPlan, *, user: str | None) -> dict[str, Any]:
    """The body of ``POST /rest/jobs?api-version=3``: the same request as ``msub``, as MWS job fields."""
    for option, value in (("name", plan.job_name), ("queue", plan.partition), ("account", plan.account)):
        if value is not None:
            _word(option, value)
    if plan.workdir:
        _word("initialWorkingDirectory", plan.workdir)
    credentials: dict[str, Any] = {"jobClass": plan.partition}
    if user:
        credentials["user"] = user
    if plan.account:
        credentials["account"] = plan.account
    requirement: dict[str, Any] = {
        "requiredNodeCountMinimum": plan.nodes,
        "requiredProcessorCountMinimum": plan.nodes * plan.tasks_per_node * plan.cpus_per_task,
        "taskCount": plan.nodes * plan.tasks_per_node,
        "tasksPerNode": plan.tasks_per_node,
        "resourcesPerTask": {
            "PROCS": {"dedicated": plan.cpus_per_task},
            "MEM": {"dedicated": max(1, plan.mem_mb_per_node // plan.tasks_per_node)},
        },
    }
    if plan.gpus_per_node:
        requirement["gpus"] = plan.gpus_per_node * plan.nodes
    if plan.exclusive:
        requirement["nodeAccessPolicy"] = "SINGLEJOB"
    job: dict[str, Any] = {
        "customName": plan.job_name,
        "commandScript": render_script(plan),
        "credentials": credentials,
        "requirements": [requirement],
        "duration": plan.time_minutes * 60,
    }
    if plan.workdir:
        job["initialWorkingDirectory"] = plan.workdir
    if plan.hold:
        job["holds"] = ["USER"]
    return job
