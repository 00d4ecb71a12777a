"""Graceful shutdown with real worker processes: SIGTERM one worker while it runs a job; another finishes it.

This is a deploy or a host drain, not a crash: the stopped worker exits 0 within its graceful shutdown timeout,
turns not-ready first, and the job goes on without failing on the other worker of the same cluster task queue,
with its usage records gapless, one final record, a correct settlement, and the job run exactly once by the local
executor (whose supervisors outlive the worker). The processes log JSON, which is checked line by line.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from tests.conftest import REPO, make_config
from tests.pipeline_harness import setup_ledger
from tests.production_support import submit, wait_result
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Config
from virtengine_hpc.messages import monitor_workflow_id
from virtengine_hpc.signing import Signer
from virtengine_hpc.states import JobState
from virtengine_hpc.usage import verify_record
from workers.metrics import free_loopback_port
from workers.wiring import task_queue

BURN = 'end=$((SECONDS+{s})); while [ "$SECONDS" -lt "$end" ]; do :; done\n'
GRACE = 1.0


class Worker:
    """``virtengine-hpc worker run`` as a child process, with its own metrics port and log file."""

    def __init__(self, config_path: Path, key_path: Path, log: Path, *, poller: bool) -> None:
        self.port = free_loopback_port()
        self.log = log
        args = [sys.executable, "-m", "virtengine_hpc", "-c", str(config_path), "worker", "run"]
        self.args = [*args, "--poller"] if poller else args
        self.env = dict(
            os.environ,
            PROVIDER_SIGNING_KEY_PATH=str(key_path),
            VIRTENGINE_HPC__METRICS__LISTEN=f"127.0.0.1:{self.port}",
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=out, stderr=out)

    async def ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
                try:
                    if (await http.get(f"http://127.0.0.1:{self.port}/readyz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise AssertionError(f"worker not ready in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def json_lines(self) -> list[dict[str, Any]]:
        lines = [line for line in self.log.read_text().splitlines() if line.strip()]
        return [json.loads(line) for line in lines]


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for worker in made:
        worker.stop()


def _activities_started(history: WorkflowHistory) -> list[tuple[float, str, Any]]:
    """(when, pid of the worker, attributes) of every activity attempt that started, in order."""
    return [
        (
            e.event_time.ToNanoseconds() / 1e9,
            e.activity_task_started_event_attributes.identity.split("@")[0],
            e.activity_task_started_event_attributes,
        )
        for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]


def _config(tmp_path: Path, env: WorkflowEnvironment, *, by_monitor: bool) -> tuple[Config, Path]:
    config = make_config(
        tmp_path,
        hpc={
            "cluster_id": f"c-{uuid.uuid4().hex[:8]}",
            "usage_reporting": {"report_interval": "30s"},
            "job_service": {"cluster_monitor": by_monitor},
        },
        temporal={
            "address": env.client.service_client.config.target_host,
            "task_queue": f"tq-{uuid.uuid4().hex[:8]}",
            "graceful_shutdown_timeout": f"{GRACE}s",
        },
        metrics={"jobs_refresh_interval": "0s"},
        logging={"format": "json"},
    )
    path = tmp_path / "config.yaml"
    # Only what differs from the defaults (a full dump trips the credential check on hpc.ood.oidc_token_url).
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    return config, path


@pytest.mark.parametrize(
    "by_monitor",
    [True, False],
    ids=["cluster monitor (default)", "watch activity (hpc.job_service.cluster_monitor off)"],
)
async def test_sigterm_during_a_job_hands_it_to_the_other_worker(
    temporal_env: WorkflowEnvironment,
    client: Client,
    tmp_path: Path,
    key_path: Path,
    workers: list[Worker],
    capsys: pytest.CaptureFixture[str],
    by_monitor: bool,
) -> None:
    config, path = _config(tmp_path, temporal_env, by_monitor=by_monitor)
    ledger = setup_ledger(config, Signer.from_file(key_path))
    first = Worker(path, key_path, tmp_path / "worker1.log", poller=True)
    second = Worker(path, key_path, tmp_path / "worker2.log", poller=False)
    workers += [first, second]
    first.start()
    await first.ready()

    job_id = submit(ledger, config, decide=config.hpc.cluster_id, script=BURN.format(s=8))
    deadline = time.monotonic() + 30
    while ledger.job(job_id).state != JobState.RUNNING and time.monotonic() < deadline:  # type: ignore[union-attr]
        await asyncio.sleep(0.2)
    assert ledger.job(job_id).state == JobState.RUNNING  # type: ignore[union-attr]
    second.start()
    await second.ready()

    assert first.proc is not None
    sent, sent_at = time.monotonic(), time.time()
    first.proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(first.proc.wait, GRACE + 20)
    took = time.monotonic() - sent
    assert code == 0, first.log.read_text()[-3000:]
    assert took < GRACE + 10, f"stopping took {took:.1f} s"

    result = await wait_result(client, job_id, timeout=90)
    assert result.state == JobState.COMPLETED, result.message

    first_pid, second_pid = str(first.proc.pid), str(second.proc.pid)  # type: ignore[union-attr]
    history = await client.get_workflow_handle(job_id).fetch_history()
    if by_monitor:
        # The job waits for its cluster's monitor without an activity of its own: nothing of it was cut short,
        # and what it still ran after SIGTERM (its final report and terminal status) ran on the second worker.
        assert not [e for e in history.events if e.HasField("activity_task_timed_out_event_attributes")]
        late = [by for at, by, _ in _activities_started(history) if at > sent_at + GRACE + 1]
        assert set(late) <= {second_pid}, late
        # The monitor's rounds went on on the second worker; a round the first was running when it stopped was
        # cancelled at the end of the grace period and retried at once (not after its heartbeat timeout).
        monitor = await client.get_workflow_handle(monitor_workflow_id(task_queue(config))).fetch_history()
        handed_over(_activities_started(monitor), first_pid, second_pid, sent_at, exactly_one=False)
    else:
        # The watch that was running on the first worker was cancelled at the end of the grace period and
        # retried at once on the second (not after its 10 s heartbeat timeout, as after a crash).
        handed_over(_activities_started(history), first_pid, second_pid, sent_at, exactly_one=True)

    records = ledger.usage_records(job_id)
    assert [r.sequence for r in records] == list(range(1, len(records) + 1))
    assert [r.is_final for r in records].count(True) == 1 and records[-1].is_final
    public = Signer.from_file(key_path).public_key
    assert all(verify_record(r, public) for r in records)
    settlement = ledger.settlement(job_id)
    assert settlement is not None and settlement.charged + settlement.refunded == settlement.escrow
    assert len(list((config.local_state_dir / "jobs").iterdir())) == 1, "the job ran exactly once"

    # Every line the processes wrote is a JSON object; the job's lines carry its id.
    lines = first.json_lines() + second.json_lines()
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any(
        line.get("job_id") == job_id and line["msg"].startswith("started workflow")
        for line in first.json_lines()
    )
    assert any(line["msg"].startswith("stopping") for line in first.json_lines())

    # Both workers signed the audit log's head after their lines: cutting its end would not go unnoticed.
    assert cli_main(["-c", str(path), "audit", "verify", "--key-file", str(key_path)]) == 0
    assert "hash chain intact" in capsys.readouterr().out
    assert (config.hpc.audit.log_path.parent / "audit.log.anchor").exists()


def handed_over(
    started: list[tuple[float, str, Any]],
    first_pid: str,
    second_pid: str,
    sent_at: float,
    *,
    exactly_one: bool,
) -> None:
    """The first worker ran some of these attempts, the second ran the last, and every retry ran on the second
    at once, after a ``WorkerShutdown`` (the attempt was cut short at the end of the grace period)."""
    by = [pid for _, pid, _ in started]
    assert first_pid in by and by[-1] == second_pid, by
    retries = [(at, pid, attrs) for at, pid, attrs in started if attrs.attempt > 1]
    if exactly_one:
        assert len(retries) == 1, retries
    for at, pid, attrs in retries:
        assert pid == second_pid and at - sent_at < GRACE + 5, (
            f"handed over {at - sent_at:.1f} s after SIGTERM"
        )
        assert attrs.last_failure.application_failure_info.type == "WorkerShutdown", attrs.last_failure
