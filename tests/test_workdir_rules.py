"""What makes ``<work_dir>/<account>`` safe to write a tenant's output in (``activities.schedulers.batch.workdir``),
on this host's real file system: the same ``stat`` answers as over SSH, read both ways."""

from __future__ import annotations

import os
import pwd
import uuid
from pathlib import Path

import pytest

from activities.schedulers.batch.workdir import (
    CHANGED,
    CHANGED_EXIT,
    TenantDirs,
    components,
    guarded,
    local_lstat,
    make_private_dir,
    remote_lstat,
)
from activities.schedulers.slurm.transports import LocalRunner
from tests.local_support import TENANT_POOL, reachable_dir, running_as_root, shared_dir
from virtengine_hpc.errors import SubmissionRejected

pytestmark = pytest.mark.skipif(not running_as_root(), reason="makes directories owned by tenant accounts")
ALICE, BOB = TENANT_POOL[0], TENANT_POOL[1]


def provider_dir() -> Path:
    path = reachable_dir("rules") / "jobs"
    path.mkdir(mode=0o755)
    return path


def give(path: Path, account: str, mode: int = 0o700) -> Path:
    entry = pwd.getpwnam(account)
    path.mkdir(mode=mode, exist_ok=True)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(mode)
    return path


async def stat_command(argv: list[str]) -> tuple[int, str]:
    """The ``stat`` a submit host runs, here through a local process (the SSH transport is tested elsewhere)."""
    result = await LocalRunner().run(argv, timeout=10)
    return result.exit_code, result.stdout


def both() -> list[TenantDirs]:
    """The checks of a worker on the file system's host and of one reaching it through ``stat``."""
    return [
        TenantDirs(local_lstat, trusted={"root"}),
        TenantDirs(remote_lstat(stat_command), trusted={"root"}),
    ]


async def why(parent: Path | str, account: str = ALICE) -> list[str]:
    """The refusal of each way of checking (both must agree)."""
    reasons = []
    for dirs in both():
        with pytest.raises(SubmissionRejected) as caught:
            await dirs.ensure(str(parent), account)
        assert caught.value.code == "work_dir_unsafe" and not caught.value.transient
        reasons.append(str(caught.value))
    assert reasons[0] == reasons[1], reasons
    return reasons


async def test_the_accounts_own_private_directory_under_the_providers_parent_passes() -> None:
    parent = provider_dir()
    give(parent / ALICE, ALICE)
    for dirs in both():
        assert await dirs.ensure(f"{parent}/", ALICE) == f"{parent}/{ALICE}"


async def test_what_another_account_could_have_planted_or_can_still_change_is_refused() -> None:
    parent = provider_dir()
    (parent / BOB).symlink_to(give(shared_dir("spy") / ALICE, ALICE, 0o777))
    assert "is a symbolic link, not" in (await why(parent, BOB))[0]
    give(parent / ALICE, BOB)
    assert f"is owned by {BOB}, not by {ALICE}" in (await why(parent))[0]
    give(parent / ALICE, ALICE, 0o750)
    assert "has mode 750, not 0700" in (await why(parent))[0]
    (parent / "file").write_text("")
    assert "is not a directory" in (await why(parent, "file"))[0]
    assert "does not exist: the operator makes it" in (await why(parent, BOB + "x"))[0]


async def test_a_parent_another_account_may_write_or_own_or_reach_through_a_link_is_refused() -> None:
    open_parent = shared_dir("open")
    give(open_parent / ALICE, ALICE)
    assert "is writable by other accounts (mode 1777)" in (await why(open_parent))[0]

    owned = give(reachable_dir("owned") / "jobs", BOB, 0o755)
    give(owned / ALICE, ALICE)
    assert f"work_dir {owned} is owned by {BOB}" in (await why(owned))[0]

    above = give(reachable_dir("above") / "mid", BOB, 0o755)
    inner = above / "jobs"
    inner.mkdir(mode=0o755)
    os.chown(inner, 0, 0)
    give(inner / ALICE, ALICE)
    assert f"{above} (above work_dir {inner}) is owned by {BOB}" in (await why(inner))[0]

    real = provider_dir()
    give(real / ALICE, ALICE)
    link = real.parent / "link"
    link.symlink_to(real)
    assert "is a symbolic link: configure work_dir by its real path" in (await why(link))[0]


def test_work_dir_must_be_a_plain_absolute_path() -> None:
    assert components("/a/b/") == ["/", "/a", "/a/b"]
    for bad in ("relative/jobs", "/a/../etc", "/a/./b", "/a//b", "/a/b c", "/a/b\nc"):
        with pytest.raises(SubmissionRejected):
            components(bad)


async def test_a_root_worker_hands_over_a_missing_or_unfinished_directory_without_following_links() -> None:
    parent = provider_dir()
    dirs = TenantDirs(local_lstat, trusted={"root"}, make=make_private_dir)
    assert await dirs.ensure(str(parent), ALICE) == f"{parent}/{ALICE}"
    made = (parent / ALICE).lstat()
    assert made.st_uid == pwd.getpwnam(ALICE).pw_uid and made.st_mode & 0o7777 == 0o700
    (parent / BOB).mkdir(mode=0o755)  # made by root and never handed over (a crash between)
    await dirs.ensure(str(parent), BOB)
    assert (parent / BOB).stat().st_uid == pwd.getpwnam(BOB).pw_uid
    target = give(shared_dir("target") / "t", ALICE, 0o777)
    (parent / TENANT_POOL[2]).symlink_to(target)
    with pytest.raises(SubmissionRejected, match="is a symbolic link"):
        await dirs.ensure(str(parent), TENANT_POOL[2])
    assert target.stat().st_uid == pwd.getpwnam(ALICE).pw_uid and target.stat().st_mode & 0o777 == 0o777


async def test_a_guarded_command_runs_only_while_the_directory_is_as_the_provider_checked_it() -> None:
    """What the provider's check found (its own ``stat``) is compared in the command itself, as run by an account's
    login (here a local ``sh`` as that account): the command runs then, and not after any change."""
    parent = provider_dir()
    alices = give(parent / ALICE, ALICE)
    dirs = TenantDirs(remote_lstat(stat_command), trusted={"root"})
    assert await dirs.ensure(str(parent), ALICE) == str(alices)
    verified = dirs.verified(str(alices))
    assert verified is not None and verified.path == str(alices)
    entry = pwd.getpwnam(ALICE)
    as_alice = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--"]
    marker = f"it's $(ran) `here` \\ {uuid.uuid4().hex}"

    async def run() -> tuple[int, str, str]:
        result = await LocalRunner().run([*as_alice, *guarded(verified, ["cat"])], stdin=marker, timeout=10)
        return result.exit_code, result.stdout, result.stderr

    assert await run() == (0, marker, ""), "as checked: the command runs, its stdin and output untouched"
    for change in (
        lambda: alices.chmod(0o755),  # the account opens its own directory
        lambda: parent.chmod(0o775),  # work_dir made writable by a group
        lambda: os.chown(alices, 0, 0),  # another owner
        lambda: (alices.rename(parent / "moved"), (parent / ALICE).symlink_to(parent / "moved")),  # a link
    ):
        change()
        code, out, err = await run()
        assert (code, out) == (CHANGED_EXIT, "") and CHANGED in err, "changed: nothing ran"
        for path in (parent / ALICE, parent / "moved"):  # put back as checked
            if path.is_symlink():
                path.unlink()
        if (parent / "moved").exists():
            (parent / "moved").rename(alices)
        parent.chmod(0o755)
        give(alices, ALICE)
        assert await run() == (0, marker, "")
