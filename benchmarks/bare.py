"""The baseline of the pipeline benchmark: a workflow that runs N trivial activities in sequence.

Lives in its own module (not ``__main__``) so it runs in the workflow sandbox like the real job workflow.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow


@activity.defn(name="bench_noop")
async def bench_noop(step: int) -> int:
    return step + 1


@workflow.defn(name="BareWorkflow")
class BareWorkflow:
    @workflow.run
    async def run(self, steps: int) -> int:
        value = 0
        for _ in range(steps):
            value = await workflow.execute_activity(
                "bench_noop", value, start_to_close_timeout=timedelta(seconds=30), result_type=int
            )
        return value
