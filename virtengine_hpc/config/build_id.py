"""The build id a worker uses unless one is configured: the package version and a digest of the workflow code."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path


def package_version() -> str:
    """The installed virtengine-hpc package's version (pyproject.toml): the build id unless one is configured."""
    try:
        return importlib.metadata.version("virtengine-hpc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def default_build_id() -> str:
    """The build id a worker uses unless one is configured: the package version and a digest of the code that
    decides what a workflow does (``workflows/`` and the messages and states it carries), so two builds whose
    workflow code differs never share an id even when nobody bumped the version."""
    digest = hashlib.sha256()
    for path in _workflow_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{package_version()}+wf.{digest.hexdigest()[:12]}"


DOMAIN_SOURCES = ("virtengine_hpc.messages", "virtengine_hpc.states", "virtengine_hpc.models")
"""The domain modules whose code a workflow carries (its input, state and the models in them)."""


def _workflow_sources() -> list[Path]:
    """The files ``default_build_id`` digests: the domain modules above, then ``workflows/*.py`` (not recursive).

    The domain files are found through the import system, not next to this file: this module lives in
    ``virtengine_hpc/config/``, where they are not, and a missing file is left out silently.
    """
    found = []
    for name in DOMAIN_SOURCES:
        module = importlib.util.find_spec(name)
        if module is not None and module.origin is not None:
            found.append(Path(module.origin))
    spec = importlib.util.find_spec("workflows")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found.extend(sorted(Path(location).glob("*.py")))
    return [path for path in found if path.is_file()]
