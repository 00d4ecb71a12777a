"""Hostile scheduler output: every SLURM parser and the adapter above them, fed garbage, truncated and mutated
captures, must answer with records or a typed error, never another exception and never a hang.

Promise (invariants 5 and 12 in docs/architecture.md): a scheduler that prints something unexpected (a truncated line after a
dropped SSH channel, a field in a format we did not ask for, Unicode digits, a timestamp beyond 2038 by a
thousand years, a JSON document of the wrong shape) costs one failed query, which the watch treats as "no news"
and retries. It must not crash a worker with a ``ValueError`` from deep inside ``int()`` or ``datetime``.

The contract checked here: the text and JSON parsers in ``activities/schedulers/slurm/parsers.py`` return their
records or raise ``ParseError``, which is a transient ``SchedulerError`` (so the activity boundary translates it
like any other scheduler failure); job ids they return are ASCII digits; the adapter's ``status_batch``,
``usage``, ``find`` and ``submit`` over a runner that prints such output raise nothing but ``HPCError``. Inputs
come from Hypothesis: free text, rows with the exact field count of the adapter's formats made of tricky
tokens, and the golden captures of ``tests/golden/slurm`` cut and mutated at random places.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from activities.schedulers.base import SubmitRequest
from activities.schedulers.slurm import parsers as p
from activities.schedulers.slurm.adapter import SlurmAdapter
from activities.schedulers.slurm.backends import TRANSIENT_PATTERNS, CliBackend, RestBackend
from activities.schedulers.slurm.base import Backoff, CommandExecutor, CommandResult
from activities.schedulers.slurm.states import exit_code_from_pair, exit_code_from_wait_status, map_state
from activities.schedulers.slurm.transports import RestClient
from activities.tenant_accounts import TenantAccounts
from virtengine_hpc.config import SlurmConfig
from virtengine_hpc.errors import HPCError, SchedulerError
from virtengine_hpc.models import JobSpec
from virtengine_hpc.states import JobState

GOLDEN = Path(__file__).parent / "golden" / "slurm"
TEXT_CAPTURES = [path.read_text() for path in sorted(GOLDEN.glob("*.txt"))]
JSON_CAPTURES = [
    json.loads(path.read_text())
    for path in sorted(GOLDEN.glob("*.json"))
    if not path.name.endswith(".request.json")
]
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
ASCII_ID = re.compile(r"^[0-9]+$")

# Tokens that have broken parsers elsewhere: placeholders, Unicode digits (str.isdigit() is True for them but
# int() refuses some), numbers beyond every range, almost-durations and almost-sizes, separators inside fields.
TRICKY = st.sampled_from(
    [
        "",
        " ",
        "N/A",
        "Unknown",
        "None",
        "(null)",
        "INVALID",
        "0",
        "-1",
        "²",
        "①",
        "\u0661\u0662\u0663",  # Arabic-Indic digits
        "\u0663:\u0660",
        "9" * 30,
        "9" * 5000,
        "1e400",
        "NaN",
        "Infinity",
        "00:00:01",
        "1-00:00:00",
        "99999999999:59:59",
        "1-2-3:4:5",
        "00:00.5",
        "cpu=1,mem=1G,node=1",
        "cpu=00:00:05,mem=322144K,fs/disk=1690155",
        "mem=xyz",
        "cpu=abc",
        "mem=1" + "0" * 400 + "E",
        "gres/gpu=2",
        "=",
        ",,,",
        "a=b=c",
        "1G",
        "1.5T",
        "K",
        "RUNNING",
        "PENDING",
        "CANCELLED by 0",
        "CANCELLED+",
        "OUT_OF_MEMORY",
        "4294967296",
        "2026-11-30T12:00:00",
        "2026-13-45T99:99:99",
        "3:0",
        "0:125",
        "vehpc-wf-1",
        "vehpc;wf=wf-1",
        "\x00",
        "\u202e",
        "|",
        "\t",
    ]
)
FIELD = TRICKY | st.text(max_size=16)


def rows(fields: Sequence[str], *, terminated: bool = False) -> st.SearchStrategy[str]:
    """Lines with exactly the field count the parser asked for, so every value reaches the field parsers."""
    row = st.lists(FIELD, min_size=len(fields), max_size=len(fields)).map(
        lambda values: "|".join(v.replace("\n", " ") for v in values) + ("|" if terminated else "")
    )
    job_ids = st.sampled_from(["7", "7.batch", "7.0", "12", "10_1", "²", "7.²", "", "x"])
    first = st.tuples(job_ids, row).map(lambda pair: pair[0] + pair[1][pair[1].find("|") :])
    return st.lists(row | first, min_size=1, max_size=6).map("\n".join)


@st.composite
def mutated(draw: st.DrawFn, captures: Sequence[str]) -> str:
    """A golden capture cut short, with a slice replaced by junk or its separators shuffled."""
    text = draw(st.sampled_from(captures))
    if not text:
        return text
    cut = draw(st.integers(0, len(text)))
    start = draw(st.integers(0, len(text)))
    end = draw(st.integers(start, min(len(text), start + 40)))
    junk = draw(FIELD)
    how = draw(st.sampled_from(["truncate", "replace", "separators", "both"]))
    if how in ("replace", "both"):
        text = text[:start] + junk + text[end:]
    if how in ("truncate", "both"):
        text = text[:cut]
    if how == "separators":
        text = text.replace("|", draw(st.sampled_from(["", "||", ",", "|\n"])))
    return text


TEXTS = st.text() | mutated(TEXT_CAPTURES)


def _typed(call: Callable[[], Any]) -> Any:
    """The call's result, or ``None`` after a typed parse error; anything else fails the test."""
    try:
        return call()
    except p.ParseError as exc:
        assert isinstance(exc, SchedulerError) and isinstance(exc, HPCError)
        assert exc.transient, "unparsable output is a failed query: retried, never final"
        return None


def test_parse_error_is_a_transient_scheduler_error() -> None:
    """The activity boundary translates ``HPCError``s; a parse error must be one, or it escapes untranslated."""
    with pytest.raises(SchedulerError) as info:
        p.parse_job_id("Submitted batch job ①")
    assert isinstance(info.value, p.ParseError) and info.value.transient
    assert info.value.code == "scheduler_output_unparsable"


# ---- text parsers ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@FAST
@given(text=TEXTS | rows(p.SQUEUE_FIELDS, terminated=True))
def test_squeue_output(text: str) -> None:
    jobs = _typed(lambda: p.parse_squeue(text))
    for job in jobs or []:
        assert ASCII_ID.match(job.job_id), job.job_id
        map_state(job.state, job.reason)  # every state string maps (unknown ones are logged)


@pytest.mark.timeout(120)
@FAST
@given(text=TEXTS | rows(p.SACCT_FIELDS))
def test_sacct_output(text: str) -> None:
    jobs = _typed(lambda: p.parse_sacct(text))
    for job in jobs or []:
        assert ASCII_ID.match(job.job_id), job.job_id
        _no_negative_quantities(job.alloc_tres, job.elapsed_seconds, job.total_cpu_seconds)
        map_state(job.state, job.reason)


@pytest.mark.timeout(120)
@FAST
@given(text=TEXTS | rows(p.SSTAT_FIELDS))
@example(text="9.0|5K|cpu=00:00:10,mem=1M,energy=3|fs/disk=7\n")  # parses: its quantities are checked
@example(text="9.0|5K|energy=-3|fs/disk=-7\n")  # a negative reading is a typed parse error
def test_sstat_output(text: str) -> None:
    steps = _typed(lambda: p.parse_sstat(text))
    for step in steps or []:  # live readings are billed as they come: none may be negative
        _no_negative_quantities(step.usage_in, step.max_rss_bytes)
        _no_negative_quantities(step.usage_out)


@pytest.mark.timeout(120)
@FAST
@given(text=TEXTS | FIELD)
def test_sbatch_and_scontrol_output(text: str) -> None:
    job_id = _typed(lambda: p.parse_job_id(text))
    assert job_id is None or ASCII_ID.match(job_id), job_id
    config = p.parse_scontrol_config(text)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in config.items())


def _no_negative_quantities(tres: dict[str, Decimal], *numbers: Decimal | int | None) -> None:
    """Usage is priced from these; a negative or NaN one would settle below zero (the ledger would refund more
    than the escrow)."""
    for value in [*tres.values(), *numbers]:
        if value is not None:
            assert Decimal(value).is_finite() and value >= 0, (tres, numbers)


@pytest.mark.timeout(120)
@FAST
@given(value=FIELD)
@example(value="cpu=-1,node=-2")
@example(value="gres/gpu=NaN,billing=Infinity")
def test_scalar_fields(value: str) -> None:
    _typed(lambda: p.parse_time(value))
    _typed(lambda: p.parse_duration(value))
    _typed(lambda: p.parse_size(value))
    for usage in (True, False):
        tres: dict[str, Decimal] = _typed(partial(p.parse_tres, value, usage=usage)) or {}
        _no_negative_quantities(tres)
    number = _typed(lambda: p.parse_int(value))
    assert number is None or number >= 0
    exit_code_from_pair(value)
    map_state(value, value)


@FAST
@given(value=st.integers(min_value=-(2**80), max_value=2**80))
def test_numeric_fields_of_any_size(value: int) -> None:
    _typed(lambda: p.parse_time(value))
    code = exit_code_from_wait_status(value)
    assert code is None or 0 <= code < 256


# ---- slurmrestd JSON -------------------------------------------------------------------------------------------

REST_KEYS = st.sampled_from(
    [
        "jobs",
        "job_id",
        "start_time",
        "end_time",
        "submit_time",
        "job_state",
        "state_reason",
        "tres_alloc_str",
        "user_name",
        "name",
        "comment",
        "exit_code",
        "time",
        "state",
        "kill_request_user",
        "steps",
        "step",
        "id",
        "tres",
        "requested",
        "total",
        "max",
        "consumed",
        "statistics",
        "energy",
        "elapsed",
        "seconds",
        "microseconds",
        "submission",
        "start",
        "end",
        "allocated",
        "type",
        "count",
        "status",
        "return_code",
        "signal",
        "signal_id",
        "set",
        "infinite",
        "number",
        "current",
        "reason",
        "job",
        "user",
        "errors",
        "error",
        "description",
        "error_code",
        "error_number",
    ]
)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | TRICKY
    | st.text(max_size=10)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(REST_KEYS | st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=40,
)


@st.composite
def mutated_json(draw: st.DrawFn) -> Any:
    """A golden slurmrestd answer with one node (found by a random walk) replaced by a random value."""
    document = json.loads(json.dumps(draw(st.sampled_from(JSON_CAPTURES))))
    parent: Any = None
    key: Any = None
    node = document
    for _ in range(draw(st.integers(0, 8))):
        if isinstance(node, dict) and node:
            k = draw(st.sampled_from(sorted(node)))
        elif isinstance(node, list) and node:
            k = draw(st.integers(0, len(node) - 1))
        else:
            break
        parent, key, node = node, k, node[k]
    replacement = draw(JSON_VALUES)
    if parent is None:
        return replacement
    parent[key] = replacement
    return document


BODIES = mutated_json() | st.dictionaries(REST_KEYS, JSON_VALUES, max_size=4) | JSON_VALUES


@pytest.mark.timeout(120)
@FAST
@given(body=BODIES)
@example(body={"jobs": [{"job_id": 1, "exit_code": {"status": "EXITED", "return_code": 0}}]})
@example(body={"jobs": [{"job_id": 1, "tres": {"allocated": [{"type": "node", "count": -4}]}}]})
@example(body={"jobs": [{"job_id": 1, "time": {"elapsed": -5}}]})
@example(body={"jobs": [{"job_id": 1, "steps": [{"time": {"total": {"seconds": -3}}}]}]})
@example(body={"jobs": [{"job_id": 1, "start_time": 10**20}]})
@example(body={"jobs": 5})
@example(body={"jobs": [{"job_id": -1}]})
@example(body={"errors": 7, "jobs": "x"})
def test_slurmrestd_answers(body: Any) -> None:
    if not isinstance(body, dict):
        body = {"jobs": body}
    for acct in _typed(lambda: p.parse_rest_db_jobs(body)) or []:
        _no_negative_quantities(acct.alloc_tres, acct.elapsed_seconds, acct.total_cpu_seconds)
        for step in acct.steps:
            _no_negative_quantities(step.usage_in, step.elapsed_seconds, step.total_cpu_seconds)
    for job in _typed(lambda: p.parse_rest_jobs(body)) or []:
        assert ASCII_ID.match(job.job_id), job.job_id
        map_state(job.state, job.reason)
    for acct in _typed(lambda: p.parse_rest_db_jobs(body)) or []:
        assert ASCII_ID.match(acct.job_id), acct.job_id
        map_state(acct.state, acct.reason)
    for error in _typed(lambda: p.rest_errors(body)) or []:
        assert isinstance(p.rest_error_text(error), str)
        p.rest_error_code(error)


def test_deeply_nested_number_shapes_do_not_recurse_without_bound() -> None:
    deep: Any = 5
    for _ in range(5000):
        deep = {"number": deep}
    _typed(lambda: p.parse_rest_jobs({"jobs": [{"job_id": deep}]}))
    state: Any = "RUNNING"
    for _ in range(5000):
        state = {"current": state}
    _typed(lambda: p.parse_rest_jobs({"jobs": [{"job_id": 1, "job_state": state}]}))


# ---- the adapter over a scheduler that prints garbage --------------------------------------------------------


class ScriptedRunner:
    """A ``CommandRunner`` whose every command prints the hypothesis-chosen output."""

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
        st.sampled_from([0, 0, 0, 1, 255]),
        TEXTS | rows(p.SQUEUE_FIELDS, terminated=True) | rows(p.SACCT_FIELDS) | rows(p.SSTAT_FIELDS),
        st.sampled_from(["", "Socket timed out", "Invalid job id specified", "slurm_load_jobs error"]),
    ),
    min_size=1,
    max_size=5,
)


def _adapter(runner: ScriptedRunner) -> SlurmAdapter:
    config = SlurmConfig(cluster_name="localcluster", default_partition="debug")
    backend = CliBackend(
        CommandExecutor(runner, TRANSIENT_PATTERNS, 5.0),
        cluster="localcluster",
        user="hpcuser",
        lookback_days=1,
    )
    return SlurmAdapter(
        backend,
        cluster_id="fuzz",
        config=config,
        backoff=Backoff(max_retries=0),
        tenants=TenantAccounts.shared(),
        verify_cluster=True,
    )


def _rest_adapter(bodies: list[Any]) -> SlurmAdapter:
    """The adapter over slurmrestd, with an HTTP transport that answers every request with the next body."""
    answers = iter(bodies * 50)

    def answer(request: httpx.Request) -> httpx.Response:
        body: Any = next(answers, {})
        return httpx.Response(200, content=body if isinstance(body, bytes) else json.dumps(body).encode())

    client = RestClient(
        base_url="http://slurmrestd.invalid",
        user="hpcuser",
        token=SecretStr("fuzz-token"),
        timeout=5.0,
        transport=httpx.MockTransport(answer),
    )
    backend = RestBackend(
        client, api_version="v0.0.38", cluster="localcluster", user="hpcuser", lookback_days=1
    )
    config = SlurmConfig(cluster_name="localcluster", default_partition="debug", work_dir=Path("/tmp"))
    return SlurmAdapter(
        backend,
        cluster_id="fuzz",
        config=config,
        backoff=Backoff(max_retries=0),
        tenants=TenantAccounts.shared(),
        verify_cluster=False,
    )


def _request() -> SubmitRequest:
    job = JobSpec(job_id="wf-fuzz", tenant="tenant1", provider="provider1", offering_id="o1", script="true\n")
    return SubmitRequest(workflow_id="wf-fuzz", job=job, body="true\n", partition="debug")


@pytest.mark.timeout(240)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(answers=ANSWERS)
def test_the_adapter_over_garbage_output_raises_only_typed_errors(
    answers: list[tuple[int, str, str]],
) -> None:
    async def scenario() -> None:
        adapter = _adapter(ScriptedRunner(answers))
        adapter._checked = True  # cluster_info is exercised below on its own
        calls: list[Callable[[], Any]] = [
            lambda: adapter.status_batch(["7", "12", "99"]),
            lambda: adapter.usage("7"),
            lambda: adapter.find("wf-fuzz"),
            lambda: adapter.submit(_request()),
            lambda: adapter.cancel("7"),
            lambda: _adapter(ScriptedRunner(answers)).status_batch(["7"]),  # with the cluster check
        ]
        for call in calls:
            try:
                result = await asyncio.wait_for(call(), 20)
            except HPCError:
                continue
            if isinstance(result, dict):
                for status in result.values():
                    # Garbage is never evidence that a job ended well.
                    assert status.state != JobState.COMPLETED or status.found

    asyncio.run(scenario())


@pytest.mark.timeout(120)
@FAST
@given(
    text=TEXTS
    | st.lists(
        st.tuples(st.sampled_from(["ClusterName", "SlurmctldPort", "MinJobAge", "SlurmctldHost[0]"]), FIELD),
        max_size=4,
    ).map(lambda kv: "\n".join(f"{k} = {v}" for k, v in kv))
)
@example(text="ClusterName = localcluster\nSlurmctldPort = \u00b2\nMinJobAge = \u00b3 sec\n")
def test_scontrol_show_config_through_the_adapter_check(text: str) -> None:
    """The adapter's first call asks which cluster it reached; an odd answer is a typed error or a mismatch."""

    async def scenario() -> None:
        try:
            await _adapter(ScriptedRunner([(0, text, "")])).status_batch(["7"])
        except HPCError:
            return

    asyncio.run(scenario())


REST_BODIES = st.lists(BODIES | st.sampled_from([b"", b"not json", b"[1, 2]"]), min_size=1, max_size=4)


@pytest.mark.timeout(240)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(bodies=REST_BODIES)
@example(bodies=[{"statistics": True, "jobs": [{"job_id": 7, "job_state": "RUNNING"}]}])
def test_the_adapter_over_garbage_slurmrestd_answers_raises_only_typed_errors(bodies: list[Any]) -> None:
    async def scenario() -> None:
        adapter = _rest_adapter(bodies)
        calls: list[Callable[[], Any]] = [
            lambda: adapter.status_batch(["7", "12"]),
            lambda: adapter.usage("7"),
            lambda: adapter.find("wf-fuzz"),
            lambda: adapter.submit(_request()),
            lambda: adapter.cancel("7"),
        ]
        try:
            for call in calls:
                try:
                    await asyncio.wait_for(call(), 20)
                except HPCError:
                    continue
        finally:
            await adapter.close()

    asyncio.run(scenario())
