"""Secrets never leave the environment (invariant 8 in docs/architecture.md), checked by looking everywhere they could end up.

A real worker process (``virtengine-hpc worker run --poller``, JSON logs at DEBUG) serves three clusters of one
provider: the local executor, MOAB through MOAB Web Services (the simulator behind HTTPS, which the worker
authenticates to with ``MOAB_USERNAME``/``MOAB_PASSWORD`` over HTTP Basic), and, when the local SLURM cluster is
up, SLURM through slurmrestd with the cluster's real JWT in ``SLURM_JWT_TOKEN``. ``OOD_OIDC_CLIENT_SECRET`` is set
too, and the provider's Ed25519 signing key signs every usage record. Jobs run to every end (completed, failed,
cancelled, refused by routing); each also prints its environment into its output.

Then every place a secret could leak is read and scanned for each secret in every form it could take (the
value, the Basic-auth header, the JWT's signature segment, the key's raw bytes, hex, base64 and PEM body): every
workflow history (raw protobuf, payloads included), every search attribute, the worker's whole log, the audit
log, the ledger's database file and every job's output. Positive controls make sure the scan looked at the
real thing: the histories hold the jobs' ids, the log holds DEBUG lines, the MWS simulator saw authenticated
requests, the job outputs hold the environment they printed.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pwd
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from activities.audit import verify_log
from activities.chain.local_ledger import LocalLedger
from tests import moab_support as ms
from tests import slurm_cluster as sc
from tests.conftest import REPO, make_config
from tests.pipeline_harness import TENANT
from virtengine_hpc.config import Config
from virtengine_hpc.messages import JobResult
from virtengine_hpc.models import Cluster, Partition, PricedQueue, Pricing, spec_digest
from virtengine_hpc.signing import Signer, public_key_b64, write_private_key
from virtengine_hpc.states import JobState

pytestmark = pytest.mark.timeout(300)

ENV_DUMP = "#!/bin/bash\necho ENV-DUMP-BEGIN\nenv\necho ENV-DUMP-END\n"


def _slurm_env() -> dict[str, Any] | None:
    probed = sc._probe()  # the SLURM tests' probe, without skipping this whole test
    if isinstance(probed, dict):
        return probed
    if os.environ.get("VEHPC_REQUIRE_SLURM") == "1":
        pytest.fail(f"VEHPC_REQUIRE_SLURM=1 but the SLURM cluster is not up: {probed}")
    return None


@pytest.fixture(scope="module")
def moab() -> Iterator[ms.MoabCluster]:
    with ms.moab_cluster(walltime_cap=30.0) as cluster:
        yield cluster


def secret_forms(secrets: dict[str, str], key_file: Path) -> dict[str, bytes]:
    """Every shape in which each secret could be written down."""
    forms: dict[str, bytes] = {}
    for name, value in secrets.items():
        forms[name] = value.encode()
    basic = base64.b64encode(f"{ms.MWS_USER}:{secrets['MOAB_PASSWORD']}".encode())
    forms["MOAB basic-auth header"] = basic
    jwt = secrets["SLURM_JWT_TOKEN"]
    if jwt.count(".") == 2:
        forms["SLURM_JWT_TOKEN signature"] = jwt.rsplit(".", 1)[1].encode()
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    forms["signing key (raw)"] = raw
    forms["signing key (hex)"] = raw.hex().encode()
    forms["signing key (base64)"] = base64.b64encode(raw).rstrip(b"=")
    forms["signing key (urlsafe base64)"] = base64.urlsafe_b64encode(raw).rstrip(b"=")
    forms["signing key (PEM body)"] = base64.b64encode(der)
    forms["signing key (DER)"] = der
    return forms


def scan(artifacts: dict[str, bytes], forms: dict[str, bytes]) -> list[str]:
    return [
        f"{secret} found in {where}"
        for where, data in artifacts.items()
        for secret, form in forms.items()
        if form in data
    ]


def write_config(config: Config, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def provider_ledger(config: Config, signer: Signer, clusters: dict[str, str]) -> LocalLedger:
    """Each cluster with one partition and its own offering, so each cluster's poller takes its own jobs."""
    ledger = LocalLedger(config.ledger_path, seconds_per_block=config.chain.seconds_per_block)
    for cluster_id, partition in clusters.items():
        ledger.register_cluster(
            Cluster(
                cluster_id=cluster_id,
                provider=config.provider.address,
                name=cluster_id,
                partitions=(Partition(name=partition, nodes=2, max_nodes=2, max_runtime_seconds=86400),),
                total_nodes=2,
                available_nodes=2,
            )
        )
        ledger.add_queue(
            PricedQueue(
                offering_id=f"offering-{cluster_id}",
                cluster_id=cluster_id,
                partition=partition,
                pricing=Pricing(
                    node_hour=Decimal(36), core_hour=Decimal("3.6"), minimum_charge=Decimal("0.01")
                ),
            )
        )
    ledger.register_provider_key(config.provider.address, public_key_b64(signer.public_key))
    ledger.fund(TENANT, Decimal(100_000))
    return ledger


async def wait_all(client: Client, ledger: LocalLedger, job_ids: list[str], timeout: float) -> dict[str, Any]:
    """Each job's workflow result, or the chain's final state for a job that never got a workflow."""
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(job_ids) and time.monotonic() < deadline:
        for job_id in job_ids:
            if job_id in results:
                continue
            try:
                desc = await client.get_workflow_handle(job_id).describe()
            except Exception:
                continue
            if desc.status != WorkflowExecutionStatus.RUNNING:
                results[job_id] = await client.get_workflow_handle(job_id, result_type=JobResult).result()
        await asyncio.sleep(0.5)
    missing = {j: getattr(ledger.job(j), "state", None) for j in job_ids if j not in results}
    assert not missing, f"not finished in {timeout:.0f} s: {missing}"
    return results


async def collect(
    client: Client,
    config: Config,
    ids: list[str],
    local_id: str,
    moab: ms.MoabCluster,
    slurm: dict[str, Any] | None,
) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Everything a secret could have been written to: ``(all artifacts, the job outputs among them)``."""
    artifacts: dict[str, bytes] = {}
    for job_id in ids:
        handle = client.get_workflow_handle(job_id)
        history = await handle.fetch_history()
        artifacts[f"history of {job_id}"] = history.to_json().encode() + b"\n".join(
            event.SerializeToString() for event in history.events
        )
        desc = await handle.describe()
        artifacts[f"search attributes of {job_id}"] = repr(
            [(pair.key.name, pair.value) for pair in desc.typed_search_attributes]
        ).encode()
    query = f"TaskQueue = '{config.temporal.task_queue}.{local_id}'"
    visible = [wf async for wf in client.list_workflows(query)]
    artifacts["visibility list"] = repr(
        [(wf.id, list(wf.typed_search_attributes)) for wf in visible]
    ).encode()
    artifacts["audit log"] = Path(config.hpc.audit.log_path).read_bytes()
    for path in config.state_dir.rglob("*"):
        if path.is_file():
            artifacts[f"state file {path.relative_to(config.state_dir)}"] = path.read_bytes()
    outputs: dict[str, bytes] = {}
    roots = [moab.work_dir, *([Path(slurm["jobs_dir"])] if slurm else [])]
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and any(job_id in path.name for job_id in ids):
                outputs[f"job output {path.name}"] = path.read_bytes()
    for path in config.local_state_dir.rglob("stdout"):
        outputs[f"local job output {path.parent.name}"] = path.read_bytes()
    artifacts.update(outputs)
    return artifacts, outputs


async def test_no_secret_reaches_histories_search_attributes_logs_audit_ledger_or_jobs(
    temporal_env: WorkflowEnvironment, client: Client, tmp_path: Path, moab: ms.MoabCluster
) -> None:
    slurm = _slurm_env()
    suffix = uuid.uuid4().hex[:6]
    canary = f"canary-{uuid.uuid4().hex}"  # not a secret: proves the scan reads files
    local_id, moab_id, slurm_id = f"sec-local-{suffix}", f"sec-moab-{suffix}", f"sec-slurm-{suffix}"
    key_file = tmp_path / "keys" / "provider.key"
    write_private_key(key_file)
    token = (
        Path(slurm["submit_jwt_token_file"]).read_text().strip()
        if slurm
        else f"eyJfake.{suffix}.tokensig{suffix}"
    )
    secrets = {
        "SLURM_JWT_TOKEN": token,
        "MOAB_PASSWORD": ms.MWS_PASSWORD,
        "OOD_OIDC_CLIENT_SECRET": f"oidc-client-secret-{uuid.uuid4().hex}",
    }
    clusters: list[dict[str, Any]] = [
        {"cluster_id": local_id, "scheduler_type": "local"},
        {
            "cluster_id": moab_id,
            "scheduler_type": "moab",
            "moab": moab.moab_section("rest", job_poll_interval="300ms", default_queue="batch"),
        },
    ]
    partitions = {local_id: "debug", moab_id: "batch"}
    if slurm:
        clusters.append(
            {"cluster_id": slurm_id, "scheduler_type": "slurm", "slurm": sc.slurm_section(slurm, "rest")}
        )
        partitions[slurm_id] = slurm["partition"]
    # One account for the tenant on both clusters: the SLURM cluster's first tenant account when it is up (the
    # simulator runs MWS jobs as any local account; its directory is what the operator would make), else the
    # simulator's own.
    account = sc.account_of(slurm) if slurm else moab.tenant_users[0]
    moab_dir = moab.work_dir / account
    if not moab_dir.exists():
        moab_dir.mkdir(mode=0o700)
        entry = pwd.getpwnam(account)
        os.chown(moab_dir, entry.pw_uid, entry.pw_gid)
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": local_id,
            "clusters": clusters,
            "usage_reporting": {"report_interval": "2s"},
            "tenants": {"accounts": {TENANT: account}},
            # No sweep: it would judge every job of the dev cluster's shared tenant accounts, other test runs'
            # included, from a worker process the tests' sweep filter (tests/conftest.py) does not reach.
            "job_service": {"sweep_interval": None},
        },
        temporal={
            "address": temporal_env.client.service_client.config.target_host,
            "task_queue": f"sec-{suffix}",
        },
        logging={"format": "json", "level": "DEBUG"},
    )
    ledger = provider_ledger(config, Signer.from_file(key_file), partitions)
    log_path = tmp_path / "worker.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("VIRTENGINE_HPC")},
        **secrets,
        "MOAB_USERNAME": ms.MWS_USER,
        "PROVIDER_SIGNING_KEY_PATH": str(key_file),
    }
    worker_cmd = [
        str(Path(sys.executable).parent / "virtengine-hpc"),
        "-c",
        str(write_config(config, tmp_path / "c.yaml")),
    ]
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [*worker_cmd, "worker", "run", "--poller", "--log-level", "DEBUG"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        jobs: dict[str, str] = {}

        def submit(label: str, cluster_id: str, script: str, **extra: Any) -> None:
            job_id = f"JOB-{label}-{uuid.uuid4().hex[:8]}"
            raw = {
                "job_id": job_id,
                "tenant": TENANT,
                "provider": config.provider.address,
                "offering_id": f"offering-{cluster_id}",
                "script": script,
                "walltime_seconds": 600,
                "max_price": "100",
                "resources": {"memory_mb_per_node": 256},
                **extra,
            }
            ledger.submit_job(raw)
            ledger.create_decision(job_id, cluster_id)
            jobs[label] = job_id

        submit("local-env", local_id, ENV_DUMP + f"# {canary}\n")
        submit("local-fail", local_id, "echo failing >&2\nexit 3\n")
        submit("local-cancel", local_id, "sleep 300\n")
        submit("local-refused", local_id, "true\n", partition="nosuchpartition")
        submit("moab-env", moab_id, ENV_DUMP)
        if slurm:
            submit("slurm-env", slurm_id, ENV_DUMP)
        deadline = time.monotonic() + 60
        while (job := ledger.job(jobs["local-cancel"])) is None or job.state != JobState.RUNNING:
            assert worker.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the job to cancel never ran: {job}"
            await asyncio.sleep(0.3)
        ledger.request_cancel(jobs["local-cancel"], tenant=TENANT)
        results = await wait_all(client, ledger, list(jobs.values()), timeout=180)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

    states = {label: results[job_id].state for label, job_id in jobs.items()}
    expected = {
        "local-env": JobState.COMPLETED,
        "local-fail": JobState.FAILED,
        "local-cancel": JobState.CANCELLED,
        "local-refused": JobState.FAILED,
        "moab-env": JobState.COMPLETED,
    }
    if slurm:
        expected["slurm-env"] = JobState.COMPLETED
    assert states == expected

    artifacts, outputs = await collect(client, config, list(jobs.values()), local_id, moab, slurm)
    ids = list(jobs.values())
    artifacts["worker log"] = log_path.read_bytes()

    # ---- positive controls: the scan reads what it claims to read ----
    for job_id in ids:
        assert job_id.encode() in artifacts[f"history of {job_id}"]
    assert b'"level": "DEBUG"' in artifacts["worker log"], "the worker logged at DEBUG"
    assert b"report_usage" in artifacts["worker log"] or b"watch_job" in artifacts["worker log"]
    assert verify_log(config.hpc.audit.log_path).ok
    assert b"usage_reported" in artifacts["audit log"] and b"job_validation_failed" in artifacts["audit log"]
    assert any(b"ENV-DUMP-END" in data for data in outputs.values()), "the jobs printed their environment"
    dumps = sum(b"ENV-DUMP-END" in data for data in outputs.values())
    assert dumps >= (3 if slurm else 2), sorted(outputs)
    assert moab.mws.requests, "the worker authenticated to MWS"
    assert ledger.usage_records(jobs["local-env"]), "records were signed with the key"

    # The digest of a job's spec travels only inside payloads: finding it proves the scan reads them. The canary
    # (in the script) proves it reads the ledger, and that the script itself never travels through Temporal.
    env_spec = ledger.job(jobs["local-env"]).raw_spec  # type: ignore[union-attr]
    assert spec_digest(env_spec).encode() in artifacts[f"history of {jobs['local-env']}"]
    canary_seen = scan(artifacts, {"canary": canary.encode()})
    assert any("ledger" in where for where in canary_seen), canary_seen
    assert not any("history" in where for where in canary_seen), canary_seen
    leaks = scan(artifacts, secret_forms(secrets, key_file))
    print(
        f"scanned {len(artifacts)} artifacts, {sum(map(len, artifacts.values())):,} bytes, "
        f"for {len(secret_forms(secrets, key_file))} secret forms (SLURM leg: {'yes' if slurm else 'no'})"
    )
    assert not leaks, "\n".join(leaks)
