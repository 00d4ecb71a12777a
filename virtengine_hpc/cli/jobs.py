"""``virtengine-hpc jobs``: list, inspect and cancel job workflows through Temporal (what `temporal` does, typed)."""

from __future__ import annotations

import argparse
import asyncio

from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.config import Config
from virtengine_hpc.errors import ValidationError
from virtengine_hpc.messages import (
    JOB_WORKFLOW_NAME,
    PARKED,
    CancelRequest,
    JobResult,
    JobStatusView,
    RetryRequest,
)
from virtengine_hpc.states import JobState


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    jobs = sub.add_parser("jobs", help="list, inspect and cancel job workflows")
    jsub = jobs.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = jsub.add_parser("list", help="job workflows, newest first")
    ls.add_argument(
        "--state", choices=[*(s.value for s in JobState), PARKED], help="parked: waiting for an operator"
    )
    ls.add_argument("--cluster")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(func=lambda a: asyncio.run(_list(config_from_args(a), a)))
    st = jsub.add_parser("status", help="the live status of one job (workflow query)")
    st.add_argument("job_id")
    st.set_defaults(func=lambda a: asyncio.run(_status(config_from_args(a), a.job_id)))
    res = jsub.add_parser("result", help="wait for a job's workflow and print its result")
    res.add_argument("job_id")
    res.set_defaults(func=lambda a: asyncio.run(_result(config_from_args(a), a.job_id)))
    cancel = jsub.add_parser("cancel", help="cancel a job (workflow update; refused if it already ended)")
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", default="cancelled by the provider operator")
    cancel.set_defaults(func=lambda a: asyncio.run(_cancel(config_from_args(a), a.job_id, a.reason)))
    retry = jsub.add_parser(
        "retry",
        help="try the step that parked a job again, once its cause is fixed (refused if the job is not parked)",
    )
    retry.add_argument("job_id")
    retry.add_argument("--note", default="", help="why it is retried (kept in the workflow's history)")
    retry.set_defaults(func=lambda a: asyncio.run(_retry(config_from_args(a), a.job_id, a.note)))


def visibility_query(state: str | None, cluster: str | None) -> str:
    parts = [f"WorkflowType = '{JOB_WORKFLOW_NAME}'"]
    if state:
        value = PARKED if state == PARKED else JobState(state).value
        parts.append(f"VeJobState = '{value}'")
    if cluster:
        if not cluster.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValidationError(f"bad cluster id {cluster!r}")
        parts.append(f"VeClusterId = '{cluster}'")
    return " AND ".join(parts)


async def _list(config: Config, args: argparse.Namespace) -> int:
    from workers.wiring import connect

    client = await connect(config)
    query = visibility_query(args.state, args.cluster)
    print(f"{'JOB':<28} {'STATE':<10} {'CLUSTER':<18} {'SCHEDULER JOB':<28} {'STATUS':<10} STARTED")
    count = 0
    async for wf in client.list_workflows(query):
        attrs = wf.typed_search_attributes
        values = {pair.key.name: pair.value for pair in attrs}
        print(
            f"{wf.id:<28} {values.get('VeJobState', '?'):<10} {values.get('VeClusterId', '?'):<18} "
            f"{values.get('VeSchedulerJobId', '-'):<28} {wf.status.name if wf.status else '?':<10} "
            f"{wf.start_time:%Y-%m-%d %H:%M:%S}"
        )
        count += 1
        if count >= args.limit:
            break
    return 0


async def _status(config: Config, job_id: str) -> int:
    from workers.wiring import connect

    client = await connect(config)
    view = await client.get_workflow_handle(job_id).query("status", result_type=JobStatusView)
    print_json(view)
    return 0


async def _result(config: Config, job_id: str) -> int:
    from workers.wiring import connect

    client = await connect(config)
    result = await client.get_workflow_handle(job_id, result_type=JobResult).result()
    print_json(result)
    return 0


async def _cancel(config: Config, job_id: str, reason: str) -> int:
    return await _update(config, job_id, "request_cancel", CancelRequest(reason=reason))


async def _retry(config: Config, job_id: str, note: str) -> int:
    return await _update(config, job_id, "retry_parked", RetryRequest(note=note))


async def _update(config: Config, job_id: str, update: str, request: CancelRequest | RetryRequest) -> int:
    """Send a workflow update and print the job's status; a refusal (its validator's reason) exits 1."""
    from temporalio.client import WorkflowUpdateFailedError
    from temporalio.service import RPCError

    from workers.wiring import connect

    client = await connect(config)
    try:
        view = await client.get_workflow_handle(job_id).execute_update(
            update, request, result_type=JobStatusView
        )
    except WorkflowUpdateFailedError as exc:
        print(f"error: {exc.cause}")
        return 1
    except RPCError as exc:  # no such workflow, or it already ended: nothing to cancel or retry
        print(f"error: job {job_id}: {exc.message}")
        return 1
    print_json(view)
    return 0
