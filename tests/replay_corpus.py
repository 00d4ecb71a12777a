"""The replay corpus: job and node workflow histories recorded by each tagged release, frozen.

``tests/histories/v<release>/`` holds one release's histories (``job-<scenario>.json``, ``node-<scenario>.json``)
and ``SHA256SUMS``, their digests in ``sha256sum`` format (``cd tests/histories/v0.3.0 && sha256sum -c SHA256SUMS``
checks them by hand). ``tests/record_histories.py`` writes a release's directory once, when the release is cut;
nothing ever rewrites it, and ``tests/test_replay.py`` fails if a committed history or its manifest changes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import WorkflowHistory

HISTORIES = Path(__file__).parent / "histories"
MANIFEST = "SHA256SUMS"
RELEASE = re.compile(r"^v(\d+)\.(\d+)\.(\d+)$")
OUTCOMES = frozenset({"completed", "failed", "cancelled-running", "routing-rejected"})
"""The job histories of every release's corpus."""
BRANCHES_SINCE_0_3 = OUTCOMES | {
    "workflow-cancelled",
    "cancel-before-submit",
    "submission-rejected",
    "recovered-submission",
    "multi-cluster",
    "continued-as-new",
    "continued-run",
    "deadline",
    "queue-wait-timeout",
    "vanished",
    "moved-to-new-build",
}
"""The job histories of every corpus from 0.3.0 on: a history for each branch of the job workflow."""
NODE_SCENARIOS = frozenset({"lifecycle", "continued"})


@dataclass(frozen=True)
class Corpus:
    """One release's histories."""

    path: Path

    @property
    def release(self) -> str:
        return self.path.name

    @property
    def version(self) -> tuple[int, ...]:
        found = RELEASE.match(self.release)
        assert found, f"{self.path} is not named v<major>.<minor>.<patch>"
        return tuple(int(part) for part in found.groups())

    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.json"))

    def scenarios(self, kind: str) -> set[str]:
        """The scenarios recorded for ``kind`` (``job`` or ``node``)."""
        return {p.stem.removeprefix(f"{kind}-") for p in self.files() if p.stem.startswith(f"{kind}-")}

    def histories(self) -> list[WorkflowHistory]:
        return [WorkflowHistory.from_json(f"{self.release}/{p.stem}", p.read_text()) for p in self.files()]


def releases(root: Path = HISTORIES) -> list[Corpus]:
    """Every release's corpus, oldest first."""
    found = [Corpus(p) for p in root.iterdir() if p.is_dir() and RELEASE.match(p.name)]
    return sorted(found, key=lambda c: c.version)


def previous_release(root: Path = HISTORIES) -> Corpus:
    """The newest recorded release: the one whose running jobs the code under test must not break."""
    return releases(root)[-1]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest_text(directory: Path) -> str:
    """``SHA256SUMS`` for the histories in ``directory`` (the format ``sha256sum`` writes and checks)."""
    return "".join(f"{digest(p)}  {p.name}\n" for p in sorted(directory.glob("*.json")))


def manifest_problems(corpus: Corpus) -> list[str]:
    """Why a release's corpus is not as it was recorded: a changed, added or removed history, or no manifest."""
    manifest = corpus.path / MANIFEST
    if not manifest.exists():
        return [f"{corpus.release} has no {MANIFEST}"]
    listed: dict[str, str] = {}
    for line in manifest.read_text().splitlines():
        hexdigest, _, name = line.partition("  ")
        listed[name] = hexdigest
    present = {p.name: p for p in corpus.files()}
    problems = [f"{corpus.release}/{name} is missing" for name in sorted(set(listed) - set(present))]
    problems += [f"{corpus.release}/{name} was added" for name in sorted(set(present) - set(listed))]
    problems += [
        f"{corpus.release}/{name} changed"
        for name in sorted(set(listed) & set(present))
        if digest(present[name]) != listed[name]
    ]
    return problems
