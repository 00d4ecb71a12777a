"""Building the SLURM adapter from configuration (no cluster needed): the worker's wiring finds it by name, each
transport gets what it needs or a clear ConfigError naming the missing key, and secrets come only from Secrets."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr

from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm.backends import CliBackend, RestBackend
from virtengine_hpc.config import Secrets, load_config
from virtengine_hpc.errors import ConfigError
from workers.wiring import build_adapter


def config(**slurm: Any) -> Any:
    return load_config(
        data={
            "hpc": {"scheduler_type": "slurm", "cluster_id": "c1", "slurm": {"cluster_name": "lc", **slurm}}
        },
        env={},
    )


def test_wiring_builds_the_registered_adapter_by_name() -> None:
    adapter = build_adapter(config(transport="cli"), Secrets())
    assert isinstance(adapter, SlurmAdapter) and isinstance(adapter.backend, CliBackend)
    assert adapter.cluster_id == "c1" and adapter.mpi_launcher == "srun"


def test_jwt_means_rest_and_needs_the_token_and_a_work_dir() -> None:
    with pytest.raises(ConfigError, match="SLURM_JWT_TOKEN"):
        SlurmAdapter.from_config(config(auth_method="jwt", work_dir="/jobs"), Secrets(), "c1")
    with pytest.raises(ConfigError, match="work_dir"):
        SlurmAdapter.from_config(config(auth_method="jwt"), Secrets(slurm_jwt_token=SecretStr("t")), "c1")
    with pytest.raises(ConfigError, match=r"hpc\.slurm\.rest_user: required for the rest transport"):
        SlurmAdapter.from_config(
            config(auth_method="jwt", work_dir="/jobs"), Secrets(slurm_jwt_token=SecretStr("t")), "c1"
        )
    adapter = SlurmAdapter.from_config(
        config(auth_method="jwt", work_dir="/jobs", controller_host="ctl.example.org", rest_user="vehpc"),
        Secrets(slurm_jwt_token=SecretStr("secret-token")),
        "c1",
    )
    assert isinstance(adapter.backend, RestBackend)
    assert adapter.backend.description == "slurmrestd http://ctl.example.org:6820 as vehpc"


def test_ssh_needs_a_user_and_defaults_to_the_controller_host() -> None:
    with pytest.raises(ConfigError, match="ssh_user"):
        SlurmAdapter.from_config(config(transport="ssh"), Secrets(), "c1")
    with pytest.raises(ConfigError, match="tenant_key_dir: required for the ssh transport with per-tenant"):
        SlurmAdapter.from_config(config(transport="ssh", ssh_user="vehpc"), Secrets(), "c1")
    adapter = SlurmAdapter.from_config(
        config(
            transport="ssh",
            ssh_user="vehpc",
            controller_host="login1",
            ssh_port=2200,
            tenant_key_dir="/etc/virtengine/tenant-keys",
        ),
        Secrets(),
        "c1",
    )
    assert adapter.backend.description == "ssh vehpc@login1:2200"
    assert adapter.backend.user == "vehpc"


def test_config_file_may_not_hold_the_token(tmp_path: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("hpc:\n  slurm:\n    auth_token: abc\n")
    with pytest.raises(ConfigError, match="credentials are not allowed"):
        load_config(path, env={})
