"""Dependencies: floors above published vulnerabilities, and a test environment pinned to what CI tested.

``pyproject.toml`` must refuse the vulnerable versions (a site that installs without the lock still gets fixed
ones), ``requirements-test.lock`` must satisfy every floor (else ``scripts/setup-venv.sh`` cannot install), and
the venv the tests run in must hold the locked versions (setup-venv installs with the lock as constraints).
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

# Last vulnerable release of each package the provider's processes load, and what it was vulnerable to.
VULNERABLE = {
    "pyjwt": ("2.12.1", "CVE-2024-53861, CVE-2026-32597, CVE-2026-48522..48526"),
    "h11": ("0.15.0", "CVE-2025-43859 request smuggling"),
    "cryptography": ("49.0.0", "CVE-2024-12797, CVE-2026-34073, CVE-2026-39892, CVE-2026-69247"),
    "paramiko": ("4.0.0", "CVE-2026-44405"),
    "starlette": ("1.0.0", "CVE-2025-62727, CVE-2026-48710"),
    "protobuf": ("6.33.4", "CVE-2025-4565, CVE-2026-0994"),
}


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for r in project["optional-dependencies"]["test"]]
    return {canonicalize_name(r.name): r for r in reqs}


def locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements-test.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned, f"requirements-test.lock: {line!r} is not a name==version pin"
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


@pytest.mark.parametrize("name", sorted(VULNERABLE))
def test_the_floors_refuse_vulnerable_versions(name: str) -> None:
    last_bad, why = VULNERABLE[name]
    requirement = requirements().get(name)
    assert requirement is not None, f"{name} has no floor in pyproject.toml ({why})"
    assert not requirement.specifier.contains(last_bad, prereleases=True), f"{name} {last_bad}: {why}"


def test_the_lock_satisfies_every_requirement_and_pins_it() -> None:
    pins = locked()
    for name, requirement in requirements().items():
        assert name in pins, f"requirements-test.lock does not pin {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements-test.lock pins {name}=={pins[name]}, pyproject.toml asks {requirement.specifier}: "
            "rerun scripts/lock-test-deps.sh"
        )


def test_the_tests_run_on_the_locked_versions() -> None:
    drift = {}
    for name, pinned in locked().items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            drift[name] = (pinned, None)
            continue
        if installed != pinned:
            drift[name] = (pinned, installed)
    assert not drift, (
        f"installed versions differ from requirements-test.lock (run scripts/setup-venv.sh): {drift}"
    )
