"""The recorder of the replay corpus (``make record-histories RELEASE=x.y.z``).

* It never touches a release's corpus once recorded: a release that has one is refused, files unchanged.
* It records every branch of the job workflow and the node workflow's scenarios, each checked to have taken
  its branch and replayed, into a new directory with its ``SHA256SUMS`` (here into a temporary one, on the
  session's dev server; the committed corpora are recorded by the command on a fresh server).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import Client

from tests.record_histories import corpus_dir, main, record_corpus
from tests.replay_corpus import (
    BRANCHES_SINCE_0_3,
    MANIFEST,
    NODE_SCENARIOS,
    Corpus,
    manifest_problems,
    releases,
)


def test_a_release_that_has_its_corpus_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    corpus = releases()[-1]
    before = {p.name: p.read_bytes() for p in corpus.path.iterdir()}
    assert main(["--release", corpus.release.removeprefix("v")]) == 2
    assert "frozen" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in corpus.path.iterdir()} == before


def test_the_release_is_named_and_explicit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])  # no release: argparse refuses
    assert main(["--release", "latest", "--into", str(tmp_path)]) == 2
    assert "not a version" in capsys.readouterr().err
    assert corpus_dir("0.9.1", tmp_path) == tmp_path / "v0.9.1"
    assert corpus_dir("0.9", tmp_path) == tmp_path / "v0.9.0"
    (tmp_path / "v0.9.1").mkdir()
    with pytest.raises(ValueError, match="frozen"):
        corpus_dir("v0.9.1", tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "v0.9.1"]


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_recorder_records_every_branch(client: Client, tmp_path: Path) -> None:
    target = corpus_dir("9.9.9", tmp_path)
    events = await record_corpus(client, target)
    corpus = Corpus(target)
    assert corpus.scenarios("job") == BRANCHES_SINCE_0_3
    assert corpus.scenarios("node") == NODE_SCENARIOS
    assert (target / MANIFEST).exists() and manifest_problems(corpus) == []
    assert set(events) == {p.stem for p in corpus.files()}
    assert [p.name for p in tmp_path.iterdir()] == ["v9.9.9"], "no staging directory left behind"
