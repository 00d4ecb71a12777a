"""The scheduler adapters by name: one table (``activities/schedulers/registry.py``), imported on demand.

Every ``scheduler_type`` the config accepts has an adapter, each adapter class carries its own name, and an
adapter package's ``__init__`` imports nothing until its adapter class is asked for, so importing a module of the
package (the parsers, the state table) does not import the adapter that imports that module back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from virtengine_hpc.config import SchedulerType
from virtengine_hpc.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_every_scheduler_type_has_an_adapter_that_carries_its_name() -> None:
    from activities.schedulers.registry import ADAPTERS, adapter_class

    assert sorted(ADAPTERS) == sorted(get_args(SchedulerType))
    for kind in ADAPTERS:
        assert adapter_class(kind).name == kind


def test_an_unknown_scheduler_is_a_config_error() -> None:
    from activities.schedulers.registry import adapter_class

    with pytest.raises(ConfigError, match=r"hpc\.scheduler_type: unknown scheduler 'pbs'"):
        adapter_class("pbs")


@pytest.mark.parametrize(
    ("package", "module", "cls"),
    [
        ("activities.schedulers.slurm", "activities.schedulers.slurm.parsers", "SlurmAdapter"),
        ("activities.schedulers.moab", "activities.schedulers.moab.parsers", "MoabAdapter"),
        ("activities.schedulers.ood", "activities.schedulers.ood.oidc", "OODAdapter"),
    ],
)
def test_an_adapter_package_imports_its_adapter_only_when_asked_for(
    package: str, module: str, cls: str
) -> None:
    adapter = f"{package}.adapter"
    probe = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print({adapter!r} in sys.modules)\n"
        f"from {package} import {cls}\n"
        f"print({adapter!r} in sys.modules, {cls}.__module__)\n"
        f"try:\n    from {package} import Nothing\nexcept ImportError as exc:\n    print(type(exc).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["False", f"True {adapter}", "ImportError"]
