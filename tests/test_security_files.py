"""The files that hold every tenant's jobs are private to the provider's account: the ledger (each job's script
and environment), its SQLite side files, the node tables, the audit log. Created 0600 under the usual umask; a
file an earlier version left readable by everyone loses the bits for others, and one rotated away comes back
0600."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.audit import AuditLog
from activities.chain.local_ledger import LocalLedger
from activities.chain.node_ledger import NodeLedger
from virtengine_hpc.config import AuditConfig
from virtengine_hpc.errors import ChainError


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)  # what services get by default: files 0644 unless created otherwise
    try:
        yield
    finally:
        os.umask(old)


def test_the_ledger_and_its_side_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ledger.db"
    ledger = LocalLedger(path)
    ledger.fund("tenant-1", "5")  # a write: the WAL and shared-memory files exist now
    job = ledger.submit_job(
        {
            "tenant": "tenant-1",
            "provider": "provider-1",
            "offering_id": "o-1",
            "script": "#!/bin/bash\nexport API_TOKEN=tenant-secret\n",
        }
    )
    assert "tenant-secret" in str(ledger.job(job).raw_spec)  # type: ignore[union-attr]
    side = [Path(f"{path}-wal"), Path(f"{path}-shm")]
    assert all(p.exists() for p in side)
    assert {p.name: mode(p) for p in (path, *side)} == {p.name: 0o600 for p in (path, *side)}
    NodeLedger(path).close()  # the node tables share the file and leave its mode alone
    assert mode(path) == 0o600


def test_a_ledger_left_readable_by_everyone_is_restricted(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    LocalLedger(path)
    os.chmod(path, 0o644)  # as an earlier version created it
    LocalLedger(path)
    assert mode(path) == 0o640, "others lose access; the owner's group keeps what the site gave it"


def test_the_node_ledger_creates_its_file_private(tmp_path: Path) -> None:
    path = tmp_path / "nodes.db"
    NodeLedger(path).close()
    assert mode(path) == 0o600


def test_the_audit_log_is_private_even_after_rotation(tmp_path: Path) -> None:
    path = tmp_path / "log" / "audit.log"
    audit = AuditLog(AuditConfig(log_path=path))
    audit.record("job_submitted", job_id="JOB-1", cluster_id="c1")
    assert mode(path) == 0o600
    path.rename(tmp_path / "audit.log.1")  # logrotate moves it away; the next event creates it again
    audit.record("job_submitted", job_id="JOB-2", cluster_id="c1")
    assert mode(path) == 0o600
    assert "JOB-2" in path.read_text()


def test_a_ledger_that_cannot_be_created_is_a_clear_error(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    with pytest.raises(ChainError, match=r"cannot create ledger .*not-a-dir/ledger\.db: Not a directory"):
        LocalLedger(blocked / "ledger.db")
    with pytest.raises(ChainError, match="cannot create node ledger"):
        NodeLedger(blocked / "ledger.db")
