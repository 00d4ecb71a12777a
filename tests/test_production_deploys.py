"""Safe deploys (docs/deploys.md): a new release must never break a job that is already running.

* The previous release's recorded job histories (``tests/histories/v0.1.0-*.json``: completed, failed, cancelled
  while running, refused by routing) replay on this code with exactly the workflows the production worker
  registers.
* The check can fail: the same workflow with one unpatched change (an extra timer before routing) is refused
  by the replayer as non-deterministic, which is what CI would report.
* A rolling upgrade with worker versioning: a job starts on build 0.1.0, build 0.2.0 becomes the deployment's
  current version, the old worker stops with SIGTERM semantics, and the job finishes on the new build
  (auto-upgrade) with its usage intact.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.api.workflowservice.v1 import SetWorkerDeploymentCurrentVersionRequest
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.memory_adapter import MemoryAdapter, Script
from tests.production_support import cluster_config, provider_ledger, submit, wait_result
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, JobResult, JobWorkflowInput
from virtengine_hpc.states import JobState
from workers.wiring import build_worker_deps
from workers.worker import WorkerProcess
from workflows.hpc_job import HPCJobWorkflow

HISTORIES = Path(__file__).parent / "histories"
PREVIOUS = sorted(HISTORIES.glob("v0.1.0-*.json"))


@workflow.defn(name=JOB_WORKFLOW_NAME, sandboxed=False)  # this test module imports too much for the sandbox
class UnpatchedChange(HPCJobWorkflow):
    """HPCJobWorkflow with a change that was not put behind ``workflow.patched``: a pause before routing."""

    @workflow.run
    async def run(self, inp: JobWorkflowInput) -> JobResult:
        await workflow.sleep(timedelta(seconds=1))
        return await super().run(inp)


def production_workflows(tmp_path: Path, key_path: Path) -> list[type]:
    """The workflow classes the production worker registers (read from a real one, not listed by hand)."""
    config = cluster_config(tmp_path, ["c1"])
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={"c1": MemoryAdapter()}
    )
    for close in deps.closers:
        close()
    return [HPCJobWorkflow, *deps.extra_workflows]


def test_every_outcome_of_the_previous_release_is_recorded() -> None:
    outcomes = {p.stem.removeprefix("v0.1.0-") for p in PREVIOUS}
    assert {"completed", "failed", "cancelled-running", "routing-rejected"} <= outcomes


@pytest.mark.parametrize("path", PREVIOUS, ids=[p.stem for p in PREVIOUS])
async def test_previous_release_histories_replay_on_the_production_worker(
    path: Path, tmp_path: Path, key_path: Path
) -> None:
    replayer = Replayer(
        workflows=production_workflows(tmp_path, key_path), data_converter=pydantic_data_converter
    )
    result = await replayer.replay_workflow(WorkflowHistory.from_json(path.stem, path.read_text()))
    assert result.replay_failure is None


async def test_an_unpatched_change_is_caught_by_replay() -> None:
    path = HISTORIES / "v0.1.0-completed.json"
    replayer = Replayer(workflows=[UnpatchedChange], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(
        WorkflowHistory.from_json(path.stem, path.read_text()), raise_on_replay_failure=False
    )
    assert result.replay_failure is not None
    assert "nondetermin" in str(result.replay_failure).lower()


async def set_current(client: Client, config: Config, build_id: str) -> None:
    """What ``temporal worker deployment set-current-version`` does: route new work to ``build_id``."""
    deadline = time.monotonic() + 20
    while True:
        try:
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=config.temporal.namespace,
                    deployment_name=config.temporal.deployment_name or "",
                    build_id=build_id,
                    identity="test-deployer",
                )
            )
            return
        except Exception:  # the version registers with the server at the worker's first poll
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


def build_ids_of_workflow_tasks(history: WorkflowHistory) -> list[str]:
    found = []
    for event in history.events:
        if event.HasField("workflow_task_completed_event_attributes"):
            attrs = event.workflow_task_completed_event_attributes
            found.append(attrs.deployment_version.build_id or attrs.worker_version.build_id)
    return found


async def test_a_rolling_upgrade_with_worker_versioning_keeps_a_running_job(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    cluster = "c-versioned"
    base = cluster_config(
        tmp_path,
        [cluster],
        hpc={"usage_reporting": {"report_interval": "1s"}},
        temporal={
            "deployment_name": f"ve-{tmp_path.name[-8:]}",
            "build_id": "0.1.0",
            "graceful_shutdown_timeout": "1s",
        },
    )
    ledger = provider_ledger(base, key_path)
    adapter = MemoryAdapter(
        default=Script(
            [(0, JobState.QUEUED), (0.2, JobState.RUNNING), (6.0, JobState.COMPLETED)], exit_code=0
        )
    )
    secrets = Secrets(provider_signing_key_path=key_path)

    def release(build_id: str, poller: bool) -> WorkerProcess:
        config = base.model_copy(update={"temporal": base.temporal.model_copy(update={"build_id": build_id})})
        return WorkerProcess(
            config, secrets, with_poller=poller, chain=ledger, adapters={cluster: adapter}, client=client
        )

    old = release("0.1.0", poller=True)
    await old.start()
    new: WorkerProcess | None = None
    try:
        await set_current(client, base, "0.1.0")
        job_id = submit(ledger, base, decide=cluster)
        deadline = time.monotonic() + 20
        while not ledger.usage_records(job_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert ledger.usage_records(job_id), "the job runs on the old build"

        new = release("0.2.0", poller=False)
        await new.start()
        await set_current(client, base, "0.2.0")
        await old.stop()
        result = await wait_result(client, job_id, timeout=60)
        assert result.state == JobState.COMPLETED
        assert adapter.submits == 1
        records = ledger.usage_records(job_id)
        assert [r.sequence for r in records] == list(range(1, len(records) + 1)) and records[-1].is_final
        history = await client.get_workflow_handle(job_id).fetch_history()
        builds = build_ids_of_workflow_tasks(history)
        assert builds[0] == "0.1.0" and builds[-1] == "0.2.0", builds
    finally:
        await old.stop()
        if new is not None:
            await new.stop()
