"""Safe deploys (docs/deploys.md): a new release must never break a job that is already running.

* The previous release's recorded histories (the newest corpus under ``tests/histories/``: completed, failed,
  cancelled while running, refused by routing, and from 0.3.0 on every other branch of the job workflow and the
  node workflow's) replay on this code with exactly the workflows the production worker registers.
* The check can fail: the same workflow with one unpatched change (an extra timer before routing) is refused
  by the replayer as non-deterministic, which is what CI would report.
"""

from __future__ import annotations

import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
from packaging.version import Version
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.conftest import REPO
from tests.memory_adapter import MemoryAdapter
from tests.production_support import cluster_config
from tests.replay_corpus import BRANCHES_SINCE_0_3, NODE_SCENARIOS, OUTCOMES, previous_release
from virtengine_hpc.config import Secrets
from virtengine_hpc.messages import JOB_WORKFLOW_NAME, JobResult, JobWorkflowInput
from workers.wiring import build_worker_deps
from workflows.hpc_job import HPCJobWorkflow

PREVIOUS = previous_release()


@workflow.defn(name=JOB_WORKFLOW_NAME, sandboxed=False)  # this test module imports too much for the sandbox
class UnpatchedChange(HPCJobWorkflow):
    """HPCJobWorkflow with a change that was not put behind ``workflow.patched``: a pause before routing."""

    @workflow.run
    async def run(self, inp: JobWorkflowInput) -> JobResult:
        await workflow.sleep(timedelta(seconds=1))
        return await super().run(inp)


def production_workflows(tmp_path: Path, key_path: Path) -> list[type]:
    """The workflow classes the production worker registers (read from a real one, not listed by hand)."""
    config = cluster_config(tmp_path, ["c1"])
    deps = build_worker_deps(
        config, Secrets(provider_signing_key_path=key_path), adapters={"c1": MemoryAdapter()}
    )
    for close in deps.closers:
        close()
    return [HPCJobWorkflow, *deps.extra_workflows]


def test_every_branch_of_the_previous_release_is_recorded() -> None:
    expected = BRANCHES_SINCE_0_3 if PREVIOUS.version >= (0, 3, 0) else OUTCOMES
    assert expected <= PREVIOUS.scenarios("job"), f"{PREVIOUS.release} misses some"
    if PREVIOUS.version >= (0, 3, 0):
        assert PREVIOUS.scenarios("node") >= NODE_SCENARIOS


@pytest.mark.parametrize("history", PREVIOUS.histories(), ids=lambda h: h.workflow_id)
async def test_previous_release_histories_replay_on_the_production_worker(
    history: WorkflowHistory, tmp_path: Path, key_path: Path
) -> None:
    replayer = Replayer(
        workflows=production_workflows(tmp_path, key_path), data_converter=pydantic_data_converter
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None


async def test_an_unpatched_change_is_caught_by_replay() -> None:
    path = PREVIOUS.path / "job-completed.json"
    replayer = Replayer(workflows=[UnpatchedChange], data_converter=pydantic_data_converter)
    result = await replayer.replay_workflow(
        WorkflowHistory.from_json(path.stem, path.read_text()), raise_on_replay_failure=False
    )
    assert result.replay_failure is not None
    assert "nondetermin" in str(result.replay_failure).lower()


def test_workflow_code_that_differs_never_shares_the_default_build_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Versioned deploys are safe by default only if a build whose workflow code changed gets another id, whether
    or not anybody bumped the package version (two builds under one id replay each other's jobs)."""
    from virtengine_hpc.config import build_id as config_module
    from virtengine_hpc.config import load_config

    before = config_module.default_build_id()
    assert before.startswith(config_module.package_version() + "+wf.")
    changed = tmp_path / "hpc_job.py"
    changed.write_text("# a workflow change\n")
    sources = config_module._workflow_sources()
    monkeypatch.setattr(config_module, "_workflow_sources", lambda: [*sources, changed])
    after = config_module.default_build_id()
    assert after != before and after.startswith(config_module.package_version() + "+wf.")
    assert load_config(data={}, env={}).temporal.build_id == after


def test_the_default_build_id_digests_the_domain_files_a_workflow_carries() -> None:
    """The messages, states and models a workflow carries decide what it does as much as workflows/ does, so
    the default build id digests them first. The digest finds them through the import system, not beside its own
    file: it lives in virtengine_hpc/config/, where they are not, and a missing file would be left out
    silently, so a build whose messages changed would keep the old id."""
    from virtengine_hpc import messages, models, states
    from virtengine_hpc.config.build_id import _workflow_sources

    sources = [path.resolve() for path in _workflow_sources()]
    domain = [Path(module.__file__ or "").resolve() for module in (messages, states, models)]
    assert sources[:3] == domain
    workflows = sorted((REPO / "workflows").glob("*.py"))
    assert sources[3:] == [path.resolve() for path in workflows]
    assert REPO / "workflows" / "hpc_job.py" in sources


def test_the_version_is_not_older_than_the_newest_recorded_release() -> None:
    """The default build id starts with the package version, so the version must say which release a build is
    (or follows): never older than the newest release whose corpus is recorded (it read 0.1.0 long after 0.3.0
    was recorded)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    newest = Version(".".join(map(str, previous_release().version)))
    assert Version(project["version"]) >= newest, f"{project['version']} is older than {newest}"
