"""Replay the committed histories of earlier releases against the current workflow code.

A change that would break a job already running in production (non-determinism) fails here, in CI, before it is
deployed. Record new histories with ``python -m tests.record_histories`` when a release is cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.hpc_job import HPCJobWorkflow

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_histories_are_committed() -> None:
    assert len(HISTORIES) >= 4, (
        "tests/histories must hold recorded job histories (python -m tests.record_histories)"
    )


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays_on_current_code(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[HPCJobWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
