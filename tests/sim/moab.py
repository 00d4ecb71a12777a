"""A protocol-faithful MOAB simulator: the server behind the fake ``msub``/``showq``/``checkjob``/``mjobctl``.

No MOAB can be installed here, so the tests start this instead (docs/moab.md says which parts are documented MOAB
behaviour and which are assumptions). It keeps the queue in memory and in ``$MOABHOMEDIR/state.json`` (so a restart
keeps the jobs), listens on ``$MOABHOMEDIR/moab.sock`` for the client commands (``tests/sim/moab_bin/moab-client``,
run over a real sshd as the job user; the caller's uid comes from ``SO_PEERCRED``, as MOAB authenticates its
clients), and really runs each job's script with bash, as its owner, in its own session. Every request's argv is
appended to ``argv.log`` (one JSON line: uid, command, argv), so tests can check that tenant strings arrived as
single literal arguments.

Behaviour: ``Idle`` jobs start at the next tick (0.1 s) while fewer than ``slots`` run; a held job waits; a running
job past ``min(walltime, walltime_cap)`` is killed and ``Removed`` with completion code ``-11``; a cancelled job is
``Removed`` with ``CNCLD``; an ended job moves to the completed queue with its exit status as completion code
(``256 + N`` for signal N), wall time, CPU seconds and peak memory. ``vanish`` forgets a job (purged records).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

import psutil

CLIENT = Path(__file__).with_name("moab_bin") / "moab-client"
COMMANDS = ("msub", "showq", "checkjob", "mjobctl")
TORQUE_WALLTIME = -11


@dataclass
class SimJob:
    number: int
    name: str
    user: str
    uid: int
    gid: int
    job_class: str
    account: str
    nodes: int
    ppn: int
    gpus: int
    mem_mb: int
    walltime: int
    workdir: str
    state: str = "Idle"
    hold: str = ""
    submit_time: int = 0
    start_time: int = 0
    completion_time: int = 0
    completion_code: int | None = None
    cancelled: bool = False
    pid: int = 0
    cpu_seconds: float = 0.0
    util_mem_mb: int = 0
    hold_reason: str = ""

    @property
    def job_id(self) -> str:
        return f"Moab.{self.number}"

    @property
    def ended(self) -> bool:
        return self.state in ("Completed", "Removed", "Vacated")

    def wall(self, now: float) -> int:
        if not self.start_time:
            return 0
        end = self.completion_time or now
        return max(0, int(end - self.start_time))


@dataclass
class Options:
    classes: tuple[str, ...] = ("batch", "debug")
    max_nodes: int = 4
    slots: int = 4
    walltime_cap: float | None = None
    """Site policy in the simulator: jobs are killed at min(walltime, cap) seconds, so TIMEOUT tests stay short."""


class _Handler(socketserver.StreamRequestHandler):
    server: _SocketServer

    def handle(self) -> None:
        creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, gid = struct.unpack("3i", creds)
        raw = self.rfile.read()
        try:
            request = json.loads(raw.decode())
            answer = self.server.moab.handle(
                uid, gid, request["command"], list(request["argv"]), request.get("stdin")
            )
        except Exception as exc:  # a simulator bug answers like a server error, never hangs the client
            answer = {"stdout": "", "stderr": f"ERROR:    internal failure ({exc})\n", "code": 1}
        self.wfile.write(json.dumps(answer).encode())


class _SocketServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    moab: MoabSim


class MoabSim:
    """The MOAB server of the tests. ``start()``/``stop()`` bring it up and down (down = clients cannot connect)."""

    def __init__(self, home: Path, options: Options | None = None) -> None:
        self.home = home
        self.options = options or Options()
        self.jobs: dict[str, SimJob] = {}
        self.next_number = 1
        self.lock = threading.RLock()
        self._server: _SocketServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.requests: list[dict[str, Any]] = []
        home.mkdir(parents=True, exist_ok=True)
        home.chmod(0o755)
        (home / "jobs").mkdir(exist_ok=True)
        (home / "jobs").chmod(0o1777)
        self.bin_dir = home / "bin"
        self.bin_dir.mkdir(exist_ok=True)
        for name in COMMANDS:
            target = self.bin_dir / name
            shutil.copyfile(CLIENT, target)
            target.chmod(0o755)
        self._load()

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @property
    def socket_path(self) -> Path:
        return self.home / "moab.sock"

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._stop.clear()
        self._server = _SocketServer(str(self.socket_path), _Handler)
        self._server.moab = self
        self.socket_path.chmod(0o666)
        serve = threading.Thread(target=self._server.serve_forever, name="moab-sim", daemon=True)
        tick = threading.Thread(target=self._tick_loop, name="moab-sim-tick", daemon=True)
        self._threads = [serve, tick]
        serve.start()
        tick.start()

    def stop(self) -> None:
        """The server goes down (its jobs keep running, as under a real MOAB restart)."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for thread in self._threads:
            thread.join(5)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def close(self) -> None:
        self.stop()
        with self.lock:
            for job in self.jobs.values():
                if job.state == "Running" and job.pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(job.pid, signal.SIGKILL)

    # ---- persistence -----------------------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.home / "state.json"
        if not path.exists():
            return
        data = json.loads(path.read_text())
        self.next_number = data["next_number"]
        self.jobs = {f"Moab.{j['number']}": SimJob(**j) for j in data["jobs"]}

    def _save(self) -> None:
        path = self.home / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"next_number": self.next_number, "jobs": [asdict(j) for j in self.jobs.values()]})
        )
        tmp.replace(path)

    # ---- requests --------------------------------------------------------------------------------------------
    def handle(self, uid: int, gid: int, command: str, argv: list[str], stdin: str | None) -> dict[str, Any]:
        entry = {"uid": uid, "command": command, "argv": argv}
        with self.lock:
            self.requests.append(entry)
            with (self.home / "argv.log").open("a") as log:
                log.write(json.dumps(entry) + "\n")
            if command == "msub":
                return self.msub(uid, gid, argv, stdin or "")
            if command == "showq":
                return _ok(self.showq_xml(completed="-c" in argv))
            if command == "checkjob":
                ids = [a for a in argv if not a.startswith("-")]
                job = self.jobs.get(ids[-1]) if ids else None
                if job is None:
                    return _err(f"ERROR:  cannot locate job '{ids[-1] if ids else ''}'\n")
                return _ok(self.checkjob_xml(job))
            if command == "mjobctl":
                return self.mjobctl(argv)
        return _err(f"ERROR:  unknown command {command}\n")

    def msub(self, uid: int, gid: int, argv: list[str], script: str) -> dict[str, Any]:
        opts: dict[str, list[str]] = {}
        hold = False
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg == "-h":
                hold = True
                i += 1
                continue
            if arg in ("-N", "-q", "-l", "-A", "-d") and i + 1 < len(argv):
                opts.setdefault(arg, []).append(argv[i + 1])
                i += 2
                continue
            return _err(f"ERROR:  cannot submit job - unsupported option '{arg}'\n")
        res: dict[str, str] = {}
        for value in opts.get("-l", []):
            for part in value.split(","):
                key, _, val = part.partition("=")
                res[key] = val
        nodes_spec = res.get("nodes", "1").split(":")
        nodes = int(nodes_spec[0])
        extra = dict(item.split("=", 1) for item in nodes_spec[1:] if "=" in item)
        job_class = (opts.get("-q") or ["batch"])[-1]
        if job_class not in self.options.classes:
            return _err(f"ERROR:  cannot submit job - class '{job_class}' does not exist\n")
        if nodes > self.options.max_nodes:
            return _err(
                f"ERROR:  cannot submit job - job violates class '{job_class}' MAXNODE limit "
                f"({nodes} > {self.options.max_nodes})\n"
            )
        user = pwd.getpwuid(uid).pw_name
        number = self.next_number
        self.next_number += 1
        job_dir = self.home / "jobs" / str(number)
        job_dir.mkdir()
        (job_dir / "script.sh").write_text(script)
        (job_dir / "script.sh").chmod(0o644)
        workdir = (opts.get("-d") or [str(job_dir)])[-1]
        if workdir == str(job_dir):
            os.chown(job_dir, uid, gid)
        mem = res.get("mem", "0mb").lower().removesuffix("mb")
        job = SimJob(
            number=number,
            name=(opts.get("-N") or ["STDIN"])[-1],
            user=user,
            uid=uid,
            gid=gid,
            job_class=job_class,
            account=(opts.get("-A") or [""])[-1],
            nodes=nodes,
            ppn=int(extra.get("ppn", "1")),
            gpus=int(extra.get("gpus", "0")),
            mem_mb=int(mem) if mem.isdigit() else 0,
            walltime=_seconds(res.get("walltime", "3600")),
            workdir=workdir,
            state="UserHold" if hold else "Idle",
            hold="user" if hold else "",
            submit_time=int(time.time()),
        )
        self.jobs[job.job_id] = job
        self._save()
        return _ok(f"\n{job.job_id}\n")

    def mjobctl(self, argv: list[str]) -> dict[str, Any]:
        if len(argv) < 2:
            return _err("ERROR:  no job specified\n")
        flag, job_id = argv[0], argv[-1]
        job = self.jobs.get(job_id)
        if job is None:
            return _err(f"ERROR:  cannot locate job '{job_id}'\n")
        if flag == "-c":
            if job.ended:
                return _err(f"ERROR:  cannot cancel job '{job_id}' - job already completed\n")
            self._cancel(job)
            return _ok(f"job '{job_id}' cancelled\n")
        if flag in ("-h", "-u"):
            if job.ended or job.state == "Running":
                return _err(f"ERROR:  cannot modify hold on job '{job_id}' in state {job.state}\n")
            job.hold = "user" if flag == "-h" else ""
            job.state = "UserHold" if flag == "-h" else "Idle"
            self._save()
            return _ok(f"holds modified for job {job_id}\n")
        return _err(f"ERROR:  unsupported mjobctl option '{flag}'\n")

    # ---- admin actions of the tests --------------------------------------------------------------------------
    def vanish(self, job_id: str) -> None:
        """Forget a job entirely (records purged), as if MOAB never had it."""
        with self.lock:
            self.jobs.pop(job_id, None)
            self._save()

    def batch_hold(self, job_id: str, reason: str) -> None:
        with self.lock:
            job = self.jobs[job_id]
            job.state, job.hold, job.hold_reason = "BatchHold", "batch", reason
            self._save()

    def argv_log(self) -> list[dict[str, Any]]:
        path = self.home / "argv.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    # ---- scheduling ------------------------------------------------------------------------------------------
    def _tick_loop(self) -> None:
        while not self._stop.wait(0.1):
            with self.lock:
                self.tick()

    def tick(self) -> None:
        now = time.time()
        changed = False
        for job in self.jobs.values():
            if job.state == "Running":
                changed |= self._follow(job, now)
        running = sum(1 for j in self.jobs.values() if j.state == "Running")
        for job in sorted(self.jobs.values(), key=lambda j: j.number):
            if running >= self.options.slots:
                break
            if job.state == "Idle" and not job.hold:
                self._start(job, now)
                running += 1
                changed = True
        if changed:
            self._save()

    def _start(self, job: SimJob, now: float) -> None:
        out = Path(job.workdir) / f"{job.name}.o{job.number}"
        err = Path(job.workdir) / f"{job.name}.e{job.number}"
        pw = pwd.getpwuid(job.uid)
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": pw.pw_dir,
            "USER": job.user,
            "LOGNAME": job.user,
            "LANG": "C.UTF-8",
            "PBS_JOBID": job.job_id,
            "PBS_JOBNAME": job.name,
            "MOAB_JOBID": job.job_id,
        }
        as_user: dict[str, Any] = {}
        if os.geteuid() == 0 and job.uid != 0:
            as_user = {"user": job.uid, "group": job.gid, "extra_groups": []}
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            if as_user:
                os.chown(out, job.uid, job.gid)
                os.chown(err, job.uid, job.gid)
            proc = subprocess.Popen(
                ["/bin/bash", str(self.home / "jobs" / str(job.number) / "script.sh")],
                cwd=job.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                **as_user,
            )
        proc.returncode = 0  # reaped by _follow with wait4 (for its rusage); keeps Popen from waiting on it
        job.pid = proc.pid
        job.state = "Running"
        job.start_time = int(now)

    def _follow(self, job: SimJob, now: float) -> bool:
        try:
            pid, status, usage = os.wait4(job.pid, os.WNOHANG)
        except ChildProcessError:  # not our child (the simulator restarted): it was lost
            pid, status, usage = job.pid, 0, None
            if psutil.pid_exists(job.pid):
                return False
        if pid == 0:
            self._sample(job)
            limit = (
                job.walltime
                if self.options.walltime_cap is None
                else min(job.walltime, self.options.walltime_cap)
            )
            if now - job.start_time >= limit:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(job.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.wait4(job.pid, 0)
                self._end(job, now, "Removed", TORQUE_WALLTIME)
                return True
            return False
        if usage is not None:
            job.cpu_seconds = max(job.cpu_seconds, usage.ru_utime + usage.ru_stime)
            job.util_mem_mb = max(job.util_mem_mb, usage.ru_maxrss // 1024)
        code = 256 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self._end(job, now, "Completed", code)
        return True

    def _sample(self, job: SimJob) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(job.pid)
            procs = [root, *root.children(recursive=True)]
            cpu = 0.0
            rss = 0
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    cpu += times.user + times.system + times.children_user + times.children_system
                    rss += proc.memory_info().rss
            job.cpu_seconds = max(job.cpu_seconds, cpu)
            job.util_mem_mb = max(job.util_mem_mb, rss // (1024 * 1024))

    def _end(self, job: SimJob, now: float, state: str, code: int | None, *, cancelled: bool = False) -> None:
        job.state = state
        job.hold = ""
        job.completion_code = code
        job.cancelled = cancelled
        job.completion_time = int(now)

    def _cancel(self, job: SimJob) -> None:
        now = time.time()
        if job.state == "Running":
            self._sample(job)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.wait4(job.pid, 0)
            self._end(job, now, "Removed", None, cancelled=True)
        else:
            self._end(job, now, "Removed", None, cancelled=True)
        self._save()

    # ---- output ----------------------------------------------------------------------------------------------
    def _attrs(self, job: SimJob, *, completed: bool) -> str:
        now = time.time()
        attrs: dict[str, Any] = {
            "JobID": job.job_id,
            "JobName": job.name,
            "State": job.state,
            "User": job.user,
            "Group": job.user,
            "Class": job.job_class,
            "StartTime": job.start_time,
            "SubmissionTime": job.submit_time,
            "ReqAWDuration": job.walltime,
            "SuspendDuration": 0,
            "ReqProcs": job.nodes * job.ppn,
            "ReqNodes": job.nodes,
        }
        if job.account:
            attrs["Account"] = job.account
        if job.start_time:
            attrs.update(
                AWDuration=job.wall(now),
                StatPSDed=f"{job.wall(now) * job.nodes * job.ppn:.2f}",
                StatPSUtl=f"{job.cpu_seconds:.2f}",
                MasterHost="node01",
                RunPriority=0,
            )
        if job.mem_mb:
            attrs["ReqMem"] = job.mem_mb
        if completed:
            if job.cancelled:
                attrs["CompletionCode"] = (
                    "CNCLD" if job.completion_code is None else f"CNCLD({job.completion_code})"
                )
            else:
                attrs["CompletionCode"] = job.completion_code if job.completion_code is not None else 0
            attrs["CompletionTime"] = job.completion_time
        if job.hold_reason:
            attrs["HoldReason"] = job.hold_reason
        return " ".join(f"{k}={quoteattr(str(v))}" for k, v in attrs.items())

    def _req(self, job: SimJob) -> str:
        tasks = job.nodes * job.ppn
        attrs: dict[str, Any] = {
            "ReqProcPerTask": 1,
            "TaskCount": tasks,
            "TCReqMin": tasks,
            "NCReqMin": job.nodes,
            "TPN": job.ppn,
            "ReqMemPerTask": job.mem_mb // tasks if tasks else 0,
        }
        if job.start_time:
            attrs["AllocNodeList"] = ",".join(f"node{i + 1:02d}" for i in range(job.nodes))
            attrs["UtilMem"] = job.util_mem_mb
        if job.gpus:
            attrs["GPUS"] = job.gpus * job.nodes
        return "<req " + " ".join(f"{k}={quoteattr(str(v))}" for k, v in attrs.items()) + "/>"

    def showq_xml(self, *, completed: bool) -> str:
        now = int(time.time())
        parts = [
            "<Data><Object>queue</Object>",
            f'<cluster LocalActiveNodes="0" LocalAllocProcs="0" LocalConfigNodes="{self.options.slots}" '
            f'LocalIdleNodes="{self.options.slots}" LocalIdleProcs="{self.options.slots}" '
            f'LocalUpNodes="{self.options.slots}" LocalUpProcs="{self.options.slots}" RemoteActiveNodes="0" '
            f'RemoteAllocProcs="0" RemoteConfigNodes="0" RemoteIdleNodes="0" RemoteIdleProcs="0" '
            f'RemoteUpNodes="0" RemoteUpProcs="0" time="{now}"></cluster>',
        ]
        jobs = sorted(self.jobs.values(), key=lambda j: j.number)
        if completed:
            done = sorted((j for j in jobs if j.ended), key=lambda j: j.completion_time)
            parts.append(f'<queue count="{len(done)}" option="completed" purgetime="86400">')
            parts += [f"<job {self._attrs(j, completed=True)}></job>" for j in done]
            parts.append("</queue>")
        else:
            sections = {
                "active": [j for j in jobs if j.state in ("Running", "Starting", "Suspended")],
                "eligible": [j for j in jobs if j.state == "Idle" and not j.hold],
                "blocked": [
                    j for j in jobs if j.state in ("UserHold", "SystemHold", "BatchHold", "Deferred")
                ],
            }
            for option, members in sections.items():
                parts.append(f'<queue count="{len(members)}" option="{option}">')
                parts += [f"<job {self._attrs(j, completed=False)}></job>" for j in members]
                parts.append("</queue>")
        parts.append("</Data>")
        return "".join(parts) + "\n"

    def checkjob_xml(self, job: SimJob) -> str:
        return f"<Data><job {self._attrs(job, completed=job.ended)}>{self._req(job)}</job></Data>\n"

    # ---- MWS view (the REST simulator serves the same queue) -------------------------------------------------
    def mws_job(self, job: SimJob) -> dict[str, Any]:
        now = time.time()
        holds = {"user": ["USER"], "system": ["SYSTEM"], "batch": ["BATCH"]}.get(job.hold, [])
        state = job.state if not holds else "Idle"
        queue = (
            "completed"
            if job.ended
            else "active"
            if job.state == "Running"
            else "blocked"
            if holds
            else "eligible"
        )
        tasks = job.nodes * job.ppn

        def date(epoch: int) -> str | None:
            return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch)) if epoch else None

        body: dict[str, Any] = {
            "id": job.job_id,
            "name": job.job_id,
            "customName": job.name,
            "credentials": {
                "user": job.user,
                "group": job.user,
                "jobClass": job.job_class,
                "account": job.account or None,
            },
            "states": {"state": state, "stateExpected": None, "subState": None},
            "holds": holds,
            "blocks": [{"category": job.hold_reason, "message": job.hold_reason}] if job.hold_reason else [],
            "queueStatus": queue,
            "dates": {
                "submitDate": date(job.submit_time),
                "startDate": date(job.start_time),
                "completionDate": date(job.completion_time),
            },
            "duration": job.walltime,
            "durationActive": job.wall(now),
            "cpuTime": round(job.cpu_seconds, 2),
            "memoryUtilizedMaximum": job.util_mem_mb or None,
            "requirements": [
                {
                    "requiredNodeCountMinimum": job.nodes,
                    "requiredProcessorCountMinimum": tasks,
                    "taskCount": tasks,
                    "tasksPerNode": job.ppn,
                    "resourcesPerTask": {
                        "PROCS": {"dedicated": 1},
                        "MEM": {"dedicated": job.mem_mb // tasks if tasks else 0},
                    },
                    "gpus": job.gpus * job.nodes,
                }
            ],
            "completionCode": job.completion_code if job.ended else None,
            "cancelled": job.cancelled,
        }
        return body


def _seconds(text: str) -> int:
    if text.isdigit():
        return int(text)
    total = 0
    for part in text.split(":"):
        total = total * 60 + int(part)
    return total


def _ok(stdout: str) -> dict[str, Any]:
    return {"stdout": stdout, "stderr": "", "code": 0}


def _err(stderr: str) -> dict[str, Any]:
    return {"stdout": "", "stderr": stderr, "code": 1}


def ensure_user(name: str, *, system: bool = True) -> bool:
    """Create a locked-password account ``name`` (key login only) if missing; False if we cannot. A tenant's is an
    ordinary account (``system=False``): uids below UID_MIN are never a tenant's (docs/security.md)."""
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        pass
    if os.geteuid() != 0:
        return False
    made = subprocess.run(
        [
            "useradd",
            *(["--system"] if system else []),
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/bin/bash",
            name,
        ],
        capture_output=True,
    )
    if made.returncode not in (0, 9):  # 9: exists (a parallel test made it)
        return False
    # useradd leaves the password locked ("!"), which sshd refuses even for key logins without PAM.
    subprocess.run(["usermod", "-p", "*", name], capture_output=True)
    return True
