"""The repository's docs and comments stand alone: nothing in it cites a document the repository does not have
(the design notes the project was planned from live outside it; what a reader needs from them is in
docs/architecture.md, "The invariants")."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABSENT = re.compile(r"\b(DESIGN|STYLE|ENVIRONMENT|REFERENCE)\.md\b|\bDESIGN\b|\.\./shared\b|shared/seeds\b")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(
        b"\0"
    )
    paths = [REPO / name.decode() for name in names if name]
    return [
        p for p in paths if p.is_file() and p.suffix in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ""}
    ]


def test_no_file_cites_a_document_the_repository_does_not_have() -> None:
    this = Path(__file__).resolve()
    cited = []
    for path in tracked_text_files():
        if path.resolve() == this:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if ABSENT.search(line):
                cited.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert cited == [], "files cite documents the repository does not have:\n" + "\n".join(cited)
    assert (REPO / "docs" / "architecture.md").read_text().count("## The invariants") == 1


def test_every_python_file_the_docs_name_exists() -> None:
    """A module that moves takes the docs with it: every ``dir/file.py`` the docs, the README and the example
    config name is a file of the repository (a reader follows them to find where things live)."""
    cited_in = [
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "README.md",
        *sorted((REPO / "deploy").glob("*.yaml")),
    ]
    cited = {
        (path.relative_to(REPO).as_posix(), name)
        for path in cited_in
        for name in re.findall(
            r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+\.py\b", path.read_text(encoding="utf-8")
        )
    }
    assert len({name for _, name in cited}) > 40, "the docs name the project's files by path"
    assert sorted(f"{doc}: {name}" for doc, name in cited if not (REPO / name).is_file()) == []
