"""Adoption markers (``virtengine_hpc.markers``) and how the batch base uses them, without a scheduler.

The marker binds a workflow id to the cluster and the account its job runs as, under the provider's secret: a name
a tenant can write (the bare ``vehpc-<id>``, a guessed tag, a tag made for another account or cluster) never
verifies, and a job with the right name under another account is not adopted either. The real-cluster tests are in
``tests/test_slurm_markers.py``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
from pydantic import SecretStr

from activities.schedulers.base import RefusedAdoption, SubmitRequest
from activities.schedulers.batch.base import Backoff, BatchSchedulerAdapter, Candidate
from virtengine_hpc.config import Secrets
from virtengine_hpc.errors import SecurityError
from virtengine_hpc.markers import (
    MarkerKey,
    bare_name,
    claimed_workflow,
    load_key,
    marked_name,
    marked_workflow,
    marker_tag,
    verify_marker,
)
from virtengine_hpc.models import JobSpec
from virtengine_hpc.signing import write_private_key

KEY = MarkerKey(b"k" * 32, source="test")
OTHER = MarkerKey(b"o" * 32, source="test")
WF = "JOB-43"
TENANT = "virtengine1tenant0alice"


def tag(key: MarkerKey = KEY, cluster: str = "c1", account: str = "alice", wf: str = WF) -> str:
    return marker_tag(key, cluster_id=cluster, account=account, workflow_id=wf)


def test_a_tag_verifies_only_for_its_workflow_cluster_account_and_key() -> None:
    good = tag()
    assert len(good) == 32 and int(good, 16) >= 0
    assert verify_marker(KEY, cluster_id="c1", account="alice", workflow_id=WF, tag=good)
    for key, cluster, account, wf in [
        (OTHER, "c1", "alice", WF),
        (KEY, "c2", "alice", WF),
        (KEY, "c1", "mallory", WF),
        (KEY, "c1", "alice", "JOB-44"),
    ]:
        assert not verify_marker(key, cluster_id=cluster, account=account, workflow_id=wf, tag=good)
    for forged in ["", "0" * 32, good.upper(), good[:-1], good + "0", f"{good}\n", "g" * 32]:
        assert not verify_marker(KEY, cluster_id="c1", account="alice", workflow_id=WF, tag=forged)


def test_names_carry_the_tag_and_say_which_workflow_they_claim() -> None:
    name = marked_name(KEY, cluster_id="c1", account="alice", workflow_id=WF)
    assert name == f"vehpc-{WF}.{tag()}"
    assert marked_workflow(KEY, cluster_id="c1", account="alice", name=name) == WF
    assert marked_workflow(KEY, cluster_id="c1", account="mallory", name=name) is None
    assert marked_workflow(KEY, cluster_id="c1", account="alice", name=bare_name(WF)) is None
    assert marked_workflow(KEY, cluster_id="c1", account="alice", name=f"vehpc-{WF}.{'0' * 32}") is None
    # A workflow id may itself contain dots and hex: the tag is always the last 32 hex digits.
    dotted = f"JOB.{'a' * 32}"
    name = marked_name(KEY, cluster_id="c1", account="alice", workflow_id=dotted)
    assert marked_workflow(KEY, cluster_id="c1", account="alice", name=name) == dotted
    assert claimed_workflow(name) == dotted and claimed_workflow(bare_name(WF)) == WF
    assert claimed_workflow("someone-else") is None and claimed_workflow("vehpc-a b") is None
    with pytest.raises(SecurityError):
        bare_name("bad id; x")


def test_the_key_never_shows(tmp_path: Path) -> None:
    secret = "s3cret-marker-value-0123456789abcdef"
    key = load_key(Secrets(marker_secret=SecretStr(secret)), tmp_path)
    assert secret not in repr(key) and secret not in str(key) and key.source == "PROVIDER_MARKER_SECRET"
    assert secret not in repr(Secrets(marker_secret=SecretStr(secret)))


def test_a_short_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="at least 32"):
        load_key(Secrets(marker_secret=SecretStr("short")), tmp_path)


def test_without_a_secret_the_key_derives_from_the_signing_key(tmp_path: Path) -> None:
    """Every worker of a provider holds the signing key, so every worker derives the same marker key."""
    path = tmp_path / "provider.key"
    write_private_key(path)
    one = load_key(Secrets(provider_signing_key_path=path), tmp_path / "a")
    two = load_key(Secrets(provider_signing_key_path=path), tmp_path / "b")
    assert tag(one) == tag(two) and one.source == "PROVIDER_SIGNING_KEY_PATH"
    other = tmp_path / "other.key"
    write_private_key(other)
    assert tag(load_key(Secrets(provider_signing_key_path=other), tmp_path)) != tag(one)
    assert not (tmp_path / "a" / "marker.key").exists(), "nothing generated when a signing key is set"


def test_without_any_key_one_is_generated_per_state_directory(tmp_path: Path) -> None:
    one, two = load_key(Secrets(), tmp_path), load_key(Secrets(), tmp_path)
    assert not (tmp_path / "marker.key").exists(), "nothing is written until a marker is needed"
    assert tag(one) == tag(two)
    assert stat.S_IMODE(os.stat(tmp_path / "marker.key").st_mode) == 0o600
    assert tag(load_key(Secrets(), tmp_path / "elsewhere")) != tag(one)


# ---- the batch base's adoption rules, with a scheduler held in a list -------------------------------------------


class ListAdapter(BatchSchedulerAdapter):
    """Jobs are (id, name, user) rows; submissions append one as the submit account."""

    def __init__(self, jobs: list[Candidate], account: str = "alice") -> None:
        super().__init__(backoff=Backoff(max_retries=0), markers=KEY)
        self.cluster_id = "c1"
        self.jobs = jobs
        self.account = account
        self.cancelled: list[str] = []
        self.refused: list[RefusedAdoption] = []
        self.on_refused_adoption(self.refused.append)

    def _submit_account(self) -> str:
        return self.account

    async def _jobs_named(self, names: list[str]) -> list[Candidate]:
        return [job for job in self.jobs if job.name in names]

    async def _submit_new(self, request: SubmitRequest) -> str:
        job_id = str(100 + len(self.jobs))
        name = self.job_name(self.owner(request.workflow_id, request.job.tenant))
        self.jobs.append(Candidate(job_id, name=name, user=self.account))
        return job_id

    async def _cancel_many(self, scheduler_job_ids: Sequence[str]) -> None:
        self.cancelled.extend(scheduler_job_ids)
        self.jobs = [
            Candidate(j.scheduler_job_id, final=True, name=j.name, user=j.user)
            if j.scheduler_job_id in scheduler_job_ids
            else j
            for j in self.jobs
        ]

    async def status_batch(self, scheduler_job_ids):  # type: ignore[no-untyped-def,override]
        raise NotImplementedError

    async def cancel(self, scheduler_job_id: str) -> None:
        raise NotImplementedError

    async def usage(self, scheduler_job_id: str):  # type: ignore[no-untyped-def,override]
        raise NotImplementedError


def request(*, first: bool = False, known: str | None = None) -> SubmitRequest:
    job = JobSpec.model_validate(
        {
            "job_id": WF,
            "tenant": TENANT,
            "provider": "virtengine1provider0test",
            "offering_id": "offering-standard",
            "script": "true\n",
            "walltime_seconds": 300,
        }
    )
    return SubmitRequest(workflow_id=WF, job=job, body="true\n", first_attempt=first, known_job_id=known)


async def test_no_adoption_path_takes_a_lookalike() -> None:
    own_name = marked_name(KEY, cluster_id="c1", account="alice", workflow_id=WF)
    lookalikes = [
        Candidate("1", name=bare_name(WF), user="alice"),  # what any tenant can write
        Candidate("2", name=f"vehpc-{WF}.{'0' * 32}", user="alice"),  # a guessed tag
        Candidate("3", name=own_name, user="mallory"),  # the right name, copied, under another account
        Candidate(
            "4", name=marked_name(KEY, cluster_id="c1", account="mallory", workflow_id=WF), user="mallory"
        ),
    ]
    adapter = ListAdapter(list(lookalikes))
    assert await adapter.find(WF, TENANT) is None
    # A retry whose heartbeat names a look-alike, a plain retry, a first attempt: each submits the own job.
    result = await adapter.submit(request(known="1"))
    assert result.scheduler_job_id == "104" and not result.adopted and result.duplicates_cancelled == []
    assert await adapter.find(WF, TENANT) == "104"
    assert await adapter.find(WF) == "104", "without the tenant: a job marked for the account it runs as"
    again = await adapter.submit(request())
    assert again.scheduler_job_id == "104" and again.adopted
    assert adapter.cancelled == [], "nothing was taken for a duplicate of the workflow's job"
    refused = {r.scheduler_job_id: r for r in adapter.refused}
    assert set(refused) == {"1", "3"}, "what a lookup by the workflow's names sees is reported, once each"
    assert "no valid marker" in refused["1"].reason
    assert refused["3"].reason == "it runs as 'mallory', not as 'alice'"
    assert refused["1"].expected_account == "alice" and refused["1"].workflow_id == WF


async def test_the_oldest_own_job_is_kept_whatever_older_lookalikes_exist() -> None:
    adapter = ListAdapter([Candidate("1", name=bare_name(WF), user="alice")])
    first = await adapter.submit(request(first=True))
    assert first.scheduler_job_id == "101" and not first.adopted
    # A racing attempt's duplicate of the own job is still reconciled: the oldest own job wins.
    adapter.jobs.append(Candidate("102", name=adapter.job_name(adapter.owner(WF, TENANT)), user="alice"))
    again = await adapter.submit(request())
    assert again.scheduler_job_id == "101" and adapter.cancelled == ["102"]


async def test_a_heartbeated_job_carrying_the_marker_is_adopted() -> None:
    adapter = ListAdapter([])
    first = await adapter.submit(request(first=True))
    again = await adapter.submit(request(known=first.scheduler_job_id))
    assert again.scheduler_job_id == first.scheduler_job_id and again.adopted
    assert adapter.refused == []
