"""Each tenant's own job directory, ``<work_dir>/<account>``, checked before every submission.

Tenants write the scripts. A tenant able to create or replace an entry of ``work_dir`` could put a symbolic link
(or a directory of its own) under another tenant's account name, pointing at a place it reads: every later
output and interactive-session token of that tenant would land there, since the scheduler opens output files
as the job's account and follows links. So:

* ``work_dir`` belongs to the provider: a directory owned by root or the provider's account, writable by no one
  else (no group or other write bit, sticky or not), and no component of its path is a symbolic link (give its
  real path). Directories above it are owned by root or the provider's account and not writable by others,
  unless sticky (like ``/tmp``: no other account can then replace what the provider owns in it).
* ``<work_dir>/<account>`` is a directory, not a link, owned by the account, mode 0700.

Every submission checks again, so a directory changed after an earlier check is caught at the next job: one
``lstat`` per path component on the worker's host, or one ``stat`` command as the provider's account over SSH.
Over SSH with per-tenant logins the check of later jobs rides in ``sbatch``'s own round trip instead
(``guarded``): the provider's own check (``TenantDirs.ensure``) remembers what it found safe (``Verified``: kind,
owner and mode of the tenant's directory and of every directory above it, one entry per tenant account), and the
tenant's submission runs ``sbatch`` only if ``stat`` finds exactly that, right before it, in the same command;
anything else and nothing is submitted: the provider checks again with its own ``stat`` and refuses, or submits
after its check as before. That comparison runs in the tenant's login session, whose startup files the tenant
can write, so the tenant could make it lie, but only about its own directory: no one but root, the provider and
(the mode of its own directory) the account itself can change what is compared, so a lie exposes nothing but that
tenant's own files, and no other account can reach that session to pass off a directory it swapped.
A failed check refuses that one job (``SubmissionRejected`` with code ``work_dir_unsafe``, which the submit
activity audits as the job's submission failure) before anything reaches the scheduler, and touches no file:
other tenants' jobs go on.

Who makes a missing tenant directory: a worker that runs as root on the host of ``work_dir`` (the ``cli``
transport) makes it itself, in the checked parent, through a directory descriptor opened with ``O_NOFOLLOW``
(``mkdir`` 0700, then ``fchown`` to the account and ``fchmod`` 0700 on that descriptor). Everywhere else
(``ssh``, an unprivileged ``cli`` worker) only root could give the account a directory in a parent it cannot
write: the operator makes it (``install -d -o <account> -g <account> -m 0700 <work_dir>/<account>``) and a
missing one is refused with that command in the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import shlex
import stat
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from virtengine_hpc.errors import SubmissionRejected

UNSAFE = "work_dir_unsafe"
"""The ``code`` of every refusal of this module (audit details, the chain's reason)."""

DIRECTORY, LINK, MISSING, OTHER = "directory", "symbolic link", "missing", "not a directory"
_NAME = re.compile(r"[A-Za-z0-9._+@-]{1,255}")
_STAT_FORMAT = "%F|%U|%a|%n"
_GUARD_FORMAT = "%F|%U|%a|%n;"  # one line (no command argument may hold a newline)
CHANGED_EXIT = 97
"""The exit code (with ``CHANGED`` on standard error) of a ``guarded`` command that did not run."""
CHANGED = "vehpc: the job directory is not as the provider checked it"


@dataclass(frozen=True)
class Entry:
    """What ``lstat`` says of one path: its kind, its owner's name and its permission bits (with the sticky bit)."""

    kind: str
    owner: str = ""
    mode: int = 0


Lstat = Callable[[Sequence[str]], Awaitable[dict[str, Entry]]]


@dataclass(frozen=True)
class Verified:
    """A tenant's job directory and every directory above it (``entries``: path and entry, ``/`` first, the
    tenant's directory last) as the provider's own check found them safe."""

    entries: tuple[tuple[str, Entry], ...]

    @property
    def path(self) -> str:
        return self.entries[-1][0]

    def stat_answer(self) -> str:
        """What ``stat --printf`` of ``guarded`` prints while nothing changed since the check."""
        return "".join(f"{e.kind}|{e.owner}|{e.mode:o}|{path};" for path, e in self.entries)


def guarded(verified: Verified, argv: Sequence[str]) -> list[str]:
    """``argv`` run only if the directories are still exactly as ``verified`` (kind, owner, mode of each), checked
    in the same command; else it exits ``CHANGED_EXIT`` saying ``CHANGED``, having run nothing. Only the
    provider's own argv and checked paths (plain names) are placed in the script; the expected answer and the
    paths travel as arguments."""
    script = (
        f'if [ "$(stat --printf {shlex.quote(_GUARD_FORMAT)} -- "$@" 2>/dev/null)" = "$0" ]; '
        f"then exec {shlex.join(argv)}; fi; "
        f"echo {shlex.quote(CHANGED)} >&2; exit {CHANGED_EXIT}"
    )
    return ["sh", "-c", script, verified.stat_answer(), *(path for path, _ in verified.entries)]


def unsafe(message: str) -> SubmissionRejected:
    return SubmissionRejected(message, code=UNSAFE)


def components(path: str) -> list[str]:
    """``/a/b`` -> ``["/", "/a", "/a/b"]``; only an absolute path of plain names (no ``.``, ``..`` or ``//``)."""
    if not path.startswith("/"):
        raise unsafe(f"work_dir {path[:200]!r} is not an absolute path")
    names = path.rstrip("/").split("/")[1:]
    if any(name in (".", "..") or not _NAME.fullmatch(name) for name in names):
        raise unsafe(
            f"work_dir {path[:200]!r} must be a plain absolute path (names of letters, digits, ._+@-)"
        )
    return ["/", *("/" + "/".join(names[: i + 1]) for i in range(len(names)))]


def parent_problem(path: str, entries: dict[str, Entry], trusted: Collection[str]) -> str | None:
    """Why ``work_dir`` (``path``) or a directory above it lets some other account replace what lies below."""
    chain = components(path)
    for i, each in enumerate(chain):
        entry = entries.get(each, Entry(MISSING))
        last = i == len(chain) - 1
        name = "work_dir " + each if last else f"{each} (above work_dir {path})"
        if entry.kind == LINK:
            return f"{name} is a symbolic link: configure work_dir by its real path"
        if entry.kind != DIRECTORY:
            return f"{name} is {entry.kind}"
        if entry.owner not in trusted:
            return f"{name} is owned by {entry.owner}, not by {' or '.join(sorted(trusted))}"
        writable = entry.mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and (last or not entry.mode & stat.S_ISVTX):
            return (
                f"{name} is writable by other accounts (mode {entry.mode:o}): a tenant could plant entries in "
                "it; make it 0755 or 0711"
            )
    return None


def tenant_problem(path: str, account: str, entry: Entry) -> str | None:
    """Why ``path`` is not ``account``'s own private directory (``None``: it is)."""
    if entry.kind == MISSING:
        return (
            f"{path} does not exist: the operator makes it "
            f"(install -d -o {account} -g {account} -m 0700 {path})"
        )
    if entry.kind == LINK:
        return f"{path} is a symbolic link, not {account}'s own directory"
    if entry.kind != DIRECTORY:
        return f"{path} is {entry.kind}"
    if entry.owner != account:
        return f"{path} is owned by {entry.owner}, not by {account}"
    if entry.mode & 0o7777 != 0o700:
        return (
            f"{path} has mode {entry.mode & 0o7777:o}, not 0700: other accounts could reach {account}'s files"
        )
    return None


class TenantDirs:
    """Checks, before each submission, that ``<work_dir>/<account>`` is the account's own private directory.

    ``lstat`` reads the paths where ``work_dir`` lives (``local_lstat``: this host; ``remote_lstat``: a submit
    host, through the provider's own login); ``trusted``: the accounts that may own ``work_dir`` and what is
    above it (root and the provider's account); ``make``: creates a missing directory (root on this host only).
    """

    def __init__(
        self,
        lstat: Lstat,
        *,
        trusted: Collection[str],
        make: Callable[[str, str], None] | None = None,
    ) -> None:
        self._lstat = lstat
        self.trusted = frozenset(trusted)
        self._make = make
        # What the last passing check of each tenant directory found (one per account; replaced, never dropped).
        self._verified: dict[str, Verified] = {}

    @staticmethod
    def path_of(work_dir: str, account: str) -> str:
        """``<work_dir>/<account>`` (no I/O); ``SubmissionRejected`` when either is not a plain name."""
        if not _NAME.fullmatch(account) or account in (".", ".."):
            raise unsafe(f"{account[:80]!r} cannot name a directory")
        return f"{components(work_dir)[-1].rstrip('/')}/{account}"

    def verified(self, path: str) -> Verified | None:
        """What the last passing check of ``path`` (a tenant directory ``ensure`` returned) found; no I/O."""
        return self._verified.get(path)

    async def ensure(self, work_dir: str, account: str) -> str:
        """``<work_dir>/<account>``, once it is the account's own and 0700; else ``SubmissionRejected``."""
        path = self.path_of(work_dir, account)
        chain = components(work_dir)
        entries = await self._lstat([*chain, path])
        problem = parent_problem(chain[-1], entries, self.trusted)
        if problem is None and self._make is not None and self._unfinished(entries[path]):
            try:
                await asyncio.to_thread(self._make, chain[-1], account)
            except (OSError, KeyError) as exc:
                raise unsafe(f"cannot make {path} for {account}: {exc}") from None
            entries = {**entries, **await self._lstat([path])}
        problem = problem or tenant_problem(path, account, entries[path])
        if problem is not None:
            raise unsafe(f"refusing to submit as {account}: {problem}")
        self._verified[path] = Verified(tuple((each, entries[each]) for each in [*chain, path]))
        return path

    def _unfinished(self, entry: Entry) -> bool:
        """Missing, or a directory one of the trusted accounts made and did not hand over (a crash between)."""
        return entry.kind == MISSING or (entry.kind == DIRECTORY and entry.owner in self.trusted)


# ---- this host ---------------------------------------------------------------------------------------------


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _entry(path: str) -> Entry:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Entry(MISSING)
    except OSError as exc:
        return Entry(f"unreadable ({exc.strerror})")
    if stat.S_ISLNK(st.st_mode):
        kind = LINK
    elif stat.S_ISDIR(st.st_mode):
        kind = DIRECTORY
    else:
        kind = OTHER
    return Entry(kind, _owner(st.st_uid), stat.S_IMODE(st.st_mode))


async def local_lstat(paths: Sequence[str]) -> dict[str, Entry]:
    return await asyncio.to_thread(lambda: {path: _entry(path) for path in paths})


def make_private_dir(parent: str, account: str) -> None:
    """Make ``parent/account`` the account's own, 0700, without following a link anywhere below ``parent``.

    Runs as root. ``mkdir`` may find it already made (by a racing submit, or by an earlier attempt that stopped
    before handing it over); it is then opened without following a link and handed over the same way."""
    entry = pwd.getpwnam(account)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(account, 0o700, dir_fd=parent_fd)
        fd = os.open(account, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            os.fchown(fd, entry.pw_uid, entry.pw_gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


def local_tenant_dirs(provider: str) -> TenantDirs:
    """``work_dir`` on this host: a root worker makes missing tenant directories; others check only."""
    root = os.geteuid() == 0
    return TenantDirs(local_lstat, trusted={"root", provider}, make=make_private_dir if root else None)


# ---- a submit host, over the provider's own login ----------------------------------------------------------


def remote_lstat(run: Callable[[list[str]], Awaitable[tuple[int, str]]]) -> Lstat:
    """``lstat`` through ``stat -c`` (GNU coreutils; it never follows a link unless told to) as the provider.

    ``run(argv)`` returns the exit code and standard output; each argument reaches the remote host quoted (the
    paths come from the provider's configuration and account names, never from a job). A path ``stat`` cannot
    read is missing from its answer: reported as missing."""

    async def lstat(paths: Sequence[str]) -> dict[str, Entry]:
        _, out = await run(["stat", "-c", _STAT_FORMAT, "--", *paths])
        found: dict[str, Entry] = {}
        for line in out.splitlines():
            parts = line.split("|", 3)
            if len(parts) != 4:
                continue
            kind, owner, mode, name = parts
            if name in paths and re.fullmatch(r"[0-7]{1,5}", mode):
                kind = kind if kind in (DIRECTORY, LINK) else OTHER
                found[name] = Entry(kind, owner, int(mode, 8))
        return {path: found.get(path, Entry(MISSING)) for path in paths}

    return lstat


def remote_tenant_dirs(run: Callable[[list[str]], Awaitable[tuple[int, str]]], provider: str) -> TenantDirs:
    """``work_dir`` on a submit host reached as the provider's account: checked there, made by the operator."""
    return TenantDirs(remote_lstat(run), trusted={"root", provider})
