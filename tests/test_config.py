"""Typed configuration: the seed's defaults, durations, errors that name the bad key, environment overrides,
credentials refused in the file and read only from the environment, the generated reference and the example.

An operator meets this module first: every message asserted here is what they read when the worker refuses to
start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import string
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.config import (
    SECRET_ENV_VARS,
    Config,
    Secrets,
    Section,
    load_config,
    parse_duration,
)
from virtengine_hpc.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy" / "config.example.yaml"
DOC = REPO / "docs" / "configuration.md"


def load(data: dict[str, Any] | None = None, **env: str) -> Config:
    return load_config(data=data or {}, env=env)


def error_of(data: dict[str, Any] | None = None, **env: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(data, **env)
    return str(info.value)


def write(tmp_path: Path, text: str | bytes, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# ---- defaults (seed 001) -------------------------------------------------------------------------------------

DEFAULTS: list[tuple[str, Any]] = [
    ("hpc.enabled", True),
    ("hpc.job_service.job_poll_interval", timedelta(seconds=15)),
    ("hpc.job_service.job_timeout_default", timedelta(hours=24)),
    ("hpc.job_service.max_concurrent_jobs", 100),
    ("hpc.job_service.enable_state_recovery", True),
    ("hpc.job_service.state_store_path", Path("/var/lib/virtengine/hpc-state")),
    ("hpc.usage_reporting.enabled", True),
    ("hpc.usage_reporting.report_interval", timedelta(minutes=5)),
    ("hpc.usage_reporting.batch_size", 50),
    ("hpc.usage_reporting.retry_on_failure", True),
    ("hpc.retry.max_retries", 3),
    ("hpc.retry.initial_backoff", timedelta(seconds=1)),
    ("hpc.retry.max_backoff", timedelta(seconds=30)),
    ("hpc.retry.backoff_multiplier", 2.0),
    ("hpc.audit.enabled", True),
    ("hpc.audit.log_path", Path("/var/log/virtengine/hpc-audit.log")),
    ("hpc.audit.log_job_events", True),
    ("hpc.audit.log_security_events", True),
    ("hpc.audit.log_usage_reports", True),
    ("hpc.slurm.cluster_name", "virtengine-hpc"),
    ("hpc.slurm.controller_port", 6817),
    ("hpc.slurm.auth_method", "munge"),
    ("hpc.slurm.default_partition", "default"),
    ("hpc.slurm.job_poll_interval", timedelta(seconds=10)),
    ("hpc.slurm.connection_timeout", timedelta(seconds=30)),
    ("hpc.slurm.max_retries", 3),
    ("routing.enforcement_mode", "strict"),
    ("routing.require_decision_for_submission", True),
    ("routing.allow_automatic_fallback", False),
    ("routing.decision_max_age_blocks", 100),
    ("routing.decision_max_age", timedelta(seconds=600)),
]


def lookup(config: BaseModel, dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("key", "expected"), DEFAULTS, ids=[k for k, _ in DEFAULTS])
def test_documented_default(key: str, expected: Any) -> None:
    assert lookup(load(), key) == expected


def test_an_empty_file_and_a_file_of_comments_give_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == load()
    assert load_config(write(tmp_path, "# nothing yet\n"), env={}) == load()


def test_a_section_with_every_key_commented_out_takes_its_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "routing:\n  # enforcement_mode: permissive\nhpc:\n  audit:\n")
    config = load_config(path, env={})
    assert config.routing.enforcement_mode == "strict"
    assert config.hpc.audit.enabled is True


def test_the_seed_configuration_loads_as_written(tmp_path: Path) -> None:
    """The YAML blocks of seed 001, merged into one file (credentials left as the seed's comment)."""
    seed = """
hpc:
  enabled: true
  scheduler_type: slurm  # Options: slurm, moab, ood
  cluster_id: "my-hpc-cluster-001"
  job_service:
    job_poll_interval: 15s
    job_timeout_default: 24h
    max_concurrent_jobs: 100
    enable_state_recovery: true
    state_store_path: /var/lib/virtengine/hpc-state
  usage_reporting:
    enabled: true
    report_interval: 5m
    batch_size: 50
    retry_on_failure: true
  retry:
    max_retries: 3
    initial_backoff: 1s
    max_backoff: 30s
    backoff_multiplier: 2.0
  audit:
    enabled: true
    log_path: /var/log/virtengine/hpc-audit.log
    log_job_events: true
    log_security_events: true
    log_usage_reports: true
  slurm:
    cluster_name: virtengine-hpc
    controller_host: slurmctld.example.com
    controller_port: 6817
    auth_method: munge  # Options: munge, jwt
    # auth_token: "..."  # Required if auth_method is jwt
    default_partition: default
    job_poll_interval: 10s
    connection_timeout: 30s
    max_retries: 3
routing:
  enforcement_mode: "strict"          # strict | permissive | audit_only
  require_decision_for_submission: true
  allow_automatic_fallback: false
"""
    config = load_config(write(tmp_path, seed), env={})
    assert config.hpc.scheduler_type == "slurm"
    assert config.hpc.cluster_id == "my-hpc-cluster-001"
    assert config.hpc.slurm.controller_host == "slurmctld.example.com"
    assert config.hpc.scheduler_poll_interval == timedelta(seconds=10)
    for key, expected in DEFAULTS:
        if key != "hpc.slurm.controller_host":
            assert lookup(config, key) == expected, key


PUBLIC_NAMES = [
    "ADDRESS_PATTERN",
    "AuditConfig",
    "ChainConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "Duration",
    "ENV_PREFIX",
    "HPCConfig",
    "JobServiceConfig",
    "LocalSchedulerConfig",
    "LoggingConfig",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "MAX_DURATION_SECONDS",
    "MAX_ERRORS_SHOWN",
    "MetricsConfig",
    "MoabConfig",
    "NodesConfig",
    "OODConfig",
    "ProviderConfig",
    "RetryConfig",
    "RoutingConfig",
    "SECRET_ENV_VARS",
    "SERVICE_ACCOUNTS",
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


def test_every_public_name_is_imported_from_the_config_package() -> None:
    """The sections live in modules of virtengine_hpc/config/, but every name the one config module had is still
    imported from the package, where the workers, adapters, CLI and tests import it."""
    import virtengine_hpc.config as package

    assert sorted(package.__all__) == sorted(PUBLIC_NAMES)
    missing = [name for name in PUBLIC_NAMES if not hasattr(package, name)]
    assert not missing


def test_derived_paths_follow_the_state_store() -> None:
    config = load({"hpc": {"job_service": {"state_store_path": "/srv/hpc"}}})
    assert config.state_dir == Path("/srv/hpc")
    assert config.ledger_path == Path("/srv/hpc/ledger.db")
    assert config.local_state_dir == Path("/srv/hpc/local-jobs")
    config = load({"chain": {"ledger_path": "/data/l.db"}, "hpc": {"local": {"state_dir": "/data/jobs"}}})
    assert config.ledger_path == Path("/data/l.db")
    assert config.local_state_dir == Path("/data/jobs")


def test_the_loaded_config_is_frozen() -> None:
    config = load()
    with pytest.raises(PydanticValidationError):
        config.routing.enforcement_mode = "audit_only"  # type: ignore[misc]


# ---- durations -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("15s", 15),
        ("5m", 300),
        ("24h", 86400),
        ("1h30m", 5400),
        ("1m30s", 90),
        ("2d", 172800),
        ("1.5h", 5400),
        ("15S", 15),
        (" 15s ", 15),
        ("90", 90),
        ("0.25", 0.25),
        (90, 90),
        (2.5, 2.5),
        (0, 0),
    ],
)
def test_duration_syntax(text: Any, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)
    config = load({"hpc": {"usage_reporting": {"report_interval": text}}})
    assert config.hpc.usage_reporting.report_interval.total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize(
    "bad",
    [
        "15 seconds",
        "5x",
        "m5",
        "-5s",
        "1h-30m",
        "",
        "   ",
        "s",
        "15s5",
        "1e3",
        "fast",
        -1,
        True,
        [1, 2],
        {"s": 1},
        math.inf,
        math.nan,
        10**20,
        "99999999999h",
    ],
    ids=repr,
)
def test_bad_durations_are_refused_naming_the_key(bad: Any) -> None:
    message = error_of({"hpc": {"retry": {"max_backoff": bad}}})
    assert message.startswith("invalid configuration: hpc.retry.max_backoff: ")


def test_a_bad_duration_message_says_how_to_write_one() -> None:
    message = error_of({"hpc": {"job_service": {"job_poll_interval": "15 seconds"}}})
    assert "invalid duration '15 seconds'" in message
    assert "15s, 5m, 24h" in message


# ---- errors that name the key --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"hpc": {"job_service": {"max_concurent_jobs": 5}}}, "hpc.job_service.max_concurent_jobs"),
        ({"routng": {}}, "routng"),
        ({"hpc": {"slurm": {"controler_host": "x"}}}, "hpc.slurm.controler_host"),
    ],
)
def test_an_unknown_key_is_named(data: dict[str, Any], key: str) -> None:
    message = error_of(data)
    assert f"{key}: unknown key" in message
    assert "docs/configuration.md" in message


@pytest.mark.parametrize(
    ("data", "key", "why"),
    [
        (
            {"hpc": {"job_service": {"max_concurrent_jobs": "lots"}}},
            "hpc.job_service.max_concurrent_jobs",
            "integer",
        ),
        (
            {"hpc": {"job_service": {"max_concurrent_jobs": True}}},
            "hpc.job_service.max_concurrent_jobs",
            "not true",
        ),
        (
            {"hpc": {"job_service": {"max_concurrent_jobs": 0}}},
            "hpc.job_service.max_concurrent_jobs",
            "greater than or equal to 1",
        ),
        ({"hpc": {"retry": {"backoff_multiplier": False}}}, "hpc.retry.backoff_multiplier", "not true"),
        ({"hpc": {"usage_reporting": {"enabled": "maybe"}}}, "hpc.usage_reporting.enabled", "boolean"),
        ({"routing": {"enforcement_mode": "lenient"}}, "routing.enforcement_mode", "'strict'"),
        ({"hpc": {"scheduler_type": "pbs"}}, "hpc.scheduler_type", "'slurm'"),
        ({"hpc": {"cluster_id": 123}}, "hpc.cluster_id", "string"),
        ({"hpc": {"cluster_id": "has space"}}, "hpc.cluster_id", "pattern"),
        (
            {"hpc": {"slurm": {"controller_port": 70000}}},
            "hpc.slurm.controller_port",
            "less than or equal to 65535",
        ),
        ({"hpc": 5}, "hpc", "dictionary"),
        ({"hpc": {"slurm": {"remote_env": ["A=b"]}}}, "hpc.slurm.remote_env", "dictionary"),
    ],
)
def test_a_wrong_type_is_named(data: dict[str, Any], key: str, why: str) -> None:
    message = error_of(data)
    assert f"{key}: " in message
    assert why in message


def test_every_problem_is_listed_at_once() -> None:
    message = error_of(
        {
            "hpc": {"job_service": {"job_poll_interval": "soon", "max_concurrent_jobs": -1}},
            "routing": {"x": 1},
        }
    )
    for key in ("hpc.job_service.job_poll_interval", "hpc.job_service.max_concurrent_jobs", "routing.x"):
        assert key in message


def test_the_documented_error_example_is_what_the_loader_says() -> None:
    message = error_of({"hpc": {"job_service": {"job_poll_interval": "15 seconds", "max_concurent_jobs": 5}}})
    assert message in DOC.read_text()


def test_cross_field_rules() -> None:
    assert "transport rest" in error_of({"hpc": {"slurm": {"auth_method": "jwt", "transport": "cli"}}})
    assert load({"hpc": {"slurm": {"auth_method": "jwt"}}}).hpc.slurm.transport is None
    message = error_of({"nodes": {"stale_after": "5m", "offline_after": "2m"}})
    assert "nodes.offline_after must be longer than nodes.stale_after" in message


def test_node_api_tls_keys() -> None:
    assert load().nodes.tls == "off", "plain HTTP by default"
    served = load({"nodes": {"tls_cert_file": "/etc/hpc/api.pem", "tls_key_file": "/etc/hpc/api.key"}}).nodes
    assert served.tls == "tls" and served.tls_cert_file == Path("/etc/hpc/api.pem")
    mutual = load(
        {"nodes": {"tls_cert_file": "/c.pem", "tls_key_file": "/k.pem", "tls_client_ca_file": "/ca.pem"}}
    ).nodes
    assert mutual.tls == "mutual" and mutual.tls_client_ca_file == Path("/ca.pem")
    # From the environment too, like every key; the key's path is not a credential.
    env = load(
        VIRTENGINE_HPC__NODES__TLS_CERT_FILE="/c.pem", VIRTENGINE_HPC__NODES__TLS_KEY_FILE="/k.pem"
    ).nodes
    assert env.tls == "tls" and env.tls_key_file == Path("/k.pem")


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ({"tls_cert_file": "/c.pem"}, "nodes.tls_cert_file and nodes.tls_key_file go together"),
        ({"tls_key_file": "/k.pem"}, "nodes.tls_cert_file and nodes.tls_key_file go together"),
        (
            {"tls_client_ca_file": "/ca.pem"},
            "nodes.tls_client_ca_file (mutual TLS) needs nodes.tls_cert_file and nodes.tls_key_file",
        ),
        (
            {"tls_client_ca_file": "/ca.pem", "tls_cert_file": "/c.pem"},
            "nodes.tls_cert_file and nodes.tls_key_file go together",
        ),
        (
            {"tls_cert_file": ["/c.pem"], "tls_key_file": "/k.pem"},
            "nodes.tls_cert_file: Input is not a valid path",
        ),
    ],
)
def test_node_api_tls_key_errors(nodes: dict[str, Any], message: str) -> None:
    error = error_of({"nodes": nodes})
    assert error.startswith("invalid configuration: nodes")
    assert message in error


# ---- the file ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["- hpc\n- routing\n", "just a string\n", "42\n", "false\n", "[]\n"])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="the top level must be a mapping of sections"):
        load_config(path, env={})


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml: No such file or directory"):
        load_config(path, env={})


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path, env={})


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, b"hpc:\n  cluster_id: \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(path, env={})


def test_invalid_yaml_says_where_without_quoting_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "hpc:\n  slurm:\n    rest_url: 'http://x?k=hunter2\n  : :\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "is not valid YAML" in message
    assert "line " in message
    assert "hunter2" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


# ---- environment overrides -----------------------------------------------------------------------------------


def test_overrides_nest_and_win_over_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "hpc:\n  job_service:\n    job_poll_interval: 15s\n    max_concurrent_jobs: 10\n"
        "routing:\n  enforcement_mode: strict\n",
    )
    config = load_config(
        path,
        env={
            "VIRTENGINE_HPC__HPC__JOB_SERVICE__JOB_POLL_INTERVAL": "1m30s",
            "VIRTENGINE_HPC__routing__enforcement_mode": "permissive",
            "VIRTENGINE_HPC__ROUTING__ALLOW_AUTOMATIC_FALLBACK": "true",
            "VIRTENGINE_HPC__HPC__RETRY__BACKOFF_MULTIPLIER": "1.5",
            "UNRELATED": "x",
        },
    )
    assert config.hpc.job_service.job_poll_interval == timedelta(seconds=90)
    assert config.hpc.job_service.max_concurrent_jobs == 10  # the file's, untouched by overrides of siblings
    assert config.routing.enforcement_mode == "permissive"
    assert config.routing.allow_automatic_fallback is True
    assert config.hpc.retry.backoff_multiplier == 1.5


def test_overrides_apply_without_a_file() -> None:
    config = load(
        VIRTENGINE_HPC__HPC__SLURM__REMOTE_ENV="{SLURM_CONF: /etc/slurm/slurm.conf}",
        VIRTENGINE_HPC__HPC__SLURM__TRANSPORT="null",
        VIRTENGINE_HPC__TEMPORAL__ADDRESS="temporal.example.com:7233",
    )
    assert config.hpc.slurm.remote_env == {"SLURM_CONF": "/etc/slurm/slurm.conf"}
    assert config.hpc.slurm.transport is None
    assert config.temporal.address == "temporal.example.com:7233"


def test_override_scalars_take_the_type_of_their_key() -> None:
    """YAML would read 0123 as 83 and `no` as false; the key's type decides instead."""
    config = load(
        VIRTENGINE_HPC__HPC__CLUSTER_ID="0123",
        VIRTENGINE_HPC__TEMPORAL__NAMESPACE="no",
        VIRTENGINE_HPC__HPC__JOB_SERVICE__MAX_CONCURRENT_JOBS="0012",
        VIRTENGINE_HPC__PROVIDER__ADDRESS="'quoted'",
    )
    assert config.hpc.cluster_id == "0123"
    assert config.temporal.namespace == "no"
    assert config.hpc.job_service.max_concurrent_jobs == 12
    assert config.provider.address == "quoted"


def test_a_bad_override_is_named_like_a_file_key() -> None:
    message = error_of(VIRTENGINE_HPC__HPC__JOB_SERVICE__MAX_CONCURRENT_JOBS="many")
    assert "hpc.job_service.max_concurrent_jobs" in message
    assert "hpc.job_service.nope: unknown key" in error_of(VIRTENGINE_HPC__HPC__JOB_SERVICE__NOPE="1")


@pytest.mark.parametrize(
    "env",
    [
        {"VIRTENGINE_HPC__HPC": "5", "VIRTENGINE_HPC__HPC__ENABLED": "true"},
        {"VIRTENGINE_HPC__HPC__ENABLED": "true", "VIRTENGINE_HPC__HPC": "5"},
    ],
)
def test_overrides_that_disagree_about_nesting_are_refused_in_any_order(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="conflicts with another override"):
        load_config(data={}, env=env)


def test_the_config_path_variable_is_not_an_override() -> None:
    assert load(VIRTENGINE_HPC_CONFIG="/etc/x.yaml", VIRTENGINE_HPC__="x") == load()


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIRTENGINE_HPC__ROUTING__ENFORCEMENT_MODE", "audit_only")
    assert load_config().routing.enforcement_mode == "audit_only"


# ---- credentials ---------------------------------------------------------------------------------------------

CREDENTIAL_FILES = {
    "auth_token in slurm (the seed's commented key)": "hpc:\n  slurm:\n    auth_token: s3cr3t-value\n",
    "password in moab": "hpc:\n  moab:\n    password: s3cr3t-value\n",
    "client_secret in ood": "hpc:\n  ood:\n    client_secret: s3cr3t-value\n",
    "top level": "auth_token: s3cr3t-value\n",
    "inside a mapping value": "hpc:\n  slurm:\n    remote_env:\n      DB_PASSWORD: s3cr3t-value\n",
    "inside a list": "hpc:\n  extra:\n    - name: x\n      api_key: s3cr3t-value\n",
    "mixed case": "temporal:\n  Client_Secret: s3cr3t-value\n",
}


@pytest.mark.parametrize("text", list(CREDENTIAL_FILES.values()), ids=list(CREDENTIAL_FILES))
def test_a_file_holding_a_credential_is_refused(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "credentials are not allowed in the configuration" in message
    for name in ("SLURM_JWT_TOKEN", "MOAB_USERNAME", "MOAB_PASSWORD", "OOD_OIDC_CLIENT_SECRET"):
        assert name in message
    assert "PROVIDER_SIGNING_KEY_PATH" in message
    assert "s3cr3t-value" not in message


def test_the_refusal_names_where_the_credential_is(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^hpc\.slurm\.auth_token: credentials"):
        load_config(
            write(tmp_path, CREDENTIAL_FILES["auth_token in slurm (the seed's commented key)"]), env={}
        )
    with pytest.raises(ConfigError, match=r"^hpc\.extra\[0\]\.api_key: credentials"):
        load_config(write(tmp_path, CREDENTIAL_FILES["inside a list"]), env={})


def test_a_credential_in_an_override_or_in_data_is_refused_too() -> None:
    message = error_of(VIRTENGINE_HPC__HPC__SLURM__AUTH_TOKEN="s3cr3t-value")
    assert message.startswith("hpc.slurm.auth_token: credentials are not allowed")
    assert "s3cr3t-value" not in message
    assert "credentials" in error_of({"hpc": {"moab": {"password": "s3cr3t-value"}}})


def test_the_name_of_a_key_variable_is_not_a_credential() -> None:
    assert load({"temporal": {"api_key_env": "TEMPORAL_API_KEY"}}).temporal.api_key_env == "TEMPORAL_API_KEY"


SECRET_ENV = {
    "SLURM_JWT_TOKEN": "eyJhbGciOiJIUzI1NiJ9.jwt-secret-value",
    "MOAB_USERNAME": "provider-service",
    "MOAB_PASSWORD": "moab-secret-value",
    "OOD_OIDC_CLIENT_SECRET": "oidc-secret-value",
    "PROVIDER_SIGNING_KEY_PATH": "/etc/virtengine/provider.key",
    "PROVIDER_MARKER_SECRET": "marker-secret-value-0123456789abcdef",
}


def test_secrets_come_from_the_six_variables() -> None:
    assert set(SECRET_ENV) == set(SECRET_ENV_VARS)
    secrets = Secrets.from_env(SECRET_ENV)
    assert secrets.slurm_jwt_token is not None
    assert secrets.slurm_jwt_token.get_secret_value() == SECRET_ENV["SLURM_JWT_TOKEN"]
    assert secrets.moab_username == "provider-service"
    assert secrets.moab_password is not None
    assert secrets.moab_password.get_secret_value() == "moab-secret-value"
    assert secrets.ood_oidc_client_secret is not None
    assert secrets.ood_oidc_client_secret.get_secret_value() == "oidc-secret-value"
    assert secrets.provider_signing_key_path == Path("/etc/virtengine/provider.key")
    assert secrets.marker_secret is not None
    assert secrets.marker_secret.get_secret_value() == SECRET_ENV["PROVIDER_MARKER_SECRET"]


def test_secrets_never_show_in_repr_str_or_json() -> None:
    secrets = Secrets.from_env(SECRET_ENV)
    for shown in (repr(secrets), str(secrets), secrets.model_dump_json(), f"{secrets}"):
        for name in ("SLURM_JWT_TOKEN", "MOAB_PASSWORD", "OOD_OIDC_CLIENT_SECRET", "PROVIDER_MARKER_SECRET"):
            assert SECRET_ENV[name] not in shown
        assert "jwt-secret-value" not in shown


def test_unset_or_empty_secret_variables_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = Secrets.from_env({name: "" for name in SECRET_ENV})
    assert empty == Secrets() == Secrets.from_env({})
    monkeypatch.setenv("MOAB_PASSWORD", "from-process-env")
    from_process = Secrets.from_env()
    assert from_process.moab_password is not None
    assert from_process.moab_password.get_secret_value() == "from-process-env"
    assert from_process.slurm_jwt_token is None


def test_secrets_are_frozen() -> None:
    with pytest.raises(PydanticValidationError):
        Secrets.from_env(SECRET_ENV).moab_username = "other"  # type: ignore[misc]


# ---- the generated reference and the example -----------------------------------------------------------------


def _gen_module() -> ModuleType:
    path = REPO / "scripts" / "gen-config-doc.py"
    spec = importlib.util.spec_from_file_location("gen_config_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_config_doc", module)
    spec.loader.exec_module(module)
    return module


def _sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    found: list[tuple[str, type[BaseModel]]] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            dotted = f"{path}.{name}" if path else name
            found += [(dotted, annotation), *_sections(annotation, dotted)]
    return found


def test_the_committed_reference_matches_the_models() -> None:
    rendered = _gen_module().render()
    assert DOC.read_text(encoding="utf-8") == rendered, (
        "docs/configuration.md is out of date: run .venv/bin/python scripts/gen-config-doc.py"
    )


def test_every_key_is_documented_with_a_description() -> None:
    text = DOC.read_text()
    for dotted, model in _sections(Config):
        assert model.__doc__, f"section {dotted} needs a docstring"
        assert f"### `{dotted}`" in text
        for name, info in model.model_fields.items():
            if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
                continue
            assert info.description, f"{dotted}.{name} needs a description"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(seconds=15), "15s"),
        (timedelta(hours=24), "24h"),
        (timedelta(seconds=5400), "1h30m"),
        (timedelta(milliseconds=500), "500ms"),
        (timedelta(0), "0s"),
        (timedelta(seconds=600), "10m"),
    ],
)
def test_the_reference_writes_defaults_in_the_duration_syntax(value: timedelta, text: str) -> None:
    assert _gen_module().format_duration(value) == text
    assert parse_duration(text) == value


def test_the_reference_check_mode_reports_drift(tmp_path: Path) -> None:
    gen = _gen_module()
    stale = write(tmp_path, "old\n", "configuration.md")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0


def test_the_example_config_loads_and_says_what_the_seed_says() -> None:
    config = load_config(EXAMPLE, env={})
    assert config.hpc.scheduler_type == "slurm"
    for key, expected in DEFAULTS:
        if key != "hpc.slurm.controller_host":
            assert lookup(config, key) == expected, key
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert set(raw) == set(Config.model_fields)  # every section appears in the example


# ---- property: nothing but ConfigError ------------------------------------------------------------------------


def _all_keys(model: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        keys.append(name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += _all_keys(annotation)
    return keys


def _leaf_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            paths += _leaf_paths(annotation, (*prefix, name))
        else:
            paths.append((*prefix, name))
    return paths


KEYS = st.sampled_from(sorted(set(_all_keys(Config)))) | st.text(min_size=0, max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(
        ["15s", "1h30m", "500ms", "-1s", "strict", "slurm", "jwt", "rest", "null", "{a: 1}", "~"]
    )
)
TREES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=25,
)


def shaped(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Trees that follow the model's nesting (so that random values reach every validator), with stray keys
    and wrong shapes mixed in."""
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            optional[name] = shaped(annotation) | SCALARS
        else:
            optional[name] = SCALARS | TREES
    exact = st.fixed_dictionaries({}, optional=optional)
    stray = st.dictionaries(st.text(max_size=12), TREES, max_size=2)
    return st.tuples(exact, stray).map(lambda pair: {**pair[1], **pair[0]})


ENV_NAMES = st.sampled_from(_leaf_paths(Config)).map(
    lambda parts: "VIRTENGINE_HPC__" + "__".join(p.upper() for p in parts)
) | st.lists(st.sampled_from(sorted(set(_all_keys(Config)))), min_size=1, max_size=4).map(
    lambda parts: "VIRTENGINE_HPC__" + "__".join(p.upper() for p in parts)
)
ENV_VALUES = st.text(alphabet=string.printable, max_size=20) | SCALARS.map(str)


@settings(max_examples=300, deadline=None)
@given(
    data=shaped(Config) | st.dictionaries(KEYS, TREES, max_size=6),
    env=st.dictionaries(ENV_NAMES, ENV_VALUES, max_size=4),
)
def test_random_input_never_crashes_the_loader(data: dict[str, Any], env: dict[str, str]) -> None:
    try:
        config = load_config(data=data, env=env)
    except ConfigError:
        return
    # What loaded is what an operator gets back when dumping the effective config: it loads again, unchanged.
    assert load_config(data=config.model_dump(mode="json"), env={}) == config


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | shaped(Config).map(lambda tree: yaml.safe_dump(tree)))
def test_random_files_never_crash_the_loader(tmp_path: Path, text: str) -> None:
    path = tmp_path / "random.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with contextlib.suppress(ConfigError):
        load_config(path, env={})


def test_a_dumped_config_loads_back_unchanged(tmp_path: Path) -> None:
    """An operator can dump the effective config and use it as a file: no key of ours trips the secret check."""
    config = load_config(data={}, env={})
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert load_config(path, env={}) == config
