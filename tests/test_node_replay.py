"""Replay the committed NodeWorkflow histories against the current code (non-determinism fails here, in CI).

Record new ones with ``python -m tests.record_node_histories`` when a release is cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.node import NodeWorkflow

HISTORIES = sorted((Path(__file__).parent / "histories" / "node").glob("*.json"))


def test_node_histories_are_committed() -> None:
    names = {path.stem.split("-", 1)[1] for path in HISTORIES}
    assert {"lifecycle", "continued"} <= names, "record them: python -m tests.record_node_histories"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_node_history_replays_on_current_code(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=[NodeWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
