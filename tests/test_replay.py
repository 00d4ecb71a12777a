"""The replay corpus (``tests/histories/v<release>/``): frozen, and every history of it replays on this code.

A change that would break a job or node workflow already running in production (non-determinism) fails here, in
CI, before it is deployed. A history that changes after it was committed fails here too: the corpus is what a
release recorded, and only ``make record-histories RELEASE=x.y.z`` writes one, for a release that has none yet.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.replay_corpus import MANIFEST, Corpus, manifest_problems, manifest_text, releases
from workflows.hpc_job import HPCJobWorkflow
from workflows.node import NodeWorkflow

CORPORA = releases()
HISTORIES = [(corpus, path) for corpus in CORPORA for path in corpus.files()]


def test_the_corpus_holds_the_releases_histories() -> None:
    assert [c.release for c in CORPORA][:2] == ["v0.1.0", "v0.2.0"]
    for corpus in CORPORA:
        assert {"completed", "failed", "cancelled-running", "routing-rejected"} <= corpus.scenarios("job")
    assert {"lifecycle", "continued"} <= CORPORA[0].scenarios("node")


@pytest.mark.parametrize("corpus", CORPORA, ids=[c.release for c in CORPORA])
def test_a_releases_histories_are_exactly_what_it_recorded(corpus: Corpus) -> None:
    assert manifest_problems(corpus) == [], "committed histories never change; record a new release instead"


def test_a_changed_added_or_removed_history_is_caught(tmp_path: Path) -> None:
    copy = Corpus(tmp_path / CORPORA[-1].release)
    shutil.copytree(CORPORA[-1].path, copy.path)
    assert manifest_problems(copy) == []
    first, second = copy.files()[:2]
    first.write_text(first.read_text().replace('"eventId"', '"eventId" ', 1))
    second.unlink()
    (copy.path / "job-extra.json").write_text("{}")
    assert manifest_problems(copy) == [
        f"{copy.release}/{second.name} is missing",
        f"{copy.release}/job-extra.json was added",
        f"{copy.release}/{first.name} changed",
    ]
    (copy.path / MANIFEST).unlink()
    assert manifest_problems(copy) == [f"{copy.release} has no {MANIFEST}"]


def test_the_manifest_is_what_sha256sum_writes() -> None:
    corpus = CORPORA[0]  # its SHA256SUMS was written by sha256sum
    assert (corpus.path / MANIFEST).read_text() == manifest_text(corpus.path)


@pytest.mark.parametrize(("corpus", "path"), HISTORIES, ids=[f"{c.release}/{p.stem}" for c, p in HISTORIES])
async def test_history_replays_on_current_code(corpus: Corpus, path: Path) -> None:
    history = WorkflowHistory.from_json(f"{corpus.release}/{path.stem}", path.read_text())
    replayer = Replayer(workflows=[HPCJobWorkflow, NodeWorkflow], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
