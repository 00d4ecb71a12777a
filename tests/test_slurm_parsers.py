"""Golden-output tests: the SLURM parsers and state table against real captures of Slurm 22.05.8.

The captures in ``tests/golden/slurm`` were taken on the local cluster (README there lists the exact commands). The
parsers are field-driven, so each capture is read with the field list it was made with; the adapter's own formats
are exercised against the live cluster in ``test_slurm_adapter.py``. These tests need no cluster.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import parsers as p
from activities.schedulers.slurm.script import (
    plan_submission,
    render_batch_script,
    render_rest_job,
)
from activities.schedulers.slurm.states import (
    NATIVE_STATES,
    exit_code_from_pair,
    exit_code_from_wait_status,
    map_state,
    never_start_reason,
)
from virtengine_hpc.errors import SecurityError
from virtengine_hpc.markers import bare_name
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState

GOLDEN = Path(__file__).parent / "golden" / "slurm"
SHORT = ("JobID", "Name", "State", "Reason", "Comment")  # squeue -o '%i|%j|%T|%r|%k'
CAPTURE_SACCT = (
    "JobID",
    "JobName",
    "State",
    "ExitCode",
    "Elapsed",
    "TotalCPU",
    "CPUTime",
    "MaxRSS",
    "AllocTRES",
    "TRESUsageInTot",
    "Start",
    "End",
    "Comment",
)


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def golden_json(name: str) -> dict:  # type: ignore[type-arg]
    return json.loads(golden(name))


# ---- squeue ----------------------------------------------------------------------------------------------------


def test_squeue_all_states_maps_every_job_and_keeps_a_piped_comment_whole() -> None:
    jobs = {j.job_id: j for j in p.parse_squeue(golden("squeue_all_states.txt"), SHORT, terminated=False)}
    # Array tasks (10_1, 10_2) are not jobs this adapter submits: skipped, not mis-parsed.
    assert set(jobs) == {"4", "5", "6", "7", "8", "9", "12", "13", "14"}
    assert jobs["12"].comment.endswith("with spaces|and a pipe")
    assert jobs["12"].name.startswith("golden-long-name-")
    expected = {
        "7": JobState.COMPLETED,
        "8": JobState.FAILED,
        "9": JobState.FAILED,
        "5": JobState.QUEUED,
        "14": JobState.QUEUED,
        "4": JobState.QUEUED,
        "6": JobState.RUNNING,
        "13": JobState.RUNNING,
    }
    for job_id, state in expected.items():
        assert map_state(jobs[job_id].state, jobs[job_id].reason).state == state, job_id
    assert map_state(jobs["4"].state, jobs["4"].reason).reason == "pending: JobHeldUser"
    assert map_state(jobs["9"].state).reason.startswith("out of memory")


def test_squeue_after_cancel_and_unknown_job() -> None:
    jobs = p.parse_squeue(golden("squeue_after_cancel.txt"), SHORT, terminated=False)
    assert {j.job_id: map_state(j.state).state for j in jobs} == dict.fromkeys(
        ("5", "13", "14"), JobState.CANCELLED
    )
    # squeue of a single purged id prints an error and nothing else: no jobs, no crash.
    assert p.parse_squeue(golden("squeue_unknown_job.txt"), SHORT, terminated=False) == []


def test_squeue_wide_times_and_usage_fields() -> None:
    fields = (
        "JobID",
        "JobIDRaw",
        "ArrayJob",
        "ArrayTask",
        "Name",
        "UserName",
        "Account",
        "Partition",
        "State",
        "StateCompact",
        "Reason",
        "TimeUsed",
        "TimeLimit",
        "Nodes",
        "CPUs",
        "MinMemory",
        "SubmitTime",
        "StartTime",
        "EndTime",
        "WorkDir",
        "Comment",
    )
    jobs = {j.job_id: j for j in p.parse_squeue(golden("squeue_wide.txt"), fields, terminated=False)}
    running = jobs["6"]
    assert running.elapsed_seconds == 22
    assert running.user == "hpcuser"
    assert running.start_time == datetime(2026, 11, 30, 13, 49, 25, tzinfo=UTC)
    assert jobs["4"].start_time is None  # "N/A" for a held job


def test_squeue_adapter_format_with_terminated_fields() -> None:
    line = (
        "48|PENDING|JobHeldUser|1796047047|N/A|N/A|0:00|cpu=1,mem=200M,node=1,billing=1|root|"
        "vehpc-wf-1|vehpc;wf=wf-1;storage_gb=5|\n"
        "CLUSTER: localcluster\n"
        "50|RUNNING|None|1796047047|1796047050|NONE|1-02:03:04|cpu=2,mem=1G,node=1,gres/gpu=2|hpcuser|x|(null)|\n"
    )
    held, running = p.parse_squeue(line)
    assert held.alloc_tres["mem"] == 200 * 1024 * 1024
    assert held.start_time is None and held.submit_time == datetime.fromtimestamp(1796047047, UTC)
    assert held.comment == "vehpc;wf=wf-1;storage_gb=5" and held.name == "vehpc-wf-1"
    assert running.elapsed_seconds == 93784
    assert running.alloc_tres["gres/gpu"] == 2
    assert running.comment == ""


# ---- sacct -----------------------------------------------------------------------------------------------------


def test_sacct_steps_give_usage_and_the_job_line_gives_state() -> None:
    jobs = {j.job_id: j for j in p.parse_sacct(golden("sacct_steps.txt"), CAPTURE_SACCT)}
    completed = jobs["7"]
    assert completed.state == "COMPLETED" and completed.exit_code == 0
    assert [s.step_id for s in completed.steps] == ["batch", "0"]
    assert completed.total_cpu_seconds == Decimal("3.070")
    assert sum(s.total_cpu_seconds for s in completed.steps) == Decimal("3.069")
    assert max(s.max_rss_bytes or 0 for s in completed.steps) == 156384 * 1024
    assert completed.alloc_tres["mem"] == 1024**3
    assert completed.steps[1].usage_in["cpu"] == 3
    assert completed.steps[1].usage_in["fs/disk"] == 44118

    assert jobs["8"].exit_code == 3
    assert map_state(jobs["8"].state).state == JobState.FAILED
    oom = jobs["9"]
    assert map_state(oom.state).state == JobState.FAILED
    assert oom.exit_code is None, "0:125 is Slurm's OOM marker, not an exit status"
    timeout = jobs["6"]
    assert map_state(timeout.state).state == JobState.TIMEOUT
    assert timeout.elapsed_seconds == 80
    cancelled = map_state(jobs["13"].state)
    assert cancelled.state == JobState.CANCELLED and cancelled.reason == "cancelled by uid 0"
    held = jobs["4"]
    assert map_state(held.state).state == JobState.QUEUED and held.start_time is None


def test_sacct_job_lines_without_steps() -> None:
    jobs = {j.job_id: j for j in p.parse_sacct(golden("sacct_jobs.txt"), CAPTURE_SACCT)}
    assert all(not j.steps for j in jobs.values())
    assert jobs["7"].total_cpu_seconds == 0, "with -X the job line's TotalCPU is 0: usage lives on the steps"
    assert jobs["5"].comment == "wf:golden-cancelled-pending"
    assert p.parse_sacct(golden("sacct_unknown_job.txt"), ("JobID", "State")) == []


def test_sacct_raw_fields_and_window() -> None:
    fields = (
        "JobIDRaw",
        "JobID",
        "State",
        "ExitCode",
        "DerivedExitCode",
        "ElapsedRaw",
        "CPUTimeRAW",
        "Reason",
        "Submit",
        "Eligible",
        "Start",
        "End",
        "Timelimit",
        "TimelimitRaw",
        "Account",
        "User",
        "Partition",
        "NodeList",
        "WorkDir",
    )
    jobs = {j.job_id: j for j in p.parse_sacct(golden("sacct_raw_fields.txt"), fields)}
    assert jobs["6"].elapsed_seconds == 80
    assert jobs["4"].reason == "JobHeldUser"
    assert jobs["4"].start_time is None
    assert jobs["13"].user == "hpcuser"
    window = p.parse_sacct(golden("sacct_window.txt"), ("JobID", "JobName", "State", "ExitCode"))
    assert [(j.job_id, map_state(j.state).state) for j in window] == [
        ("6", JobState.TIMEOUT),
        ("7", JobState.COMPLETED),
        ("8", JobState.FAILED),
        ("9", JobState.FAILED),
    ]


def test_sacct_reused_job_id_keeps_the_latest_submission() -> None:
    text = (
        "12|COMPLETED|0:0|5|1796000000|old|\n12.batch|COMPLETED|0:0|5|1796000000|batch|\n"
        "12|FAILED|2:0|1|1796040000|new|\n12.batch|FAILED|2:0|1|1796040000|batch|\n"
    )
    (job,) = p.parse_sacct(
        text, ("JobIDRaw", "State", "ExitCode", "ElapsedRaw", "Submit", "JobName", "Comment")
    )
    assert job.name == "new" and job.exit_code == 2 and len(job.steps) == 1
    assert job.earlier_runs == [], "another job under a reused id is not an earlier run of this one"


def test_sacct_reused_job_id_after_a_requeued_job_is_not_its_run() -> None:
    """An id reused after a rebuild, by the same account: the old job was requeued once, then completed. Its
    completed run ends the walk back from the new job: neither of the old job's runs is the new job's."""
    fields = ("JobIDRaw", "State", "ExitCode", "ElapsedRaw", "Submit", "JobName", "Comment", "User")
    text = (
        "12|REQUEUED|0:0|50|1795000000|old||acct\n12|COMPLETED|0:0|5|1795000100|old||acct\n"
        "12|REQUEUED|0:0|7|1796040000|new||acct\n12|COMPLETED|0:0|1|1796040100|renamed||acct\n"
    )
    (job,) = p.parse_sacct(text, fields)
    assert [(run.name, run.elapsed_seconds) for run in job.runs] == [("new", 7), ("renamed", 1)]


def test_sacct_reused_job_id_after_a_node_failure_is_not_its_run() -> None:
    """An id reused by the same account: the old job ended NODE_FAIL (not requeued: it had no --requeue). A
    requeue submits the next run the moment it ends the last; this old run ended a day before, so it is not the
    new job's, renamed or not."""
    fields = ("JobIDRaw", "State", "ExitCode", "ElapsedRaw", "Submit", "End", "JobName", "Comment", "User")
    text = (
        "12|NODE_FAIL|0:0|50|1795900000|1795950000|old||acct\n"
        "12|NODE_FAIL|0:0|7|1796040000|1796040007|new||acct\n12|COMPLETED|0:0|1|1796040009|1796040100|x||acct\n"
    )
    (job,) = p.parse_sacct(text, fields)
    assert [(run.name, run.elapsed_seconds) for run in job.runs] == [("new", 7), ("x", 1)]


def test_sacct_duplicates_of_a_requeued_job_are_its_runs() -> None:
    (job,) = p.parse_sacct(golden("metering/sacct_requeued.txt"))
    assert [(run.state, run.elapsed_seconds, len(run.steps)) for run in job.runs] == [
        ("REQUEUED", 12, 2),
        ("COMPLETED", 6, 2),
    ]
    assert job is job.runs[-1] and job.start_time == datetime.fromtimestamp(1796159394, UTC)


# ---- sstat -----------------------------------------------------------------------------------------------------


def test_sstat_live_steps() -> None:
    (step,) = p.parse_sstat(
        golden("sstat_running_allsteps.txt"), ("JobID", "MaxRSS", "AveCPU", "TRESUsageInTot")
    )
    assert step.step_id == "batch" and step.max_rss_bytes == 64520 * 1024
    assert step.usage_in["mem"] == 64520 * 1024 and step.usage_in["cpu"] == 0
    fields = (
        "JobID",
        "MaxRSS",
        "AveRSS",
        "MaxVMSize",
        "AveCPU",
        "MinCPU",
        "NTasks",
        "TRESUsageInTot",
        "TRESUsageInMax",
    )
    (batch,) = p.parse_sstat(golden("sstat_running_batch.txt"), fields)
    assert batch.usage_in["fs/disk"] == 8183


# ---- sbatch, scontrol ------------------------------------------------------------------------------------------


def test_sbatch_parsable_ids() -> None:
    assert p.parse_job_id(golden("sbatch_parsable.txt")) == "1"
    assert p.parse_job_id("123;localcluster\n") == "123"
    assert p.parse_job_id("sbatch: warning: something\n77\n") == "77"
    with pytest.raises(p.ParseError):
        p.parse_job_id(golden("sbatch_plain.txt"))


def test_scontrol_config_lines() -> None:
    config = p.parse_scontrol_config("ClusterName             = localcluster\nMinJobAge = 300 sec\n")
    assert config == {"ClusterName": "localcluster", "MinJobAge": "300 sec"}


# ---- slurmrestd JSON -------------------------------------------------------------------------------------------


def test_rest_jobs_decode_wait_status_exit_codes() -> None:
    jobs = {j.job_id: j for j in p.parse_rest_jobs(golden_json("rest_jobs.json"))}
    assert jobs["4"].state == "PENDING" and jobs["4"].reason == "JobHeldUser"
    assert jobs["4"].comment == "wf:golden-held" and jobs["4"].user == "hpcuser"
    assert jobs["9"].exit_code is None, "253 = signal 125, Slurm's OOM marker"
    (done,) = p.parse_rest_jobs(golden_json("rest_job_get_completed.json"))
    assert done.exit_code == 0 and done.alloc_tres["mem"] == 1024**3
    assert done.start_time == datetime.fromtimestamp(1796046565, UTC)
    assert p.parse_rest_jobs(golden_json("rest_job_get_unknown.json")) == []
    (error,) = p.rest_errors(golden_json("rest_job_get_unknown.json"))
    assert p.rest_error_code(error) == 2017


def test_rest_accounting_records() -> None:
    (job,) = p.parse_rest_db_jobs(golden_json("slurmdb_job_completed.json"))
    assert job.state == "COMPLETED" and job.elapsed_seconds == 3
    # time.total {"seconds": 2, "microseconds": 1060162}: microseconds over a million are added, not dropped.
    assert job.total_cpu_seconds == Decimal("0.009962") + Decimal("3.060162")
    assert max(s.max_rss_bytes or 0 for s in job.steps) == 160137216
    assert job.alloc_tres["mem"] == 1024**3 and job.comment == "wf:golden-completed"
    (cancelled,) = p.parse_rest_db_jobs(golden_json("slurmdb_job_cancelled_running.json"))
    assert map_state(cancelled.state).reason == "cancelled by root"
    (oom,) = p.parse_rest_db_jobs(golden_json("slurmdb_job_oom.json"))
    assert map_state(oom.state).state == JobState.FAILED and oom.exit_code is None
    (timeout,) = p.parse_rest_db_jobs(golden_json("slurmdb_job_timeout.json"))
    assert map_state(timeout.state).state == JobState.TIMEOUT and timeout.elapsed_seconds == 80
    assert p.parse_rest_db_jobs(golden_json("slurmdb_job_unknown.json")) == []


def test_rest_submit_answers() -> None:
    held = golden_json("rest_job_submit_held.json")
    assert held["job_id"] == 16 and [p.rest_error_code(e) for e in p.rest_errors(held)] == [2042]
    bad = golden_json("rest_job_submit_error_no_environment.json")
    assert "environment must be set" in p.rest_error_text(p.rest_errors(bad)[0])


def test_rest_number_shapes_of_newer_api_versions() -> None:
    body = {
        "jobs": [
            {
                "job_id": 5,
                "job_state": ["COMPLETED"],
                "exit_code": {"set": True, "infinite": False, "number": 768},
                "start_time": {"set": True, "number": 1796046565},
                "end_time": {"set": False, "number": 0},
            }
        ]
    }
    (job,) = p.parse_rest_jobs(body)
    assert job.state == "COMPLETED" and job.exit_code == 3 and job.end_time is None


# ---- scalars ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:03.070", Decimal("3.070")),
        ("00:00:05", Decimal(5)),
        ("1-02:03:04", Decimal(93784)),
        ("0:22", Decimal(22)),
        ("12:00:00.5", Decimal("43200.5")),
    ],
)
def test_durations(text: str, seconds: Decimal) -> None:
    assert p.parse_duration(text) == seconds


def test_sizes_and_tres() -> None:
    assert p.parse_size("156384K") == 156384 * 1024
    assert p.parse_size("4128768") == 4128768
    assert p.parse_size("1G") == 1024**3
    assert p.parse_size("100", default_unit="M") == 100 * 1024**2
    alloc = p.parse_tres("billing=1,cpu=1,mem=1024M,node=1,gres/gpu=2,gres/gpu:a100=2", usage=False)
    assert alloc["mem"] == 1024**3 and alloc["gres/gpu"] == 2 and alloc["node"] == 1
    usage = p.parse_tres("cpu=00:00:05,energy=0,fs/disk=1690155,mem=322144K,ic/ofed=2048", usage=True)
    assert usage == {
        "cpu": 5,
        "energy": 0,
        "fs/disk": 1690155,
        "mem": 322144 * 1024,
        "ic/ofed": 2048,
    }
    assert p.parse_time("Unknown") is None and p.parse_time("0") is None


# ---- the state table -------------------------------------------------------------------------------------------


def test_every_documented_state_is_mapped_and_ends_are_honest() -> None:
    for native in NATIVE_STATES:
        assert map_state(native).native_state == native
    assert map_state("OUT_OF_MEMORY").state == JobState.FAILED
    assert map_state("NODE_FAIL").state == JobState.FAILED
    assert map_state("BOOT_FAIL").state == JobState.FAILED
    assert map_state("PREEMPTED").state == JobState.FAILED
    assert map_state("DEADLINE").state == JobState.TIMEOUT
    assert map_state("TIMEOUT").state == JobState.TIMEOUT
    assert map_state("CANCELLED by 1001").reason == "cancelled by uid 1001"
    assert map_state("CANCELLED+").state == JobState.CANCELLED
    assert map_state("COMPLETING").state == JobState.RUNNING, "not final: the end state follows"
    assert map_state("REQUEUED").state == JobState.QUEUED
    assert map_state("CF").state == JobState.STARTING
    assert map_state("S").state == JobState.SUSPENDED
    assert map_state("ST").state == JobState.SUSPENDED


def test_unknown_state_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    mapped = map_state("WIBBLE")
    assert mapped.state == JobState.QUEUED and "WIBBLE" in mapped.reason
    assert "unknown Slurm job state" in caplog.text


@pytest.mark.parametrize(
    "reason",
    [
        "PartitionConfig",
        "BadConstraints",
        "AccountNotAllowed",
        "InvalidQOS",
        "InvalidAccount",
        "DependencyNeverSatisfied",
        "QOSMaxWallDurationPerJobLimit",
        "AssocMaxNodesPerJob",
        "QOSMinGRES",
        "PartitionTimeLimit",
    ],
)
def test_pending_reasons_that_never_clear_fail_the_job(reason: str) -> None:
    mapped = map_state("PENDING", reason)
    assert mapped.state == JobState.FAILED and mapped.never_starts
    assert reason in mapped.reason


@pytest.mark.parametrize(
    "reason",
    [
        "Resources",
        "Priority",
        "JobHeldUser",
        "ReqNodeNotAvail, UnavailableNodes:node2",
        "AssocGrpCpuLimit",
        "QOSMaxJobsPerUserLimit",
        "BeginTime",
        "Dependency",
        "PartitionDown",
    ],
)
def test_pending_reasons_that_clear_keep_the_job_queued(reason: str) -> None:
    assert never_start_reason(reason) is None
    assert map_state("PENDING", reason).state == JobState.QUEUED


def test_exit_codes() -> None:
    assert exit_code_from_pair("3:0") == 3
    assert exit_code_from_pair("0:15") == 143
    assert exit_code_from_pair("0:125") is None
    assert exit_code_from_pair("garbage") is None
    assert exit_code_from_wait_status(768) == 3
    assert exit_code_from_wait_status(15) == 143
    assert exit_code_from_wait_status(253) is None


# ---- the batch script --------------------------------------------------------------------------------------------

HOSTILE = [
    "$(touch /tmp/vehpc-pwned)",
    "`touch /tmp/vehpc-pwned`",
    "a; touch /tmp/vehpc-pwned",
    'it\'s "q" \\ $HOME',
]


def _spec(**extra: object) -> JobSpec:
    raw: dict[str, object] = {
        "job_id": "JOB-1",
        "tenant": "virtengine1tenant0alice",
        "provider": "virtengine1provider0x",
        "offering_id": "o1",
        "script": "#!/bin/bash\n#SBATCH --partition=evil\n#SBATCH --job-name=evil\necho hi\n",
        "walltime_seconds": 90,
        "resources": {
            "nodes": 2,
            "tasks_per_node": 4,
            "cpus_per_task": 2,
            "memory_mb_per_node": 300,
            "gpus_per_node": 1,
            "gpu_type": "a100",
            "storage_gb": 7,
        },
        "environment": {f"V{i}": value for i, value in enumerate(HOSTILE)},
    }
    raw.update(extra)
    return JobSpec.model_validate(raw)


def test_script_directives_come_from_validated_values_and_env_stays_literal() -> None:
    spec = _spec()
    plan = plan_submission(
        SubmitRequest(workflow_id="JOB-1", job=spec, body=spec.script or ""),
        name="vehpc-JOB-1.0123456789abcdef0123456789abcdef",
        cluster_id="c1",
        default_partition="debug",
        account="vehpc",
        work_dir="/scratch/jobs",
    )
    script = render_batch_script(plan)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives[:3] == [
        "#SBATCH --job-name=vehpc-JOB-1.0123456789abcdef0123456789abcdef",
        "#SBATCH --comment=vehpc;wf=JOB-1;storage_gb=7",
        "#SBATCH --partition=debug",
    ]
    assert "#SBATCH --time=2" in directives  # 90 s rounds up to 2 minutes
    assert "#SBATCH --mem=300M" in directives and "#SBATCH --gres=gpu:a100:1" in directives
    assert "#SBATCH --export=NONE" in directives and "#SBATCH --account=vehpc" in directives
    # The tenant's own #SBATCH lines come after the first command: sbatch ignores them.
    first_command = next(i for i, line in enumerate(script.splitlines()) if line.startswith("export "))
    tenant_directive = script.splitlines().index("#SBATCH --partition=evil")
    assert tenant_directive > first_command
    for i in range(len(HOSTILE)):
        line = next(line for line in script.splitlines() if line.startswith(f"export V{i}="))
        assert line.startswith(f"export V{i}='"), "every value is single-quoted"
    assert "export SLURM_EXPORT_ENV=ALL" in script


def test_rest_job_description_matches_the_script() -> None:
    spec = _spec()
    plan = plan_submission(
        SubmitRequest(workflow_id="JOB-1", job=spec, body=spec.script or ""),
        name="vehpc-JOB-1.0123456789abcdef0123456789abcdef",
        cluster_id="c1",
        default_partition="debug",
        work_dir="/scratch/jobs",
        hold=True,
    )
    body = render_rest_job(plan)
    job = body["job"]
    assert (
        job["name"] == "vehpc-JOB-1.0123456789abcdef0123456789abcdef"
        and job["nodes"] == [2, 2]
        and job["tasks"] == 8
    )
    assert job["memory_per_node"] == 300 and job["time_limit"] == 2 and job["hold"] is True
    assert job["environment"]["V0"] == HOSTILE[0] and job["environment"]["PATH"]
    assert job["standard_output"] == "/scratch/jobs/vehpc-JOB-1-%j.out"
    assert body["script"].startswith("#!/bin/bash\n")


def test_hostile_fields_are_refused_before_any_script_exists() -> None:
    for field, value in [
        ("name", "x; rm -rf /"),
        ("partition", "debug\n#SBATCH --account=other"),
        ("working_directory", "/tmp/$(id)"),
        ("tenant", "alice`id`"),
    ]:
        with pytest.raises(ValueError):
            _spec(**{field: value})
    with pytest.raises(ValueError):
        _spec(environment={"X": "line1\nline2"})
    with pytest.raises(ValueError):
        _spec(environment={"SLURM_JOB_ID": "1"})
    with pytest.raises(SecurityError):
        bare_name("bad id; x")


def test_admin_levels_from_sacctmgr_and_slurmdbd() -> None:
    """Who may act on every user's jobs (never a tenant's account): ``sacctmgr -n -P show user
    format=User,AdminLevel`` as Slurm 22.05 prints it, and slurmdbd's ``users`` answer."""
    text = "hpcuser|Operator\nroot|Administrator\nvehpc-t1|None\n|Operator\nodd line\n"
    assert p.parse_admin_levels(text) == {"hpcuser": "Operator", "root": "Administrator"}
    body = {
        "users": [
            {"name": "hpcuser", "administrator_level": ["Operator"]},
            {"name": "root", "administrator_level": "Administrator"},
            {"name": "vehpc-t1", "administrator_level": ["None"]},
            {"administrator_level": ["Operator"]},
            "junk",
        ]
    }
    assert p.parse_rest_admin_levels(body) == {"hpcuser": "Operator", "root": "Administrator"}


def test_a_job_record_from_the_kept_scontrol_is_matched_whole() -> None:
    """``scontrol -o show job`` as the provider's kept ``scontrol`` prints it (its prompt and the echo of the
    request first): the record must be the account's job of exactly that name, and a name its owner wrote to carry
    a ``UserId=`` or record lines never reads as another account's job."""
    record = golden("scontrol_show_job_oneliner_held.txt")
    answer = "scontrol: show job 4\n" + record + "\nscontrol: show hostnames vehpc-end-1"
    assert p.job_record_mismatch(answer, "4", "hpcuser", "golden-held") is None
    assert p.job_record_mismatch(record, "4", "hpcuser", "golden-held") is None, "without the echo"
    assert p.job_record_mismatch(answer, "4", "vehpc-t1", "golden-held") == "'golden-held' of hpcuser"
    assert p.job_record_mismatch(answer, "4", "hpcuser", "golden") == "'golden-held' of hpcuser"
    assert p.job_record_mismatch(answer, "5", "hpcuser", "golden-held") == "not held by the controller"
    unknown = "scontrol: show job 5\nscontrol: show hostnames vehpc-end-1"  # the error went to stderr
    assert p.job_record_mismatch(unknown, "5", "hpcuser", "golden-held") == "not held by the controller"

    forged = record.replace("JobName=golden-held ", "JobName=golden-held UserId=vehpc-t1(1002) ")
    assert p.job_record_mismatch(forged, "4", "vehpc-t1", "golden-held") is not None
    lines = record.replace(
        "JobName=golden-held ", "JobName=x\nJobId=4 JobName=golden-held UserId=vehpc-t1(1) "
    )
    assert p.job_record_mismatch(lines, "4", "vehpc-t1", "golden-held") is not None
    echoed = "scontrol: show job 4\n" + lines.replace("JobId=4 JobName=x\n", "")
    assert p.job_record_mismatch(echoed, "4", "vehpc-t1", "golden-held") is not None
