"""The detached supervisor of one local job: waits for a slot, runs the script, enforces limits, measures use.

The local adapter starts one supervisor per job as ``python -I -S local_supervisor.py --lock-fd N <jobdir>``,
in a new session, so that the job outlives the worker that submitted it (a worker may be SIGKILLed at any
instant). The module uses the standard library only and imports little: run with ``-I -S`` it starts in about
20 ms and never imports the worker's packages (or sees the worker's environment).

Exactly-once execution rests on two things:

* the job's ``lock`` file, flocked by the submitter and inherited through ``pass_fds`` (the lock belongs to
  the open file description, so it passes from the submitter to the supervisor with no moment where it is
  free), held for the supervisor's whole life and released by the kernel when it exits or dies;
* the ``started`` marker, naming the supervisor's pid, created with ``O_EXCL`` and fsynced by the submitter
  right after the spawn or by the supervisor first thing, whichever comes first, and always before the script
  can run: once it exists, no submit launches another supervisor for the job, and a supervisor that finds
  another pid in it exits without running anything.

The supervisor is a child subreaper, so processes the job daemonizes (``setsid``, double fork) are reparented
to it rather than to init: they are still measured, killed at the end and reaped. Usage comes from ``/proc``
(sampled about once a second) plus the ``wait4`` rusage of every reaped process; see
``docs/local-executor.md``.

Everything the job and the adapter share lives in the job directory; this module owns its layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

# Kept off the import path on purpose (``typing`` and ``dataclasses`` cost milliseconds on every job start).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# ---- the job directory (shared with activities/schedulers/local.py) ----------------------------------------
SCRIPT = "job.sh"
META = "meta.json"
STATUS = "status.json"
STDOUT = "stdout"
STDERR = "stderr"
LOCK = "lock"
STARTED = "started"
CANCEL = "cancel"
SUPERVISOR_LOG = "supervisor.log"
#: The directory the job's account owns (the rest of the job directory is the supervisor's), and its tmp.
WORK = "work"
JOB_TMP = "tmp"

STATUS_VERSION = 1
FINAL_STATES = frozenset({"completed", "failed", "timeout", "cancelled"})

#: Sampling schedule: a few early samples so short jobs get measured, then one per ``SAMPLE_INTERVAL``, spaced out
#: to at most ``MAX_SAMPLE_INTERVAL`` as the job ages (``sample_interval``).
EARLY_SAMPLES = (0.05, 0.2, 0.5)
SAMPLE_INTERVAL = 1.0
MAX_SAMPLE_INTERVAL = 10.0
#: How often the head of the queue looks for a free slot; how often a running job's cancel file is checked.
SLOT_POLL = 0.25
CANCEL_POLL = 2.0
#: How often a queued job wakes to look for a cancel file; the adapter also sends SIGTERM, which wakes it at once.
QUEUE_RECHECK = 5.0
#: How long to wait for killed leftovers to be reaped before giving up on them.
REAP_LIMIT = 10.0
BASH = "/bin/bash" if os.path.exists("/bin/bash") else "/usr/bin/bash"

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_CHILD_SUBREAPER = 36


# ---- /proc -------------------------------------------------------------------------------------------------
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` that accounting and process identification need.

    ``cpu_seconds`` is utime + stime + cutime + cstime: the process's own CPU plus that of the children it
    reaped. ``start_ticks`` (clock ticks since boot) and the pid identify a process across pid reuse.
    """

    __slots__ = ("cpu_seconds", "pgrp", "pid", "ppid", "rss_bytes", "start_ticks", "state")

    def __init__(
        self, pid: int, ppid: int, pgrp: int, state: str, cpu_seconds: float, rss_bytes: int, start_ticks: int
    ) -> None:
        self.pid, self.ppid, self.pgrp, self.state = pid, ppid, pgrp, state
        self.cpu_seconds, self.rss_bytes, self.start_ticks = cpu_seconds, rss_bytes, start_ticks

    def __repr__(self) -> str:
        return f"ProcStat(pid={self.pid}, ppid={self.ppid}, pgrp={self.pgrp}, state={self.state!r})"


def read_stat(pid: int) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat``; ``None`` when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it start past the last ")".
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 22:
        return None
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ProcStat(
        pid=pid,
        ppid=int(fields[1]),
        pgrp=int(fields[2]),
        state=fields[0].decode(),
        cpu_seconds=ticks / _CLK_TCK,
        rss_bytes=int(fields[21]) * _PAGE_SIZE,
        start_ticks=int(fields[19]),
    )


def boot_id() -> str:
    """This boot's id: pids and start ticks recorded during another boot name nothing now."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def is_same_process(pid: int | None, start_ticks: int | None) -> bool:
    """True if ``pid`` still names the process that started at ``start_ticks`` (not a reused pid)."""
    if not pid or start_ticks is None:
        return False
    stat = read_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks


def sample_interval(elapsed: float) -> float:
    """Seconds until the next usage sample of a job that has run ``elapsed`` seconds.

    Every sample lists ``/proc`` and rewrites ``status.json``, a cost that grows with the number of processes on
    the host: at 1,000 running jobs, one sample a second per job took more than both cores of the benchmark
    machine (``benchmarks/load.py``). Usage records are differences of cumulative readings and the final reading
    is the exact ``wait4`` rusage, so sparser samples of an old job lose nothing; they only make a running
    reading (and the memory integral) up to ``MAX_SAMPLE_INTERVAL`` older. Young jobs keep one sample a second.
    """
    return min(MAX_SAMPLE_INTERVAL, max(SAMPLE_INTERVAL, elapsed / 30))


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def kill_orphaned_group(pgid: int | None, leader_start_ticks: int | None, sig: int = signal.SIGKILL) -> bool:
    """Kill what is left of a job's process group after its supervisor died; True if a signal was sent.

    The group id is the job's first pid. While the leader lives, its start time must match the recorded one;
    once it has exited, the kernel does not hand out its pid while members of the group remain, so any process
    whose group is ``pgid`` still belongs to the job.
    """
    if not pgid or pgid <= 1:
        return False
    leader = read_stat(pgid)
    if leader is not None and leader.start_ticks != leader_start_ticks:
        return False  # the number now belongs to another process
    members = [s for s in (read_stat(p) for p in _pids()) if s is not None and s.pgrp == pgid]
    if not members:
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
        return True
    return False


class ProcessTree:
    """The live descendants of the supervisor, found by scanning ``/proc``.

    ``/proc/<pid>/task/<tid>/children`` needs a kernel option that is often off, so membership is decided
    from parent pids. A scan costs a directory listing plus one ``stat`` read per member and per pid not seen
    in the previous listing: pids already known not to belong to the job are not read again.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self._members: dict[int, tuple[int, int]] = {}  # pid -> (start_ticks, depth below root)
        self._listed: set[int] = set()

    def scan(self) -> list[ProcStat]:
        """Members in parent-before-child order.

        Reading a parent before its children means a child that its parent reaps mid-scan is missed (counted
        once the parent's ``cutime`` shows it) rather than counted twice: running readings err low, not high.
        """
        listed = _pids()
        stats: list[ProcStat] = []
        for pid, (start, _depth) in sorted(self._members.items(), key=lambda item: item[1][1]):
            stat = read_stat(pid) if pid in listed else None
            if stat is None or stat.start_ticks != start:
                del self._members[pid]
                if stat is not None:  # the pid was reused: decide again below
                    self._listed.discard(pid)
                continue
            stats.append(stat)
        pending = [read_stat(pid) for pid in sorted(listed - self._listed)]
        candidates = [s for s in pending if s is not None]
        # Repeat while new members appear: with pid wrap-around a child may sort before its parent.
        while candidates:
            rest = []
            for stat in candidates:
                if stat.ppid == self.root:
                    depth = 1
                elif stat.ppid in self._members:
                    depth = self._members[stat.ppid][1] + 1
                else:
                    rest.append(stat)
                    continue
                self._members[stat.pid] = (stat.start_ticks, depth)
                stats.append(stat)
            if len(rest) == len(candidates):
                break
            candidates = rest
        self._listed = listed
        return stats

    def pids(self) -> list[int]:
        return list(self._members)


# ---- usage -------------------------------------------------------------------------------------------------
class Integrator:
    """Cumulative usage of the job: CPU seconds, memory byte-seconds (trapezoids), peak memory, wall clock.

    Every reading it publishes is >= the previous one, field by field, and the final reading (from the exact
    ``wait4`` rusage of everything reaped) is >= every running reading.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.last_time = start
        self.last_rss: int | None = None
        self.cpu_seconds = 0.0
        self.byte_seconds = 0.0
        self.peak_bytes = 0
        self.wall_seconds = 0.0
        self.samples = 0

    def add(self, now: float, cpu_seconds: float, rss_bytes: int) -> None:
        dt = max(0.0, now - self.last_time)
        previous = rss_bytes if self.last_rss is None else self.last_rss
        self.byte_seconds += (previous + rss_bytes) / 2 * dt
        self.last_time, self.last_rss = now, rss_bytes
        self.cpu_seconds = max(self.cpu_seconds, cpu_seconds)
        self.peak_bytes = max(self.peak_bytes, rss_bytes)
        self.wall_seconds = max(self.wall_seconds, now - self.start)
        self.samples += 1

    def close(self, end: float, cpu_seconds: float, max_rss_bytes: int) -> None:
        """Fold in the end of the job: the last sampled memory holds until ``end``; exact CPU from rusage."""
        dt = max(0.0, end - self.last_time)
        held = self.last_rss if self.last_rss is not None else max_rss_bytes
        self.byte_seconds += held * dt
        self.last_time = end
        self.cpu_seconds = max(self.cpu_seconds, cpu_seconds)
        self.peak_bytes = max(self.peak_bytes, max_rss_bytes)
        self.wall_seconds = max(self.wall_seconds, end - self.start)

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_clock_seconds": f"{self.wall_seconds:.6f}",
            "cpu_seconds": f"{self.cpu_seconds:.6f}",
            "memory_byte_seconds": f"{self.byte_seconds:.0f}",
            "memory_bytes_max": self.peak_bytes,
            "samples": self.samples,
        }


# ---- files -------------------------------------------------------------------------------------------------
def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a single write may be short)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_json_atomic(
    path: str | Path, data: dict[str, Any], *, durable: bool, dir_fd: int | None = None
) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see old or new, never half.

    ``durable`` also fsyncs the file and its directory: used for the states that must survive a host crash.
    With ``dir_fd``, ``path`` is a name in that directory (the one a supervisor holds, wherever it was moved).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = json.dumps(data, sort_keys=True).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        write_all(fd, payload)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if durable:
        if dir_fd is None:
            fsync_dir(path.parent)
        else:
            os.fsync(dir_fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | Path, dir_fd: int | None = None) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        with open(fd, "rb") as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def exists_in(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in the directory ``dir_fd`` (a link counts, not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def claim_marker(jobdir: Path, pid: int, dir_fd: int | None = None) -> bool:
    """Record that the supervisor ``pid`` owns the job; False if another supervisor already does.

    Both the submitter (right after spawning) and the supervisor (first thing) call this with the supervisor's
    pid: whichever comes first creates the marker, the other finds its own pid in it. A marker naming another
    pid means some earlier supervisor took the job, and this one must not run it. The marker appears whole
    (written aside, then hard-linked into place, which fails if it exists) and is on disk before this returns
    True, so a host crash cannot lose it once the script may run. The supervisor passes ``dir_fd``, the directory
    it holds: the names are then taken in it, never by a path the adapter may have given to another job.
    """
    at = Path() if dir_fd is not None else jobdir
    tmp = at / f".{STARTED}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, f"{pid}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, at / STARTED, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except FileExistsError:
        if marker_pid(jobdir, dir_fd) != pid:
            return False
    finally:
        os.unlink(tmp, dir_fd=dir_fd)
    # Also when the other party linked it: it may not have reached its own fsync of the directory yet.
    if dir_fd is None:
        fsync_dir(jobdir)
    else:
        os.fsync(dir_fd)
    return True


def marker_pid(jobdir: Path, dir_fd: int | None = None) -> int | None:
    """The pid of the supervisor that owns the job (from its ``started`` marker), if any."""
    try:
        fd = os.open(
            STARTED if dir_fd is not None else jobdir / STARTED, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd
        )
        with open(fd, "rb") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _set_child_subreaper() -> bool:
    """Make orphaned descendants of the job reparent to the supervisor instead of init (Linux >= 3.4)."""
    try:
        import ctypes  # only once the job starts: queued supervisors stay small

        libc = ctypes.CDLL(None, use_errno=True)  # the running program's symbols include libc's prctl
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (ImportError, OSError, AttributeError):
        return False


class EnterJob:
    """The last steps of starting a job, in the forked child once it runs as the job's account (``preexec_fn``).

    Resource limits first (``limits``: ``{"AS": [soft, hard], ...}``, each ``RLIMIT_<name>``; a limit is only
    ever lowered), then the working directory, entered as the account, so that a directory the account may not
    enter is refused even though the supervisor could. On failure it says why on the job's stderr and raises;
    nothing of the job has run.
    """

    def __init__(self, workdir: str, limits: dict[str, list[int]], account: str) -> None:
        import resource  # before the fork: the child should only make system calls

        self.workdir = workdir
        self.account = account
        self.limits = [
            (getattr(resource, f"RLIMIT_{name}"), soft, hard) for name, (soft, hard) in limits.items()
        ]
        self._getrlimit, self._setrlimit = resource.getrlimit, resource.setrlimit
        self._infinity = resource.RLIM_INFINITY

    def __call__(self) -> None:
        try:
            for which, soft, hard in self.limits:
                _, now = self._getrlimit(which)
                hard = hard if now == self._infinity else min(hard, now)
                self._setrlimit(which, (min(soft, hard), hard))
        except (OSError, ValueError) as exc:
            self._refuse(f"cannot set the job's resource limits: {exc}")
        try:
            os.chdir(self.workdir)
        except FileNotFoundError:
            self._refuse(f"working directory {self.workdir} does not exist")
        except NotADirectoryError:
            self._refuse(f"working directory {self.workdir} is not a directory")
        except OSError as exc:
            self._refuse(
                f"working directory {self.workdir} cannot be entered{self.account}: {exc.strerror or exc}"
            )

    @staticmethod
    def _refuse(message: str) -> None:
        os.write(2, f"{message}\n".encode())
        raise RuntimeError(message)


def _last_line(name: str, dir_fd: int) -> str:
    try:
        with open(os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd), "rb") as fh:
            lines = fh.read()[-1000:].decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    print(f"{stamp} supervisor[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


# ---- the supervisor ----------------------------------------------------------------------------------------
class Supervisor:
    """Runs one job. Every file it reads or writes in the job directory is named relative to ``dir_fd``, the
    directory it was handed (``open_held_directory``): if the adapter sets that directory aside (a look-alike) and
    makes another job under the same path, this supervisor's statuses, marker and outputs stay with its own job."""

    def __init__(self, jobdir: Path, meta: dict[str, Any], dir_fd: int) -> None:
        self.jobdir = jobdir
        self.dir_fd = dir_fd
        self.meta = meta
        self.limits = meta["limits"]
        self._signalled: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._reaped_cpu = 0.0
        self._max_rss = 0
        self._script: subprocess.Popen[bytes] | None = None
        self._script_status: int | None = None
        self._end: float | None = None
        self._tree = ProcessTree(os.getpid())
        self._integrator: Integrator | None = None
        me = read_stat(os.getpid())
        self.status: dict[str, Any] = {
            "version": STATUS_VERSION,
            "scheduler_job_id": meta["scheduler_job_id"],
            "workflow_id": meta["workflow_id"],
            "state": "queued",
            "native_state": "QUEUED",
            "reason": "waiting for a free slot",
            "exit_code": None,
            "signal": None,
            "boot_id": boot_id(),
            "supervisor_pid": os.getpid(),
            "supervisor_start_ticks": me.start_ticks if me else None,
            "job_pid": None,
            "job_start_ticks": None,
            "slot": None,
            "submit_time": meta["submit_time"],
            "start_time": None,
            "end_time": None,
            "updated_time": time.time(),
            "usage": Integrator(0.0).as_dict() | {"memory_bytes_max": None},
        }

    # -- signals and sleeping
    def install_signals(self) -> None:
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_terminate)
        # A handler (not SIG_IGN, which the job would inherit) so that select() wakes when a child exits.
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def _on_terminate(self, signum: int, _frame: object) -> None:
        self._signalled = signum

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            with contextlib.suppress(InterruptedError):
                select.select([self._wake_r], [], [], seconds)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 512):
                pass

    def cancel_requested(self) -> bool:
        return self._signalled is not None or exists_in(self.dir_fd, CANCEL)

    def cancel_reason(self) -> str:
        if exists_in(self.dir_fd, CANCEL):
            return "cancelled on request"
        return f"cancelled: the supervisor received {signal_name(self._signalled or signal.SIGTERM)}"

    # -- status
    def write_status(self, *, durable: bool = False, **changes: Any) -> None:
        self.status.update(changes, updated_time=time.time())
        if self._integrator is not None:
            self.status["usage"] = self._integrator.as_dict()
        try:
            write_json_atomic(STATUS, self.status, durable=durable, dir_fd=self.dir_fd)
        except OSError as exc:  # a full disk must not kill the job; the next write may succeed
            _log(f"cannot write the status file: {exc}")

    # -- queueing
    def wait_for_slot(self) -> int | None:
        """Hold one of the ``max_parallel_jobs`` slot locks; ``None`` if the job is cancelled while queued.

        Waiting jobs line up on ``queue.lock``, asleep in the kernel; only the head of the line polls the
        slots, so a queued job costs no CPU. A cancel reaches it as SIGTERM (and, as a fallback, as a file).
        """
        slots_dir = Path(self.meta["slots"]["dir"])
        count = int(self.meta["slots"]["count"])
        queue_fd = os.open(slots_dir / "queue.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(queue_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not self._wait_for_head_of_queue(queue_fd):
                    return None
            while not self.cancel_requested():
                slot = self._try_slots(slots_dir, count)
                if slot is not None:
                    return slot
                self._sleep(SLOT_POLL)
            return None
        finally:
            os.close(queue_fd)  # lets the next waiting job to the head of the line

    def _wait_for_head_of_queue(self, queue_fd: int) -> bool:
        """Block on the queue lock in a helper thread; True once held, False if the job is cancelled first.

        A thread, because a blocking ``flock`` in the main thread can only be broken by raising from a signal
        handler, which is fragile; and waking waiters periodically would wake every waiter queued behind them.
        """
        import threading  # only queued jobs pay for it

        done_r, done_w = os.pipe()
        took: list[bool] = []

        def take() -> None:
            try:
                fcntl.flock(queue_fd, fcntl.LOCK_EX)
                took.append(True)
            finally:
                os.write(done_w, b"x")

        threading.Thread(target=take, name="queue-lock", daemon=True).start()
        while not self.cancel_requested():
            readable, _, _ = select.select([done_r, self._wake_r], [], [], QUEUE_RECHECK)
            if done_r in readable:
                return bool(took)
            self._sleep(0)  # drain the signal wake-up bytes
        return False

    def _try_slots(self, slots_dir: Path, count: int) -> int | None:
        first = os.getpid() % count  # spread the first try over the slots
        for offset in range(count):
            index = (first + offset) % count
            fd = os.open(slots_dir / f"slot-{index}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.status["slot"] = index
            return fd
        return None

    # -- running
    def start_script(self) -> str | None:
        """Start the script in a new session (and process group); an error message if it cannot start.

        With ``run_as`` in the job's meta, the script runs as that account (its own groups, no others), which
        takes a supervisor running as root: the account cannot signal the supervisor, read its or the worker's
        ``/proc/<pid>/environ``, or write the files the adapter bills from.
        """
        workdir = self.meta["working_directory"]
        run_as = self.meta.get("run_as")
        if not still_named(self.jobdir, self.dir_fd):
            # bash opens the script, and the job enters its default working directory, by path: under that
            # path is now another job's directory.
            return (
                f"its job directory was moved or replaced before the script started ({self.jobdir}); not run"
            )
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        out = os.open(STDOUT, flags, 0o600, dir_fd=self.dir_fd)
        err = os.open(STDERR, flags, 0o600, dir_fd=self.dir_fd)
        account = f" as {run_as['user']}" if run_as else ""
        try:
            # A fixed argv: the script travels as a file path, never as a shell string.
            self._script = subprocess.Popen(
                [BASH, str(self.jobdir / SCRIPT)],
                env=self.meta["env"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                user=run_as["uid"] if run_as else None,
                group=run_as["gid"] if run_as else None,
                extra_groups=run_as["groups"] if run_as else None,
                umask=0o077,
                preexec_fn=EnterJob(workdir, self.limits.get("rlimits") or {}, account),
            )
        except subprocess.SubprocessError:  # EnterJob refused; it said why on the job's stderr
            return _last_line(STDERR, self.dir_fd) or f"cannot start the job script{account} in {workdir}"
        except OSError as exc:
            return f"cannot start the job script{account} in {workdir}: {exc.strerror or exc}"
        finally:
            os.close(out)
            os.close(err)
        return None

    def _reap(self) -> None:
        """Reap every exited child (the script and reparented orphans), adding up their exact rusage."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._reaped_cpu += usage.ru_utime + usage.ru_stime
            self._max_rss = max(self._max_rss, usage.ru_maxrss * 1024)
            if self._script is not None and pid == self._script.pid:
                self._script_status = status
                self._script.returncode = os.waitstatus_to_exitcode(status)
                self._end = time.monotonic()

    def _sample(self, now: float) -> None:
        assert self._integrator is not None
        # Reaped CPU is read before the tree and nothing is reaped in between, so no process is counted twice.
        cpu, rss = self._reaped_cpu, 0
        for stat in self._tree.scan():
            cpu += stat.cpu_seconds
            rss += stat.rss_bytes
        self._integrator.add(now, cpu, rss)
        self.write_status()

    def _signal_job(self, sig: int) -> None:
        """Signal the job's process group and every other descendant (those that left the group)."""
        assert self._script is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._script.pid, sig)
        for pid in self._tree.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def monitor(self) -> str | None:
        """Wait for the script to end, enforcing walltime and cancel;"""
        assert self._script is not None and self._integrator is not None
        start = self._integrator.start
        deadline = start + float(self.limits["walltime_seconds"])
        kill_wait = float(self.limits["kill_wait_seconds"])
        schedule = [start + t for t in EARLY_SAMPLES]
        next_sample = schedule.pop(0)
        ending: str | None = None
        kill_at = float("inf")
        while True:
            now = time.monotonic()
            wake = min(next_sample, deadline if ending is None else kill_at, now + CANCEL_POLL)
            self._sleep(wake - now)
            self._reap()
            if self._end is not None:
                return ending
            now = time.monotonic()
            if ending is None and (self.cancel_requested() or now >= deadline):
                ending = "cancelled" if self.cancel_requested() else "timeout"
                self._tree.scan()
                self._signal_job(signal.SIGTERM)
                kill_at = now + kill_wait
                _log(f"{ending}: sent SIGTERM, SIGKILL in {kill_wait:g}s")
            elif ending is not None and now >= kill_at:
                self._tree.scan()
                self._signal_job(signal.SIGKILL)
                kill_at = now + 1.0
            if now >= next_sample:
                self._sample(now)
                next_sample = schedule.pop(0) if schedule else now + sample_interval(now - start)

    def clean_up(self) -> None:
        """Kill what the script left behind (as SLURM does when a batch script ends) and reap all of it."""
        assert self._script is not None
        limit = time.monotonic() + REAP_LIMIT
        while time.monotonic() < limit:
            self._reap()
            left = self._tree.scan()
            if not left:
                break
            self._signal_job(signal.SIGKILL)
            self._sleep(0.05)
        else:
            _log(f"processes still alive after {REAP_LIMIT:g}s: {self._tree.pids()}")
        self._reap()

    def outcome(self, ending: str | None) -> dict[str, Any]:
        status = self._script_status if self._script_status is not None else 0
        exit_code = os.waitstatus_to_exitcode(status)
        signum = -exit_code if exit_code < 0 else None
        shell_code = 128 + signum if signum is not None else exit_code
        walltime = float(self.limits["walltime_seconds"])
        if ending == "timeout":
            state, native, reason = "timeout", "TIMEOUT", f"walltime of {walltime:g}s exceeded"
        elif ending == "cancelled":
            state, native, reason = "cancelled", "CANCELLED", self.cancel_reason()
        elif signum is not None:
            name = signal_name(signum)
            state, native = "failed", f"FAILED({name})"
            reason = f"killed by signal {name}"
            if signum == signal.SIGKILL:
                reason += " (the kernel's OOM killer also uses SIGKILL; it cannot be told apart here)"
        elif exit_code == 0:
            state, native, reason = "completed", "COMPLETED", ""
        else:
            state, native, reason = "failed", "FAILED", f"exit code {exit_code}"
        return {
            "state": state,
            "native_state": native,
            "reason": reason,
            "exit_code": shell_code,
            "signal": signal_name(signum) if signum is not None else None,
        }

    def run(self) -> int:
        slot = self.wait_for_slot()
        if slot is None:
            self.write_status(
                durable=True,
                state="cancelled",
                native_state="CANCELLED",
                reason=self.cancel_reason() + " before it started",
                end_time=time.time(),
            )
            return 0
        start_wall = time.time()
        self._integrator = Integrator(time.monotonic())
        _set_child_subreaper()
        error = self.start_script()
        if error is not None:
            self.write_status(
                durable=True, state="failed", native_state="FAILED", reason=error, end_time=time.time()
            )
            return 0
        assert self._script is not None
        leader = read_stat(self._script.pid)
        self.write_status(
            state="running",
            native_state="RUNNING",
            reason="",
            start_time=start_wall,
            job_pid=self._script.pid,
            job_start_ticks=leader.start_ticks if leader else None,
        )
        ending = self.monitor()
        end = self._end if self._end is not None else time.monotonic()
        end_wall = start_wall + (end - self._integrator.start)
        self.clean_up()
        self._integrator.close(end, self._reaped_cpu, self._max_rss)
        self.write_status(durable=True, end_time=end_wall, **self.outcome(ending))
        return 0


def _daemonize() -> None:
    """Fork again so that the submitter reaps its child at once; the grandchild keeps the inherited fds."""
    if os.fork() > 0:
        os._exit(0)


def open_held_directory(jobdir: Path, lock_fd: int) -> int | None:
    """A descriptor of the directory whose lock this supervisor was handed, or ``None`` if ``jobdir`` no longer
    names it.

    The adapter sets a look-alike's directory aside (renames it) and makes the workflow's own job under the same
    path. A look-alike's supervisor that starts after that must not touch the new directory (it would mark the
    victim's job as taken); one that runs on must keep writing its status into its own (it would overwrite the
    victim's state and usage). The descriptor is checked once, by the lock inside it, and follows the directory
    wherever it is renamed: every later name is taken relative to it, so no check can go stale.
    """
    try:
        dir_fd = os.open(jobdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        here = os.stat(LOCK, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        here = None
    handed = os.fstat(lock_fd)
    if here is None or (here.st_dev, here.st_ino) != (handed.st_dev, handed.st_ino):
        os.close(dir_fd)
        return None
    return dir_fd


def still_named(jobdir: Path, dir_fd: int) -> bool:
    """Whether the path ``jobdir`` still names the directory ``dir_fd``."""
    try:
        here = os.stat(jobdir, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(dir_fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _parse_args(argv: list[str]) -> tuple[int, Path]:
    """``--lock-fd N JOBDIR`` (parsed by hand: argparse costs milliseconds of start-up per job)."""
    if len(argv) != 3 or argv[0] != "--lock-fd" or not argv[1].isdigit():
        raise SystemExit("usage: local_supervisor.py --lock-fd N JOBDIR (started by the local adapter)")
    return int(argv[1]), Path(argv[2])


def main(argv: list[str] | None = None) -> int:
    lock_fd, jobdir = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # Re-locking an open file description that already holds the lock succeeds at once: a sanity check
        # that the submitter passed the locked fd and nobody else runs this job.
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        _log(f"the job lock was not handed over ({exc}); not starting")
        return 2
    dir_fd = open_held_directory(jobdir, lock_fd)
    if dir_fd is None:
        _log(f"{jobdir} was moved or replaced since this supervisor was started; not starting")
        return 2
    meta = read_json(META, dir_fd)
    if meta is None:
        _log(f"cannot read {jobdir / META}; not starting")
        return 2
    if not claim_marker(jobdir, os.getpid(), dir_fd):
        _log("the job was already taken by another supervisor; not running it twice")
        return 3
    _daemonize()
    supervisor = Supervisor(jobdir, meta, dir_fd)
    supervisor.install_signals()
    supervisor.write_status()
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
