"""Record a release's replay corpus: ``make record-histories RELEASE=0.3.0``.

Run it once, when the release is cut, on the release's code, and commit ``tests/histories/v<release>/``: every
later change to the workflow code must replay these histories (``tests/test_replay.py``,
``tests/test_production_deploys.py``), or jobs already running in production would break on deploy. A release's
corpus is frozen: the recorder refuses a release that already has one, and the replay test fails if a committed
history changes.

Every branch of the job workflow gets a history (below), and the node workflow's lifecycle and continue-as-new.
The recorder runs them on a fresh Temporal dev server with the real worker process, ledger and signer and the
in-memory scheduler, checks that each one took its branch, replays each one, and only then writes the directory
(all or nothing) with its ``SHA256SUMS``.

    python -m tests.record_histories --release 0.3.0 [--into DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.chain.local_ledger import LocalLedger
from tests import node_scenarios
from tests.conftest import binary
from tests.memory_adapter import MemoryAdapter, Script
from tests.production_support import cluster_config, provider_ledger, submit, wait_result
from tests.replay_corpus import HISTORIES, MANIFEST, RELEASE, manifest_text
from tests.versioning_support import build_workers
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, CancelRequest, JobRef, JobResult, JobWorkflowInput
from virtengine_hpc.models import JobSpec, PricedQueue, Pricing, spec_digest
from virtengine_hpc.signing import write_private_key
from virtengine_hpc.states import JobState
from workers.versioning import promote_first_build
from workers.wiring import job_settings, task_queue
from workers.worker import WorkerProcess
from workflows.hpc_job import (
    PATCH_UPGRADE_ON_CONTINUE_AS_NEW,
    SEARCH_ATTRIBUTES,
    HPCJobWorkflow,
    initial_search_attributes,
)
from workflows.node import NodeWorkflow

A, B = "cluster-a", "cluster-b"
OFFERING_B = "offering-b"
Q, R, C, F = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.FAILED
RUNNING_LONG = Script([(0, Q), (0.3, R), (600, C)])


class BranchMissed(AssertionError):
    """A scenario ran but did not take the branch it stands for: its history would not cover it."""


@dataclass
class Provider:
    """Two clusters, each served by its own worker process (as on two hosts), one chain."""

    client: Client
    config: Config
    ledger: LocalLedger
    key_path: Path
    adapters: dict[str, MemoryAdapter] = field(default_factory=dict)

    async def start(
        self,
        script: Script | None = None,
        *,
        decide: str | None = A,
        runs_on: str = A,
        settings: dict[str, Any] | None = None,
        cancel_first: bool = False,
        **spec: Any,
    ) -> str:
        """A chain job started as the poller starts it (``settings`` override the config's; ``cancel_first``:
        the tenant's cancel arrives with the start, as the poller sends it for a job it had not started)."""
        job_id = submit(self.ledger, self.config, decide=decide, **spec)
        if script is not None:
            self.adapters[runs_on].scripts[job_id] = script
        raw = self.ledger.job(job_id).raw_spec  # type: ignore[union-attr]
        job_settings_ = job_settings(self.config).model_copy(update=settings or {})
        inp = JobWorkflowInput(
            job=JobRef.of(JobSpec.model_validate(raw), spec_digest(raw)),
            cluster_id=A,
            provider=self.config.provider.address,
            settings=job_settings_,
        )
        extra: dict[str, Any] = {}
        if cancel_first:
            extra = {
                "start_signal": "cancel",
                "start_signal_args": [CancelRequest(reason="cancelled at once")],
            }
        await self.client.start_workflow(
            JOB_WORKFLOW_NAME,
            inp,
            id=job_id,
            task_queue=task_queue(self.config, A),
            search_attributes=initial_search_attributes(inp),
            **extra,
        )
        return job_id

    async def running(self, job_id: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (job := self.ledger.job(job_id)) is None or job.state != R:
            if time.monotonic() > deadline:
                raise BranchMissed(f"job {job_id} never ran")
            await asyncio.sleep(0.1)

    async def result(self, job_id: str) -> JobResult:
        return await wait_result(self.client, job_id, timeout=240)

    async def runs(self, job_id: str) -> list[WorkflowHistory]:
        """Every run of the job's workflow, first to last."""
        handle = self.client.get_workflow_handle(job_id)
        run_id: str | None = (await handle.describe()).raw_description.workflow_execution_info.first_run_id
        runs = []
        while run_id:
            history = await self.client.get_workflow_handle(job_id, run_id=run_id).fetch_history()
            runs.append(history)
            run_id = next((_continued_to(e) for e in history.events if _continued_to(e)), None)
        return runs


def _continued_to(event: Any) -> str | None:
    if event.HasField("workflow_execution_continued_as_new_event_attributes"):
        return str(event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id)
    return None


def activities_of(history: WorkflowHistory) -> list[tuple[str, str]]:
    """(activity type, task queue) of every activity the run scheduled."""
    return [
        (e.activity_task_scheduled_event_attributes.activity_type.name,
         e.activity_task_scheduled_event_attributes.task_queue.name)
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]  # fmt: skip


def has_event(history: WorkflowHistory, kind: str) -> bool:
    return any(e.HasField(f"{kind}_event_attributes") for e in history.events)


def has_marker(history: WorkflowHistory, patch: str) -> bool:
    return any(
        patch.encode() in e.marker_recorded_event_attributes.SerializeToString()
        for e in history.events
        if e.HasField("marker_recorded_event_attributes")
    )


def expect(condition: bool, why: str) -> None:
    if not condition:
        raise BranchMissed(why)


# ---- the job workflow's branches ---------------------------------------------------------------------------------

Scenario = Callable[[Provider], Awaitable[dict[str, WorkflowHistory]]]


async def _one(p: Provider, job_id: str) -> tuple[JobResult, WorkflowHistory]:
    result = await p.result(job_id)
    (run,) = await p.runs(job_id)
    return result, run


async def completed(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(Script([(0, Q), (0.3, R), (3.5, C)], exit_code=0))
    result, run = await _one(p, job)
    expect(result.state == C and result.usage_records >= 2, f"completed with periodic records: {result}")
    return {"completed": run}


async def failed(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(Script([(0, Q), (0.2, R), (0.8, F)], exit_code=3, reason="exit code 3"))
    result, run = await _one(p, job)
    expect(result.state == F and result.exit_code == 3, f"failed with its exit code: {result}")
    return {"failed": run}


async def cancelled_running(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(RUNNING_LONG)
    await p.running(job)
    await p.client.get_workflow_handle(job).signal("cancel", CancelRequest(reason="replay scenario"))
    result, run = await _one(p, job)
    expect(result.state == JobState.CANCELLED, f"cancelled by the tenant: {result}")
    expect(("cancel_job", task_queue(p.config, A)) in activities_of(run), "the scheduler job was cancelled")
    return {"cancelled-running": run}


async def workflow_cancelled(p: Provider) -> dict[str, WorkflowHistory]:
    """The Web UI's Cancel (a Temporal workflow cancel) is a provider cancel."""
    job = await p.start(RUNNING_LONG)
    await p.running(job)
    await p.client.get_workflow_handle(job).cancel()
    result, run = await _one(p, job)
    expect(result.state == JobState.CANCELLED, f"cancelled by the operator: {result}")
    expect(has_event(run, "workflow_execution_cancel_requested"), "a Temporal cancel")
    return {"workflow-cancelled": run}


async def cancel_before_submit(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(cancel_first=True)
    result, run = await _one(p, job)
    expect(result.state == JobState.CANCELLED, f"cancelled before submission: {result}")
    expect("submit_job" not in {name for name, _ in activities_of(run)}, "never submitted")
    return {"cancel-before-submit": run}


async def routing_rejected(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(decide=None)
    result, run = await _one(p, job)
    expect(result.state == F and "routing_rejected" in result.message, f"refused by routing: {result}")
    return {"routing-rejected": run}


async def submission_rejected(p: Provider) -> dict[str, WorkflowHistory]:
    job_id = uuid.uuid4().hex[:10]
    p.adapters[A].reject[f"JOB-{job_id}"] = "Invalid account or account/partition combination specified"
    job = await p.start(job_id=f"JOB-{job_id}")
    result, run = await _one(p, job)
    names = [name for name, _ in activities_of(run)]
    expect(result.state == F and "submit_job" in names, f"refused by the scheduler: {result}")
    expect("find_job" not in names, "a refusal is not looked up")
    return {"submission-rejected": run}


async def recovered_submission(p: Provider) -> dict[str, WorkflowHistory]:
    job_id = f"JOB-{uuid.uuid4().hex[:10]}"
    p.adapters[A].lose_submit_answers.add(job_id)
    job = await p.start(Script([(0, Q), (0.3, R), (2.0, C)], exit_code=0), job_id=job_id)
    result, run = await _one(p, job)
    expect("find_job" in {name for name, _ in activities_of(run)}, "every submit attempt failed: looked up")
    expect(result.state == C, f"adopted and completed: {result}")
    return {"recovered-submission": run}


async def multi_cluster(p: Provider) -> dict[str, WorkflowHistory]:
    """Started on A's task queue, decided for B: the scheduler activities run on B's queue (B's workers)."""
    script = Script([(0, Q), (0.3, R), (2.5, C)], exit_code=0)
    job = await p.start(script, decide=B, runs_on=B, offering_id=OFFERING_B, cluster_id=A)
    result, run = await _one(p, job)
    expect(result.state == C, f"completed on B: {result}")
    expect(("submit_job", task_queue(p.config, B)) in activities_of(run), "submitted on B's task queue")
    return {"multi-cluster": run}


async def continued_as_new(p: Provider) -> dict[str, WorkflowHistory]:
    settings = {"continue_as_new_after_events": 40, "report_interval_seconds": 0.5}
    job = await p.start(Script([(0, Q), (0.2, R), (8.0, C)], exit_code=0), settings=settings)
    result = await p.result(job)
    runs = await p.runs(job)
    expect(len(runs) >= 2 and result.state == C, f"continued as new ({len(runs)} runs): {result}")
    expect(has_event(runs[0], "workflow_execution_continued_as_new"), "the first run continued as new")
    return {"continued-as-new": runs[0], "continued-run": runs[-1]}


async def deadline(p: Provider) -> dict[str, WorkflowHistory]:
    """A job that runs past its walltime is cancelled by the provider and ends timed out."""
    settings = {"walltime_grace_seconds": 1, "report_interval_seconds": 20}
    job = await p.start(RUNNING_LONG, walltime_seconds=60, settings=settings)
    result, run = await _one(p, job)
    expect(result.state == JobState.TIMEOUT and "walltime" in result.message, f"timed out: {result}")
    return {"deadline": run}


async def queue_wait_timeout(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(Script([(0, Q)]), settings={"max_queue_wait_seconds": 2})
    result, run = await _one(p, job)
    expect(result.state == JobState.TIMEOUT, f"timed out in the queue: {result}")
    return {"queue-wait-timeout": run}


async def vanished(p: Provider) -> dict[str, WorkflowHistory]:
    job = await p.start(RUNNING_LONG)
    await p.running(job)
    p.adapters[A].vanished.add(job)  # gone from the queue and from accounting
    result, run = await _one(p, job)
    expect(result.state == F and "vanished" in result.message, f"failed as vanished: {result}")
    return {"vanished": run}


async def moved_to_new_build(p: Provider) -> dict[str, WorkflowHistory]:
    """Versioned workers: a job pinned to one build continues as new onto the build made current after it."""
    deployment = f"record-{uuid.uuid4().hex[:8]}"
    temporal = p.config.temporal.model_copy(
        update={"deployment_name": deployment, "task_queue": f"{p.config.temporal.task_queue}-versioned"}
    )
    config = p.config.model_copy(update={"temporal": temporal})
    adapter = p.adapters[A]
    first = temporal.model_copy(update={"build_id": "build-1"})
    async with (
        build_workers(p.client, config, p.key_path, p.ledger, adapter, HPCJobWorkflow, "build-1"),
        build_workers(p.client, config, p.key_path, p.ledger, adapter, HPCJobWorkflow, "build-2"),
    ):
        await promote_first_build(p.client, first, timeout=60)
        job_id = submit(p.ledger, config, decide=A)
        adapter.scripts[job_id] = Script([(0, Q), (0.3, R), (6.0, C)], exit_code=0)
        raw = p.ledger.job(job_id).raw_spec  # type: ignore[union-attr]
        inp = JobWorkflowInput(
            job=JobRef.of(JobSpec.model_validate(raw), spec_digest(raw)),
            cluster_id=A,
            provider=config.provider.address,
            settings=job_settings(config).model_copy(update={"report_interval_seconds": 1}),
        )
        await p.client.start_workflow(
            JOB_WORKFLOW_NAME,
            inp,
            id=job_id,
            task_queue=task_queue(config, A),
            search_attributes=initial_search_attributes(inp),
        )
        await p.running(job_id)
        await make_current(p.client, temporal.namespace, deployment, "build-2")
        result = await p.result(job_id)
    runs = await p.runs(job_id)
    expect(result.state == C and len(runs) == 2, f"moved once: {len(runs)} runs, {result}")
    expect(has_marker(runs[0], PATCH_UPGRADE_ON_CONTINUE_AS_NEW), "continued as new onto the new build")
    return {"moved-to-new-build": runs[0]}


async def make_current(client: Client, namespace: str, deployment: str, build_id: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            described = await client.workflow_service.describe_worker_deployment(
                DescribeWorkerDeploymentRequest(namespace=namespace, deployment_name=deployment)
            )
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=namespace,
                    deployment_name=deployment,
                    build_id=build_id,
                    conflict_token=described.conflict_token,
                    identity="record-histories",
                )
            )
            return
        except RPCError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


JOB_SCENARIOS: tuple[Scenario, ...] = (
    completed,
    failed,
    cancelled_running,
    workflow_cancelled,
    cancel_before_submit,
    routing_rejected,
    submission_rejected,
    recovered_submission,
    multi_cluster,
    continued_as_new,
    deadline,
    queue_wait_timeout,
    vanished,
    moved_to_new_build,
)


# ---- the node workflow's ----------------------------------------------------------------------------------------


async def node_histories(client: Client, base: Path) -> dict[str, WorkflowHistory]:
    found = {}
    for name, scenario in (("lifecycle", node_scenarios.lifecycle), ("continued", node_scenarios.continued)):
        directory = base / f"node-{name}"
        directory.mkdir()
        found[name] = WorkflowHistory.from_json(f"node-{name}", await scenario(client, directory))
    expect(
        has_event(found["continued"], "workflow_execution_continued_as_new"), "a node run continued as new"
    )
    return found


# ---- recording ---------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def provider(client: Client, base: Path) -> AsyncIterator[Provider]:
    key_path = base / "provider.key"
    write_private_key(key_path)
    config = cluster_config(base, [A, B], hpc={"usage_reporting": {"report_interval": "1s"}})
    ledger = provider_ledger(config, key_path)
    ledger.add_queue(
        PricedQueue(
            offering_id=OFFERING_B,
            cluster_id=B,
            partition="debug",
            pricing=Pricing(node_hour=Decimal("72"), minimum_charge=Decimal("0.01")),
        )
    )
    p = Provider(client, config, ledger, key_path, {A: MemoryAdapter(), B: MemoryAdapter()})
    secrets = Secrets(provider_signing_key_path=key_path)
    workers = []
    for cluster_id in (A, B):
        clusters = [c.model_copy(update={"serve": c.cluster_id == cluster_id}) for c in config.hpc.clusters]
        serving = config.model_copy(update={"hpc": config.hpc.model_copy(update={"clusters": clusters})})
        process = WorkerProcess(
            serving, secrets, chain=ledger, adapters={cluster_id: p.adapters[cluster_id]}, client=client
        )
        await process.start()
        workers.append(process)
    try:
        yield p
    finally:
        for process in workers:
            await process.stop()


async def record_corpus(client: Client, dest: Path) -> dict[str, int]:
    """Run every scenario, check its branch, replay its history, and write ``dest`` (which must not exist):
    ``job-<scenario>.json``, ``node-<scenario>.json`` and ``SHA256SUMS``. Returns the events of each history."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        # The node workflow's scenarios need no provider: they run beside the job's (whose deadline scenario waits
        # out the shortest walltime, a minute).
        nodes = asyncio.create_task(node_histories(client, base))
        try:
            async with provider(client, base / "provider") as p:
                outcomes = await asyncio.gather(
                    *(scenario(p) for scenario in JOB_SCENARIOS), return_exceptions=True
                )
            failures = [
                f"{scenario.__name__}: {outcome!r}"
                for scenario, outcome in zip(JOB_SCENARIOS, outcomes, strict=True)
                if isinstance(outcome, BaseException)
            ]
            if failures:
                raise BranchMissed("; ".join(failures))
            node_runs = await nodes
        finally:
            nodes.cancel()
    found = [outcome for outcome in outcomes if isinstance(outcome, dict)]
    histories = {f"job-{name}": h for part in found for name, h in part.items()}
    histories.update({f"node-{name}": h for name, h in node_runs.items()})
    replayer = Replayer(workflows=[HPCJobWorkflow, NodeWorkflow], data_converter=pydantic_data_converter)
    for name, history in histories.items():
        replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        expect(replayed.replay_failure is None, f"{name} does not replay: {replayed.replay_failure}")
    staging = dest.parent / f".{dest.name}.recording-{uuid.uuid4().hex[:6]}"
    staging.mkdir(parents=True)
    try:
        for name, history in sorted(histories.items()):
            (staging / f"{name}.json").write_text(history.to_json())
        (staging / MANIFEST).write_text(manifest_text(staging))
        staging.rename(dest)  # fails if dest appeared meanwhile: nothing is overwritten
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: len(h.events) for name, h in sorted(histories.items())}


def corpus_dir(release: str, root: Path = HISTORIES) -> Path:
    """Where a release's corpus goes; ``ValueError`` if the name is not x.y.z or the release has one already."""
    name = release if release.startswith("v") else f"v{release}"
    if re.fullmatch(r"v\d+\.\d+", name):
        name += ".0"  # 0.3 is 0.3.0
    if not RELEASE.match(name):
        raise ValueError(f"release {release!r} is not a version like 0.3.0")
    target = root / name
    if target.exists():
        raise ValueError(
            f"{target} exists: a release's recorded histories are frozen and never recorded again "
            "(record the next release instead)"
        )
    return target


async def _record(target: Path) -> dict[str, int]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        dev_server_log_level="error",
        ui=False,
    )
    try:
        return await record_corpus(env.client, target)
    finally:
        await env.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.record_histories", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--release", required=True, help="the release being cut, e.g. 0.3.0")
    parser.add_argument(
        "--into", type=Path, default=HISTORIES, help="directory of the corpora (tests/histories)"
    )
    args = parser.parse_args(argv)
    try:
        target = corpus_dir(args.release, args.into)
    except ValueError as err:
        print(f"record-histories: {err}", file=sys.stderr)
        return 2
    try:
        events = asyncio.run(_record(target))
    except BranchMissed as err:
        print(f"record-histories: nothing written: {err}", file=sys.stderr)
        return 1
    for name, count in events.items():
        print(f"recorded {target.name}/{name}.json: {count} events")
    print(f"commit {target} (its {MANIFEST} freezes it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
