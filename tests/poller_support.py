"""Helpers for the poller and reconciler tests: a thin fault-injecting wrapper around the real Temporal client, the
input a workflow run was started with, and workflows parked on a task queue that no worker serves."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any, cast

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import SearchAttributePair, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from tests.pipeline_harness import Pipeline
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, JobWorkflowInput
from virtengine_hpc.models import JobSpec
from workers.wiring import job_settings
from workflows.hpc_job import SA_SCHEDULER_JOB, initial_search_attributes


def rpc_error(status: RPCStatusCode, message: str = "injected by the test") -> RPCError:
    return RPCError(message, status, b"")


class _Handle:
    """A real workflow handle whose ``signal`` fails with ``error``."""

    def __init__(self, handle: WorkflowHandle[Any, Any], error: RPCError) -> None:
        self._handle = handle
        self._error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    async def signal(self, *args: Any, **kwargs: Any) -> None:
        raise self._error


class FaultyClient:
    """The real client, except that ``signal`` (all workflows) and ``start_workflow`` (the given ids) raise the
    given RPC errors. Every start attempt is counted by workflow id."""

    def __init__(
        self,
        client: Client,
        *,
        signal_error: RPCError | None = None,
        start_errors: dict[str, RPCError] | None = None,
    ) -> None:
        self.client = client
        self.signal_error = signal_error
        self.start_errors = dict(start_errors or {})
        self.start_attempts: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def get_workflow_handle(self, workflow_id: str, **kwargs: Any) -> Any:
        handle = self.client.get_workflow_handle(workflow_id, **kwargs)
        return _Handle(handle, self.signal_error) if self.signal_error else handle

    async def start_workflow(self, *args: Any, **kwargs: Any) -> Any:
        workflow_id = kwargs["id"]
        self.start_attempts[workflow_id] = self.start_attempts.get(workflow_id, 0) + 1
        error = self.start_errors.get(workflow_id)
        if error is not None:
            raise error
        return await self.client.start_workflow(*args, **kwargs)

    def as_client(self) -> Client:
        return cast(Client, self)


def idle_queue() -> str:
    """A task queue no worker polls: workflows started there stay open and do nothing."""
    return f"idle-{uuid.uuid4().hex[:12]}"


async def start_idle(
    pipe: Pipeline, job_id: str, queue: str, *, scheduler_job_id: str | None = None
) -> WorkflowHandle[Any, Any]:
    """Start the job's workflow on ``queue`` as the poller would (same input and search attributes)."""
    job = pipe.ledger.job(job_id)
    assert job is not None
    inp = JobWorkflowInput(
        job=JobSpec.model_validate(job.raw_spec),
        cluster_id=pipe.cluster_id,
        provider=pipe.config.provider.address,
        settings=job_settings(pipe.config),
    )
    attributes = initial_search_attributes(inp)
    if scheduler_job_id:
        attributes = attributes.updated(SearchAttributePair(SA_SCHEDULER_JOB, scheduler_job_id))
    return await pipe.client.start_workflow(
        JOB_WORKFLOW_NAME,
        inp,
        id=job_id,
        task_queue=queue,
        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        search_attributes=attributes,
    )


async def started_input(client: Client, workflow_id: str) -> JobWorkflowInput:
    """The input the workflow's latest run was started with (its first history event)."""
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        attributes = event.workflow_execution_started_event_attributes
        [inp] = await client.data_converter.decode(attributes.input.payloads, [JobWorkflowInput])
        return cast(JobWorkflowInput, inp)
    raise AssertionError(f"{workflow_id} has no history")


async def terminate_all(client: Client, workflow_ids: list[str]) -> None:
    """Clean up open runs a test left on an idle queue (the dev server is shared by the whole session)."""
    for workflow_id in workflow_ids:
        with contextlib.suppress(RPCError):
            await client.get_workflow_handle(workflow_id).terminate("test cleanup")


async def visibility_shows(
    client: Client, statuses: dict[str, WorkflowExecutionStatus], timeout: float = 30
) -> None:
    """Wait until Temporal's visibility store lists the latest run of each workflow id with the given status. It
    lags starts and closes by a moment, and the poller's running count and the reconciler's first look read it;
    a test that wants one poll or round to see everything waits for it first."""
    ids = sorted(statuses)
    for _ in range(int(timeout / 0.1)):
        latest: dict[str, tuple[object, WorkflowExecutionStatus | None]] = {}
        for chunk in range(0, len(ids), 100):
            quoted = ", ".join(f"'{i}'" for i in ids[chunk : chunk + 100])
            async for w in client.list_workflows(f"WorkflowId IN ({quoted})"):
                if w.id not in latest or w.start_time > latest[w.id][0]:  # type: ignore[operator]
                    latest[w.id] = (w.start_time, w.status)
        if {i: latest.get(i, (None, None))[1] for i in ids} == statuses:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("visibility does not show the expected workflow states")
