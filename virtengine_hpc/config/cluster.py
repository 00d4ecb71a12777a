"""The ``hpc`` section: the cluster (or clusters) this worker serves, with which scheduler and settings."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field, model_validator

from virtengine_hpc.config.base import Section
from virtengine_hpc.config.job_service import (
    AuditConfig,
    JobServiceConfig,
    RetryConfig,
    UsageReportingConfig,
)
from virtengine_hpc.config.local import LocalSchedulerConfig
from virtengine_hpc.config.moab import MoabConfig
from virtengine_hpc.config.ood import OODConfig
from virtengine_hpc.config.slurm import SlurmConfig
from virtengine_hpc.config.tenants import TenantsConfig

SchedulerType = Literal["slurm", "moab", "ood", "local"]
_CLUSTER_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class ClusterConfig(Section):
    """One of the provider's clusters in ``hpc.clusters``: its id, scheduler and whether this worker serves it.

    What an entry leaves out comes from the ``hpc`` section: ``scheduler_type``, and every key of ``slurm``,
    ``moab``, ``ood`` and ``local`` (an entry's section is merged key by key over the ``hpc`` one), so clusters
    that share most settings repeat only what differs. See docs/production.md.
    """

    cluster_id: str = Field(pattern=_CLUSTER_ID, description="The cluster's id on chain.")
    scheduler_type: SchedulerType | None = Field(
        None, description="Scheduler adapter of this cluster; default: hpc.scheduler_type."
    )
    serve: bool = Field(
        True,
        description="Run this cluster's task queue (<temporal.task_queue>.<cluster_id>) in this worker. false: "
        "workers on another host serve it; this one only routes jobs to it.",
    )
    slurm: SlurmConfig | None = Field(
        None, description="SLURM settings of this cluster, merged key by key over hpc.slurm."
    )
    moab: MoabConfig | None = Field(
        None, description="MOAB settings of this cluster, merged key by key over hpc.moab."
    )
    ood: OODConfig | None = Field(
        None, description="Open OnDemand settings of this cluster, merged key by key over hpc.ood."
    )
    local: LocalSchedulerConfig | None = Field(
        None,
        description="Local executor settings of this cluster, merged key by key over hpc.local; its state_dir "
        "defaults to <state_store_path>/local-jobs/<cluster_id>.",
    )


class HPCConfig(Section):
    """The seed's ``hpc:`` section: which cluster this worker serves and with which scheduler."""

    enabled: bool = Field(
        True,
        description="false: the poller takes no new jobs from the chain (they stay pending for another provider "
        "host or until it is switched back on); running jobs go on and tenant cancellations are still forwarded.",
    )
    scheduler_type: SchedulerType = Field(
        "local",
        description="Which scheduler adapter runs this cluster's jobs: slurm, moab, ood or local (the embedded "
        "executor, for demos and single-tenant hosts: it runs only with hpc.local.allow_unisolated).",
    )
    cluster_id: str = Field(
        "local-cluster",
        pattern=_CLUSTER_ID,
        description="This cluster's id on chain; the worker serves it and takes only its jobs. With hpc.clusters: "
        "the default cluster of commands that take --cluster (default: the first listed).",
    )
    job_service: JobServiceConfig = Field(default_factory=JobServiceConfig)
    usage_reporting: UsageReportingConfig = Field(default_factory=UsageReportingConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    moab: MoabConfig = Field(default_factory=MoabConfig)
    ood: OODConfig = Field(default_factory=OODConfig)
    local: LocalSchedulerConfig = Field(default_factory=LocalSchedulerConfig)
    tenants: TenantsConfig = Field(default_factory=TenantsConfig)
    clusters: list[ClusterConfig] = Field(
        default_factory=list,
        description="Several clusters per provider: one task queue per cluster, each with its own scheduler "
        "settings. Empty: the one cluster above (hpc.cluster_id with hpc.scheduler_type).",
    )

    @model_validator(mode="before")
    @classmethod
    def _clusters_inherit_the_hpc_sections(cls, data: Any) -> Any:
        """Merge each entry's scheduler sections over the ``hpc`` ones; the default cluster is the first."""
        if not isinstance(data, Mapping) or not isinstance(data.get("clusters"), list):
            return data
        clusters = []
        for entry in data["clusters"]:
            if isinstance(entry, Mapping):
                entry = dict(entry)
                for section in ("slurm", "moab", "ood", "local"):
                    base, own = data.get(section), entry.get(section)
                    if isinstance(base, Mapping) and isinstance(own, Mapping):
                        entry[section] = {**base, **own}
            clusters.append(entry)
        data = {**data, "clusters": clusters}
        if "cluster_id" not in data and clusters and isinstance(clusters[0], Mapping):
            first = clusters[0].get("cluster_id")
            if isinstance(first, str):
                data["cluster_id"] = first
        return data

    @model_validator(mode="after")
    def _clusters_are_unique(self) -> HPCConfig:
        ids = [c.cluster_id for c in self.clusters]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"hpc.clusters lists {', '.join(duplicates)} more than once")
        if ids and self.cluster_id not in ids:
            raise ValueError(
                f"hpc.cluster_id {self.cluster_id} is not one of hpc.clusters ({', '.join(ids)})"
            )
        return self

    @property
    def scheduler_poll_interval(self) -> timedelta:
        """The poll interval of the configured scheduler's section."""
        section = getattr(self, self.scheduler_type)
        interval: timedelta = section.job_poll_interval
        return interval
