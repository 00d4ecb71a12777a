"""Metrics and probes (``metrics``), logging (``logging``) and tracing (``tracing``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from pydantic import Field

from virtengine_hpc.config.base import Duration, Section


class MetricsConfig(Section):
    """The worker's HTTP endpoint: Prometheus ``/metrics`` and the ``/healthz`` and ``/readyz`` probes."""

    listen: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:\[\]-]{1,253}:[0-9]{1,5}$",
        description="host:port of the endpoint (e.g. 127.0.0.1:9464); unset: no endpoint. Each process "
        "(worker, poller) needs its own port.",
    )
    sdk_metrics: bool = Field(
        True, description="Include the Temporal SDK's own metrics (temporal_*: polls, task latencies, slots)."
    )
    jobs_refresh_interval: Duration = Field(
        timedelta(seconds=30),
        description="How often the jobs-by-state gauge is read from Temporal's visibility store; 0s: never.",
    )
    readiness_timeout: Duration = Field(
        timedelta(seconds=5), description="Longest wait for Temporal's health check behind /readyz."
    )


class LoggingConfig(Section):
    """How the long-running processes log (docs/production.md)."""

    format: Literal["text", "json"] = Field(
        "text",
        description="text (one readable line) or json (one object per line with job_id, workflow_id, "
        "activity, cluster_id for log collectors).",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None = Field(
        None, description="Log level; unset: the command line's --log-level (INFO)."
    )


class TracingConfig(Section):
    """OpenTelemetry tracing of workflows and activities through the Temporal SDK's interceptor (optional)."""

    enabled: bool = Field(
        False, description="Trace workflow starts, workflows and activities (needs the tracing extra)."
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces); unset: the process's "
        "global tracer provider (e.g. from opentelemetry-instrument).",
    )
    service_name: str = Field(
        "virtengine-hpc", pattern=r"^[A-Za-z0-9._-]{1,100}$", description="service.name of the spans."
    )
