"""A tiny workflow and activity for the logging and tracing tests (a module of its own, as the sandbox wants)."""

from __future__ import annotations

import logging
from datetime import timedelta

from temporalio import activity, workflow

plain = logging.getLogger("tests.production_workflows")


@activity.defn(name="say")
async def say(text: str) -> str:
    activity.logger.info("activity says %s", text)
    plain.warning("a plain module logger inside the activity")
    return text


@workflow.defn(name="HPCJobWorkflow")
class LoggingJob:
    """Named like the job workflow, so its log lines carry ``job_id`` (the workflow id)."""

    @workflow.run
    async def run(self, text: str) -> str:
        workflow.logger.info("workflow starts")
        return await workflow.execute_activity(say, text, start_to_close_timeout=timedelta(seconds=10))
