"""Usage records as a third party sees them: the documented format verifies with nothing but ``json``,
``base64`` and ``cryptography``; ``usage export`` gives that form; ``usage verify`` catches every kind of
tampering."""

from __future__ import annotations

import ast
import base64
import json
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.testing import ActivityEnvironment

from activities.chain.client import StatusReport
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SubmitRequest
from tests.conftest import make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import OFFERING, setup_ledger
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import UsageInput
from virtengine_hpc.metering import PRICED, Reading, basis_of, held, meter
from virtengine_hpc.models import Allocation, JobSpec, Resources, UsageMetrics, UsageRecord
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import (
    quantize,
    record_document,
    record_id,
    sign_record,
    signing_payload,
    sum_metrics,
    verify_record,
)
from workers.wiring import build_worker_deps

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "usage-records.md"
PROVIDER = "virtengine1provider0test"
TENANT = "virtengine1tenant0alice"
CLUSTER = "local-cluster"
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

Cli = Callable[..., tuple[int, str, str]]


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def make_records(signer: Signer, job_id: str, count: int = 3, version: int = 1) -> list[UsageRecord]:
    """A job's records as the workflow makes them: cumulative readings differenced, the last one final
    (format 1, as earlier releases wrote them, or format 2 with its allocation, basis and measured use)."""
    records = []
    for seq in range(1, count + 1):
        final = seq == count
        metrics = UsageMetrics(
            wall_clock_seconds=Decimal("300.000000"),
            cpu_core_seconds=Decimal("598.250000"),
            memory_gb_seconds=Decimal("15.728640"),
            node_hours=Decimal("0.083333"),
            network_bytes_in=1024 * seq,
            energy_joules=Decimal("12.5") if seq == 2 else None,
            memory_bytes_max=52_428_800,
        )
        v2: dict[str, Any] = {}
        if version == 2:  # 2 cores, 1 GiB and 10 GB held for 300 s, and what the job measurably used
            allocation = Allocation(nodes=1, cpus=2, memory_bytes=2**30, storage_gb=10)
            priced = {name: quantize(value) for name, value in held(allocation, Decimal(300)).items()}
            measured = {"cpu_time_seconds": Decimal("598.25"), "disk_bytes_written": 4096 * seq}
            metrics = metrics.model_copy(update=priced | measured)
            v2 = {"version": 2, "allocation": allocation, "basis": basis_of(metrics)}
        unsigned = UsageRecord(
            record_id=record_id(CLUSTER, job_id, seq),
            job_id=job_id,
            cluster_id=CLUSTER,
            scheduler_job_id="ジョブ-4242" if seq == 1 else "4242",  # non-ASCII must survive verbatim
            provider=PROVIDER,
            tenant=TENANT,
            sequence=seq,
            # Each period starts where the previous one ended.
            period_start=T0 + timedelta(minutes=5 * (seq - 1), microseconds=123 if seq > 1 else 0),
            period_end=T0 + timedelta(minutes=5 * seq, microseconds=123),
            job_state=JobState.COMPLETED if final else JobState.RUNNING,
            is_final=final,
            metrics=metrics,
            created_at=T0 + timedelta(minutes=5 * seq, seconds=1),
            key_id="",
            **v2,
        )
        records.append(sign_record(unsigned, signer))
    return records


@pytest.fixture
def workspace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Cli, LocalLedger, Signer, Path]:
    """A ledger created by the CLI with a generated provider key, and a finished job with three records on
    it."""
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "hpc": {
                    "cluster_id": CLUSTER,
                    "job_service": {"state_store_path": str(tmp_path / "state")},
                    "audit": {"log_path": str(tmp_path / "audit.log")},
                },
                "provider": {"address": PROVIDER},
            }
        )
    )

    def cli(*argv: str) -> tuple[int, str, str]:
        code = cli_main(["--config", str(config), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    key = tmp_path / "provider.key"
    assert cli("ledger", "init", "--generate-key", str(key))[0] == 0
    ledger = LocalLedger(tmp_path / "state" / "ledger.db")
    return cli, ledger, Signer.from_file(key), key


async def finished_job(
    ledger: LocalLedger, signer: Signer, version: int = 1
) -> tuple[str, list[UsageRecord]]:
    ledger.fund(TENANT, "10")
    job_id = ledger.submit_job(
        {"tenant": TENANT, "provider": PROVIDER, "offering_id": f"{CLUSTER}-standard", "max_price": "5"}
    )
    for state in (JobState.QUEUED, JobState.RUNNING):
        await ledger.report_status(StatusReport(job_id=job_id, state=state, cluster_id=CLUSTER))
    records = make_records(signer, job_id, version=version)
    result = await ledger.submit_usage(records)
    assert len(result.accepted) == 3
    return job_id, records


def export(cli: Cli, job_id: str, path: Path) -> list[dict[str, Any]]:
    code, _, err = cli("usage", "export", "--job", job_id, "--output", str(path))
    assert code == 0, err
    exported: list[dict[str, Any]] = json.loads(path.read_text())
    return exported


def run_doc_script(script: Path, records: Path, public_b64: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", str(script), str(records), public_b64],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )


# ---- the documented format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
async def test_the_docs_verifier_checks_records_this_project_signed(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path, version: int
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, records = await finished_job(ledger, signer, version)
    exported = export(cli, job_id, tmp_path / "records.json")
    assert [r["record_id"] for r in exported] == [r.record_id for r in records]

    code = next(block for block in doc_blocks("python") if "Ed25519PublicKey" in block)
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"base64", "datetime", "decimal", "hashlib", "json", "sys", "cryptography"}, imported
    script = tmp_path / "verify_usage.py"
    script.write_text(code)

    public = public_key_b64(signer.public_key)
    good = run_doc_script(script, tmp_path / "records.json", public)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.split("\n")[:3] == [f"OK   {r.record_id}" for r in records]

    # Change one digit of one metric: the documented verifier must see it.
    exported[1]["metrics"]["cpu_core_seconds"] = "598.26"
    (tmp_path / "tampered.json").write_text(json.dumps(exported))
    bad = run_doc_script(script, tmp_path / "tampered.json", public)
    assert bad.returncode == 1
    lines = bad.stdout.split("\n")
    assert lines[0] == f"OK   {records[0].record_id}" and lines[2] == f"OK   {records[2].record_id}"
    assert lines[1].startswith(f"FAIL {records[1].record_id}: signature does not verify")
    # Another provider's key verifies nothing.
    stranger = public_key_b64(Signer.generate().public_key)
    assert run_doc_script(script, tmp_path / "records.json", stranger).stdout.count("FAIL") == 3


def test_the_documented_test_vector_matches_the_code() -> None:
    text = DOC.read_text()
    seed = bytes.fromhex(re.search(r"`([0-9a-f]{64})`; public key", text).group(1))  # type: ignore[union-attr]
    blocks = doc_blocks("text")
    public_b64 = blocks[0].strip()
    signer = Signer(Ed25519PrivateKey.from_private_bytes(seed))
    assert public_key_b64(signer.public_key) == public_b64
    assert f"`key_id`: `{signer.key_id}`" in text
    vectors = [(blocks[1], blocks[2]), (blocks[3], blocks[4])]  # format 1, format 2
    for version, (message, signature_block) in enumerate(vectors, start=1):
        tag, body = message.rstrip("\n").split("\n")
        assert tag == f"virtengine-hpc/usage-record/v{version}"
        signature = signature_block.strip()
        record = UsageRecord.model_validate({**json.loads(body), "signature": signature})
        assert record.version == version
        assert signing_payload(record) == f"{tag}\n{body}".encode()
        assert verify_record(record, signer.public_key)
        assert sign_record(record, signer).signature == signature  # Ed25519 is deterministic
    # The format-2 vector is what the one metering function makes of its reading.
    v2 = UsageRecord.model_validate_json(vectors[1][0].split("\n", 1)[1])
    metered = meter(
        Reading(
            wall_clock_seconds=Decimal(300),
            cpu_time_seconds=Decimal("598.2"),
            memory_byte_seconds=Decimal(300 * 52428800),
            memory_bytes_max=52428800,
            disk_bytes_read=1048576,
            disk_bytes_written=4096,
        ),
        Resources(tasks_per_node=2, memory_mb_per_node=1024, storage_gb=10),
    )
    assert (v2.metrics, v2.allocation, v2.basis) == (metered.metrics, metered.allocation, metered.basis)


async def test_export_is_the_canonical_form(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, records = await finished_job(ledger, signer)
    exported = export(cli, job_id, tmp_path / "records.json")
    for item, record in zip(exported, records, strict=True):
        body = {k: v for k, v in item.items() if k != "signature"}
        dumped = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert signing_payload(record) == b"virtengine-hpc/usage-record/v1\n" + dumped.encode()
        assert item["signature"] == record.signature
    first = exported[0]
    assert first["metrics"]["cpu_core_seconds"] == "598.25" and first["metrics"]["gpu_seconds"] == "0"
    assert first["period_end"] == "2026-11-30T12:05:00.000123Z"
    assert first["scheduler_job_id"] == "ジョブ-4242"
    code, _, err = cli("usage", "export", "--job", "JOB-404")
    assert code == 2 and "unknown job" in err


# ---- usage verify ------------------------------------------------------------------------------------------


async def test_usage_verify_accepts_a_whole_job(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, key = workspace
    job_id, records = await finished_job(ledger, signer)
    code, out, _ = cli("usage", "verify", "--job", job_id)  # keys registered on the ledger
    assert code == 0, out
    assert [line.split()[:2] for line in out.splitlines()[:3]] == [["OK", r.record_id] for r in records]
    assert f"OK    job {job_id}: 3 records, sequences 1..3 gapless, one final record" in out
    assert out.rstrip().endswith("3 records: 3 ok, 0 failed")

    export(cli, job_id, tmp_path / "records.json")
    public = public_key_b64(signer.public_key)
    assert cli("usage", "verify", "--file", str(tmp_path / "records.json"), "--public-key", public)[0] == 0
    assert cli("usage", "verify", "--file", str(tmp_path / "records.json"), "--key-file", str(key))[0] == 0
    pem = tmp_path / "provider.pub.pem"
    pem.write_bytes(
        signer.public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    assert cli("usage", "verify", "--file", str(tmp_path / "records.json"), "--key-file", str(pem))[0] == 0
    # Another rendering of the same records (trailing zeros, "+00:00" times) is canonicalized before checking.
    pydantic_form = tmp_path / "pydantic.json"
    pydantic_form.write_text(json.dumps([r.model_dump(mode="json") for r in records]))
    assert "598.250000" in pydantic_form.read_text()
    assert cli("usage", "verify", "--file", str(pydantic_form), "--public-key", public)[0] == 0


async def test_usage_verify_catches_tampering(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, records = await finished_job(ledger, signer)
    good = export(cli, job_id, tmp_path / "records.json")
    public = public_key_b64(signer.public_key)

    def verify(items: list[dict[str, Any]], *extra: str) -> tuple[int, str]:
        path = tmp_path / "case.json"
        path.write_text(json.dumps(items))
        code, out, _ = cli("usage", "verify", "--file", str(path), *(extra or ("--public-key", public)))
        return code, out

    inflated = json.loads(json.dumps(good))
    inflated[2]["metrics"]["node_hours"] = "8.083333"
    code, out = verify(inflated)
    assert code == 1
    assert f"FAIL  {records[2].record_id}" in out and "signature does not verify" in out
    assert out.rstrip().endswith("3 records: 2 ok, 1 failed")

    code, out = verify([good[0], good[2]])  # a period removed
    assert code == 1 and f"FAIL  job {job_id}: sequence gap: missing 2" in out

    code, out = verify([good[0], good[1]])  # the final record withheld
    assert code == 1 and "no final record" in out

    code, out = verify([*good, good[1]])  # a period counted twice
    assert code == 1 and "sequence repeated: 2" in out

    promoted = json.loads(json.dumps(good))
    promoted[1]["is_final"] = True  # two finals, and the signature breaks too
    code, out = verify(promoted)
    assert code == 1 and "2 final records" in out and f"FAIL  {records[1].record_id}" in out

    renamed = json.loads(json.dumps(good))
    renamed[0]["record_id"] = f"{CLUSTER}/{job_id}/9"
    code, out = verify(renamed)
    assert code == 1 and f"record id should be {records[0].record_id}" in out

    code, out = verify(good, "--public-key", public_key_b64(Signer.generate().public_key))
    assert code == 1 and out.count("is not the given key") == 3

    broken = json.loads(json.dumps(good))
    broken[0]["sequence"] = "one"
    code, out = verify(broken)
    assert code == 1 and "FAIL  " + records[0].record_id in out and "malformed record: sequence" in out

    assert verify([])[0] == 1


async def test_usage_verify_with_ledger_keys_rejects_an_unregistered_signer(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, _ = await finished_job(ledger, signer)
    forged = make_records(Signer.generate(), job_id)
    path = tmp_path / "forged.json"
    path.write_text(json.dumps([r.model_dump(mode="json") for r in forged]))
    code, out, _ = cli("usage", "verify", "--file", str(path))
    assert code == 1 and out.count("is not registered on the ledger") == 3


def test_usage_verify_bad_input_is_a_clear_error(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, *_ = workspace
    junk = tmp_path / "junk.json"
    junk.write_text("{not json")
    code, _, err = cli(
        "usage", "verify", "--file", str(junk), "--public-key", base64.b64encode(b"x" * 32).decode()
    )
    assert code == 2 and "neither JSON nor JSON lines" in err
    code, _, err = cli("usage", "verify", "--file", str(junk), "--public-key", "not-base64!")
    assert code == 2 and "not a base64 Ed25519 public key" in err
    loose = tmp_path / "loose.key"
    loose.write_bytes(b"\x01" * 32)
    loose.chmod(0o644)
    code, _, err = cli("usage", "verify", "--file", str(junk), "--key-file", str(loose))
    assert code == 2 and "chmod 600" in err


# ---- what the format forbids, damaged rows, the registered keys ------------------------------------------------


async def test_usage_verify_refuses_what_the_format_forbids(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    """Each of these still carries a valid signature once a lenient reader has "repaired" it; the documented
    form forbids them, so a verifier must not vouch for them."""
    cli, ledger, signer, _ = workspace
    job_id, _ = await finished_job(ledger, signer)
    good = export(cli, job_id, tmp_path / "records.json")
    public = public_key_b64(signer.public_key)

    def verify_text(text: str) -> tuple[int, str]:
        path = tmp_path / "case.json"
        path.write_text(text)
        code, out, _ = cli("usage", "verify", "--file", str(path), "--public-key", public)
        return code, out

    def variant(seq: int, change: Callable[[dict[str, Any]], None]) -> str:
        items = json.loads(json.dumps(good))
        change(items[seq - 1])
        return json.dumps(items)

    assert verify_text(json.dumps(good))[0] == 0
    cases = {
        "metrics.cpu_core_seconds is 598.25: a decimal is written as a JSON string": variant(
            2, lambda r: r["metrics"].update(cpu_core_seconds=598.25)
        ),
        'is_final is "no": true or false': variant(1, lambda r: r.update(is_final="no")),
        'period_end is "2026-11-30T12:05:00.000123": a time is a JSON string in RFC 3339 with its zone': variant(
            1, lambda r: r.update(period_end=r["period_end"].rstrip("Z"))
        ),
        'sequence is "1": an integer is a JSON number': variant(1, lambda r: r.update(sequence="1")),
        # Nine digits: a reader cuts them to the microsecond, the signed instant, though this one is another.
        'period_end is "2026-11-30T12:05:00.000123999Z": a time is a JSON string in RFC 3339': variant(
            1, lambda r: r.update(period_end=r["period_end"].replace("Z", "999Z"))
        ),
        "energy_joules: missing": variant(1, lambda r: r["metrics"].pop("energy_joules")),
    }
    # A duplicate key: json keeps the last value (the signed one), hiding the first from a lenient reader.
    final = json.dumps(good[2], ensure_ascii=False)
    cases["duplicate key 'is_final'"] = json.dumps(good[:2], ensure_ascii=False)[:-1] + (
        ", " + final.replace("{", '{"is_final": false, ', 1) + "]"
    )
    for expected, text in cases.items():
        code, out = verify_text(text)
        assert code == 1, (expected, out)
        failed = [
            line for line in out.splitlines() if line.startswith("FAIL  ") and "malformed record" in line
        ]
        assert len(failed) == 1 and expected in failed[0], (expected, out)


async def test_a_damaged_stored_record_is_reported_not_a_traceback(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, records = await finished_job(ledger, signer)
    with sqlite3.connect(ledger.path) as db:
        db.execute(
            "UPDATE usage_records SET data = ? WHERE record_id = ?",
            ('{"record_id": "' + records[1].record_id + '", "sequence": "two"}', records[1].record_id),
        )
        db.execute("UPDATE usage_records SET data = 'not json' WHERE record_id = ?", (records[2].record_id,))
    code, out, err = cli("usage", "verify", "--job", job_id)
    assert code == 1 and "Traceback" not in out + err
    assert out.startswith(f"OK    {records[0].record_id}")
    assert f"FAIL  {records[1].record_id}" in out and "malformed record" in out
    assert "FAIL  #3" in out and "a record is a JSON object, not str" in out
    assert out.rstrip().endswith("3 records: 1 ok, 2 failed")

    code, out, err = cli("usage", "export", "--job", job_id)
    assert code == 1 and "Traceback" not in err
    assert [r["record_id"] for r in json.loads(out)] == [records[0].record_id]
    assert f"error: stored record {records[1].record_id}: malformed record" in err
    assert f"error: stored record {records[2].record_id}: malformed record" in err


async def test_ledger_keys_prints_what_the_documented_verifier_takes(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, ledger, signer, _ = workspace
    job_id, records = await finished_job(ledger, signer)
    export(cli, job_id, tmp_path / "records.json")
    rotated = Signer.generate()
    ledger.register_provider_key("virtengine1provider0other", public_key_b64(rotated.public_key))

    code, out, _ = cli("ledger", "keys")
    assert code == 0
    assert out.split("\n")[0].split() == ["PROVIDER", "KEY", "ID", "PUBLIC", "KEY", "(BASE64)", "REGISTERED"]
    rows = [line.split()[:3] for line in out.splitlines()[1:]]
    assert [PROVIDER, signer.key_id, public_key_b64(signer.public_key)] in rows
    assert ["virtengine1provider0other", rotated.key_id, public_key_b64(rotated.public_key)] in rows

    code, quiet, _ = cli("ledger", "keys", "--provider", PROVIDER, "--quiet")
    assert code == 0 and quiet.split() == [public_key_b64(signer.public_key)]
    code, by_id, _ = cli("ledger", "keys", "--key-id", records[0].key_id, "-q")
    assert by_id == quiet
    listed = json.loads(cli("ledger", "keys", "--json")[1])
    assert {k["provider"]: k["key_id"] for k in listed} == {
        PROVIDER: signer.key_id,
        "virtengine1provider0other": rotated.key_id,
    }
    assert cli("ledger", "keys", "--provider", "virtengine1nobody0x")[0] == 2

    code = next(block for block in doc_blocks("python") if "Ed25519PublicKey" in block)
    script = tmp_path / "verify_usage.py"
    script.write_text(code)
    checked = run_doc_script(script, tmp_path / "records.json", quiet.strip())
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_usage_verify_refuses_a_record_claiming_more_run_time_than_its_period(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    cli, _, signer, _ = workspace
    records = make_records(signer, "JOB-9", version=2)
    stretched = records[1].model_copy(
        update={"metrics": records[1].metrics.model_copy(update={"wall_clock_seconds": Decimal("300.5")})}
    )
    records[1] = sign_record(stretched, signer)  # signed: only the format's rule catches it
    path = tmp_path / "records.json"
    path.write_text(json.dumps([r.model_dump(mode="json") for r in records]))
    code, out, _ = cli(
        "usage", "verify", "--file", str(path), "--public-key", public_key_b64(signer.public_key)
    )
    assert code == 1
    assert f"FAIL  {records[1].record_id}" in out and "claims 300.5 s of run time in a 300 s period" in out
    assert out.rstrip().endswith("3 records: 2 ok, 1 failed")


async def test_usage_verify_checks_the_metering_rules_and_that_periods_follow_each_other(
    workspace: tuple[Cli, LocalLedger, Signer, Path], tmp_path: Path
) -> None:
    """Signed records that a tenant would dispute: each is caught by a rule of the format, not by its signature,
    by ``usage verify`` and by the verifier the documentation gives an outsider."""
    cli, _, signer, _ = workspace
    public = public_key_b64(signer.public_key)
    outsider = tmp_path / "verify_usage.py"
    outsider.write_text(next(block for block in doc_blocks("python") if "Ed25519PublicKey" in block))

    def verify(records: list[UsageRecord]) -> tuple[int, str]:
        path = tmp_path / "records.json"
        path.write_text(json.dumps([record_document(r) for r in records], ensure_ascii=False))
        code, out, _ = cli("usage", "verify", "--file", str(path), "--public-key", public)
        documented = run_doc_script(outsider, path, public)
        assert documented.returncode == code, (out, documented.stdout)
        return code, out

    def changed(version: int, seq: int, **update: Any) -> list[UsageRecord]:
        records = make_records(signer, "JOB-9", version=version)
        metrics = update.pop("metrics", {})
        record = records[seq - 1]
        update["metrics"] = record.metrics.model_copy(update=metrics)
        records[seq - 1] = sign_record(record.model_copy(update=update), signer)
        return records

    assert verify(make_records(signer, "JOB-9", version=2))[0] == 0
    first = make_records(signer, "JOB-9", version=2)[0]
    failures = {
        # The same 300 s billed twice: record 2 covers record 1's period again.
        "record 2's period starts at 2026-11-30T12:00:00.000000Z, not where record 1's ended "
        "(2026-11-30T12:05:00.000123Z)": changed(2, 2, period_start=first.period_start),
        "record 3's period starts at 2026-11-30T12:10:00.000124Z": changed(
            1, 3, period_start=T0 + timedelta(minutes=10, microseconds=124)
        ),
        "cpu_core_seconds 6000 is not allocation.cpus held for 300 s (600)": changed(
            2, 1, metrics={"cpu_core_seconds": Decimal(6000)}
        ),
        "memory_gb_seconds 322.123 is not allocation.memory_bytes held for 300 s (322.122547)": changed(
            2, 2, metrics={"memory_gb_seconds": Decimal("322.123")}
        ),
        "basis does not follow the format for cpu_time_seconds, memory_gb_seconds": changed(
            2, 1, basis={**first.basis, "memory_gb_seconds": "measured", "cpu_time_seconds": "allocated"}
        ),
        "basis does not follow the format for cpu_time_seconds": changed(
            2, 1, basis={k: v for k, v in first.basis.items() if k != "cpu_time_seconds"}
        ),
        "its period ends before it starts": changed(1, 1, period_end=T0 - timedelta(seconds=1)),
    }
    for expected, records in failures.items():
        code, out = verify(records)
        assert code == 1 and expected in out, (expected, out)


# ---- a job that runs across the upgrade to format 2 --------------------------------------------------------


async def test_a_job_whose_first_records_are_format_1_is_billed_once_for_each_period(
    tmp_path: Path, key_path: Path
) -> None:
    """A job ran 600 s under the earlier release, which signed two format-1 records (its CPU time used as its
    core-seconds, GiB-seconds); the upgraded worker reports the rest in format 2. The format-2 records price only
    their own periods (2 cores, 1 GiB held for their run time), and all four add up to the accounting settled."""
    config = make_config(tmp_path)
    signer = Signer.from_file(key_path)
    ledger = setup_ledger(config, signer)
    now = [0.0]  # the scheduler's clock, in seconds
    adapter = MemoryAdapter(
        default=Script(
            [(0, JobState.QUEUED), (1, JobState.RUNNING), (1000, JobState.COMPLETED)], exit_code=0
        ),
        clock=lambda: now[0],
    )
    deps = build_worker_deps(
        config,
        Secrets(provider_signing_key_path=key_path),
        chain=ledger,
        adapters={config.hpc.cluster_id: adapter},
    )
    raw = {
        "job_id": "JOB-upgrade",
        "tenant": TENANT,
        "provider": config.provider.address,
        "offering_id": OFFERING,
        "script": "x",
        "resources": {"tasks_per_node": 2, "memory_mb_per_node": 1024},
    }
    job = JobSpec.model_validate(raw)
    ledger.submit_job(raw)
    await ledger.report_status(StatusReport(job_id=job.job_id, state=JobState.RUNNING))
    scheduler_job_id = (
        await adapter.submit(SubmitRequest(workflow_id=job.job_id, job=job, body="x"))
    ).scheduler_job_id
    start = datetime.now(UTC) - timedelta(seconds=900)
    earlier = []
    for seq in (1, 2):
        unsigned = UsageRecord(
            record_id=record_id(config.hpc.cluster_id, job.job_id, seq),
            job_id=job.job_id,
            cluster_id=config.hpc.cluster_id,
            scheduler_job_id=scheduler_job_id,
            provider=job.provider,
            tenant=job.tenant,
            sequence=seq,
            period_start=start + timedelta(seconds=300 * (seq - 1)),
            period_end=start + timedelta(seconds=300 * seq),
            job_state=JobState.RUNNING,
            is_final=False,
            metrics=UsageMetrics(
                wall_clock_seconds=Decimal(300),
                cpu_core_seconds=Decimal(10),  # CPU time used, as format 1 priced it
                memory_gb_seconds=Decimal(300),  # 1 GiB x 300 s in GiB-seconds
                node_hours=Decimal("0.083333"),
            ),
            created_at=start + timedelta(seconds=300 * seq),
            key_id="",
        )
        earlier.append(sign_record(unsigned, signer))
    assert (await ledger.submit_usage(earlier)).accepted == [r.record_id for r in earlier]

    def report(sequence: int, previous: list[UsageRecord], *, final: bool) -> UsageInput:
        return UsageInput(
            job_id=job.job_id,
            tenant=job.tenant,
            provider=job.provider,
            cluster_id=config.hpc.cluster_id,
            scheduler_job_id=scheduler_job_id,
            sequence=sequence,
            period_start=previous[-1].period_end,
            previous_cumulative=sum_metrics([r.metrics for r in previous]),
            job_state=JobState.COMPLETED if final else JobState.RUNNING,
            is_final=final,
            report_accounting=final,
        )

    try:
        now[0] = 901.0  # 900 s run: 300 s since the last format-1 record
        await ActivityEnvironment().run(deps.activities.report_usage, report(3, earlier, final=False))
        now[0] = 1001.0  # it completed at 1000: 999 s run in all
        records = ledger.usage_records(job.job_id)
        out = await ActivityEnvironment().run(deps.activities.report_usage, report(4, records, final=True))
    finally:
        await deps.close()

    records = ledger.usage_records(job.job_id)
    assert [r.version for r in records] == [1, 1, 2, 2] and records[-1].is_final
    assert [r.metrics.wall_clock_seconds for r in records] == [300, 300, 300, 99]
    for record in records[2:]:
        assert record.allocation is not None and record.allocation.cpus == 2
        exact = held(record.allocation, record.metrics.wall_clock_seconds)
        for name in PRICED:
            assert abs(getattr(record.metrics, name) - exact[name]) <= Decimal("0.000001"), (
                name,
                record.metrics,
            )
    assert records[2].metrics.cpu_core_seconds == 600, (
        "2 cores x 300 s, not the job's 1800 less the 20 billed"
    )
    total = sum_metrics([r.metrics for r in records])
    assert total.wall_clock_seconds == 999
    assert total.cpu_core_seconds == 10 + 10 + 2 * 399
    assert out.cumulative == total and ledger.settlement(job.job_id) is not None
