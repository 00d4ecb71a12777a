"""Upgrades never break a running job: versioned deploys (docs/deploys.md), on the real Temporal dev server.

* Side by side: an old and a new build of the workers run at once, the new one with a workflow change that was
  NOT put behind ``workflow.patched`` (a pause before routing), which would break the replay of every running
  job. Jobs are pinned to the build that started them: a job that ends during its current step finishes on the
  old build; a job with work left continues as new once the new build is current, its next run on the new build;
  a job started after the switch runs on the new build only. No workflow task fails, nothing is submitted twice,
  usage stays gapless across the builds, and the old build drains (no open workflow pinned to it).
* The control: the same change rolled out the unversioned way (old worker stopped, new one started) fails the
  running job's workflow tasks with a non-determinism error. That is what versioning prevents.
* A first install makes itself current (``temporal.promote_first_build``); a later build never does.
* The defaults: workers are versioned (deployment ``virtengine-hpc``, build id = the package's version), pinned.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHistory
from temporalio.common import VersioningBehavior

from activities.audit import AuditLog
from activities.chain.local_ledger import LocalLedger
from tests.conftest import binary
from tests.memory_adapter import MemoryAdapter, Script
from tests.production_support import cluster_config, provider_ledger, submit, wait_result
from tests.versioning_support import build_workers
from virtengine_hpc.config import Config, Secrets, default_build_id, load_config, package_version
from virtengine_hpc.messages import (
    JOB_WORKFLOW_NAME,
    JobRef,
    JobResult,
    JobWorkflowInput,
    monitor_workflow_id,
)
from virtengine_hpc.models import JobSpec, spec_digest
from virtengine_hpc.states import JobState
from workers.poller import ChainPoller
from workers.versioning import deployment_config, promote_first_build
from workers.wiring import job_settings, task_queue
from workers.worker import WorkerProcess
from workflows.hpc_job import HPCJobWorkflow, initial_search_attributes

Q, R, C = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED


@workflow.defn(name=JOB_WORKFLOW_NAME, sandboxed=False)  # this test module imports too much for the sandbox
class ChangedJobWorkflow(HPCJobWorkflow):
    """The next release's job workflow, with a change that was not put behind ``workflow.patched``: a pause
    before anything else. Replaying any history of the current code on it fails."""

    @workflow.run
    async def run(self, inp: JobWorkflowInput) -> JobResult:
        await workflow.sleep(timedelta(seconds=1))
        return await super().run(inp)


# ---- helpers ----------------------------------------------------------------------------------------------------


async def temporal_cli(client: Client, *args: str) -> str:
    """Run the temporal CLI against the test server, as an operator following docs/deploys.md would."""
    proc = await asyncio.create_subprocess_exec(
        binary("temporal"),
        *args,
        "--address",
        client.service_client.config.target_host,
        "--namespace",
        client.namespace,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    if proc.returncode != 0:
        raise AssertionError(f"temporal {' '.join(args)} exited {proc.returncode}: {err.decode()}")
    return out.decode()


async def set_current_version(client: Client, deployment: str, build_id: str) -> None:
    """``temporal worker deployment set-current-version`` (retried until the build's workers have registered it
    with their first poll)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            await temporal_cli(
                client,
                "worker",
                "deployment",
                "set-current-version",
                "--deployment-name",
                deployment,
                "--build-id",
                build_id,
                "--yes",
            )
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def open_workflows_on(
    client: Client, deployment: str, build_id: str, workflow_type: str | None = None
) -> int:
    """``temporal workflow count`` of the running workflows pinned to a build (of one type, if given): 0 once
    it has drained."""
    query = f"TemporalWorkerDeploymentVersion='{deployment}:{build_id}' AND ExecutionStatus='Running'"
    if workflow_type is not None:
        query += f" AND WorkflowType='{workflow_type}'"
    out = await temporal_cli(client, "workflow", "count", "--query", query, "--output", "json")
    return int(json.loads(out).get("count", 0))  # the JSON leaves a zero count out


async def wait_for_open_workflows(
    client: Client, deployment: str, build_id: str, expected: int, timeout: float = 30
) -> None:
    """Until ``expected`` jobs run pinned to a build, or, for 0, until no workflow at all does (the build has
    drained: its cluster monitor has left it too). Visibility lags a little."""
    workflow_type = JOB_WORKFLOW_NAME if expected else None
    deadline = time.monotonic() + timeout
    while (found := await open_workflows_on(client, deployment, build_id, workflow_type)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{found} workflows run on build {build_id}, not {expected}")
        await asyncio.sleep(0.5)


async def runs_of(client: Client, workflow_id: str) -> list[WorkflowHistory]:
    """Every run of a workflow, first to last (following continue-as-new)."""
    handle = client.get_workflow_handle(workflow_id)
    first = (await handle.describe()).raw_description.workflow_execution_info.first_run_id
    runs: list[WorkflowHistory] = []
    run_id: str | None = first
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        runs.append(history)
        run_id = next(
            (
                e.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                for e in history.events
                if e.HasField("workflow_execution_continued_as_new_event_attributes")
            ),
            None,
        )
    return runs


def builds_of(history: WorkflowHistory) -> set[str]:
    """The builds whose workers completed the run's workflow tasks."""
    return set(task_builds(history))


def task_builds(history: WorkflowHistory) -> list[str]:
    """The build of each completed workflow task, in order ("" for an unversioned worker)."""
    return [
        e.workflow_task_completed_event_attributes.deployment_version.build_id
        for e in history.events
        if e.HasField("workflow_task_completed_event_attributes")
    ]


def failed_tasks(history: WorkflowHistory) -> list[str]:
    return [
        WorkflowTaskFailedCause.Name(e.workflow_task_failed_event_attributes.cause)
        for e in history.events
        if e.HasField("workflow_task_failed_event_attributes")
    ]


def paused_first(history: WorkflowHistory) -> bool:
    """The run began with the changed code's pause (a timer before any activity)."""
    for e in history.events:
        if e.HasField("timer_started_event_attributes"):
            return True
        if e.HasField("activity_task_scheduled_event_attributes"):
            return False
    return False


async def start_job(client: Client, config: Config, ledger: LocalLedger, report_interval: float) -> str:
    """A chain job, decided for the config's cluster, started as the poller would (with its own report
    interval)."""
    job_id = submit(ledger, config, decide=config.hpc.cluster_id)
    raw = ledger.job(job_id).raw_spec  # type: ignore[union-attr]
    spec = JobSpec.model_validate(raw)
    settings = job_settings(config).model_copy(update={"report_interval_seconds": report_interval})
    inp = JobWorkflowInput(
        job=JobRef.of(spec, spec_digest(raw)),
        cluster_id=config.hpc.cluster_id,
        provider=spec.provider,
        settings=settings,
    )
    await client.start_workflow(
        JOB_WORKFLOW_NAME,
        inp,
        id=job_id,
        task_queue=task_queue(config),
        search_attributes=initial_search_attributes(inp),
    )
    return job_id


async def wait_for_state(ledger: LocalLedger, job_id: str, state: JobState, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = ledger.job(job_id)
        if job is not None and job.state == state:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} never reached {state.value}")


def check_usage(ledger: LocalLedger, job_id: str) -> None:
    records = ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records] == [False] * (len(records) - 1) + [True]
    for earlier, later in itertools.pairwise(records):
        assert later.period_start == earlier.period_end
    assert ledger.settlement(job_id) is not None


def versioned_config(
    tmp_path: Path, deployment: str | None, hpc: dict[str, Any] | None = None, **temporal: Any
) -> Config:
    """A one-cluster provider whose workers belong to ``deployment`` (None: unversioned)."""
    return cluster_config(
        tmp_path,
        [f"c-{uuid.uuid4().hex[:6]}"],
        hpc=hpc or {},
        temporal={"deployment_name": deployment, **temporal},
    )


# ---- tests ------------------------------------------------------------------------------------------------------


async def test_old_and_new_builds_side_by_side_with_an_unpatched_change_break_no_job(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment)
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with (
        build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "old"),
        build_workers(client, config, key_path, ledger, adapter, ChangedJobWorkflow, "new"),
    ):
        await set_current_version(client, deployment, "old")
        # Ends during the step it is in when the new build becomes current (no report due before then).
        ending = await start_job(client, config, ledger, report_interval=3600)
        adapter.scripts[ending] = Script([(0, Q), (0.3, R), (8.0, C)], exit_code=0)
        # Still has work after that step: a usage record every second until it ends.
        moving = await start_job(client, config, ledger, report_interval=1)
        adapter.scripts[moving] = Script([(0, Q), (0.3, R), (20.0, C)], exit_code=0)
        await wait_for_state(ledger, ending, R)
        await wait_for_state(ledger, moving, R)
        await wait_for_open_workflows(client, deployment, "old", 2)

        await set_current_version(client, deployment, "new")
        later = await start_job(client, config, ledger, report_interval=1)
        adapter.scripts[later] = Script([(0, Q), (0.3, R), (3.0, C)], exit_code=0)

        results = {job: await wait_result(client, job, timeout=90) for job in (ending, moving, later)}
        assert all(r.state == C for r in results.values()), results
        await wait_for_open_workflows(client, deployment, "old", 0)  # the old build has drained

    for job in (ending, moving, later):
        assert sum(1 for j in adapter.jobs.values() if j.workflow_id == job) == 1, "submitted once"
        check_usage(ledger, job)

    (ending_run,) = await runs_of(client, ending)
    assert builds_of(ending_run) == {"old"} and failed_tasks(ending_run) == []

    moving_runs = await runs_of(client, moving)
    assert len(moving_runs) == 2, "continued as new once, onto the new build"
    assert builds_of(moving_runs[0]) == {"old"} and builds_of(moving_runs[1]) == {"new"}
    assert paused_first(moving_runs[1]) and not paused_first(moving_runs[0])
    assert [failed_tasks(run) for run in moving_runs] == [[], []]
    assert len(ledger.usage_records(moving)) >= 6, "records on both builds"

    (later_run,) = await runs_of(client, later)
    assert builds_of(later_run) == {"new"} and paused_first(later_run) and failed_tasks(later_run) == []


async def test_an_idle_cluster_monitor_leaves_the_old_build(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """The cluster's monitor is pinned to the build that started it, like a job. Once its last job has ended it
    waits idle (a minute or more) for the next one; when another build becomes current meanwhile it ends within
    about ten seconds, so the old build drains, and the next job starts a monitor on the new build. (Before, the
    idle monitor kept the old build running for its whole idle time.)"""
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment, hpc={"job_service": {"cluster_monitor": True}})
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with (
        build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "old"),
        build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "new"),
    ):
        await set_current_version(client, deployment, "old")
        first = await start_job(client, config, ledger, report_interval=3600)
        adapter.scripts[first] = Script([(0, Q), (0.3, R), (1.0, C)], exit_code=0)
        assert (await wait_result(client, first, timeout=60)).state == C
        assert await open_workflows_on(client, deployment, "old") == 1, (
            "the monitor waits idle on the old build"
        )

        await set_current_version(client, deployment, "new")
        await wait_for_open_workflows(client, deployment, "old", 0, timeout=25)

        later = await start_job(client, config, ledger, report_interval=3600)
        adapter.scripts[later] = Script([(0, Q), (0.3, R), (1.0, C)], exit_code=0)
        assert (await wait_result(client, later, timeout=60)).state == C
        monitor = await client.get_workflow_handle(monitor_workflow_id(task_queue(config))).fetch_history()
        assert builds_of(monitor) == {"new"}, "the next job's monitor runs on the new build"
    check_usage(ledger, first)
    check_usage(ledger, later)


async def test_the_same_change_rolled_out_unversioned_breaks_the_running_job(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """The control: restart the workers on the changed code without versioning, and the running job's next
    workflow task fails as non-deterministic (and keeps failing: the job is stuck)."""
    config = versioned_config(tmp_path, None)
    assert deployment_config(config.temporal) is None
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "old"):
        job = await start_job(client, config, ledger, report_interval=1)
        adapter.scripts[job] = Script([(0, Q), (0.3, R), (30.0, C)], exit_code=0)
        await wait_for_state(ledger, job, R)
    handle = client.get_workflow_handle(job)
    try:
        async with build_workers(client, config, key_path, ledger, adapter, ChangedJobWorkflow, "new"):
            deadline = time.monotonic() + 30
            causes: list[str] = []
            while time.monotonic() < deadline and not causes:
                causes = failed_tasks(await handle.fetch_history())
                await asyncio.sleep(0.3)
            assert causes and set(causes) == {"WORKFLOW_TASK_FAILED_CAUSE_NON_DETERMINISTIC_ERROR"}, causes
            assert ledger.job(job).state == R  # type: ignore[union-attr]
    finally:
        await handle.terminate("test over")


async def test_a_rollback_moves_jobs_back_to_the_old_build(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """docs/deploys.md, "Rolling back": the old build made current again takes back a job that had moved to the
    new one (at its next step), and the job finishes there, its usage whole."""
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment)
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with (
        build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "0.2.0"),
        build_workers(client, config, key_path, ledger, adapter, ChangedJobWorkflow, "0.3.0"),
    ):
        await set_current_version(client, deployment, "0.2.0")
        job = await start_job(client, config, ledger, report_interval=1)
        adapter.scripts[job] = Script([(0, Q), (0.3, R), (30.0, C)], exit_code=0)
        await wait_for_state(ledger, job, R)
        await set_current_version(client, deployment, "0.3.0")
        await wait_for_open_workflows(client, deployment, "0.3.0", 1)
        await set_current_version(client, deployment, "0.2.0")
        await wait_for_open_workflows(client, deployment, "0.3.0", 0)
        assert (await wait_result(client, job, timeout=60)).state == C
    runs = await runs_of(client, job)
    assert [builds_of(run) for run in runs] == [{"0.2.0"}, {"0.3.0"}, {"0.2.0"}]
    assert all(failed_tasks(run) == [] for run in runs)
    assert adapter.submits == 1
    check_usage(ledger, job)


async def test_jobs_of_unversioned_workers_move_to_the_first_versioned_build(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """docs/deploys.md, "Upgrading from unversioned workers": once the first versioned build is current, the
    running job's workflow tasks go to it only, even while the unversioned worker still runs."""
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment, build_id="0.3.0")
    unversioned = config.model_copy(
        update={"temporal": config.temporal.model_copy(update={"deployment_name": None})}
    )
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with build_workers(client, unversioned, key_path, ledger, adapter, HPCJobWorkflow, "0.2.0"):
        job = await start_job(client, config, ledger, report_interval=1)
        adapter.scripts[job] = Script([(0, Q), (0.3, R), (12.0, C)], exit_code=0)
        await wait_for_state(ledger, job, R)
        async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "0.3.0"):
            assert await promote_first_build(client, config.temporal, timeout=30)
            assert (await wait_result(client, job, timeout=60)).state == C
    runs = await runs_of(client, job)
    builds = [build for run in runs for build in task_builds(run)]
    assert builds[0] == "" and builds[-1] == "0.3.0", builds
    assert "" not in builds[builds.index("0.3.0") :], f"back to the unversioned worker: {builds}"
    assert all(failed_tasks(run) == [] for run in runs)
    check_usage(ledger, job)


async def test_a_first_install_makes_itself_current_and_a_later_build_waits_for_the_operator(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment, build_id="1.0.0")
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "1.0.0"):
        assert await promote_first_build(client, config.temporal, timeout=30)
        poller = ChainPoller(
            client,
            ledger,
            config,
            AuditLog(config.hpc.audit),
            task_queue=task_queue(config),
            settings=job_settings(config),
        )
        job = submit(ledger, config, decide=config.hpc.cluster_id)
        await poller.poll_once()
        assert (await wait_result(client, job)).state == C, "the first build took the job"

        second = config.temporal.model_copy(update={"build_id": "1.1.0"})
        async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "1.1.0"):
            assert not await promote_first_build(client, second, timeout=30)
        described = await temporal_cli(
            client, "worker", "deployment", "describe", "--name", deployment, "--output", "json"
        )
        current = json.loads(described)["routingConfig"]["currentVersionBuildID"]
        assert current == "1.0.0", "a later build is made current by the operator, never by itself"


async def test_an_upgrade_by_the_documented_procedure_keeps_a_running_job(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """docs/deploys.md, "Upgrading", with the production worker process: the first build makes itself current,
    the next one is started beside it and made current with the temporal CLI, the old build drains (its job
    moves at its next usage report), then it stops. The job finishes on the new build, submitted once, its usage
    records gapless across the two builds."""
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    base = versioned_config(
        tmp_path,
        deployment,
        hpc={"usage_reporting": {"report_interval": "1s"}},
        build_id="0.1.0",
        graceful_shutdown_timeout="1s",
    )
    ledger = provider_ledger(base, key_path)
    adapter = MemoryAdapter(default=Script([(0, Q), (0.2, R), (12.0, C)], exit_code=0))
    cluster = base.hpc.cluster_id

    def release(build_id: str, poller: bool) -> WorkerProcess:
        config = base.model_copy(update={"temporal": base.temporal.model_copy(update={"build_id": build_id})})
        secrets = Secrets(provider_signing_key_path=key_path)
        return WorkerProcess(
            config, secrets, with_poller=poller, chain=ledger, adapters={cluster: adapter}, client=client
        )

    old, new = release("0.1.0", poller=True), release("0.2.0", poller=False)
    await old.start()
    try:
        job = submit(ledger, base, decide=cluster)
        await wait_for_state(ledger, job, R)
        await wait_for_open_workflows(client, deployment, "0.1.0", 1)

        await new.start()
        await set_current_version(client, deployment, "0.2.0")
        await wait_for_open_workflows(client, deployment, "0.1.0", 0)
        await old.stop()

        result = await wait_result(client, job, timeout=60)
        assert result.state == C
    finally:
        await old.stop()
        await new.stop()
    assert adapter.submits == 1
    check_usage(ledger, job)
    runs = await runs_of(client, job)
    assert builds_of(runs[0]) == {"0.1.0"} and builds_of(runs[-1]) == {"0.2.0"}
    assert all(failed_tasks(run) == [] for run in runs)


async def test_a_job_left_on_a_stopped_build_is_moved_by_an_override(
    client: Client, tmp_path: Path, key_path: Path
) -> None:
    """The way out when an old build's workers were stopped before it drained (docs/deploys.md): its jobs wait
    for them; ``temporal workflow update-options --versioning-override-behavior auto_upgrade`` moves them to the
    current build, whose code replays their history (patched changes only, as the replay tests check)."""
    deployment = f"ve-{uuid.uuid4().hex[:8]}"
    config = versioned_config(tmp_path, deployment)
    ledger = provider_ledger(config, key_path)
    adapter = MemoryAdapter()
    async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "new"):
        async with build_workers(client, config, key_path, ledger, adapter, HPCJobWorkflow, "old"):
            await set_current_version(client, deployment, "old")
            job = await start_job(client, config, ledger, report_interval=3600)
            adapter.scripts[job] = Script([(0, Q), (0.3, R), (6.0, C)], exit_code=0)
            await wait_for_state(ledger, job, R)
            await set_current_version(client, deployment, "new")
        # The old build is gone with the job still on it: the job waits (it ends on the scheduler meanwhile).
        await asyncio.sleep(8)
        assert ledger.job(job).state == R  # type: ignore[union-attr]

        query = f"TemporalWorkerDeploymentVersion='{deployment}:old' AND ExecutionStatus='Running'"
        await temporal_cli(
            client,
            "workflow",
            "update-options",
            "--query",
            query,
            "--versioning-override-behavior",
            "auto_upgrade",
            "--yes",
        )
        result = await wait_result(client, job, timeout=60)
    assert result.state == C
    (run,) = await runs_of(client, job)
    assert builds_of(run) == {"old", "new"} and failed_tasks(run) == []
    check_usage(ledger, job)


def test_workers_are_versioned_and_pinned_by_default() -> None:
    config = load_config(data={"provider": {"address": "virtengine1provider0test"}}, env={})
    assert config.temporal.deployment_name == "virtengine-hpc"
    assert config.temporal.build_id == default_build_id()
    assert default_build_id().startswith(package_version() + "+wf.")
    assert config.temporal.promote_first_build
    deployment = deployment_config(config.temporal)
    assert deployment is not None and deployment.use_worker_versioning
    assert deployment.version.deployment_name == "virtengine-hpc"
    assert deployment.version.build_id == default_build_id()
    assert deployment.default_versioning_behavior == VersioningBehavior.PINNED
    unversioned = load_config(data={"temporal": {"deployment_name": None}}, env={})
    assert deployment_config(unversioned.temporal) is None
