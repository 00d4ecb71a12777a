"""A real worker process for crash tests: ``python -m tests.crash_worker CONFIG_JSON [--crash-after-submit JOB]``.

It is the production worker (same wiring, same activities, local executor) with one optional fault: for the given
job it SIGKILLs itself right after the scheduler accepted the job and before the submit activity completes, the
exact window in which a naive orchestrator submits twice.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

from activities.schedulers.base import Accounting, NativeStatus, SchedulerAdapter, SubmitRequest, SubmitResult
from virtengine_hpc.config import Config, Secrets
from workers.wiring import build_adapter, build_worker_deps, connect
from workers.worker import make_worker


class CrashAfterSubmit(SchedulerAdapter):
    """Delegates to a real adapter; dies by SIGKILL after the real submit of one workflow id returns."""

    def __init__(self, inner: SchedulerAdapter, workflow_id: str | None) -> None:
        self.inner = inner
        self.workflow_id = workflow_id

    async def submit(
        self, request: SubmitRequest, *, on_submitted: Callable[[str], None] | None = None
    ) -> SubmitResult:
        result = await self.inner.submit(request, on_submitted=on_submitted)
        if request.workflow_id == self.workflow_id:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    async def find(self, workflow_id: str, tenant: str | None = None) -> str | None:
        return await self.inner.find(workflow_id, tenant)

    async def status_batch(self, scheduler_job_ids: Iterable[str]) -> dict[str, NativeStatus]:
        return await self.inner.status_batch(scheduler_job_ids)

    async def cancel(self, scheduler_job_id: str) -> None:
        await self.inner.cancel(scheduler_job_id)

    async def usage(self, scheduler_job_id: str) -> Accounting:
        return await self.inner.usage(scheduler_job_id)


async def main(config: Config, task_queue: str, crash_job: str | None) -> None:
    secrets = Secrets.from_env()
    adapter = CrashAfterSubmit(build_adapter(config, secrets), crash_job)
    deps = build_worker_deps(config, secrets, adapters={config.hpc.cluster_id: adapter})
    client = await connect(config)
    worker = make_worker(client, deps, queue=task_queue)
    print("worker ready", flush=True)
    await worker.run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config_json")
    parser.add_argument("task_queue")
    parser.add_argument("--crash-after-submit")
    args = parser.parse_args()
    cfg = Config.model_validate_json(Path(args.config_json).read_text())
    asyncio.run(main(cfg, args.task_queue, args.crash_after_submit))
