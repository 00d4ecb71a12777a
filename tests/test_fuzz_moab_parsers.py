"""Hostile MOAB output: ``showq --xml``, ``checkjob --xml``, ``msub`` and MOAB Web Services JSON, garbled on
purpose, must give records or the parsers' ``ParseError``, and the adapter above them nothing but ``HPCError``.

The same promise as ``test_fuzz_parsers.py`` makes for SLURM (invariants 5 and 12 in docs/architecture.md): unexpected output
is a failed query, retried, never a crash, a hang, or usage that prices below zero. The XML comes from a
generator that writes MOAB's layout with tricky attribute values, from the hand-written layouts of
``tests/test_moab_parsers.py`` cut and mutated at random places, and from XML attacks (entity expansion, external
entities) that ``defusedxml`` must refuse.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from decimal import Decimal
from functools import partial
from typing import Any
from xml.sax.saxutils import quoteattr

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from activities.schedulers.base import SubmitRequest
from activities.schedulers.batch.base import Backoff, CommandExecutor, CommandResult
from activities.schedulers.moab import parsers as p
from activities.schedulers.moab.adapter import MoabAdapter
from activities.schedulers.moab.backends import TRANSIENT_PATTERNS, CliBackend
from activities.schedulers.moab.states import Completion, map_state
from activities.tenant_accounts import TenantAccounts
from tests.test_fuzz_parsers import TRICKY
from tests.test_moab_parsers import CHECKJOB, SHOWQ, SHOWQ_COMPLETED
from virtengine_hpc.config import MoabConfig
from virtengine_hpc.errors import HPCError
from virtengine_hpc.models import JobSpec

pytestmark = pytest.mark.timeout(240)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)

ATTRIBUTES = st.sampled_from(
    [
        "JobID",
        "JobName",
        "User",
        "State",
        "HoldReason",
        "CompletionCode",
        "SubmissionTime",
        "StartTime",
        "CompletionTime",
        "ReqAWDuration",
        "AWDuration",
        "StatPSUtl",
        "ReqProcs",
        "ReqNodes",
        "ReqMem",
    ]
)
REQ_ATTRIBUTES = st.sampled_from(["AllocNodeList", "ReqMemPerTask", "TaskCount", "UtilMem", "GPUS"])
VALUE = TRICKY.filter(lambda v: "\x00" not in v) | st.sampled_from(
    ["1e400", "-1e400", "inf", "-inf", "nan", "-5", "1:2:3:4:5", "CNCLD(271)", "CNCLD", "Moab.12", "99:99"]
)


@st.composite
def showq_xml(draw: st.DrawFn) -> str:
    jobs = []
    for _ in range(draw(st.integers(0, 3))):
        attrs = draw(st.dictionaries(ATTRIBUTES, VALUE, max_size=8))
        reqs = [
            "<req "
            + " ".join(
                f"{k}={quoteattr(v)}"
                for k, v in draw(st.dictionaries(REQ_ATTRIBUTES, VALUE, max_size=4)).items()
            )
            + "/>"
            for _ in range(draw(st.integers(0, 2)))
        ]
        jobs.append(
            "<job "
            + " ".join(f"{k}={quoteattr(v)}" for k, v in attrs.items())
            + ">"
            + "".join(reqs)
            + "</job>"
        )
    option = draw(st.sampled_from(["active", "eligible", "blocked", "completed", "", "x"]))
    return f'<Data><queue option="{option}">' + "".join(jobs) + "</queue></Data>"


@st.composite
def mutated_xml(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from([SHOWQ, SHOWQ_COMPLETED, CHECKJOB]))
    start = draw(st.integers(0, len(text)))
    end = draw(st.integers(start, min(len(text), start + 30)))
    text = text[:start] + draw(VALUE | st.text(max_size=8)) + text[end:]
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


XML_ATTACKS = [
    '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>'
    '<Data><queue option="active"><job JobID="Moab.1" JobName="&d;"/></queue></Data>',
    '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
    '<Data><queue option="active"><job JobID="Moab.1" JobName="&x;"/></queue></Data>',
    "<Data>" + "<queue>" * 20_000 + "</queue>" * 20_000 + "</Data>",
]
XML = showq_xml() | mutated_xml() | st.sampled_from(XML_ATTACKS) | st.text(max_size=50)


def _sane(job: p.MoabJob) -> None:
    assert p.is_job_id(job.job_id) or job.job_id == "", job.job_id
    for value in (
        job.wall_seconds,
        job.walltime_limit,
        job.cpu_seconds,
        job.procs,
        job.nodes,
        job.mem_mb,
        job.gpus,
    ):
        if value is not None:
            assert Decimal(value).is_finite() and value >= 0, job
    map_state(
        job.state,
        completion=job.completion,
        started=job.started,
        hold_reason=job.hold_reason,
        walltime_reached=job.walltime_reached,
    )


def _typed(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except p.ParseError:
        return None


@FAST
@given(text=XML)
@example(text='<Data><queue option="active"><job JobID="Moab.1" StartTime="1e400"/></queue></Data>')
@example(text='<Data><queue option="active"><job JobID="Moab.1" AWDuration="inf"/></queue></Data>')
@example(text='<Data><queue option="active"><job JobID="Moab.1" ReqAWDuration="\u00b2"/></queue></Data>')
@example(
    text='<Data><queue option="active"><job JobID="Moab.1" AWDuration="-5" StatPSUtl="nan"/></queue></Data>'
)
def test_showq_and_checkjob_xml(text: str) -> None:
    for parse in (p.parse_showq, p.parse_checkjob):
        for job in _typed(partial(parse, text)) or []:
            _sane(job)


@FAST
@given(text=st.text(max_size=60) | VALUE | st.sampled_from(["\nMoab.12\n", "ERROR: x\nMoab.1", "\u00b2"]))
def test_msub_output_and_scalars(text: str) -> None:
    job_id = _typed(lambda: p.parse_msub(text))
    assert job_id is None or p.is_job_id(job_id)
    seconds = p.duration_seconds(text)
    assert seconds is None or seconds >= 0
    Completion.parse(text)


MWS_KEYS = st.sampled_from(
    [
        "name",
        "id",
        "customName",
        "states",
        "state",
        "credentials",
        "user",
        "dates",
        "submitDate",
        "startDate",
        "completionDate",
        "requirements",
        "resourcesPerTask",
        "MEM",
        "dedicated",
        "taskCount",
        "holds",
        "blocks",
        "category",
        "completionCode",
        "queueStatus",
        "cancelled",
        "duration",
        "durationActive",
        "cpuTime",
        "requiredProcessorCountMinimum",
        "requiredNodeCountMinimum",
        "memoryUtilizedMaximum",
        "gpus",
        "messages",
        "results",
    ]
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | VALUE,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(MWS_KEYS | st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=30,
)
MWS_JOB = {
    "name": "Moab.12",
    "customName": "vehpc-JOB-1",
    "states": {"state": "Running"},
    "credentials": {"user": "alice"},
    "dates": {"submitDate": "2026-11-30 12:00:00 UTC", "startDate": "2026-11-30 12:00:05 UTC"},
    "requirements": [{"resourcesPerTask": {"MEM": {"dedicated": 512}}, "taskCount": 2, "gpus": 1}],
    "holds": [],
    "duration": 600,
    "durationActive": 12,
    "cpuTime": 10,
    "queueStatus": "active",
}


@st.composite
def mws_bodies(draw: st.DrawFn) -> Any:
    job = dict(MWS_JOB)
    for key in draw(st.lists(st.sampled_from(sorted(MWS_JOB)), max_size=3)):
        job[key] = draw(JSON_VALUES)
    return draw(st.sampled_from([job, {"results": [job]}, {"results": job}]))


@FAST
@given(body=mws_bodies() | st.dictionaries(MWS_KEYS, JSON_VALUES, max_size=5) | JSON_VALUES)
@example(body={"name": "Moab.1", "holds": 5})
@example(body={"name": "Moab.1", "durationActive": float("inf")})
@example(body={"name": "Moab.1", "cpuTime": "NaN"})
@example(body={"name": "Moab.1", "durationActive": -3})
def test_mws_json(body: Any) -> None:
    if isinstance(body, dict):
        job = _typed(lambda: p.parse_mws_job(body))
        if job is not None:
            _sane(job)
        for each in _typed(lambda: p.parse_mws_jobs(body)) or []:
            _sane(each)
    assert isinstance(p.mws_messages(body), str)


# ---- the adapter over a MOAB that prints garbage -------------------------------------------------------------


class ScriptedRunner:
    description = "scripted"

    def __init__(self, outputs: list[tuple[int, str, str]]) -> None:
        self.outputs = outputs
        self.calls = 0

    async def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout: float) -> CommandResult:
        code, out, err = self.outputs[self.calls % len(self.outputs)]
        self.calls += 1
        return CommandResult(tuple(argv), code, out, err)

    async def close(self) -> None:
        return None


ANSWERS = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 1]), XML | st.sampled_from(["\nMoab.12\n"]), st.sampled_from(["", "ERROR"])
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(answers=ANSWERS)
def test_the_moab_adapter_over_garbage_raises_only_typed_errors(answers: list[tuple[int, str, str]]) -> None:
    async def scenario() -> None:
        backend = CliBackend(CommandExecutor(ScriptedRunner(answers), TRANSIENT_PATTERNS, 5.0), user="alice")
        adapter = MoabAdapter(
            backend,
            cluster_id="fuzz",
            config=MoabConfig(),
            backoff=Backoff(max_retries=0),
            tenants=TenantAccounts.shared(),
        )
        job = JobSpec(
            job_id="wf-fuzz", tenant="tenant1", provider="provider1", offering_id="o1", script="true\n"
        )
        calls: list[Callable[[], Any]] = [
            lambda: adapter.status_batch(["Moab.1", "Moab.12"]),
            lambda: adapter.usage("Moab.12"),
            lambda: adapter.find("wf-fuzz"),
            lambda: adapter.submit(SubmitRequest(workflow_id="wf-fuzz", job=job, body="true\n")),
            lambda: adapter.cancel("Moab.12"),
        ]
        for call in calls:
            try:
                await asyncio.wait_for(call(), 20)
            except HPCError:
                continue

    asyncio.run(scenario())


def test_json_answers_round_trip_through_the_parser() -> None:
    """The MWS fixture above is a valid job (so the generator mutates something that parses)."""
    job = p.parse_mws_job(json.loads(json.dumps(MWS_JOB)))
    assert job.job_id == "Moab.12" and job.wall_seconds == 12 and job.mem_mb == 1024
