"""The node API's OpenAPI spec fuzzed with schemathesis against the real API process: never a 5xx.

Schemathesis generates bodies, paths and headers from ``/openapi.json`` (valid and invalid by the schema) and
Hypothesis drives them; every request must be answered, accepted or refused with a 4xx, and no input may crash
the API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core.result import Ok
from temporalio.testing import WorkflowEnvironment

from tests.node_support import Provider

EXAMPLES_PER_OPERATION = 120


async def test_no_generated_input_makes_the_node_api_fail(
    tmp_path: Path, temporal_env: WorkflowEnvironment
) -> None:
    provider = Provider(tmp_path, temporal_env.client.service_client.config.target_host)
    provider.start_api()
    try:
        schema = schemathesis.openapi.from_url(f"{provider.url}/openapi.json")
        results = list(schema.get_all_operations())
        assert all(isinstance(result, Ok) for result in results), "the spec is valid OpenAPI"
        operations = [result.ok() for result in results if isinstance(result, Ok)]
        assert {op.path for op in operations} >= {
            "/api/v1/hpc/nodes/register",
            "/api/v1/hpc/nodes/{node_id}/heartbeat",
        }
        statuses: dict[int, int] = {}
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(
                max_examples=EXAMPLES_PER_OPERATION,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
            def fuzz(case: schemathesis.Case) -> None:
                response = case.call(timeout=10)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code < 500, (
                    f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
                )

            await asyncio.to_thread(fuzz)
        print("node API fuzz answers by status:", dict(sorted(statuses.items())))
        assert sum(statuses.values()) >= len(operations) * 10
        assert any(400 <= status < 500 for status in statuses), statuses
    finally:
        provider.stop()
