"""The MOAB scheduler adapter (``scheduler_type: moab``); ``MoabAdapter`` is imported on first use.

Modules: ``adapter`` (the adapter, a thin subclass of ``activities.schedulers.batch``), ``backends`` (commands over
SSH, MOAB Web Services), ``parsers`` (``showq``/``checkjob`` XML, MWS JSON), ``states`` (the native-state table),
``script`` (``msub`` command line and script, MWS job). See ``docs/moab.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from activities.schedulers.registry import lazy

if TYPE_CHECKING:
    from activities.schedulers.moab.adapter import MoabAdapter

__all__ = ["MoabAdapter"]


def __getattr__(name: str) -> type[MoabAdapter]:
    """``from activities.schedulers.moab import MoabAdapter`` imports the adapter now, not with the package (PEP 562)."""
    return lazy(__name__, "moab", "MoabAdapter", name)  # type: ignore[return-value]
