"""The MOAB test cluster: the simulator (``tests/sim/moab.py``) behind a real sshd and an HTTPS MWS, and helpers
to build adapters for it the way a worker does (``MoabAdapter.from_config``).

Jobs run as tenant accounts, as in production: Alice and Bob are mapped to two system accounts made for the
simulator (``TENANT_USERS``), each with its own key file in ``tenant_key_dir`` (the simulator's sshd takes one
client key for every account). Without root (no accounts can be made) the tests run with ``isolation: none``.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from activities.schedulers.base import Accounting, NativeStatus, SchedulerAdapter, SubmitRequest, SubmitResult
from activities.schedulers.moab import MoabAdapter
from tests.conftest import make_config
from tests.sim import mws
from tests.sim.https import HttpsServer, TestCA, make_ca
from tests.sim.moab import MoabSim, Options, ensure_user
from tests.sim.sshd import SshServer
from virtengine_hpc.config import Config, Secrets
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState

MWS_USER = "mwsadmin"
MWS_PASSWORD = f"pw-{uuid.uuid4().hex}"
SIM_USER = "vehpcmoab"
TENANT_USERS = ("vehpc-mt1", "vehpc-mt2")
ALICE, BOB = "virtengine1tenant0alice", "virtengine1tenant0bob"


@dataclass
class MoabCluster:
    home: Path
    moab: MoabSim
    sshd: SshServer
    ca: TestCA
    mws_server: HttpsServer
    mws: mws.MwsState
    user: str
    work_dir: Path
    tenant_users: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    cluster_id: str = field(default_factory=lambda: f"moab-{uuid.uuid4().hex[:8]}")
    """One cluster id for the simulated cluster: a restarted worker serves the same cluster (the adoption marker
    binds it)."""

    @property
    def tenant_key_dir(self) -> Path:
        return self.home / "tenant-keys"

    def tenants_section(self) -> dict[str, Any]:
        """``hpc.tenants``: Alice and Bob on the simulator's two tenant accounts (none without root)."""
        if len(self.tenant_users) < 2:
            return {"isolation": "none"}
        return {"accounts": {ALICE: self.tenant_users[0], BOB: self.tenant_users[1]}}

    def output(self, name: str, number: str, account: str | None = None) -> Path:
        """A job's output file: in its account's directory under the work dir (the work dir without isolation)."""
        account = account if account is not None else (self.tenant_users[0] if self.tenant_users else "")
        return (self.work_dir / account if account else self.work_dir) / f"{name}.o{number}"

    @property
    def mws_url(self) -> str:
        return f"{self.mws_server.url}/mws"

    def moab_section(self, transport: str, **overrides: Any) -> dict[str, Any]:
        section: dict[str, Any] = {
            "transport": transport,
            "default_queue": "batch",
            "connection_timeout": "10s",
            "max_retries": 1,
            "work_dir": str(self.work_dir),
        }
        if transport == "ssh":
            section.update(
                ssh_host="127.0.0.1",
                ssh_port=self.sshd.port,
                ssh_user=self.user,
                ssh_key_path=str(self.sshd.client_key),
                known_hosts_path=str(self.sshd.known_hosts),
                tenant_key_dir=str(self.tenant_key_dir),
                bin_dir=str(self.moab.bin_dir),
                remote_env={"MOABHOMEDIR": str(self.moab.home)},
            )
        else:
            section.update(mws_url=self.mws_url, mws_ca_cert=str(self.ca.ca_cert), mws_job_user=self.user)
        section.update(overrides)
        return section

    def config(self, tmp: Path, transport: str, **overrides: Any) -> Config:
        return make_config(
            tmp,
            hpc={
                "scheduler_type": "moab",
                "cluster_id": self.cluster_id,
                "retry": {"max_retries": 1, "initial_backoff": "100ms", "max_backoff": "200ms"},
                "moab": self.moab_section(transport, **overrides),
                "tenants": self.tenants_section(),
            },
        )

    def adapter(self, tmp: Path, transport: str, *, hold: bool = False, **overrides: Any) -> MoabAdapter:
        config = self.config(tmp, transport, **overrides)
        adapter = MoabAdapter.from_config(config, secrets(), config.hpc.cluster_id)
        adapter.hold_jobs = hold
        return adapter


MARKER_SECRET = "moabtest-adoption-marker-secret-0123456789"
"""The tests' ``PROVIDER_MARKER_SECRET``: a restarted worker's adapter adopts what the first one submitted."""


def secrets() -> Secrets:
    return Secrets.from_env(
        {"MOAB_USERNAME": MWS_USER, "MOAB_PASSWORD": MWS_PASSWORD, "PROVIDER_MARKER_SECRET": MARKER_SECRET}
    )


@contextmanager
def moab_cluster(walltime_cap: float = 3.0, max_nodes: int = 4) -> Iterator[MoabCluster]:
    """Start the simulator, its sshd and its MWS; stop them all after."""
    home = Path(tempfile.mkdtemp(prefix="vehpc-moab-"))
    home.chmod(0o755)
    user = SIM_USER if ensure_user(SIM_USER) else pwd.getpwuid(os.geteuid()).pw_name
    # The provider's (the simulator's account), 0755: no tenant may plant entries beside the tenants' directories.
    work = home / "work"
    work.mkdir(mode=0o755)
    sim = pwd.getpwnam(user)
    os.chown(work, sim.pw_uid, sim.pw_gid)
    moab = MoabSim(home / "moab", Options(walltime_cap=walltime_cap, max_nodes=max_nodes))
    moab.start()
    sshd = SshServer.create(home / "ssh")
    sshd.start()
    tenants = TENANT_USERS if all(ensure_user(u, system=False) for u in TENANT_USERS) else ()
    keys = home / "tenant-keys"
    keys.mkdir(mode=0o700)
    for account in tenants:
        shutil.copyfile(sshd.client_key, keys / account)
        (keys / account).chmod(0o600)
        # What the operator makes (the adapter checks it over SSH before every msub; MWS cannot).
        entry = pwd.getpwnam(account)
        (work / account).mkdir(mode=0o700)
        os.chown(work / account, entry.pw_uid, entry.pw_gid)
    ca = make_ca(home / "tls")
    state = mws.MwsState(moab, MWS_USER, MWS_PASSWORD)
    server = HttpsServer(ca, mws.MwsHandler, mws.setup(state))
    server.start()
    try:
        yield MoabCluster(home, moab, sshd, ca, server, state, user, work, tenants)
    finally:
        server.stop()
        sshd.stop()
        moab.close()
        shutil.rmtree(home, ignore_errors=True)


def spec(job_id: str, script: str, **fields: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "job_id": job_id,
        "tenant": "virtengine1tenant0alice",
        "provider": "virtengine1provider0test",
        "offering_id": "offering-standard",
        "script": script,
        "walltime_seconds": 600,
        "resources": {"memory_mb_per_node": 256},
    }
    raw.update(fields)
    return JobSpec.model_validate(raw)


def workflow_id(label: str) -> str:
    return f"moabtest-{label}-{uuid.uuid4().hex[:8]}"


@dataclass
class Outcome:
    workflow_id: str
    submitted: SubmitResult
    final: NativeStatus
    states: list[JobState]
    usage: Accounting | None
    live: list[Accounting]


async def run_job(
    adapter: SchedulerAdapter,
    wf: str,
    job: JobSpec,
    *,
    on_running: Callable[[str], Awaitable[None]] | None = None,
    sample_usage: bool = False,
    timeout: float = 30,
) -> Outcome:
    submitted = await adapter.submit(SubmitRequest(workflow_id=wf, job=job, body=job.script or ""))
    job_id = submitted.scheduler_job_id
    states: list[JobState] = []
    live: list[Accounting] = []
    acted = False
    deadline = time.monotonic() + timeout
    while True:
        status = (await adapter.status_batch([job_id]))[job_id]
        assert status.found, status
        if not states or states[-1] != status.state:
            states.append(status.state)
        if status.state.final:
            break
        if status.state == JobState.RUNNING:
            if on_running is not None and not acted:
                acted = True
                await on_running(job_id)
            if sample_usage:
                live.append(await adapter.usage(job_id))
        assert time.monotonic() < deadline, f"{wf} not final after {timeout} s: {states}"
        await asyncio.sleep(0.2)
    usage = await adapter.usage(job_id)
    return Outcome(wf, submitted, status, states, usage, live)
