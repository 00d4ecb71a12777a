"""Record workflow histories for the replay test: ``python -m tests.record_histories``.

Run it when a release is cut (and commit ``tests/histories/*.json``): every later change to the workflow code must
still replay these, or jobs already running in production would break on deploy. Existing files
are kept; only missing scenarios are recorded, tagged with the current version.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.conftest import binary, make_config
from tests.memory_adapter import MemoryAdapter, Script
from tests.pipeline_harness import running_pipeline
from virtengine_hpc.messages import CancelRequest
from virtengine_hpc.signing import write_private_key
from virtengine_hpc.states import JobState
from workflows.hpc_job import SEARCH_ATTRIBUTES

HISTORIES = Path(__file__).parent / "histories"
VERSION = "v0.2.0"
Q, R, C, F = JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.FAILED

SCENARIOS: dict[str, Script] = {
    "completed": Script([(0, Q), (0.3, R), (3.5, C)], exit_code=0),
    "failed": Script([(0, Q), (0.2, R), (0.8, F)], exit_code=3, reason="exit code 3"),
    "cancelled-running": Script([(0, Q), (0.2, R), (600, C)]),
    "routing-rejected": Script([(0, Q)]),
}


async def record() -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        data_converter=pydantic_data_converter,
        search_attributes=list(SEARCH_ATTRIBUTES),
        ui=False,
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = Path(tmp)
            key = base / "provider.key"
            write_private_key(key)
            config = make_config(base, hpc={"cluster_id": "replay-cluster"})
            adapter = MemoryAdapter()
            async with running_pipeline(env.client, config, key, adapter, f"tq-{uuid.uuid4().hex[:8]}") as p:
                for name, script in SCENARIOS.items():
                    target = HISTORIES / f"{VERSION}-{name}.json"
                    if target.exists():
                        continue
                    job_id = p.submit(decide=name != "routing-rejected")
                    adapter.scripts[job_id] = script
                    if name == "cancelled-running":
                        await p.wait_started(job_id)
                        await asyncio.sleep(1.5)
                        await p.handle(job_id).signal("cancel", CancelRequest(reason="replay scenario"))
                    await p.run_until_done([job_id])
                    history = await p.handle(job_id).fetch_history()
                    target.write_text(history.to_json())
                    print(f"recorded {target.name}: {len(history.events)} events")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(record())
