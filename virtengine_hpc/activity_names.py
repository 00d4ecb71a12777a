"""The name of every activity, defined once: the workers register each activity under its name
(``@activity.defn(name=...)``) and the workflows call it by the same constant.

A name is part of every history that scheduled the activity: renaming one breaks the replay of running workflows
and strands the tasks already queued under the old name, so these strings never change.
"""

from __future__ import annotations

from typing import Final

# ---- a job's steps (activities/jobs.py, called by workflows/hpc_job.py) ------------------------------------------
ROUTE_JOB: Final = "route_job"
SUBMIT_JOB: Final = "submit_job"
FIND_JOB: Final = "find_job"
RECOVER_JOB: Final = "recover_job"
PARK_JOB: Final = "park_job"
WATCH_JOB: Final = "watch_job"
CANCEL_JOB: Final = "cancel_job"
REPORT_TRANSITION: Final = "report_transition"
REPORT_USAGE: Final = "report_usage"

# ---- a cluster's monitor (activities/monitor.py, called by workflows/cluster_monitor.py and hpc_job.py) ----------
POLL_CLUSTER: Final = "poll_cluster"
WATCH_WITH_MONITOR: Final = "watch_with_monitor"

# ---- a node's lifecycle (activities/nodes.py, called by workflows/node.py) ---------------------------------------
NODE_LOAD: Final = "node_load"
NODE_APPLY_STATE: Final = "node_apply_state"
NODE_PUBLISH_METADATA: Final = "node_publish_metadata"
NODE_SCHEDULER_DRAIN: Final = "node_scheduler_drain"
NODE_SCHEDULER_RESUME: Final = "node_scheduler_resume"
NODE_SCHEDULER_BUSY: Final = "node_scheduler_busy"

ALL: Final = (
    ROUTE_JOB,
    SUBMIT_JOB,
    FIND_JOB,
    RECOVER_JOB,
    PARK_JOB,
    WATCH_JOB,
    CANCEL_JOB,
    REPORT_TRANSITION,
    REPORT_USAGE,
    POLL_CLUSTER,
    WATCH_WITH_MONITOR,
    NODE_LOAD,
    NODE_APPLY_STATE,
    NODE_PUBLISH_METADATA,
    NODE_SCHEDULER_DRAIN,
    NODE_SCHEDULER_RESUME,
    NODE_SCHEDULER_BUSY,
)
"""Every activity name, in the order above (tests check that the workers register exactly these)."""
