"""The SLURM scheduler adapter (``scheduler_type: slurm``); importing this package registers it.

Modules: ``adapter`` (the adapter), ``base`` (the batch-scheduler base MOAB shares), ``backends`` (CLI, slurmrestd,
pyslurm operations), ``transports`` (local processes, SSH, HTTP), ``parsers`` (squeue/sacct/sstat/REST output),
``states`` (the native-state table), ``script`` (batch script and REST job description). See ``docs/slurm.md``.
"""

from activities.schedulers.slurm.adapter import SlurmAdapter

__all__ = ["SlurmAdapter"]
