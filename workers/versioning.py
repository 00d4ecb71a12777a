"""Worker versioning: every build of the workers is a version of one Temporal Worker Deployment (docs/deploys.md).

Workflows are pinned to the build that started them: a workflow task of a running job only ever goes to workers
of that build, so a new build can change workflow code freely without breaking the jobs the old one runs, and a
restart mixes nothing. The workflows move to the deployment's current build at their next continue-as-new (they
continue as new as soon as Temporal tells them another build became current), so the old build drains within
one watch cycle of its jobs and can then be stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from temporalio.api.workflowservice.v1 import (
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
)
from temporalio.client import Client
from temporalio.common import VersioningBehavior
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig, WorkerDeploymentVersion

from virtengine_hpc.config import TemporalConfig

log = logging.getLogger(__name__)

# Answers that mean "not yet": the deployment or this version is registered only after a worker of it has polled.
_NOT_YET = (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION, RPCStatusCode.ABORTED)


def deployment_config(t: TemporalConfig) -> WorkerDeploymentConfig | None:
    """The worker's deployment version (``temporal.deployment_name`` / ``temporal.build_id``); None: unversioned.

    Pinned by default: a workflow stays on the build that started it (see the module docstring).
    """
    if not t.deployment_name or not t.build_id:
        return None
    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=t.deployment_name, build_id=t.build_id),
        use_worker_versioning=True,
        default_versioning_behavior=VersioningBehavior.PINNED,
    )


async def promote_first_build(
    client: Client,
    t: TemporalConfig,
    *,
    timeout: float = 120.0,
    stopping: Callable[[], bool] = lambda: False,
) -> bool:
    """Make this build the deployment's current version when no version has ever been current (a first install).

    Without a current version Temporal gives the workflows of a versioned deployment to no one; an operator who
    once chose a current version (or chose unversioned workers) is never overruled. True if this call made the
    build current. Waits, up to ``timeout`` seconds, for the server to register the version (at its workers'
    first poll).
    """
    if not t.deployment_name or not t.build_id:
        return False
    deadline = time.monotonic() + timeout
    delay = 0.2
    while not stopping():
        try:
            described = await client.workflow_service.describe_worker_deployment(
                DescribeWorkerDeploymentRequest(namespace=t.namespace, deployment_name=t.deployment_name)
            )
            routing = described.worker_deployment_info.routing_config
            if routing.HasField("current_version_changed_time"):
                return False  # a version was made current before (by an operator or another worker)
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=t.namespace,
                    deployment_name=t.deployment_name,
                    build_id=t.build_id,
                    conflict_token=described.conflict_token,
                    identity=client.identity,
                )
            )
        except RPCError as err:
            if err.status not in _NOT_YET or time.monotonic() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        log.info(
            "worker deployment %s had no current version: made build %s current (first install)",
            t.deployment_name,
            t.build_id,
        )
        return True
    return False
