"""Bounded payloads: whatever a tenant sends, what travels through Temporal stays small, and a job that cannot be
accepted is refused on its own while every other job goes on.

Real Temporal dev server, the real chain poller loop, LocalLedger and the local executor running real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from activities.chain.local_ledger import MAX_RAW_SPEC_BYTES
from activities.schedulers.local import LocalAdapter
from tests.conftest import make_config
from tests.pipeline_harness import TENANT, Pipeline, running_pipeline
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import PAYLOAD_BUDGET
from virtengine_hpc.models import MAX_ENV_ENTRIES, MAX_ENV_VALUE, MAX_SCRIPT_BYTES, MAX_TEMPLATE_PARAMETERS
from virtengine_hpc.states import JobState

# A script that runs and succeeds, then a comment line that carries the bulk (bash never executes it).
SCRIPT_HEAD = "#!/bin/bash\necho payload-ok\nexit 0\n# "


@pytest.fixture
async def pipe(client: Client, tmp_path: Path, key_path: Path, task_queue: str) -> AsyncIterator[Pipeline]:
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "local": {"max_walltime": "60s", "kill_wait": "1s", "job_poll_interval": "200ms"},
        },
    )
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


@contextlib.asynccontextmanager
async def poller_loop(pipe: Pipeline) -> AsyncIterator[None]:
    """The poller's own loop (``ChainPoller.run``), as ``virtengine-hpc poller`` runs it."""
    stop = asyncio.Event()
    task = asyncio.create_task(pipe.poller.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def wait_final(pipe: Pipeline, job_ids: list[str], timeout: float = 120) -> dict[str, JobState]:
    deadline = time.monotonic() + timeout
    states: dict[str, JobState] = {}
    while time.monotonic() < deadline:
        states = {j: pipe.ledger.job(j).state for j in job_ids}  # type: ignore[union-attr]
        if all(s.final for s in states.values()):
            return states
        await asyncio.sleep(0.3)
    raise AssertionError(f"jobs not final in {timeout}s: {states}")


def control_script_at_ledger_limit(pipe: Pipeline, head: str = SCRIPT_HEAD) -> str:
    """The largest script of control characters the ledger stores: JSON writes each as ``\\u0001`` (6 bytes)."""
    probe = {
        "job_id": "JOB-" + "x" * 10,
        "tenant": TENANT,
        "provider": pipe.config.provider.address,
        "offering_id": "offering-standard",
        "script": head,
        "walltime_seconds": 600,
        "max_price": "100",
    }
    base = len(json.dumps(probe, ensure_ascii=False).encode())
    count = (MAX_RAW_SPEC_BYTES - base) // 6
    assert count < MAX_SCRIPT_BYTES, "the ledger's limit is what binds for control characters"
    return head + "\x01" * count


async def test_payload_bomb_then_normal_jobs_all_finish(pipe: Pipeline) -> None:
    """A script just under the ledger's limit, made of control characters, used to make the workflow input larger
    than Temporal's 2 MiB payload limit: the poller failed every round and every later job stayed pending."""
    bomb = pipe.submit(script=control_script_at_ledger_limit(pipe))
    normal = [pipe.submit(script=f"#!/bin/bash\necho normal {n}\n") for n in range(3)]
    async with poller_loop(pipe):
        states = await wait_final(pipe, [bomb, *normal])
    assert [states[j] for j in normal] == [JobState.COMPLETED] * 3
    assert states[bomb] == JobState.COMPLETED, pipe.ledger.job(bomb).status_message  # type: ignore[union-attr]
    settlement = pipe.ledger.settlement(bomb)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow


def payloads_of(events: list[Any]) -> list[tuple[str, bytes, int]]:
    """(budget key, data, serialized size) of every payload in a workflow history, as the server holds it."""
    out: list[tuple[str, bytes, int]] = []
    scheduled: dict[int, str] = {}

    def add(what: str, payloads: Any) -> None:
        out.extend((what, p.data, p.ByteSize()) for p in payloads.payloads)

    for event in events:
        if event.HasField("workflow_execution_started_event_attributes"):
            add("workflow input", event.workflow_execution_started_event_attributes.input)
        elif event.HasField("workflow_execution_continued_as_new_event_attributes"):
            add("workflow input", event.workflow_execution_continued_as_new_event_attributes.input)
        elif event.HasField("workflow_execution_completed_event_attributes"):
            add("workflow result", event.workflow_execution_completed_event_attributes.result)
        elif event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = attrs.activity_type.name
            add(attrs.activity_type.name, attrs.input)
        elif event.HasField("activity_task_completed_event_attributes"):
            attrs = event.activity_task_completed_event_attributes
            add(scheduled[attrs.scheduled_event_id], attrs.result)
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            attrs = event.workflow_execution_signaled_event_attributes
            add(attrs.signal_name, attrs.input)
        elif event.HasField("marker_recorded_event_attributes"):
            # A local activity leaves its result in its marker (its input never reaches the server).
            details = event.marker_recorded_event_attributes.details
            if (
                event.marker_recorded_event_attributes.marker_name == "core_local_activity"
                and "result" in details
            ):
                data = json.loads(details["data"].payloads[0].data)
                add(data["activity_type"], details["result"])
    return out


async def test_every_payload_stays_within_its_budget_at_the_limits(pipe: Pipeline) -> None:
    """The largest script the provider accepts, the largest the ledger stores in control characters, and a
    template job with the most environment and parameters the model allows: each runs end to end on the local
    executor, and every payload of its history (workflow input and result, each activity's input and result)
    stays within the stated budget and holds nothing of the tenant's program or environment."""
    marker = f"MARK{uuid.uuid4().hex}"
    head = f"#!/bin/bash\necho {marker}\nexit 0\n# "
    env = {f"VAR_{n:02d}": "\x01" * (MAX_ENV_VALUE - len(marker)) + marker for n in range(MAX_ENV_ENTRIES)}
    names = " ".join(sorted(env))
    jobs = {
        "largest script": pipe.submit(script=head + "x" * (MAX_SCRIPT_BYTES - len(head.encode()))),
        "control characters": pipe.submit(script=control_script_at_ledger_limit(pipe, head)),
        "environment and parameters": pipe.submit(
            template_id="batch-standard",
            template_parameters={"command": "printenv", "args": names},
            environment=env,
        ),
        # Runs past two report intervals: it sends period records.
        "small": pipe.submit(script=f"#!/bin/bash\necho {marker}\nsleep 5\n"),
    }
    async with poller_loop(pipe):
        states = await wait_final(pipe, list(jobs.values()))
    assert set(states.values()) == {JobState.COMPLETED}, {
        label: pipe.ledger.job(j).status_message  # type: ignore[union-attr]
        for label, j in jobs.items()
    }
    adapter = pipe.adapter
    assert isinstance(adapter, LocalAdapter)
    for label, job_id in jobs.items():
        out = (adapter.job_dir(pipe.ledger.job(job_id).scheduler_job_id) / "stdout").read_text()  # type: ignore[arg-type, union-attr]
        expected = [env[name] for name in sorted(env)] if label == "environment and parameters" else [marker]
        assert out.splitlines() == expected, label

    largest: dict[str, int] = {}
    for label, job_id in jobs.items():
        events = [e async for e in pipe.client.get_workflow_handle(job_id).fetch_history_events()]
        for what, data, size in payloads_of(events):
            assert size <= PAYLOAD_BUDGET[what], f"{label}: {what} payload of {size} bytes"
            assert marker.encode() not in data and b"\\u0001" not in data, f"{label}: {what} carries the job"
            largest[what] = max(largest.get(what, 0), size)
    assert set(largest) >= {
        "workflow input",
        "route_job",
        "submit_job",
        "report_transition",
        "report_usage",
        "observe",  # the cluster monitor's news (a job started with hpc.job_service.cluster_monitor off
        # carries a watch_job instead, whose bound is checked below)
    }
    assert len(pipe.ledger.usage_records(jobs["small"])) >= 3, "period records and the final one"
    print("\nlargest payloads (bytes):", json.dumps(largest, indent=1))


def assert_refused_on_its_own(pipe: Pipeline, job_id: str, reason: str) -> None:
    """Failed on chain with the reason, audited, escrow back with the tenant, nothing started for it."""
    job = pipe.ledger.job(job_id)
    assert job is not None and job.state == JobState.FAILED, job
    assert job.status_message.startswith("invalid job: ") and reason in job.status_message, job.status_message
    audited = pipe.audit_events("job_validation_failed", job_id)
    assert len(audited) == 1 and reason in audited[0]["error_msg"]
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged == 0 and settlement.refunded == Decimal("100")
    assert not pipe.ledger.usage_records(job_id)


async def test_a_job_that_cannot_be_accepted_is_refused_on_its_own(pipe: Pipeline) -> None:
    before = pipe.ledger.balance(TENANT)
    refused = {
        pipe.submit(script="x" * (MAX_SCRIPT_BYTES + 1)): f"script is larger than {MAX_SCRIPT_BYTES} bytes",
        pipe.submit(environment={f"V{n}": "1" for n in range(MAX_ENV_ENTRIES + 1)}): (
            f"{MAX_ENV_ENTRIES + 1} environment variables; at most {MAX_ENV_ENTRIES} are allowed"
        ),
        pipe.submit(
            template_id="batch-standard",
            template_parameters={f"p{n}": n for n in range(MAX_TEMPLATE_PARAMETERS + 1)},
        ): f"at most {MAX_TEMPLATE_PARAMETERS} are allowed",
        pipe.submit(resources="all of them"): "resources: Input should be a valid dictionary",
    }
    normal = [pipe.submit(script=f"#!/bin/bash\necho normal {n}\n") for n in range(2)]
    async with poller_loop(pipe):
        states = await wait_final(pipe, [*refused, *normal])
    assert [states[j] for j in normal] == [JobState.COMPLETED] * 2
    for job_id, reason in refused.items():
        assert_refused_on_its_own(pipe, job_id, reason)
    charged = sum(pipe.ledger.settlement(j).charged for j in normal)  # type: ignore[union-attr]
    assert pipe.ledger.balance(TENANT) == before - charged, "every refused job's escrow is back"


@pytest.fixture
async def small_blob_client() -> AsyncIterator[Client]:
    """A dev server of its own whose payload limit is lower than a job's workflow input with the longest ids
    and higher than a usual one's: Temporal itself refuses that one job's start."""
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from tests.conftest import binary
    from workflows.hpc_job import SEARCH_ATTRIBUTES

    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        dev_server_log_level="error",
        ui=False,
        dev_server_extra_args=[
            "--dynamic-config-value",
            f"limit.blobSize.error={SMALL_BLOB_LIMIT}",
            "--dynamic-config-value",
            f"limit.blobSize.warn={SMALL_BLOB_LIMIT}",
        ],
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


SMALL_BLOB_LIMIT = 1200


async def test_a_start_temporal_refuses_for_its_size_fails_that_job_only(
    small_blob_client: Client, tmp_path: Path, key_path: Path, task_queue: str
) -> None:
    """An RPC error about one job's payload used to end the poll round (and every later one): now that job is
    refused with Temporal's reason and the jobs after it start and complete."""
    config = make_config(tmp_path, hpc={"cluster_id": f"c-{uuid.uuid4().hex[:8]}"})
    adapter = LocalAdapter.from_config(config, Secrets(), config.hpc.cluster_id)
    async with running_pipeline(small_blob_client, config, key_path, adapter, task_queue) as pipe:
        longest = pipe.submit(
            job_id="JOB-" + uuid.uuid4().hex + "x" * 92,
            name="n" * 64,
            job_class="c" * 64,
            partition="p" * 64,
            resources={"gpu_type": "g" * 64},
        )
        normal = [pipe.submit() for _ in range(2)]
        async with poller_loop(pipe):
            states = await wait_final(pipe, [longest, *normal])
        assert [states[j] for j in normal] == [JobState.COMPLETED] * 2
        assert_refused_on_its_own(
            pipe, longest, "Temporal refused its workflow input: Blob data size exceeds limit"
        )


def test_a_reference_at_its_largest_fits_every_budget() -> None:
    """Every field of a job reference at its longest: the messages that carry it stay within their budgets."""
    from datetime import UTC, datetime

    from temporalio.contrib.pydantic import pydantic_data_converter

    from virtengine_hpc.messages import (
        CancelInput,
        FindInput,
        JobRef,
        JobSettings,
        JobWorkflowInput,
        MonitorSettings,
        ParkInput,
        RecoverOutput,
        RouteRequest,
        SubmitInput,
        SubmitReport,
        TransitionInput,
        UsageInput,
        WatchEntry,
        WatchInput,
        WatchRegistration,
    )
    from virtengine_hpc.models import Resources, UsageMetrics

    def size(value: Any) -> int:
        return pydantic_data_converter.payload_converter.to_payloads([value])[0].ByteSize()

    ref = JobRef(
        job_id="J" * 128,
        tenant="t" * 128,
        provider="p" * 128,
        offering_id="o" * 128,
        cluster_id="c" * 128,
        name="n" * 64,
        partition="q" * 64,
        job_class="k" * 64,
        resources=Resources(
            nodes=10_000,
            tasks_per_node=1024,
            cpus_per_task=1024,
            memory_mb_per_node=64 * 1024 * 1024,
            gpus_per_node=64,
            gpu_type="g" * 64,
            storage_gb=10_000_000,
        ),
        walltime_seconds=90 * 86400,
        template_id="T" * 128,
        spec_sha256="f" * 64,
    )
    now = datetime.now(UTC)
    usage = UsageInput(
        job_id=ref.job_id,
        tenant=ref.tenant,
        provider=ref.provider,
        cluster_id="c" * 128,
        scheduler_job_id="9" * 64,
        sequence=10**9,
        period_start=now,
        previous_cumulative=UsageMetrics(
            wall_clock_seconds=Decimal("1e12"),
            cpu_core_seconds=Decimal("1e15"),
            energy_joules=Decimal("1e15"),
        ),
        job_state=JobState.RUNNING,
    )
    # What a submission and a final record report along: the longest message, the monitor's longest queue.
    monitor = MonitorSettings(cluster_id="c" * 128, task_queue="q" * 256, poll_interval_seconds=15.0)
    terminal = TransitionInput(
        job_id=ref.job_id,
        cluster_id="c" * 128,
        old_state=JobState.RUNNING,
        new_state=JobState.FAILED,
        message="m" * 1024,
        exit_code=255,
        scheduler_job_id="9" * 64,
        tenant=ref.tenant,
        watch=WatchRegistration(
            workflow_id=ref.job_id,
            monitor=monitor,
            entry=WatchEntry(scheduler_job_id="9" * 64, state=JobState.FAILED, start_time=now),
        ),
    )
    queued = SubmitReport(old_state=JobState.PENDING, message="m" * 1024, tenant=ref.tenant, monitor=monitor)
    sizes = {
        "workflow input": size(
            JobWorkflowInput(job=ref, cluster_id="c" * 128, provider=ref.provider, settings=JobSettings())
        ),
        "route_job": size(RouteRequest(job=ref, cluster_id="c" * 128, workflow_id=ref.job_id)),
        "submit_job": size(
            SubmitInput(
                workflow_id=ref.job_id, job=ref, cluster_id="c" * 128, partition="q" * 64, report=queued
            )
        ),
        "report_usage": size(usage.model_copy(update={"then_report": terminal, "is_final": True})),
        "report_transition": size(terminal),
        "watch_job": size(
            WatchInput(
                job_id=ref.job_id,
                cluster_id="c" * 128,
                scheduler_job_id="9" * 64,
                last_state=JobState.RUNNING,
                return_by=now,
                poll_interval_seconds=15.0,
                missing_since=now,
                report=usage,
            )
        ),
    }
    sizes["find_job"] = size(FindInput(workflow_id=ref.job_id, job_id=ref.job_id, cluster_id="c" * 128))
    sizes["cancel_job"] = size(
        CancelInput(job_id=ref.job_id, cluster_id="c" * 128, scheduler_job_id="9" * 64, reason="r" * 512)
    )
    sizes["recover_job"] = size(
        RecoverOutput(
            scheduler_job_id="9" * 64,
            next_sequence=10**9,
            cumulative=usage.previous_cumulative,
            last_period_end=now,
            first_period_start=now,
        )
    )
    sizes["park_job"] = size(
        ParkInput(
            job_id=ref.job_id,
            cluster_id="c" * 128,
            state=JobState.RUNNING,
            reason="r" * 1000,
            scheduler_job_id="9" * 64,
        )
    )
    for what, measured in sizes.items():
        assert measured <= PAYLOAD_BUDGET[what], (what, measured)
    print("\nlargest possible inputs (bytes):", json.dumps(sizes, indent=1))


def test_payloads_recorded_before_references_still_load() -> None:
    """Histories and in-flight activity tasks of v0.2.0 carry the whole spec (and the rendered body): they load
    as references, the tenant's fields dropped, so those workflows replay and their activities run."""
    from virtengine_hpc.messages import JobWorkflowInput, RouteOutcome, SubmitInput, UsageInput

    spec = {
        "job_id": "JOB-1",
        "tenant": TENANT,
        "provider": "virtengine1provider0test",
        "offering_id": "offering-standard",
        "script": "#!/bin/bash\necho hi\n",
        "environment": {"A": "1"},
        "template_parameters": {},
        "working_directory": None,
        "max_price": "100",
        "resources": {"nodes": 1, "storage_gb": 7},
    }
    inp = JobWorkflowInput.model_validate({"job": spec, "cluster_id": "c", "provider": spec["provider"]})
    assert inp.job.job_id == "JOB-1" and inp.job.spec_sha256 is None
    assert "script" not in inp.model_dump_json() and "environment" not in inp.model_dump_json()
    submit = SubmitInput.model_validate(
        {"workflow_id": "JOB-1", "job": spec, "cluster_id": "c", "body": "echo hi\n", "exclusive": False}
    )
    assert submit.job.job_id == "JOB-1"
    outcome = RouteOutcome.model_validate({"accepted": True, "body": "echo hi\n", "exclusive": True})
    assert outcome.accepted
    usage = UsageInput.model_validate(
        {
            "job": spec,
            "cluster_id": "c",
            "scheduler_job_id": "1",
            "sequence": 1,
            "period_start": "2026-11-30T00:00:00Z",
            "previous_cumulative": {},
            "job_state": "running",
        }
    )
    assert (usage.job_id, usage.tenant, usage.provider, usage.storage_gb) == (
        "JOB-1",
        TENANT,
        spec["provider"],
        7,
    )
    with pytest.raises(ValueError, match="scrpit"):
        JobWorkflowInput.model_validate({"job": {**spec, "scrpit": "x"}, "cluster_id": "c", "provider": "p"})


async def test_a_spec_changed_on_chain_after_acceptance_is_never_submitted(pipe: Pipeline) -> None:
    """The activities read the spec back from the chain: one that differs from the spec the poller accepted (its
    digest) is refused by routing and by submission, audited, and nothing reaches the scheduler."""
    from temporalio.exceptions import ApplicationError
    from temporalio.testing import ActivityEnvironment

    from virtengine_hpc.messages import JobRef, RouteRequest, SubmitInput
    from virtengine_hpc.models import JobSpec, spec_digest

    job_id = pipe.submit(script="#!/bin/bash\necho accepted\n")
    accepted = pipe.ledger.job(job_id).raw_spec  # type: ignore[union-attr]
    ref = JobRef.of(JobSpec.model_validate(accepted), spec_digest(accepted))
    changed = {**accepted, "script": "#!/bin/bash\necho swapped\n"}
    with sqlite3.connect(pipe.config.ledger_path) as db:
        db.execute("UPDATE jobs SET raw_spec = ? WHERE job_id = ?", (json.dumps(changed), job_id))

    env = ActivityEnvironment()
    outcome = await env.run(
        pipe.deps.activities.route_job, RouteRequest(job=ref, cluster_id=pipe.cluster_id, workflow_id=job_id)
    )
    assert not outcome.accepted and outcome.code == "validation_failed"
    assert "not the one accepted for it" in outcome.message
    with pytest.raises(ApplicationError) as refused:
        await env.run(
            pipe.deps.activities.submit_job,
            SubmitInput(workflow_id=job_id, job=ref, cluster_id=pipe.cluster_id),
        )
    assert refused.value.non_retryable and refused.value.type == "SubmissionUnprepared"
    assert len(pipe.audit_events("job_validation_failed", job_id)) == 2
    adapter = pipe.adapter
    assert isinstance(adapter, LocalAdapter)
    assert await adapter.find(job_id) is None, "nothing was submitted"


async def test_a_workflow_started_with_the_whole_spec_runs_on(pipe: Pipeline) -> None:
    """A workflow started by v0.2.0 (its input holds the whole spec) goes on after the upgrade: its activities
    read the program from the chain and the job completes."""
    from virtengine_hpc.messages import JobResult
    from workers.wiring import job_settings

    marker = f"MARK{uuid.uuid4().hex}"
    job_id = pipe.submit(script=f"#!/bin/bash\necho {marker}\n")
    full = {**pipe.ledger.job(job_id).raw_spec, "environment": {}, "template_parameters": {}}  # type: ignore[union-attr]
    old_input = {
        "job": full,
        "cluster_id": pipe.cluster_id,
        "provider": full["provider"],
        "settings": job_settings(pipe.config).model_dump(mode="json"),
    }
    handle = await pipe.client.start_workflow(
        "HPCJobWorkflow", old_input, id=job_id, task_queue=pipe.task_queue, result_type=JobResult
    )
    result = await handle.result()
    assert result.state == JobState.COMPLETED
    adapter = pipe.adapter
    assert isinstance(adapter, LocalAdapter)
    assert (adapter.job_dir(result.scheduler_job_id) / "stdout").read_text() == f"{marker}\n"  # type: ignore[arg-type]


def test_the_documented_budget_is_the_one_enforced() -> None:
    """docs/architecture.md states the budget of every payload; it is the one the poller and these tests use."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    stated = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[2].isdigit():
            stated[cells[0].strip("`")] = int(cells[2])
    assert stated == PAYLOAD_BUDGET
