"""The audit log's hash chain: intact logs verify, and an edited, removed, inserted or reordered line is
found, by ``verify_log`` and through ``virtengine-hpc audit verify``; ``audit show`` filters events."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from activities.audit import (
    EVENTS,
    GENESIS_HASH,
    AuditLog,
    _line_hash,
    anchor_block,
    anchor_path,
    events_since,
    verify_log,
)
from activities.chain.local_ledger import LocalLedger
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import AuditConfig
from virtengine_hpc.signing import Signer, public_key_b64, write_private_key

REPO = Path(__file__).resolve().parents[1]
Cli = Callable[..., tuple[int, str, str]]


PROVIDER = "virtengine1provider0audit"


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "provider.key"
    write_private_key(path)
    return path


@pytest.fixture
def log(tmp_path: Path, key_file: Path) -> Path:
    """Eight events of three jobs, as a worker holding the provider's key writes them (head signed)."""
    path = tmp_path / "audit.log"
    audit = AuditLog(AuditConfig(log_path=path), anchor_signer=Signer.from_file(key_file))
    audit.record("service_started", details={"pid": 1})
    for job in ("JOB-1", "JOB-2"):
        audit.record("job_submitted", job_id=job, cluster_id="c1", details={"scheduler_job_id": "7"})
        audit.record(
            "job_lifecycle_event", job_id=job, cluster_id="c1", details={"from": "pending", "to": "queued"}
        )
    audit.record("job_validation_failed", job_id="JOB-3", success=False, error_msg="nodes must be >= 1")
    audit.record(
        "routing_violation", job_id="JOB-3", severity=4, details={"violation_type": "missing_decision"}
    )
    audit.record("usage_reported", job_id="JOB-1", cluster_id="c1", details={"record_id": "c1/JOB-1/1"})
    return path


@pytest.fixture
def cli(tmp_path: Path, log: Path, key_file: Path, capsys: pytest.CaptureFixture[str]) -> Cli:
    """The CLI with a config whose ``hpc.audit.log_path`` is the fixture's log, and a ledger on which the
    provider's key is registered (where ``audit verify`` finds the key of the signed anchor)."""
    config = tmp_path / "config.yaml"
    ledger_path = tmp_path / "ledger.db"
    LocalLedger(ledger_path).register_provider_key(
        PROVIDER, public_key_b64(Signer.from_file(key_file).public_key)
    )
    config.write_text(
        json.dumps(
            {
                "hpc": {"audit": {"log_path": str(log)}},
                "provider": {"address": PROVIDER},
                "chain": {"ledger_path": str(ledger_path)},
            }
        )
    )

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli_main(["--config", str(config), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def rewrite(path: Path, new_lines: list[str]) -> None:
    path.write_text("".join(new_lines))


def test_an_intact_log_verifies(log: Path, cli: Cli) -> None:
    result = verify_log(log)
    assert result.ok and result.lines == 8
    code, out, _ = cli("audit", "verify")
    assert code == 0
    last = json.loads(lines(log)[-1])
    anchor = json.loads(anchor_path(log).read_text())
    assert anchor["seq"] == 8 and anchor["hash"] == last["hash"]
    assert out.strip() == (
        f"OK    {log}: 8 lines, hash chain intact; head seq 8 hash {last['hash']}; signed anchor at seq 8 "
        f"({anchor['anchored_at']}, key {anchor['key_id'][:16]}...)"
    )


def test_an_edited_line_is_found(log: Path, cli: Cli) -> None:
    content = lines(log)
    entry = json.loads(content[4])
    entry["details"]["to"] = "running"  # a quiet change of history
    content[4] = json.dumps(entry, sort_keys=True) + "\n"
    rewrite(log, content)
    code, out, _ = cli("audit", "verify")
    assert code == 1
    expected = "at line 5: line content does not match its hash (edited) (4 lines verified before it)"
    assert out.strip() == f"FAIL  {log} {expected}"


def test_an_edit_with_a_recomputed_hash_still_breaks_the_next_line(log: Path, cli: Cli) -> None:
    from activities.audit import _line_hash

    content = lines(log)
    entry = json.loads(content[5])
    entry.pop("hash")
    entry["success"] = True  # hide the validation failure ...
    entry["error_msg"] = None
    entry["hash"] = _line_hash(entry["prev_hash"], entry)  # ... and forge this line's own hash
    content[5] = json.dumps(entry, sort_keys=True) + "\n"
    rewrite(log, content)
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "at line 7" in out and "removed, inserted or reordered" in out


@pytest.mark.parametrize(
    ("change", "bad_line"),
    [
        (lambda c: c[:3] + c[4:], 4),  # a line removed from the middle
        (lambda c: c[1:], 1),  # the first line removed
        (lambda c: [*c[:2], c[3], c[2], *c[4:]], 3),  # two lines swapped
        (lambda c: [*c[:5], c[2], *c[5:]], 6),  # an old line replayed
    ],
    ids=["removed", "first-removed", "reordered", "duplicated"],
)
def test_removed_reordered_or_inserted_lines_are_found(
    log: Path, cli: Cli, change: Callable[[list[str]], list[str]], bad_line: int
) -> None:
    rewrite(log, change(lines(log)))
    result = verify_log(log)
    assert not result.ok and result.bad_line == bad_line
    code, out, _ = cli("audit", "verify", "--file", str(log))
    assert code == 1
    assert f"at line {bad_line}: chain broken: a line was removed, inserted or reordered" in out


def test_garbage_and_blank_lines_are_found(log: Path, cli: Cli) -> None:
    content = lines(log)
    rewrite(log, [*content[:2], "not json\n", *content[2:]])
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "at line 3: line is not valid JSON" in out
    rewrite(log, [*content[:2], "\n", *content[2:]])
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "at line 3: blank line" in out


def test_an_anchor_catches_lines_cut_from_the_end(log: Path, cli: Cli) -> None:
    head = json.loads(lines(log)[-1])["hash"]
    assert cli("audit", "verify", "--anchor", head)[0] == 0
    rewrite(log, lines(log)[:-2])  # the chain itself still verifies ...
    assert verify_log(log).ok
    code, out, _ = cli("audit", "verify", "--anchor", head)  # ... the anchor does not
    assert code == 1 and "is not in the chain" in out


def test_a_missing_log_is_reported(tmp_path: Path, cli: Cli) -> None:
    code, out, _ = cli("audit", "verify", "--file", str(tmp_path / "nope.log"))
    assert code == 1 and "cannot read" in out


_APPENDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from activities.audit import AuditLog
    from virtengine_hpc.config import AuditConfig
    from virtengine_hpc.signing import Signer

    audit = AuditLog(AuditConfig(log_path=Path(sys.argv[1])), anchor_signer=Signer.from_file(sys.argv[4]))
    for i in range(int(sys.argv[3])):
        audit.record("status_reported", job_id=f"{sys.argv[2]}-{i}", details={"state": "running"})
    """
)


def test_two_processes_appending_keep_one_chain(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "shared-audit.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _APPENDER, str(path), name, "150", str(key_file)],
            cwd=REPO,
            stderr=subprocess.PIPE,
        )
        for name in ("worker", "poller")
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert cli_main(["audit", "verify", "--file", str(path), "--key-file", str(key_file)]) == 0
    out = capsys.readouterr().out
    assert "300 lines, hash chain intact" in out and "signed anchor at seq 300" in out


# ---- the signed anchor ---------------------------------------------------------------------------------------


def test_cutting_the_last_line_is_found(log: Path, cli: Cli) -> None:
    rewrite(log, lines(log)[:-1])
    assert verify_log(log).ok, "the chain alone cannot tell"
    code, out, _ = cli("audit", "verify")
    assert code == 1
    assert out.strip() == (
        f"FAIL  {log}: the anchored line 8 is gone: the log ends at line 7 (lines cut off) "
        "(7 lines, hash chain intact)"
    )


def test_an_edit_with_every_hash_recomputed_is_found(log: Path, cli: Cli) -> None:
    """Hide the validation failure of JOB-3 and rebuild the whole chain after it: it verifies as a chain."""
    entries = [json.loads(line) for line in lines(log)]
    entries[5]["success"] = True
    entries[5]["error_msg"] = None
    prev = GENESIS_HASH
    for entry in entries:
        entry.pop("hash")
        entry["prev_hash"] = prev
        entry["hash"] = prev = _line_hash(prev, entry)
    rewrite(log, [json.dumps(e, sort_keys=True) + "\n" for e in entries])
    assert verify_log(log).ok
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "line 8 does not have the anchored hash" in out and "the log was rewritten" in out


def test_an_anchor_signed_by_another_key_or_removed_fails(log: Path, cli: Cli, tmp_path: Path) -> None:
    head = json.loads(lines(log)[-1])
    rewrite(log, lines(log)[:-1])  # cut a line, then forge an anchor for the new head with the attacker's key
    forged = json.loads(lines(log)[-1])
    anchor_path(log).write_bytes(anchor_block(forged["seq"], forged["hash"], Signer.generate()))
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "is not registered on the ledger for virtengine1provider0audit" in out
    code, out, _ = cli("audit", "verify", "--public-key", public_key_b64(Signer.generate().public_key))
    assert code == 1 and "signature does not verify with the provider's key" in out
    anchor_path(log).unlink()
    code, out, _ = cli("audit", "verify")
    assert code == 1 and "no signed anchor" in out
    code, out, _ = cli("audit", "verify", "--unanchored")
    assert code == 0 and "7 lines, hash chain intact" in out and head["hash"] not in out


def test_lines_of_a_process_without_the_key_are_reported_as_not_yet_anchored(log: Path, cli: Cli) -> None:
    AuditLog(AuditConfig(log_path=log)).record("service_started", details={"service": "poller"})
    code, out, _ = cli("audit", "verify")
    assert code == 0 and "signed anchor at seq 8" in out and "1 later lines not anchored yet" in out
    assert stat.S_IMODE(anchor_path(log).stat().st_mode) == 0o600


# ---- audit show --------------------------------------------------------------------------------------------


def test_audit_show_filters_by_job_event_and_tail(cli: Cli) -> None:
    code, out, _ = cli("audit", "show")
    assert code == 0 and len(out.splitlines()) == 8

    code, out, _ = cli("audit", "show", "--job", "JOB-1")
    shown = out.splitlines()
    assert [line.split()[3] for line in shown] == ["job_submitted", "job_lifecycle_event", "usage_reported"]

    code, out, _ = cli("audit", "show", "--job", "JOB-3", "--json")
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["event_type"] for e in events] == ["job_validation_failed", "routing_violation"]
    assert events[0]["success"] is False and events[1]["severity"] == 4

    code, out, _ = cli("audit", "show", "--event", "job_lifecycle_event", "--tail", "1")
    assert len(out.splitlines()) == 1 and "JOB-2" in out and '"to":"queued"' in out

    code, out, _ = cli("audit", "show", "--job", "JOB-3", "--event", "job_validation_failed")
    assert "FAIL" in out and "nodes must be >= 1" in out

    code, _, err = cli("audit", "show", "--event", "no_such_event")
    assert code == 2 and "unknown event type" in err


def test_audit_show_skips_a_garbled_line_with_a_warning(log: Path, cli: Cli) -> None:
    rewrite(log, [*lines(log), "{garbled\n"])
    code, out, err = cli("audit", "show", "--tail", "2")
    assert code == 0 and len(out.splitlines()) == 2
    assert "line 9 is not JSON" in err


def test_events_since_reads_back_only_as_far_as_asked(tmp_path: Path) -> None:
    """A poller's first sweep round asks the log which jobs earlier pollers already audited: the log is read from
    its end back to the instant asked for (its size does not matter), newest first, and a line a crash cut short
    is skipped rather than failing the read."""
    audit = AuditLog(AuditConfig(log_path=tmp_path / "audit.log"))
    start = datetime(2026, 12, 1, tzinfo=UTC)
    for minute in range(3000):
        audit.record(
            "unowned_job_found" if minute % 2 else "job_submitted",
            details={"scheduler_job_id": str(minute)},
            timestamp=start + timedelta(minutes=minute),
        )
    with open(tmp_path / "audit.log", "ab") as handle:
        handle.write(b'{"timestamp": "2026-12-04T')  # the last append, cut short

    found = events_since(tmp_path / "audit.log", start + timedelta(minutes=2994), ["unowned_job_found"])

    assert [e["details"]["scheduler_job_id"] for e in found] == ["2999", "2997", "2995"]
    assert events_since(tmp_path / "missing.log", start, ["unowned_job_found"]) == []


def test_docs_list_every_audit_event_under_its_category() -> None:
    """docs/production.md, "Audit events": an operator looks up there what an event means and which switch of
    ``hpc.audit`` records it; every name the log knows is listed once, in the row of its own category."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "production.md").read_text()
    section = text.split("### Audit events", 1)[1].split("\n### ", 1)[0]
    listed: dict[str, list[str]] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("category", "---"):
            for name in re.findall(r"`(\w+)`", cells[2]):
                listed.setdefault(name, []).append(cells[0])
    assert listed == {name: [category.value] for name, category in EVENTS.items()}


def test_a_line_written_with_an_audit_event_is_the_line_written_with_its_name(tmp_path: Path) -> None:
    """The hash chain covers every byte of a line: recording ``AuditEvent.X`` writes exactly what recording the
    plain name wrote before the names were defined in one place (these bytes and hashes were written then)."""
    at = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)

    def write(name: str, events: tuple[AuditEvent | str, AuditEvent | str]) -> bytes:
        log = AuditLog(AuditConfig(enabled=True, log_path=str(tmp_path / name)))
        log.record(
            events[0], job_id="job-1", cluster_id="c1", details={"scheduler_job_id": "42"}, timestamp=at
        )
        log.record(
            events[1],
            job_id="job-1",
            cluster_id="c1",
            success=False,
            severity=4,
            error_msg="cluster_mismatch",
            details={"type": "cluster_mismatch"},
            timestamp=at,
        )
        return (tmp_path / name).read_bytes()

    written = write("enum.log", (AuditEvent.JOB_SUBMITTED, AuditEvent.ROUTING_VIOLATION))
    assert written == write("names.log", ("job_submitted", "routing_violation"))
    assert written == (
        b'{"category": "job", "cluster_id": "c1", "details": {"scheduler_job_id": "42"}, "error_msg": null, '
        b'"event_type": "job_submitted", "hash": "cae629d02a38277ddf9a6d425236cfc360925c79032d993e8b4ec4fdaa971395", '
        b'"job_id": "job-1", "prev_hash": "0000000000000000000000000000000000000000000000000000000000000000", '
        b'"seq": 1, "severity": null, "success": true, "timestamp": "2026-12-02T08:00:00+00:00"}\n'
        b'{"category": "routing", "cluster_id": "c1", "details": {"type": "cluster_mismatch"}, '
        b'"error_msg": "cluster_mismatch", "event_type": "routing_violation", '
        b'"hash": "5e7166699379f2e2023242b23cc50bc3b9375cca275a472dcc957f21be7328f6", "job_id": "job-1", '
        b'"prev_hash": "cae629d02a38277ddf9a6d425236cfc360925c79032d993e8b4ec4fdaa971395", "seq": 2, '
        b'"severity": 4, "success": false, "timestamp": "2026-12-02T08:00:00+00:00"}\n'
    )
    assert verify_log(tmp_path / "enum.log").ok
    assert [type(e["event_type"]) for e in map(json.loads, written.splitlines())] == [str, str]
