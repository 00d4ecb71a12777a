"""Structured JSON logs with job and workflow ids, and optional OpenTelemetry tracing through the SDK.

A real workflow and activity run on the dev server while the process logs JSON: the workflow's and the
activity's lines (from the SDK's loggers and from a plain module logger inside the activity) must carry the job,
workflow and activity ids as fields. Tracing: with ``tracing.enabled`` the worker's client carries the SDK's
interceptor, and a workflow start, the workflow and its activity produce connected spans.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import Worker

from tests.conftest import make_config
from tests.production_workflows import LoggingJob, say
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.logging import JsonFormatter, setup_logging
from workers.wiring import connect, tracing_interceptors


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    wf_flag, act_flag = workflow.logger.workflow_info_on_message, activity.logger.activity_info_on_message
    stream = io.StringIO()
    setup_logging("json", "INFO", static={"role": "test"}, stream=stream)
    try:
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        workflow.logger.workflow_info_on_message = wf_flag
        activity.logger.activity_info_on_message = act_flag


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


async def test_workflow_and_activity_lines_carry_job_and_workflow_ids(
    client: Client, task_queue: str, json_logs: io.StringIO
) -> None:
    job_id = f"JOB-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=task_queue, workflows=[LoggingJob], activities=[say]):
        assert await client.execute_workflow("HPCJobWorkflow", "hi", id=job_id, task_queue=task_queue) == "hi"
    found = lines(json_logs)
    assert all({"ts", "level", "logger", "msg", "role"} <= set(line) for line in found)
    wf = [line for line in found if line["msg"] == "workflow starts"]
    assert wf and wf[0]["job_id"] == job_id and wf[0]["workflow_id"] == job_id
    assert wf[0]["workflow_type"] == "HPCJobWorkflow" and wf[0]["task_queue"] == task_queue
    act = [line for line in found if line["msg"] == "activity says hi"]
    assert act and act[0]["job_id"] == job_id and act[0]["activity"] == "say" and act[0]["attempt"] == 1
    plain = [line for line in found if line["msg"] == "a plain module logger inside the activity"]
    assert plain and plain[0]["job_id"] == job_id and plain[0]["activity"] == "say"
    assert plain[0]["level"] == "WARNING" and plain[0]["role"] == "test"


def test_a_line_outside_temporal_keeps_its_extras_and_exception() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "poll failed: %s", ("boom",), None)
    record.cluster_id = "c1"
    try:
        raise ValueError("bad")
    except ValueError:
        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "poll failed: boom" and entry["cluster_id"] == "c1"
    assert "job_id" not in entry and entry["exc"].endswith("ValueError: bad")


async def test_tracing_spans_cover_the_start_the_workflow_and_its_activity(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from temporalio.contrib.opentelemetry import TracingInterceptor

    config = make_config(
        tmp_path,
        temporal={"address": client.service_client.config.target_host},
        tracing={"enabled": True},
    )
    [interceptor] = tracing_interceptors(config)
    assert isinstance(interceptor, TracingInterceptor)
    # Spans go to the tracer the interceptor was given; point it at an in-memory exporter for the test.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptor.tracer = provider.get_tracer("test")
    traced = await connect(config, interceptors=[interceptor])
    job_id = f"JOB-{uuid.uuid4().hex[:8]}"
    async with Worker(traced, task_queue=task_queue, workflows=[LoggingJob], activities=[say]):
        await traced.execute_workflow("HPCJobWorkflow", "traced", id=job_id, task_queue=task_queue)
    names = [span.name for span in exporter.get_finished_spans()]
    assert "StartWorkflow:HPCJobWorkflow" in names
    assert "RunWorkflow:HPCJobWorkflow" in names
    assert "RunActivity:say" in names
    traces = {span.context.trace_id for span in exporter.get_finished_spans()}
    assert len(traces) == 1, "one trace from the start to the activity"


def test_tracing_without_opentelemetry_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "temporalio.contrib.opentelemetry", None)
    config = make_config(tmp_path, tracing={"enabled": True})
    with pytest.raises(ConfigError, match=r"tracing\.enabled needs OpenTelemetry .*pip install"):
        tracing_interceptors(config)
    assert tracing_interceptors(make_config(tmp_path)) == []
