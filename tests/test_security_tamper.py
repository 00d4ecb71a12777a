"""Tampered documents are rejected: usage records, workload templates and heartbeats, one field at a time.

Each signed document is turned into JSON and every leaf (every field, every metric, every nested value) is changed
in turn, as an attacker between signer and receiver would. Every changed copy must be refused by the receiver
that matters (the ledger for usage records and templates, the node API for heartbeats) with a security error,
and must leave no trace (no record stored, no sequence consumed, nothing forwarded). The untouched document is
accepted afterwards: the refusals came from the tampering, not from a receiver that refuses everything.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError as PydanticValidationError

from activities.audit import AuditLog, read_events
from activities.chain.local_ledger import LocalLedger
from activities.chain.node_ledger import NodeLedger
from tests.node_support import PROVIDER, SimulatedNode
from tests.pipeline_harness import TENANT
from tests.test_templates import PUBLISHER, custom_document
from virtengine_hpc.config import AuditConfig, NodesConfig
from virtengine_hpc.errors import ChainError, SecurityError
from virtengine_hpc.models import UsageMetrics, UsageRecord
from virtengine_hpc.node.heartbeat import REGISTRATION_DOMAIN, SignedHeartbeat, sign_document
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.templates import WorkloadTemplate, sign_template
from virtengine_hpc.templates.model import SignedTemplate
from virtengine_hpc.usage import sign_record, verify_record
from workers.node_api import NodeAPI

Path_ = tuple[str | int, ...]


def leaves(doc: Any, path: Path_ = ()) -> Iterator[Path_]:
    """The path of every scalar in a JSON document."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from leaves(value, (*path, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from leaves(value, (*path, index))
    else:
        yield path


def changed(value: Any) -> Any:
    """A different value of a plausible kind: what an attacker would write instead."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        try:
            return str(Decimal(value) + 1)
        except ArithmeticError:
            pass
        try:
            return (datetime.fromisoformat(value.replace("Z", "+00:00")) + timedelta(seconds=1)).isoformat()
        except ValueError:
            pass
        return value[:-1] + ("b" if value.endswith("a") else "a") if value else "a"
    return "1" if value is None else None


def tampered(doc: dict[str, Any], skip: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in leaves(doc):
        if path and path[0] in skip:
            continue
        copy_ = copy.deepcopy(doc)
        node: Any = copy_
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = changed(node[path[-1]])
        yield ".".join(map(str, path)), copy_


# ---- usage records --------------------------------------------------------------------------------------------

SIGNER = Signer.generate()


@pytest.fixture
def ledger(tmp_path: Path) -> LocalLedger:
    ledger = LocalLedger(tmp_path / "ledger.db")
    ledger.register_provider_key("virtengine1provider0test", public_key_b64(SIGNER.public_key))
    ledger.fund(TENANT, Decimal(100))
    ledger.submit_job(
        {
            "job_id": "JOB-1",
            "tenant": TENANT,
            "provider": "virtengine1provider0test",
            "offering_id": "offering-standard",
            "script": "true\n",
            "max_price": "10",
        }
    )
    return ledger


def signed_record() -> UsageRecord:
    start = datetime(2026, 11, 30, 12, tzinfo=UTC)
    return sign_record(
        UsageRecord(
            record_id="c1/JOB-1/1",
            job_id="JOB-1",
            cluster_id="c1",
            scheduler_job_id="4711",
            provider="virtengine1provider0test",
            tenant=TENANT,
            sequence=1,
            period_start=start,
            period_end=start + timedelta(minutes=5),
            job_state="running",
            is_final=False,
            metrics=UsageMetrics(
                wall_clock_seconds=Decimal("300"),
                cpu_core_seconds=Decimal("599.5"),
                memory_gb_seconds=Decimal("307.2"),
                gpu_seconds=Decimal("300"),
                node_hours=Decimal("0.083333"),
                storage_gb_hours=Decimal("0.5"),
                network_bytes_in=1000,
                network_bytes_out=2000,
                energy_joules=Decimal("12.5"),
                memory_bytes_max=1 << 30,
            ),
            created_at=start + timedelta(minutes=5),
            key_id=SIGNER.key_id,
        ),
        SIGNER,
    )


def test_every_field_of_a_usage_record_is_covered_by_its_signature(ledger: LocalLedger) -> None:
    original = signed_record()
    doc = json.loads(original.model_dump_json())
    refused = 0
    for where, copy_ in tampered(doc, skip={"signature"}):
        try:
            record = UsageRecord.model_validate(copy_)
        except PydanticValidationError:
            refused += 1  # the change made it malformed: refused before any signature check
            continue
        assert not verify_record(record, SIGNER.public_key), f"{where}: a changed record still verifies"
        with pytest.raises((SecurityError, ChainError)) as info:
            ledger.store_usage([record])
        assert isinstance(info.value, SecurityError), f"{where}: refused for another reason: {info.value}"
        assert ledger.usage_records("JOB-1") == [], f"{where}: something was stored"
        refused += 1
    assert refused == len(list(leaves(doc))) - 1, "every field was tried"
    # Another key's signature over the same content, and the genuine record.
    forged = sign_record(original, Signer.generate())
    with pytest.raises(SecurityError, match="not a registered key"):
        ledger.store_usage([forged])
    assert ledger.store_usage([original]).accepted == ["c1/JOB-1/1"]


def test_a_batch_with_one_tampered_record_is_refused_whole(ledger: LocalLedger) -> None:
    good = signed_record()
    bad = good.model_copy(
        update={
            "record_id": "c1/JOB-1/2",
            "sequence": 2,
            "metrics": good.metrics.model_copy(update={"cpu_core_seconds": Decimal(1)}),
        }
    )
    with pytest.raises(SecurityError, match="c1/JOB-1/2: signature does not verify"):
        ledger.store_usage([good, bad])
    assert ledger.usage_records("JOB-1") == []


# ---- workload templates ---------------------------------------------------------------------------------------


def test_every_field_of_a_custom_template_is_covered_by_its_signature(tmp_path: Path) -> None:
    ledger = LocalLedger(tmp_path / "ledger.db")
    publisher = Signer.generate()
    ledger.register_publisher_key(PUBLISHER, public_key_b64(publisher.public_key))
    signed = sign_template(WorkloadTemplate.model_validate(custom_document()), publisher)
    doc = json.loads(signed.model_dump_json())
    tried = 0
    for where, copy_ in tampered(doc, skip={"signature", "public_key"}):
        try:
            candidate = SignedTemplate.model_validate(copy_)
        except PydanticValidationError:
            continue
        tried += 1
        assert not candidate.verify(), f"{where}: a changed template still verifies"
        with pytest.raises(SecurityError):
            ledger.publish_template(candidate)
    assert tried >= 20, tried
    assert ledger.templates() == [], "nothing was published"
    assert ledger.publish_template(signed).status == "pending"


# ---- heartbeats -----------------------------------------------------------------------------------------------


class _Forwarded:
    def __init__(self) -> None:
        self.beats = 0

    async def heartbeat(self, cluster_id: str, node_id: str, beat: Any) -> None:
        self.beats += 1

    async def registered(self, cluster_id: str, node_id: str, registration: Any) -> None:
        return None


async def test_every_field_of_a_heartbeat_is_covered_by_its_signature(tmp_path: Path) -> None:
    ledger = NodeLedger(tmp_path / "ledger.db")
    audit_path = tmp_path / "audit.log"
    forwarded = _Forwarded()
    api = NodeAPI(
        ledger,
        AuditLog(AuditConfig(log_path=audit_path)),
        forwarded,
        provider_address=PROVIDER,
        settings=NodesConfig(audit_rate_window=timedelta(0)),
    )
    node = SimulatedNode("c1", "node-1")
    ledger.allow(node.cluster_id, node.node_id, node.public_key)
    status, answer = await api.register(json.dumps(node.registration()).encode(), "test")
    assert status == 200, answer
    genuine = node.heartbeat(1)
    outcomes: dict[str, int] = {}
    for where, copy_ in tampered(genuine, skip={"signature"}):
        status, answer = await api.heartbeat(node.node_id, json.dumps(copy_).encode(), {}, "test")
        assert status in (401, 422), f"{where}: {status} {answer}"
        reason = answer.error  # type: ignore[attr-defined]
        outcomes[reason] = outcomes.get(reason, 0) + 1
    fields = len(list(leaves(genuine))) - 1
    assert sum(outcomes.values()) == fields
    print("heartbeat tampering outcomes:", outcomes)
    assert outcomes.get("signature_invalid", 0) >= fields * 0.7, outcomes  # most changes are well-formed
    # The registration's signature over a heartbeat body: another domain, refused.
    cross = sign_document(SignedHeartbeat.model_validate(genuine), REGISTRATION_DOMAIN, node.signer)
    status, _ = await api.heartbeat(node.node_id, json.dumps(cross).encode(), {}, "test")
    assert status == 401
    row = ledger.get(node.cluster_id, node.node_id)
    assert row is not None and row.last_sequence == 0 and forwarded.beats == 0, "no trace of any of them"
    rejected = [e for e in read_events(audit_path) if e["event_type"] == "heartbeat_rejected"]
    assert len(rejected) == fields + 1 and all(e["category"] == "security" for e in rejected)
    status, _ = await api.heartbeat(node.node_id, json.dumps(genuine).encode(), {}, "test")
    assert status == 200 and forwarded.beats == 1
