"""The ``virtengine-hpc`` process ends with its command's exit code and all of its output, without interpreter
teardown (a Temporal client's runtime threads could otherwise abort a finished command: temporalio/sdk-python#300)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml


def _run(body: str) -> subprocess.CompletedProcess[str]:
    code = "from virtengine_hpc.cli.common import exit_process\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_exit_code_and_buffered_output_survive() -> None:
    done = _run(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stderr, format="%(message)s")
        def main():
            print("x" * 200_000, end="")  # more than a pipe buffer, still in Python's buffer at exit
            logging.getLogger("t").warning("logged before exit")
            return 3
        exit_process(main)
        """
    )
    assert done.returncode == 3
    assert len(done.stdout) == 200_000
    assert "logged before exit" in done.stderr


def test_a_thread_still_running_does_not_hold_the_process() -> None:
    done = _run(
        """
        import threading, time
        def main():
            threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: teardown would wait for it
            print("done")
            return 0
        exit_process(main)
        """
    )
    assert (done.returncode, done.stdout) == (0, "done\n")


@pytest.mark.parametrize(
    ("raise_", "expected"),
    [
        ("SystemExit(0)", 0),
        ("SystemExit(4)", 4),
        ("SystemExit('bad usage')", 1),
        ("KeyboardInterrupt()", 130),
    ],
)
def test_exits_raised_by_a_command_keep_their_meaning(raise_: str, expected: int) -> None:
    done = _run(
        f"""
        def main():
            raise {raise_}
        exit_process(main)
        """
    )
    assert done.returncode == expected
    if expected == 1:
        assert "bad usage" in done.stderr


def test_an_unexpected_exception_prints_its_traceback_and_exits_1() -> None:
    done = _run(
        """
        def main():
            raise RuntimeError("boom")
        exit_process(main)
        """
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: boom" in done.stderr


def test_the_real_cli_keeps_its_exit_codes() -> None:
    help_ = subprocess.run([sys.executable, "-m", "virtengine_hpc", "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "usage: virtengine-hpc" in help_.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "virtengine_hpc", "--config", "/nonexistent/vehpc.yaml", "jobs", "list"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    code = textwrap.dedent(
        """
        from virtengine_hpc.cli.common import exit_process
        def main():
            for i in range(1_000_000):
                print(f"line {i}")
            return 0
        exit_process(main)
        """
    )
    # `... | head -1`: the reader closes the pipe after the first line.
    done = subprocess.run(
        ["bash", "-c", f'{sys.executable} -c "$0" | head -1', code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == "line 0\n"
    assert done.stderr == "", done.stderr


def test_worker_build_id_prints_the_id_the_upgrade_commands_name(tmp_path: Path) -> None:
    """``temporal worker deployment ... --build-id "$(virtengine-hpc worker build-id)"``: the id the workers of this
    installation register (by default the version and a digest of the workflow code), or the configured one."""
    from virtengine_hpc.config import default_build_id

    def build_id(temporal: dict[str, object]) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"temporal": temporal}))
        return subprocess.run(
            [sys.executable, "-m", "virtengine_hpc", "-c", str(path), "worker", "build-id"],
            capture_output=True,
            text=True,
            timeout=60,
        )

    default = build_id({})
    assert default.returncode == 0, default.stderr
    assert default.stdout == default_build_id() + "\n"
    assert re.fullmatch(r"[0-9][0-9a-z.]*\+wf\.[0-9a-f]{12}\n", default.stdout)
    assert build_id({"build_id": "site-7"}).stdout == "site-7\n"
    unversioned = build_id({"deployment_name": None})
    assert unversioned.returncode == 1 and "unversioned" in unversioned.stderr
