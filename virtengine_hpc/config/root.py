"""The whole configuration file: its sections and the checks that span several of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from virtengine_hpc.config.base import Section
from virtengine_hpc.config.chain import ChainConfig, ProviderConfig
from virtengine_hpc.config.cluster import HPCConfig
from virtengine_hpc.config.nodes import NodesConfig
from virtengine_hpc.config.observability import LoggingConfig, MetricsConfig, TracingConfig
from virtengine_hpc.config.routing import RoutingConfig
from virtengine_hpc.config.slurm import SlurmConfig
from virtengine_hpc.config.temporal import TemporalConfig
from virtengine_hpc.errors import ConfigError


class Config(Section):
    """The whole configuration file."""

    hpc: HPCConfig = Field(default_factory=HPCConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    temporal: TemporalConfig = Field(default_factory=TemporalConfig)
    chain: ChainConfig = Field(default_factory=ChainConfig)
    provider: ProviderConfig = Field(default_factory=ProviderConfig)
    nodes: NodesConfig = Field(default_factory=NodesConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)

    @model_validator(mode="after")
    def _jwt_needs_rest(self) -> Config:
        for where, slurm in self._sections("slurm"):
            assert isinstance(slurm, SlurmConfig)
            if slurm.auth_method == "jwt" and slurm.transport not in (None, "rest"):
                raise ValueError(f"{where}.auth_method jwt works only with transport rest (slurmrestd)")
        return self

    @model_validator(mode="after")
    def _submit_accounts_are_not_tenants(self) -> Config:
        """The provider's own accounts (SSH login, slurmrestd user, MWS job user) never run a tenant's job."""
        tenants = set(self.hpc.tenants.pool) | set(self.hpc.tenants.accounts.values())
        for name in ("slurm", "moab"):
            for where, section in self._sections(name):
                for key in ("ssh_user", "rest_user", "mws_job_user"):
                    user = getattr(section, key, None)
                    if user is not None and user in tenants:
                        raise ValueError(
                            f"{where}.{key} {user} is also a tenant account in hpc.tenants: the provider's own "
                            "account must never run a tenant's job"
                        )
        return self

    def _sections(self, name: str) -> list[tuple[str, Section]]:
        found: list[tuple[str, Section]] = [(f"hpc.{name}", getattr(self.hpc, name))]
        for i, cluster in enumerate(self.hpc.clusters):
            own = getattr(cluster, name)
            if own is not None:
                found.append((f"hpc.clusters[{i}].{name}", own))
        return found

    # ---- several clusters -------------------------------------------------------------------------------------

    def cluster_ids(self) -> list[str]:
        """Every cluster of the provider this config knows (each has a task queue), served here or elsewhere."""
        return [c.cluster_id for c in self.hpc.clusters] or [self.hpc.cluster_id]

    def served_cluster_ids(self) -> list[str]:
        """The clusters whose task queues this worker runs."""
        if not self.hpc.clusters:
            return [self.hpc.cluster_id]
        return [c.cluster_id for c in self.hpc.clusters if c.serve]

    def for_cluster(self, cluster_id: str) -> Config:
        """This config as a single-cluster one for ``cluster_id``: ``hpc.cluster_id``, ``hpc.scheduler_type`` and
        the scheduler sections are that cluster's, so adapters and pollers read ``hpc.*`` unchanged.

        A single-cluster config answers for any id with its own sections (one worker may serve an extra cluster
        id with the same scheduler); a multi-cluster config refuses an id it does not list.
        """
        hpc = self.hpc
        if not hpc.clusters:
            if cluster_id == hpc.cluster_id:
                return self
            return self.model_copy(update={"hpc": hpc.model_copy(update={"cluster_id": cluster_id})})
        entry = next((c for c in hpc.clusters if c.cluster_id == cluster_id), None)
        if entry is None:
            raise ConfigError(
                f"cluster {cluster_id} is not in hpc.clusters ({', '.join(self.cluster_ids())})"
            )
        local = entry.local or hpc.local
        if local.state_dir is None:
            # Two local executors on one host must not share a job directory.
            local = local.model_copy(update={"state_dir": self.state_dir / "local-jobs" / cluster_id})
        update: dict[str, Any] = {
            "cluster_id": cluster_id,
            "scheduler_type": entry.scheduler_type or hpc.scheduler_type,
            "slurm": entry.slurm or hpc.slurm,
            "moab": entry.moab or hpc.moab,
            "ood": entry.ood or hpc.ood,
            "local": local,
        }
        return self.model_copy(update={"hpc": hpc.model_copy(update=update)})

    @property
    def state_dir(self) -> Path:
        return self.hpc.job_service.state_store_path

    @property
    def ledger_path(self) -> Path:
        return self.chain.ledger_path or self.state_dir / "ledger.db"

    @property
    def local_state_dir(self) -> Path:
        return self.hpc.local.state_dir or self.state_dir / "local-jobs"
