"""The scheduler adapters by name: the one list of them.

``hpc.scheduler_type`` (and a cluster entry's) names an adapter here, and so does ``hpc.ood.underlying_scheduler``.
Each entry is ``"module:Class"``, imported only when an adapter of that kind is built: a worker of a SLURM cluster
never imports the MOAB adapter, and an adapter whose optional packages are missing fails only where it is asked
for, with a configuration error that says so. Each adapter class carries its entry's name as ``name``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from virtengine_hpc.errors import ConfigError

if TYPE_CHECKING:
    from activities.schedulers.base import SchedulerAdapter

ADAPTERS: dict[str, str] = {
    "local": "activities.schedulers.local:LocalAdapter",
    "slurm": "activities.schedulers.slurm.adapter:SlurmAdapter",
    "moab": "activities.schedulers.moab.adapter:MoabAdapter",
    "ood": "activities.schedulers.ood.adapter:OODAdapter",
}


def adapter_class(kind: str) -> type[SchedulerAdapter]:
    """The adapter class registered as ``kind``, imported now if it was not yet."""
    where = ADAPTERS.get(kind)
    if where is None:
        raise ConfigError(f"hpc.scheduler_type: unknown scheduler {kind!r}")
    module, _, name = where.partition(":")
    try:
        found: type[SchedulerAdapter] = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"hpc.scheduler_type: the {kind} adapter is not available ({exc})") from None
    return found


def lazy(package: str, kind: str, class_name: str, attribute: str) -> type[SchedulerAdapter]:
    """A package ``__init__``'s ``__getattr__`` (PEP 562): its adapter class, imported on first use, so that
    importing the package (or one of its modules) does not import the adapter and everything it imports."""
    if attribute != class_name:
        raise AttributeError(f"module {package!r} has no attribute {attribute!r}")
    return adapter_class(kind)
