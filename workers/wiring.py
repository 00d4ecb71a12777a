"""Builds the real dependencies of a worker from its config: Temporal client, chain, adapters, signer, audit.

The only place that turns configuration into live objects; activities receive them ready-made (STYLE.md item 4).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import TLSConfig

from activities.audit import AuditLog
from activities.chain.client import ChainClient
from activities.jobs import BodyResolver, JobActivities, script_only_body
from activities.routing import CapacityProbe, RoutingEnforcer
from activities.schedulers.base import SchedulerAdapter, registered
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.errors import ConfigError, SecurityError
from virtengine_hpc.messages import JobSettings, RetrySettings
from virtengine_hpc.signing import Signer

# Modules that register adapters with @register(name) when imported. Optional ones may be absent.
ADAPTER_MODULES = {
    "local": "activities.schedulers.local",
    "slurm": "activities.schedulers.slurm",
    "moab": "activities.schedulers.moab",
    "ood": "activities.schedulers.ood",
}


def task_queue(config: Config, cluster_id: str | None = None) -> str:
    """One task queue per cluster, so a cluster's activities run on workers that can reach its scheduler."""
    return f"{config.temporal.task_queue}.{cluster_id or config.hpc.cluster_id}"


def job_settings(config: Config) -> JobSettings:
    hpc = config.hpc
    return JobSettings(
        poll_interval_seconds=hpc.scheduler_poll_interval.total_seconds(),
        report_interval_seconds=hpc.usage_reporting.report_interval.total_seconds(),
        usage_enabled=hpc.usage_reporting.enabled,
        retry_on_failure=hpc.usage_reporting.retry_on_failure,
        job_timeout_default_seconds=hpc.job_service.job_timeout_default.total_seconds(),
        vanished_grace_seconds=hpc.job_service.vanished_job_grace.total_seconds(),
        retry=RetrySettings(
            max_retries=hpc.retry.max_retries,
            initial_backoff_seconds=hpc.retry.initial_backoff.total_seconds(),
            max_backoff_seconds=hpc.retry.max_backoff.total_seconds(),
            backoff_multiplier=hpc.retry.backoff_multiplier,
        ),
    )


async def connect(config: Config, secrets: Secrets | None = None) -> Client:
    """Connect to Temporal with the pydantic converter (every client: workers, poller, CLI, tests)."""
    t = config.temporal
    tls: TLSConfig | bool = False
    if t.tls or t.tls_client_cert:
        tls = TLSConfig(
            server_root_ca_cert=Path(t.tls_server_ca_cert).read_bytes() if t.tls_server_ca_cert else None,
            client_cert=Path(t.tls_client_cert).read_bytes() if t.tls_client_cert else None,
            client_private_key=Path(t.tls_client_key).read_bytes() if t.tls_client_key else None,
        )
    api_key = os.environ.get(t.api_key_env) if t.api_key_env else None
    return await Client.connect(
        t.address, namespace=t.namespace, tls=tls, api_key=api_key, data_converter=pydantic_data_converter
    )


def open_chain(config: Config) -> ChainClient:
    from activities.chain.local_ledger import LocalLedger

    return LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)


def build_adapter(config: Config, secrets: Secrets, cluster_id: str | None = None) -> SchedulerAdapter:
    kind = config.hpc.scheduler_type
    module = ADAPTER_MODULES.get(kind)
    if module is None:
        raise ConfigError(f"hpc.scheduler_type: unknown scheduler {kind!r}")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"hpc.scheduler_type: the {kind} adapter is not available ({exc})") from None
    factory = registered().get(kind)
    if factory is None:
        raise ConfigError(f"hpc.scheduler_type: no adapter registered as {kind!r}")
    return factory.from_config(config, secrets, cluster_id or config.hpc.cluster_id)


def load_signer(secrets: Secrets) -> Signer:
    if secrets.provider_signing_key_path is None:
        raise SecurityError(
            "PROVIDER_SIGNING_KEY_PATH is not set: usage records must be signed with the provider's Ed25519 key "
            "(create one with `virtengine-hpc dev keygen PATH`)"
        )
    return Signer.from_file(secrets.provider_signing_key_path)


def body_resolver() -> BodyResolver:
    """The template renderer when templates are installed, else scripts only."""
    try:
        module = importlib.import_module("activities.templates")
    except ModuleNotFoundError:
        return script_only_body
    resolver: BodyResolver = getattr(module, "resolve_body", script_only_body)
    return resolver


@dataclass
class WorkerDeps:
    config: Config
    chain: ChainClient
    audit: AuditLog
    signer: Signer
    adapters: dict[str, SchedulerAdapter]
    activities: JobActivities
    extra_activities: list[Callable[..., Any]] = field(default_factory=list)

    async def close(self) -> None:
        for adapter in self.adapters.values():
            await adapter.close()


def build_worker_deps(
    config: Config,
    secrets: Secrets,
    *,
    chain: ChainClient | None = None,
    adapters: dict[str, SchedulerAdapter] | None = None,
    capacity_probe: CapacityProbe | None = None,
) -> WorkerDeps:
    chain = chain or open_chain(config)
    audit = AuditLog(config.hpc.audit)
    signer = load_signer(secrets)
    adapters = adapters or {config.hpc.cluster_id: build_adapter(config, secrets)}
    enforcer = RoutingEnforcer(
        chain, audit, config.routing, served_clusters=frozenset(adapters), capacity_probe=capacity_probe
    )
    activities = JobActivities(
        config=config,
        adapters=adapters,
        chain=chain,
        signer=signer,
        audit=audit,
        enforcer=enforcer,
        resolve_body=body_resolver(),
    )
    return WorkerDeps(config, chain, audit, signer, adapters, activities)
