"""Keys and host keys (invariants 8 and 10 in docs/architecture.md), checked on the real processes and the real sshd.

* A private key file that group or others may read is refused before it is used: by the worker process (the
  provider's signing key from ``PROVIDER_SIGNING_KEY_PATH``), also through a symlink, and by ``hpc-node-agent``
  (the node's key). The process exits with the reason and the fix, and never connects anywhere with it.
* SSH refuses a host it cannot verify: the SLURM adapter's SSH transport against the local cluster's sshd with
  an empty ``known_hosts``, a ``known_hosts`` holding another key for that host, and no ``known_hosts`` at all
  (the system's, here empty). The submission fails at once as a non-transient ``SecurityError`` (never retried
  until it "works"), no job reaches Slurm, and nothing is added to ``known_hosts``. End to end over the MOAB
  simulator's sshd: the job fails with the reason on chain, after one attempt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.schedulers.base import SubmitRequest
from activities.schedulers.moab import MoabAdapter
from tests import moab_support as ms
from tests import slurm_cluster as sc
from tests.conftest import REPO, make_config
from tests.pipeline_harness import Pipeline, running_pipeline
from virtengine_hpc.errors import SecurityError
from virtengine_hpc.signing import write_private_key
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.timeout(120)
BIN = Path(sys.executable).parent


def _run(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# ---- key files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "link"), [(0o640, False), (0o604, False), (0o644, True)])
def test_the_worker_refuses_a_signing_key_others_can_read(
    temporal_env: WorkflowEnvironment, tmp_path: Path, mode: int, link: bool
) -> None:
    key = tmp_path / "keys" / "provider.key"
    write_private_key(key)
    key.chmod(mode)
    given = key
    if link:  # the mode that counts is the file's, not the link's
        given = tmp_path / "provider-link.key"
        given.symlink_to(key)
    config = make_config(
        tmp_path, temporal={"address": temporal_env.client.service_client.config.target_host}
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = {**os.environ, "PROVIDER_SIGNING_KEY_PATH": str(given)}
    done = _run([str(BIN / "virtengine-hpc"), "-c", str(path), "worker", "run"], env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"accessible by group or others (mode {mode:o}); chmod 600 it" in done.stderr
    assert "Traceback" not in done.stderr
    assert "worker for cluster" not in done.stderr, "it never started serving"


def test_the_node_agent_refuses_a_key_others_can_read(tmp_path: Path) -> None:
    key = tmp_path / "agent.key"
    write_private_key(key)
    key.chmod(0o644)
    config = tmp_path / "hpc-node-agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node-id": "node-001",
                "cluster-id": "hpc-cluster-1",
                "provider-address": "virtengine1provider0test",
                "provider-daemon-url": "http://127.0.0.1:9",
                "key-file": str(key),
            }
        )
    )
    for action in ("start", "register"):
        done = _run([str(BIN / "hpc-node-agent"), action, "--config", str(config)], dict(os.environ), 30)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "chmod 600" in done.stderr and "Traceback" not in done.stderr
        assert not key.with_name("agent.key.seq").exists(), "it stopped before touching its sequence file"


# ---- SSH host keys: the SLURM cluster's sshd -----------------------------------------------------------------


def _other_host_key_line(host: str, port: int) -> str:
    public = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    return f"[{host}]:{port} {public}\n"


@pytest.fixture
def slurm_env() -> dict[str, Any]:
    return sc.cluster()


@pytest.mark.slurm
@pytest.mark.parametrize("known", ["empty", "other key", "none configured"])
async def test_slurm_over_ssh_refuses_a_host_it_cannot_verify(
    slurm_env: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, known: str
) -> None:
    env = slurm_env
    known_hosts: Path | None = tmp_path / "known_hosts"
    assert known_hosts is not None
    if known == "empty":
        known_hosts.write_text("")
    elif known == "other key":
        known_hosts.write_text(_other_host_key_line(env["ssh_host"], env["ssh_port"]))
    else:
        known_hosts = None
        monkeypatch.setenv("HOME", str(tmp_path))  # the system known_hosts: ~/.ssh/known_hosts, absent here
    before = known_hosts.read_text() if known_hosts else None
    adapter = sc.adapter(env, "ssh", known_hosts_path=str(known_hosts) if known_hosts else None)
    wf = sc.workflow_id("hostkey")
    try:
        with pytest.raises(SecurityError) as info:
            await adapter.submit(SubmitRequest(workflow_id=wf, job=sc.spec(wf, "true\n"), body="true\n"))
        assert not info.value.transient, "a host key problem is not retried until it goes away"
        message = str(info.value)
        assert "refusing to connect" in message
        assert ("does not match" in message) == (known == "other key"), message
        with pytest.raises(SecurityError):
            await adapter.status_batch(["1"])
    finally:
        await adapter.close()
    assert sc.sacct_jobs_of(env, wf) == []
    assert wf not in sc.slurm_command(env, ["squeue", "-h", "-o", "%j"])
    if known_hosts is not None:
        assert known_hosts.read_text() == before, "the unknown key was not added"
    else:
        assert not (tmp_path / ".ssh" / "known_hosts").exists()


# ---- end to end: a job for an unverifiable host fails with the reason, after one attempt ---------------------


@pytest.fixture(scope="module")
def moab() -> Iterator[ms.MoabCluster]:
    with ms.moab_cluster() as cluster:
        yield cluster


@pytest.fixture
async def pipe(
    client: Client, tmp_path: Path, key_path: Path, task_queue: str, moab: ms.MoabCluster
) -> AsyncIterator[Pipeline]:
    wrong = tmp_path / "known_hosts"
    wrong.write_text(_other_host_key_line("127.0.0.1", moab.sshd.port))
    config = make_config(
        tmp_path,
        hpc={
            "scheduler_type": "moab",
            "cluster_id": f"moab-{uuid.uuid4().hex[:8]}",
            "retry": {"max_retries": 3, "initial_backoff": "100ms", "max_backoff": "200ms"},
            "moab": moab.moab_section("ssh", known_hosts_path=str(wrong), default_queue="batch"),
            "tenants": moab.tenants_section(),
        },
    )
    adapter = MoabAdapter.from_config(config, ms.secrets(), config.hpc.cluster_id)
    async with running_pipeline(client, config, key_path, adapter, task_queue) as p:
        yield p


async def test_a_job_for_a_host_that_fails_verification_fails_once_with_the_reason(
    pipe: Pipeline, moab: ms.MoabCluster
) -> None:
    job_id = pipe.submit(script="echo never\n")
    result = (await pipe.run_until_done([job_id], timeout=60))[job_id]
    assert result.state == JobState.FAILED
    assert "does not match known_hosts" in result.message and "refusing to connect" in result.message
    failures = pipe.audit_events("job_submission_failed", job_id)
    assert len(failures) == 1 and failures[0]["details"]["code"] == "security_violation"
    assert [e["details"]["attempt"] for e in failures] == [1], "not retried"
    assert not pipe.audit_events("job_submitted", job_id)
    assert not [j for j in moab.moab.jobs.values() if job_id in j.name], "nothing reached MOAB"
    settlement = pipe.ledger.settlement(job_id)
    assert settlement is not None and settlement.charged == 0, "the tenant is refunded in full"
