"""The SLURM scheduler adapter (``scheduler_type: slurm``); ``SlurmAdapter`` is imported on first use.

Modules: ``adapter`` (the adapter), ``base`` (the batch-scheduler base MOAB shares), ``backends`` (CLI, slurmrestd,
pyslurm operations), ``transports`` (local processes, SSH, HTTP), ``parsers`` (squeue/sacct/sstat/REST output),
``states`` (the native-state table), ``script`` (batch script and REST job description). See ``docs/slurm.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from activities.schedulers.registry import lazy

if TYPE_CHECKING:
    from activities.schedulers.slurm.adapter import SlurmAdapter

__all__ = ["SlurmAdapter"]


def __getattr__(name: str) -> type[SlurmAdapter]:
    """``from activities.schedulers.slurm import SlurmAdapter`` imports the adapter now, not with the package (PEP 562)."""
    return lazy(__name__, "slurm", "SlurmAdapter", name)  # type: ignore[return-value]
