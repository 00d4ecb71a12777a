"""The MOAB section (``hpc.moab``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import Field

from virtengine_hpc.config.base import ACCOUNT_PATTERN, Section
from virtengine_hpc.config.scheduler import AdapterRetries, CommandTimeout, JobPollInterval
from virtengine_hpc.config.ssh import KnownHostsPath, SshKeyPath, SshPort


class MoabConfig(Section):
    """MOAB: commands over SSH or MOAB Web Services."""

    server: str = Field(
        "localhost", pattern=r"^[A-Za-z0-9_.:-]{1,253}$", description="Host of the MOAB server."
    )
    port: int = Field(42559, ge=1, le=65535, description="MOAB server port.")
    transport: Literal["ssh", "rest"] = Field(
        "ssh", description="ssh (msub, checkjob, showq, mjobctl over SSH) or rest (MOAB Web Services)."
    )
    mws_url: str | None = Field(
        None,
        description="MOAB Web Services base URL (rest transport); credentials come from MOAB_USERNAME / MOAB_PASSWORD.",
    )
    ssh_host: str | None = Field(None, description="Login host for the ssh transport.")
    ssh_port: SshPort = 22
    ssh_user: str | None = Field(None, description="Account on ssh_host that submits the jobs.")
    ssh_key_path: SshKeyPath = None
    known_hosts_path: KnownHostsPath = None
    default_queue: str = Field(
        "batch", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Queue (class) for jobs that name none."
    )
    job_poll_interval: JobPollInterval = timedelta(seconds=10)
    connection_timeout: CommandTimeout = timedelta(seconds=30)
    max_retries: AdapterRetries = 3
    bin_dir: Path | None = Field(
        None,
        description="Directory of the MOAB client commands on the login host (e.g. /opt/moab/bin); default: the "
        "commands are found on the SSH session's PATH.",
    )
    remote_env: dict[str, str] = Field(
        default_factory=dict, description="Environment for the remote commands (e.g. MOABHOMEDIR)."
    )
    work_dir: Path | None = Field(
        None,
        description="Default working directory of jobs on the cluster (msub -d). With per-tenant accounts each "
        "job runs in <work_dir>/<account>, which the operator makes the account's own, mode 0700; work_dir itself "
        "is owned by root or ssh_user and writable by no one else. Over ssh both are checked before every msub "
        "(code work_dir_unsafe when they are not so).",
    )
    account: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Account jobs are charged to (msub -A)."
    )
    mws_ca_cert: Path | None = Field(
        None,
        description="CA bundle that verifies the MOAB Web Services certificate (rest transport); default: the "
        "system's roots. Verification cannot be turned off.",
    )
    mws_job_user: str | None = Field(
        None,
        pattern=ACCOUNT_PATTERN,
        description="Cluster user MWS submits the jobs as (credentials.user) when tenants are not isolated "
        "(hpc.tenants.isolation none); default: MOAB_USERNAME's own account. With per-tenant accounts each job "
        "names its tenant's account instead.",
    )
    tenant_key_dir: Path | None = Field(
        None,
        description="ssh transport with per-tenant accounts: directory holding one private key per tenant "
        "account, named after the account (<dir>/<account>); msub runs logged in as the tenant's account.",
    )
