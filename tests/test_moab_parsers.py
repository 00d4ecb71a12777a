"""MOAB's state table and parsers on MOAB's documented output layouts (no real MOAB is installed here, so these
are hand-written in the layout of MOAB's own XML writers; see docs/moab.md for what is documented and assumed)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from activities.schedulers.moab import parsers as p
from activities.schedulers.moab.states import Completion, map_state
from virtengine_hpc.states import JobState

SHOWQ = (
    '<Data><Object>queue</Object><cluster LocalAllocProcs="2" LocalUpProcs="8" time="1764511300"></cluster>'
    '<queue count="1" option="active"><job AWDuration="100" Account="vehpc" Class="batch" Group="alice" '
    'JobID="Moab.12" JobName="vehpc-JOB-1" MasterHost="node01" ReqAWDuration="600" ReqNodes="1" ReqProcs="2" '
    'RunPriority="0" StartTime="1764511200" StatPSDed="200.00" StatPSUtl="97.50" State="Running" '
    'SubmissionTime="1764511190" SuspendDuration="0" User="alice"></job></queue>'
    '<queue count="1" option="eligible"><job JobID="Moab.13" JobName="vehpc-JOB-2" ReqAWDuration="1:00:00" '
    'State="Idle" StartTime="0" SubmissionTime="1764511250" User="alice"></job></queue>'
    '<queue count="1" option="blocked"><job HoldReason="RMReject" JobID="Moab.14" JobName="x" State="BatchHold" '
    'User="bob"></job></queue></Data>'
)
SHOWQ_COMPLETED = (
    '<Data><Object>queue</Object><cluster time="1764511300"></cluster>'
    '<queue count="2" option="completed" purgetime="86400">'
    '<job AWDuration="42" CompletionCode="3" CompletionTime="1764511290" JobID="Moab.9" JobName="vehpc-JOB-0" '
    'ReqAWDuration="600" StartTime="1764511248" State="Completed" User="alice"></job>'
    '<job AWDuration="5" CompletionCode="CNCLD(271)" CompletionTime="1764511291" JobID="Moab.10" JobName="y" '
    'ReqAWDuration="600" StartTime="1764511286" State="Removed" User="alice"></job></queue></Data>'
)
CHECKJOB = (
    '<Data><job AWDuration="100" JobID="Moab.12" JobName="vehpc-JOB-1" ReqAWDuration="600" StartTime="1764511200" '
    'StatPSUtl="97.5" State="Running" User="alice"><req AllocNodeList="node01,node02" ReqMemPerTask="512" '
    'TaskCount="4" UtilMem="300" GPUS="2"/></job></Data>'
)


def test_showq_sections_and_attributes() -> None:
    jobs = {j.job_id: j for j in p.parse_showq(SHOWQ)}
    running = jobs["Moab.12"]
    assert (running.queue, running.state, running.user, running.name) == (
        "active",
        "Running",
        "alice",
        "vehpc-JOB-1",
    )
    assert (
        running.wall_seconds == 100
        and running.cpu_seconds == Decimal("97.50")
        and running.walltime_limit == 600
    )
    assert jobs["Moab.13"].queue == "eligible" and jobs["Moab.13"].walltime_limit == 3600
    assert jobs["Moab.13"].start_time is None, "StartTime 0 means not started"
    assert jobs["Moab.14"].hold_reason == "RMReject"


def test_completed_queue_codes() -> None:
    jobs = {j.job_id: j for j in p.parse_showq(SHOWQ_COMPLETED)}
    assert jobs["Moab.9"].completion == Completion(3)
    assert jobs["Moab.10"].completion == Completion(271, cancelled=True)


def test_checkjob_requirements() -> None:
    (job,) = p.parse_checkjob(CHECKJOB)
    assert job.nodes == 2 and job.mem_mb == 2048 and job.util_mem_mb == 300 and job.gpus == 2


@pytest.mark.parametrize(
    ("state", "completion", "extra", "expected", "exit_code"),
    [
        ("Idle", None, {}, JobState.QUEUED, None),
        ("Deferred", None, {}, JobState.QUEUED, None),
        ("Blocked", None, {}, JobState.QUEUED, None),
        ("UserHold", None, {}, JobState.QUEUED, None),
        ("SystemHold", None, {}, JobState.QUEUED, None),
        ("BatchHold", None, {"hold_reason": "RMReject"}, JobState.FAILED, None),
        ("Starting", None, {}, JobState.STARTING, None),
        ("Running", None, {}, JobState.RUNNING, None),
        ("Suspended", None, {}, JobState.SUSPENDED, None),
        ("Completed", "0", {}, JobState.COMPLETED, 0),
        ("Completed", "3", {}, JobState.FAILED, 3),
        ("Completed", "265", {}, JobState.FAILED, 137),
        ("Completed", "-11", {}, JobState.TIMEOUT, None),
        ("Removed", "-11", {}, JobState.TIMEOUT, None),
        ("Completed", "-10", {}, JobState.FAILED, None),
        ("Removed", "CNCLD", {}, JobState.CANCELLED, None),
        ("Removed", "CNCLD", {"walltime_reached": True}, JobState.TIMEOUT, None),
        ("Vacated", "0", {}, JobState.FAILED, None),
        ("Canceling", None, {"started": True}, JobState.RUNNING, None),
        ("Canceling", None, {}, JobState.QUEUED, None),
        ("SomethingNew", None, {}, JobState.QUEUED, None),
    ],
)
def test_state_map(
    state: str, completion: str | None, extra: dict, expected: JobState, exit_code: int | None
) -> None:
    mapped = map_state(state, completion=Completion.parse(completion) if completion else None, **extra)
    assert mapped.state == expected, mapped
    assert mapped.exit_code == exit_code
    assert mapped.reason


def test_mws_job_json() -> None:
    job = p.parse_mws_job(
        {
            "name": "Moab.5",
            "customName": "vehpc-JOB-5",
            "credentials": {"user": "alice", "jobClass": "batch"},
            "states": {"state": "Completed"},
            "queueStatus": "completed",
            "completionCode": 2,
            "dates": {"startDate": "2026-11-30 14:00:00 UTC", "completionDate": "2026-11-30 14:01:00 UTC"},
            "duration": 600,
            "durationActive": 60,
            "requirements": [
                {
                    "requiredNodeCountMinimum": 1,
                    "taskCount": 2,
                    "resourcesPerTask": {"MEM": {"dedicated": 128}},
                }
            ],
        }
    )
    assert (job.job_id, job.name, job.user, job.wall_seconds, job.mem_mb) == (
        "Moab.5",
        "vehpc-JOB-5",
        "alice",
        60,
        256,
    )
    assert map_state(job.state, completion=job.completion).exit_code == 2
    held = p.parse_mws_job({"name": "Moab.6", "states": {"state": "Idle"}, "holds": ["USER"]})
    assert held.state == "UserHold"


def test_bad_output_is_a_parse_error() -> None:
    with pytest.raises(p.ParseError):
        p.parse_showq("ERROR:    cannot connect")
    with pytest.raises(p.ParseError):
        p.parse_showq('<!DOCTYPE x [<!ENTITY a "aaaa">]><Data>&a;</Data>')
    with pytest.raises(p.ParseError):
        p.parse_msub("ERROR:  cannot submit job\n")
    assert p.parse_msub("\nMoab.77\n") == "Moab.77"
