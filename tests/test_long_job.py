"""A long job, run on Temporal's time-skipping test server: history stays bounded, usage stays whole.

A job that runs for a month with a usage record every 5 minutes writes about 52,000 history events. The workflow
continues as new when Temporal suggests it (4,096 events) or at ``hpc.job_service.continue_as_new_after_events``,
whichever comes first, carrying its state into the next run. These tests run such a job end to end with the real
activities, ledger and signer and the in-memory scheduler (``tests/long_job_support.py``), and check what an
operator and the chain would see: the job ends settled after several runs, no run's history comes near Temporal's
10,240-event warning, the usage records are gapless (sequences 1..N, each period starting where the previous one
ended) and add up to the final accounting, and every run's history replays on the current code.

The suite runs a few days of it (several runs on the server's suggestion, and more on the configured bound);
``benchmarks/long_job.py`` runs the whole month with the same checks and prints its figures (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.long_job_support import (
    DAY,
    RUN_MARGIN,
    TEMPORAL_HISTORY_WARNING,
    check_gapless_usage,
    check_runs_replay,
    run_long_job,
    skipping_server,
)
from virtengine_hpc.states import JobState


@pytest.fixture(scope="module")
async def skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    async with skipping_server() as env:
        yield env


@pytest.mark.timeout(600)
async def test_a_5_day_job_with_5_minute_reports_continues_as_new_when_temporal_suggests_and_settles(
    skipping_env: WorkflowEnvironment, tmp_path: Path, key_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five days of 5-minute reports (about 8,600 events): the server's suggestion ends each run, twice, the job's
    state carried into the next; the month (about 52,000 events, a dozen runs) is ``benchmarks/long_job.py``."""
    days = 5
    job = await run_long_job(skipping_env, tmp_path, key_path, monkeypatch, days=days)
    assert job.result.state == JobState.COMPLETED
    assert job.adapter.submits == 1, "continue-as-new never resubmits"
    # A record every 5 minutes from the moment the workflow saw the job running, a few milliseconds after it
    # started: the last period is cut short by the job's end and closed by the final record.
    assert len(job.records) == days * DAY // 300
    check_gapless_usage(job, key_path)
    lengths = [len(run.events) for run in job.runs]
    assert len(job.runs) >= 3, f"8,600 events need three runs, not {lengths}"
    assert max(lengths) < TEMPORAL_HISTORY_WARNING
    # The server's suggestion (4,096 events) comes first; the configured bound (5,000) is the backstop.
    assert max(lengths) <= 4_096 + RUN_MARGIN, lengths
    assert sum(lengths) > 8_000, "the whole history, across the runs"
    await check_runs_replay(job.runs)


async def test_the_configured_bound_continues_as_new_before_the_servers_suggestion(
    skipping_env: WorkflowEnvironment, tmp_path: Path, key_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hpc.job_service.continue_as_new_after_events`` holds where a server suggests late or never."""
    job = await run_long_job(
        skipping_env,
        tmp_path,
        key_path,
        monkeypatch,
        days=2,
        job_service={"continue_as_new_after_events": 500},
    )
    assert job.settings.continue_as_new_after_events == 500
    assert job.result.state == JobState.COMPLETED
    lengths = [len(run.events) for run in job.runs]
    assert len(job.runs) >= 5, lengths
    assert all(length <= 500 + RUN_MARGIN for length in lengths), lengths
    check_gapless_usage(job, key_path)
    await check_runs_replay(job.runs)
