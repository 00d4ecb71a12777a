"""A month-long job on Temporal's time-skipping test server: history per run, runs, records and wall time.

    .venv/bin/python benchmarks/long_job.py [--days 30] [--continue-as-new-after-events 5000]

One job with a usage record every 5 minutes runs ``--days`` simulated days end to end with the real activities,
ledger and signer and the in-memory scheduler (``tests/long_job_support.py``, what ``tests/test_long_job.py``
runs for a few days). The run checks what the suite checks (settled, submitted once, one record per period,
gapless and signed records that add up to the job's run, every run below Temporal's 10,240-event warning, every
run's history replays on this code) and prints the figures: runs, events per run, events in all, records, real
time. Target: no run above 10,240 events at any duration.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.long_job_support import (
    DAY,
    TEMPORAL_HISTORY_WARNING,
    check_gapless_usage,
    check_runs_replay,
    run_long_job,
    skipping_server,
)
from virtengine_hpc.signing import write_private_key
from virtengine_hpc.states import JobState


async def main(days: float, bound: int | None) -> None:
    job_service = {"continue_as_new_after_events": bound} if bound else None
    with tempfile.TemporaryDirectory(prefix="long-job-") as tmp, pytest.MonkeyPatch.context() as patch:
        tmp_path = Path(tmp)
        key_path = tmp_path / "keys" / "provider.key"
        write_private_key(key_path)
        async with skipping_server() as env:
            start = time.monotonic()
            job = await run_long_job(env, tmp_path, key_path, patch, days=days, job_service=job_service)
            ran = time.monotonic() - start
            assert job.result.state == JobState.COMPLETED, job.result
            assert job.adapter.submits == 1, "continue-as-new never resubmits"
            assert len(job.records) == int(days * DAY) // 300
            check_gapless_usage(job, key_path)
            lengths = [len(run.events) for run in job.runs]
            assert max(lengths) < TEMPORAL_HISTORY_WARNING, lengths
            replay_start = time.monotonic()
            await check_runs_replay(job.runs)
            replayed = time.monotonic() - replay_start
    print(f"simulated: {days:g} days, a usage record every 5 minutes ({len(job.records):,} records)")
    print(f"runs (continue-as-new): {len(job.runs)}")
    print(
        f"events per run: largest {max(lengths):,}, median {statistics.median(lengths):,.0f}, "
        f"last {lengths[-1]:,} (warning at {TEMPORAL_HISTORY_WARNING:,})"
    )
    print(f"events in all: {sum(lengths):,} ({sum(lengths) / len(job.records):.2f} per record)")
    print(f"real time: {ran:.0f} s to run, {replayed:.0f} s to replay every run")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument(
        "--continue-as-new-after-events",
        type=int,
        default=None,
        help="hpc.job_service.continue_as_new_after_events (default: the config's own, 5,000)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.days, args.continue_as_new_after_events))
