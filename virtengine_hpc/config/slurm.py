"""The SLURM section (``hpc.slurm``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from virtengine_hpc.config.base import ACCOUNT_PATTERN, Duration, Section
from virtengine_hpc.config.scheduler import AdapterRetries, CommandTimeout, JobPollInterval
from virtengine_hpc.config.ssh import KnownHostsPath, SshKeyPath, SshPort


class SlurmConfig(Section):
    """SLURM: transports cli (local commands), ssh, rest (slurmrestd + JWT) or pyslurm."""

    cluster_name: str = Field(
        "virtengine-hpc",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="The SLURM cluster name (ClusterName in slurm.conf).",
    )
    controller_host: str = Field(
        "localhost",
        pattern=r"^[A-Za-z0-9_.:-]{1,253}$",
        description="Host of slurmctld (and of slurmrestd unless rest_url says otherwise).",
    )
    controller_port: int = Field(6817, ge=1, le=65535, description="slurmctld port.")
    auth_method: Literal["munge", "jwt"] = Field(
        "munge",
        description="munge (commands run as a munge-authenticated user) or jwt (slurmrestd with the token from SLURM_JWT_TOKEN).",
    )
    transport: Literal["cli", "ssh", "rest", "pyslurm"] | None = Field(
        None,
        description="cli (local commands), ssh (commands over SSH), rest (slurmrestd), pyslurm. "
        "Default: rest for jwt auth, cli for munge.",
    )
    default_partition: str = Field(
        "default", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Partition for jobs that name none."
    )
    job_poll_interval: JobPollInterval = timedelta(seconds=10)
    connection_timeout: CommandTimeout = timedelta(seconds=30)
    max_retries: AdapterRetries = 3
    slurm_conf: Path | None = Field(None, description="SLURM_CONF for the commands (cli transport).")
    rest_url: str | None = Field(
        None, description="slurmrestd base URL; default http://controller_host:6820."
    )
    rest_user: str | None = Field(
        None,
        pattern=ACCOUNT_PATTERN,
        description="The provider's own Slurm account on slurmrestd (X-SLURM-USER-NAME of status, accounting and "
        "cancel requests); required for the rest transport, never root. With per-tenant accounts jobs are "
        "submitted as the tenant's account instead, which needs SLURM_JWT_TOKEN to be a token of SlurmUser "
        "(docs/security.md), and this account must be a Slurm operator to cancel them.",
    )
    api_version: str = Field(
        "v0.0.38", pattern=r"^v\d+\.\d+\.\d+$", description="slurmrestd API version in the URL path."
    )
    ssh_host: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:-]{1,253}$", description="Login host for the ssh transport."
    )
    ssh_port: SshPort = 22
    ssh_user: str | None = Field(
        None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="Account on ssh_host that submits the jobs."
    )
    ssh_key_path: SshKeyPath = None
    known_hosts_path: KnownHostsPath = None
    tenant_key_dir: Path | None = Field(
        None,
        description="ssh transport with per-tenant accounts: directory holding one private key per tenant "
        "account, named after the account (<dir>/<account>); jobs are submitted by logging in as the tenant's "
        "account with its key (host key checked as for ssh_user).",
    )
    switch_user: Literal["runuser", "setpriv", "sudo"] = Field(
        "runuser",
        description="cli transport with per-tenant accounts: how the worker runs sbatch as the tenant's account "
        "(argv, no shell). runuser and setpriv need the worker to run as root; sudo needs a sudoers rule letting "
        "the worker's account run sbatch as each tenant account without a password (docs/security.md).",
    )
    remote_env: dict[str, str] = Field(default_factory=dict, description="Environment for remote commands.")
    work_dir: Path | None = Field(
        None,
        description="Default working directory of jobs on the cluster. With per-tenant accounts each job runs in "
        "<work_dir>/<account>, which must be the account's own directory, mode 0700, not a symbolic link; "
        "work_dir itself (given by its real path) must be owned by root or the provider's account and writable "
        "by no one else. Checked before every submission over cli and ssh (a root cli worker makes a missing "
        "<work_dir>/<account>; elsewhere the operator does); a job whose directory fails the check is refused "
        "(code work_dir_unsafe). Required by the rest transport.",
    )
    account: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Slurm account jobs are charged to (--account)."
    )
    qos: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Slurm QOS of jobs (--qos).")
    accounting_lookback: Duration = Field(
        timedelta(days=30),
        description="How far back accounting (sacct, slurmdbd) is searched for a job or a workflow's job.",
    )
    accounting_grace: Duration = Field(
        timedelta(seconds=60),
        description="How long a job the controller reports ended waits for accounting (its exit code) before "
        "its end is reported without it.",
    )

    @field_validator("rest_user")
    @classmethod
    def _rest_user_not_root(cls, value: str | None) -> str | None:
        if value == "root":
            raise ValueError(
                "root is refused: name the provider's own unprivileged Slurm account (a Slurm operator)"
            )
        return value
