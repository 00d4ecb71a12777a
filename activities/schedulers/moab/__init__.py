"""The MOAB scheduler adapter (``scheduler_type: moab``); importing this package registers it.

Modules: ``adapter`` (the adapter, a thin subclass of ``activities.schedulers.batch``), ``backends`` (commands over
SSH, MOAB Web Services), ``parsers`` (``showq``/``checkjob`` XML, MWS JSON), ``states`` (the native-state table),
``script`` (``msub`` command line and script, MWS job). See ``docs/moab.md``.
"""

from activities.schedulers.moab.adapter import MoabAdapter

__all__ = ["MoabAdapter"]
