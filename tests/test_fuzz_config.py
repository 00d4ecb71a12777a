"""Hostile configuration: files and environment overrides built to hang, exhaust or crash the loader.

``tests/test_config.py`` already throws random trees and random text at ``load_config``; this file adds what random
generation does not find: YAML documents that are small on disk and enormous in memory (an alias "billion laughs"),
nesting past Python's recursion limit, integers past ``int()``'s digit limit, durations of any size and script, and
the same payloads through ``VIRTENGINE_HPC__*`` variables (their values are parsed as YAML too). The contract: a
``ConfigError`` naming the problem, quickly; never a hang, ``RecursionError``, ``OverflowError`` or bare
``ValueError``.
"""

from __future__ import annotations

import itertools
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from virtengine_hpc.config import Secrets, load_config, parse_duration
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.node.config import load_agent_config

pytestmark = pytest.mark.timeout(60)


def _alias_bomb(levels: int = 9, fan_out: int = 9) -> str:
    """``fan_out ** levels`` leaves (387 million here) from a 300-byte file: each level lists the previous one 9x."""
    names = [f"l{i}" for i in range(levels + 1)]
    lines = [f"{names[0]}: &{names[0]} [" + ", ".join(["lol"] * fan_out) + "]"]
    for prev, name in itertools.pairwise(names):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * fan_out) + "]")
    return "\n".join(lines) + "\n"


HOSTILE_FILES = {
    "alias bomb": _alias_bomb(),
    "alias bomb under a real section": "hpc:\n  job_service:\n"
    + "".join(f"    {line}\n" for line in _alias_bomb().splitlines()),
    "deep list": "[" * 50_000 + "]" * 50_000,
    "deep mapping": "".join(f"{' ' * i}k{i}:\n" for i in range(3000)) + " " * 3000 + "v\n",
    "huge integer": "hpc:\n  job_service:\n    max_concurrent_jobs: " + "9" * 5000 + "\n",
    "huge duration": "hpc:\n  job_service:\n    job_poll_interval: " + "9" * 400 + "\n",
    "huge float": "hpc:\n  job_service:\n    job_poll_interval: 1e400\n",
    "python tag": "hpc: !!python/object/apply:os.system ['touch /tmp/vehpc-pwned-config']\n",
    "binary": "\x00\x01\x02\xff",
    "many keys": "".join(f"k{i}: {i}\n" for i in range(60_000)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_a_hostile_file_is_refused_quickly_with_a_config_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(HOSTILE_FILES[name], encoding="utf-8", errors="surrogatepass")
    # A guard against hangs and blow-ups (the biggest file takes ~3-5 s here), not a speed test: generous enough
    # for a loaded 2-core CI machine.
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert time.monotonic() - started < 60, f"{name}: the loader took too long"
    assert len(str(info.value)) < 2000, "the message names the problem; it does not echo the document"
    assert not Path("/tmp/vehpc-pwned-config").exists()


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_the_node_agent_config_loader_refuses_them_too(tmp_path: Path, name: str) -> None:
    path = tmp_path / "hpc-node-agent.yaml"
    path.write_text(HOSTILE_FILES[name], encoding="utf-8", errors="surrogatepass")
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_agent_config(path, env={})
    assert time.monotonic() - started < 60
    assert len(str(info.value)) < 2000


def test_a_node_agent_latency_target_bomb_is_refused() -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError):
        load_agent_config(env={"VE_NODE_LATENCY_TARGETS": "[" * 50_000 + "]" * 50_000})
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("name", ["alias bomb", "deep list", "huge integer", "huge duration"])
def test_the_same_payloads_through_environment_overrides(name: str) -> None:
    payload = HOSTILE_FILES[name]
    if name.startswith("huge"):
        payload = payload.rsplit(": ", 1)[1].strip()
    started = time.monotonic()
    with pytest.raises(ConfigError):
        load_config(data={}, env={"VIRTENGINE_HPC__HPC__JOB_SERVICE__JOB_POLL_INTERVAL": payload})
    assert time.monotonic() - started < 60


def test_aliases_that_stay_small_are_still_allowed(tmp_path: Path) -> None:
    """Operators share settings with anchors; only the expanded size is bounded, not the feature."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "hpc:\n"
        "  cluster_id: c1\n"
        "  local: &local {max_parallel_jobs: 7, job_poll_interval: 2s}\n"
        "  clusters:\n"
        "    - {cluster_id: c1, scheduler_type: local}\n"
        "    - {cluster_id: c2, scheduler_type: local, local: *local}\n"
    )
    config = load_config(path, env={})
    assert config.for_cluster("c2").hpc.local.max_parallel_jobs == 7


DURATION_TEXT = st.text(max_size=30) | st.from_regex(
    r"\A[0-9\u0660-\u0669\u00b2.]{0,6}(ms|s|m|h|d)?([0-9]{0,3}(ms|s|m|h|d))?\Z"
)


@settings(max_examples=400, deadline=None, database=None)
@given(
    value=DURATION_TEXT
    | st.integers(min_value=-(10**500), max_value=10**500)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
)
def test_parse_duration_gives_a_duration_or_a_value_error(value: object) -> None:
    try:
        parsed = parse_duration(value)
    except ValueError:
        return
    assert isinstance(parsed, timedelta)
    assert timedelta(0) <= parsed <= timedelta(days=3650)
    if isinstance(value, str):
        assert value.isascii(), f"{value!r}: only ASCII digits make a duration"


ENV_NAMES = (
    "SLURM_JWT_TOKEN",
    "MOAB_USERNAME",
    "MOAB_PASSWORD",
    "OOD_OIDC_CLIENT_SECRET",
    "PROVIDER_SIGNING_KEY_PATH",
    "UNRELATED",
)


@settings(max_examples=200, deadline=None, database=None)
@given(
    env=st.fixed_dictionaries(
        {},
        optional={
            name: st.builds(f"{name}={{}}".format, st.text(max_size=40)) | st.just("") for name in ENV_NAMES
        },
    )
)
def test_secrets_from_any_environment_never_show(env: dict[str, str]) -> None:
    secrets = Secrets.from_env(env)
    shown = repr(secrets) + str(secrets) + secrets.model_dump_json()
    for name in ("SLURM_JWT_TOKEN", "MOAB_PASSWORD", "OOD_OIDC_CLIENT_SECRET"):
        value = env.get(name)
        if value:
            assert value not in shown, f"{name} leaked into the repr or JSON of Secrets"
