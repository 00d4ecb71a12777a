"""Typed configuration: the seed's ``hpc:`` and ``routing:`` sections plus ``temporal:``, ``chain:`` and ``provider:``.

One YAML file, overridden by environment variables ``VIRTENGINE_HPC__SECTION__KEY`` (``__`` nests; a scalar
value is converted by the key's type, mappings and lists are YAML), validated into frozen pydantic models.
Durations are written ``500ms``, ``15s``, ``5m``, ``24h``, ``1h30m`` or as plain seconds. Errors name the bad key
and say why; the reference of every key is ``docs/configuration.md``, generated from these models by
``scripts/gen-config-doc.py``.

Credentials never come from the file (invariant 8 in docs/architecture.md): they are read only from ``SLURM_JWT_TOKEN``,
``MOAB_USERNAME``, ``MOAB_PASSWORD``, ``OOD_OIDC_CLIENT_SECRET``, ``PROVIDER_SIGNING_KEY_PATH`` and
``PROVIDER_MARKER_SECRET``, and a
configuration (file or override) that holds a credential-like key at any depth is refused. Only worker-side
code reads configuration; workflows get what they need in their input.

Each section is a module of this package (``job_service``, ``slurm``, ``moab``, ``ood``, ``local``, ``tenants``,
``cluster`` for ``hpc`` itself, ``routing``, ``temporal``, ``observability``, ``chain``, ``nodes``), ``root`` is the
whole file, ``loader`` reads it, ``secrets`` holds the credentials and ``build_id`` the default build id. Every
public name is imported from here: ``from virtengine_hpc.config import Config, load_config``.
"""

from __future__ import annotations

from virtengine_hpc.config.base import MAX_DURATION_SECONDS, Duration, Section, parse_duration
from virtengine_hpc.config.build_id import default_build_id, package_version
from virtengine_hpc.config.chain import ChainConfig, ProviderConfig
from virtengine_hpc.config.cluster import ClusterConfig, HPCConfig, SchedulerType
from virtengine_hpc.config.job_service import (
    AuditConfig,
    JobServiceConfig,
    RetryConfig,
    UsageReportingConfig,
)
from virtengine_hpc.config.loader import (
    ENV_PREFIX,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_VALUES,
    MAX_ERRORS_SHOWN,
    check_config_size,
    load_config,
)
from virtengine_hpc.config.local import LocalSchedulerConfig
from virtengine_hpc.config.moab import MoabConfig
from virtengine_hpc.config.nodes import NodesConfig
from virtengine_hpc.config.observability import LoggingConfig, MetricsConfig, TracingConfig
from virtengine_hpc.config.ood import OODConfig
from virtengine_hpc.config.root import Config
from virtengine_hpc.config.routing import RoutingConfig
from virtengine_hpc.config.secrets import SECRET_ENV_VARS, Secrets
from virtengine_hpc.config.slurm import SlurmConfig
from virtengine_hpc.config.temporal import TemporalConfig
from virtengine_hpc.config.tenants import ADDRESS_PATTERN, SERVICE_ACCOUNTS, TenantsConfig
from virtengine_hpc.errors import ConfigError

__all__ = [
    "ADDRESS_PATTERN",
    "ENV_PREFIX",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "MAX_DURATION_SECONDS",
    "MAX_ERRORS_SHOWN",
    "SECRET_ENV_VARS",
    "SERVICE_ACCOUNTS",
    "AuditConfig",
    "ChainConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "Duration",
    "HPCConfig",
    "JobServiceConfig",
    "LocalSchedulerConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MoabConfig",
    "NodesConfig",
    "OODConfig",
    "ProviderConfig",
    "RetryConfig",
    "RoutingConfig",
    "SchedulerType",
    "Secrets",
    "Section",
    "SlurmConfig",
    "TemporalConfig",
    "TenantsConfig",
    "TracingConfig",
    "UsageReportingConfig",
    "check_config_size",
    "default_build_id",
    "load_config",
    "package_version",
    "parse_duration",
]
