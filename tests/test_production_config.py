"""The multi-cluster configuration and the deployment files in deploy/: they load, they agree with each other,
and the single-cluster seed configuration still means what it meant.

No systemd runs here, so the unit files are checked for what would break a deployment: a command the CLI does
not have, a stop timeout shorter than the worker's graceful shutdown, a kill mode that would take local jobs
down with the worker, two processes on one metrics port.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, make_config
from virtengine_hpc.cli import build_parser
from virtengine_hpc.config import load_config, parse_duration
from virtengine_hpc.errors import ConfigError
from workers.wiring import build_worker_deps, job_settings, task_queue, task_queues

DEPLOY = REPO / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


class Unit(dict[str, dict[str, list[str]]]):
    """A systemd unit file: section -> key -> every value (Environment= may repeat)."""

    def get1(self, section: str, key: str) -> str:
        [value] = self[section][key]
        return value


def unit(name: str) -> Unit:
    parsed = Unit()
    section = ""
    for line in (DEPLOY / "systemd" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            parsed[section] = {}
            continue
        key, _, value = line.partition("=")
        parsed[section].setdefault(key.strip(), []).append(value.strip())
    return parsed


# ---- several clusters ------------------------------------------------------------------------------------------


def test_the_single_cluster_seed_config_is_unchanged(tmp_path: Path) -> None:
    config = make_config(tmp_path, hpc={"cluster_id": "seed-cluster"})
    assert config.cluster_ids() == config.served_cluster_ids() == ["seed-cluster"]
    assert config.for_cluster("seed-cluster") is config
    assert task_queue(config) == "virtengine-hpc.seed-cluster"
    assert job_settings(config).task_queues == {"seed-cluster": "virtengine-hpc.seed-cluster"}
    example = load_config(DEPLOY / "config.example.yaml", env={})
    assert example.cluster_ids() == ["my-hpc-cluster-001"]


def test_cluster_entries_inherit_and_override_the_hpc_sections(tmp_path: Path) -> None:
    config = load_config(
        data={
            "hpc": {
                "job_service": {"state_store_path": str(tmp_path / "state")},
                "scheduler_type": "slurm",
                "slurm": {"controller_host": "ctl-shared", "default_partition": "batch", "transport": "cli"},
                "clusters": [
                    {"cluster_id": "a"},
                    {"cluster_id": "b", "slurm": {"controller_host": "ctl-b"}},
                    {"cluster_id": "c", "scheduler_type": "local", "serve": False},
                ],
            }
        },
        env={},
    )
    assert config.hpc.cluster_id == "a", "the first listed is the default cluster"
    assert config.served_cluster_ids() == ["a", "b"] and config.cluster_ids() == ["a", "b", "c"]
    a, b, c = (config.for_cluster(x).hpc for x in "abc")
    assert (a.cluster_id, a.slurm.controller_host, a.slurm.default_partition) == ("a", "ctl-shared", "batch")
    assert (b.slurm.controller_host, b.slurm.default_partition, b.slurm.transport) == (
        "ctl-b",
        "batch",
        "cli",
    )
    assert c.scheduler_type == "local"
    dirs = {config.for_cluster(x).local_state_dir for x in "abc"}
    assert len(dirs) == 3, "two local executors on one host never share a job directory"
    assert task_queues(config) == {x: f"virtengine-hpc.{x}" for x in "abc"}
    assert job_settings(config, "b").poll_interval_seconds == b.slurm.job_poll_interval.total_seconds()
    with pytest.raises(ConfigError, match=r"^cluster z is not in hpc\.clusters \(a, b, c\)$"):
        config.for_cluster("z")


@pytest.mark.parametrize(
    ("hpc", "message"),
    [
        ({"clusters": [{"cluster_id": "a"}, {"cluster_id": "a"}]}, "hpc.clusters lists a more than once"),
        (
            {"cluster_id": "x", "clusters": [{"cluster_id": "a"}]},
            "hpc.cluster_id x is not one of hpc.clusters (a)",
        ),
        ({"clusters": [{"serve": True}]}, "hpc.clusters.0.cluster_id: Field required"),
        (
            {"clusters": [{"cluster_id": "a", "slurm": {"auth_method": "jwt", "transport": "ssh"}}]},
            "hpc.clusters[0].slurm.auth_method jwt works only with transport rest",
        ),
    ],
)
def test_bad_cluster_lists_are_named(hpc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as failure:
        load_config(data={"hpc": hpc}, env={})
    assert message in str(failure.value)


def test_a_worker_that_serves_no_cluster_is_refused(tmp_path: Path, key_path: Path) -> None:
    from virtengine_hpc.config import Secrets

    config = make_config(tmp_path, hpc={"cluster_id": "a", "clusters": [{"cluster_id": "a", "serve": False}]})
    with pytest.raises(ConfigError, match="this worker serves no cluster"):
        build_worker_deps(config, Secrets(provider_signing_key_path=key_path), nodes=False)


def test_clusters_from_an_environment_override() -> None:
    config = load_config(
        env={"VIRTENGINE_HPC__HPC__CLUSTERS": "[{cluster_id: a}, {cluster_id: b, serve: false}]"}
    )
    assert config.served_cluster_ids() == ["a"] and config.cluster_ids() == ["a", "b"]


# ---- deploy/ ---------------------------------------------------------------------------------------------------


def test_the_production_example_loads_and_serves_two_of_three_clusters() -> None:
    config = load_config(DEPLOY / "production.yaml", env={})
    assert config.served_cluster_ids() == ["hpc-east-1", "hpc-east-2"]
    assert config.cluster_ids() == ["hpc-east-1", "hpc-east-2", "gpu-west-1"]
    east1, east2 = config.for_cluster("hpc-east-1").hpc.slurm, config.for_cluster("hpc-east-2").hpc.slurm
    assert (east1.transport, east1.rest_user, east1.controller_host) == (
        "rest",
        "vehpc",
        "slurmctld-east-1.example.com",
    )
    assert (east2.transport, east2.auth_method, east2.default_partition) == ("ssh", "munge", "batch")
    t = config.temporal
    assert t.uses_tls and t.tls_client_cert and t.deployment_name and t.build_id
    assert config.metrics.listen and config.logging.format == "json"


def test_every_unit_runs_a_real_command_with_its_config_and_credentials() -> None:
    assert {u.name for u in UNITS} == {
        "virtengine-hpc-worker@.service",
        "virtengine-hpc-poller@.service",
        "virtengine-hpc-node-api@.service",
    }
    parser = build_parser()
    for path in UNITS:
        u = unit(path.name)
        argv = shlex.split(u.get1("Service", "ExecStart"))
        assert argv[0].endswith("/virtengine-hpc")
        args = parser.parse_args(argv[1:])
        assert callable(args.func), path.name
        assert u.get1("Service", "EnvironmentFile").endswith("/%i.env")
        assert "VIRTENGINE_HPC_CONFIG=/etc/virtengine/hpc/%i.yaml" in u["Service"]["Environment"]
        assert u.get1("Service", "KillSignal") == "SIGTERM" and u.get1("Service", "Restart") == "on-failure"
        assert u.get1("Install", "WantedBy") == "multi-user.target"


def test_the_worker_unit_lets_activities_hand_over_and_local_jobs_survive() -> None:
    u = unit("virtengine-hpc-worker@.service")
    config = load_config(DEPLOY / "production.yaml", env={})
    stop = parse_duration(u.get1("Service", "TimeoutStopSec"))
    assert stop >= config.temporal.graceful_shutdown_timeout * 1.5, (
        "systemd must not SIGKILL during the grace"
    )
    # mixed would SIGKILL the local executor's supervisors (the rest of the cgroup) once the worker exits.
    assert u.get1("Service", "KillMode") == "process"


def test_the_poller_unit_has_its_own_metrics_port() -> None:
    u = unit("virtengine-hpc-poller@.service")
    env = dict(item.split("=", 1) for item in u["Service"]["Environment"])
    overridden = load_config(
        DEPLOY / "production.yaml", env={k: v for k, v in env.items() if k.startswith("VIRTENGINE_HPC__")}
    )
    worker = load_config(DEPLOY / "production.yaml", env={})
    assert overridden.metrics.listen and overridden.metrics.listen != worker.metrics.listen


def test_the_environment_file_example_names_only_credential_variables() -> None:
    from virtengine_hpc.config import SECRET_ENV_VARS

    names = {
        line.split("=", 1)[0].lstrip("# ").strip()
        for line in (DEPLOY / "provider.env.example").read_text().splitlines()
        if "=" in line and not line.startswith("# /etc")
    }
    assert names <= set(SECRET_ENV_VARS) | {"TEMPORAL_API_KEY"}
    assert "PROVIDER_SIGNING_KEY_PATH" in names
