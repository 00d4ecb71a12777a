"""Renders a template and a job's validated parameters into the body of a batch script, for one scheduler.

The adapter's script builder adds everything the scheduler reads (``#SBATCH`` lines with nodes, tasks, memory,
``--gres=gpu:...``, walltime); the body only starts the program, through the launcher the template names:

* ``direct``: the command itself (optionally in a container image, optionally without network);
* ``mpi``: ``srun`` on SLURM, ``mpirun -np $SLURM_NTASKS`` elsewhere (the adapter's ``mpi_launcher``; a template
  may let the tenant pick ``mpirun`` on SLURM too);
* ``data``: a Dask or Spark cluster started inside the allocation (one worker per node) and the driver program;
* ``session``: a long-running interactive service (JupyterLab, or the tenant's own HTTP service) on a free port,
  whose endpoint the job writes to ``virtengine-session-<job id>.json`` in its working directory.

Safety: the body is assembled from fixed text and shell words; every word that carries a parameter value is
``shlex.quote``-d, and values were validated against the template's schema before (``validate.py``). A hostile
value therefore arrives in the program's argv exactly as given and never runs as shell code.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from virtengine_hpc.errors import ValidationError
from virtengine_hpc.models import JobSpec
from virtengine_hpc.signing import canonical_decimal
from virtengine_hpc.templates.model import _PLACEHOLDER_RE, RUNTIME_PLACEHOLDERS, WorkloadTemplate
from virtengine_hpc.templates.validate import Values, image_ok

#: Schedulers whose "nodes" are nominal: every task runs on the worker's own host (the local executor).
HOST_LOCAL_SCHEDULERS = frozenset({"local"})
SESSION_FILE = "virtengine-session-${VIRTENGINE_JOB_ID:-job}.json"
"""Where an interactive session publishes its endpoint, relative to the job's working directory."""


@dataclass(frozen=True)
class LaunchProfile:
    """What the renderer needs to know about the scheduler that will run the body."""

    scheduler: str
    mpi_launcher: str = "mpirun"
    host_local: bool = False

    @classmethod
    def of(cls, scheduler: str, mpi_launcher: str) -> LaunchProfile:
        if mpi_launcher not in ("srun", "mpirun"):
            raise ValidationError(f"unknown MPI launcher {mpi_launcher!r} for scheduler {scheduler}")
        return cls(scheduler, mpi_launcher, scheduler in HOST_LOCAL_SCHEDULERS)


def render(template: WorkloadTemplate, values: Values, job: JobSpec, profile: LaunchProfile) -> str:
    """The batch-script body (without ``#!`` line or scheduler directives) that runs ``job`` per ``template``."""
    return _Renderer(template, values, job, profile).body()


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return canonical_decimal(value)
    return str(value)


def _line(words: Sequence[str]) -> str:
    return " ".join(words)


class _Renderer:
    def __init__(
        self, template: WorkloadTemplate, values: Values, job: JobSpec, profile: LaunchProfile
    ) -> None:
        self.t = template
        self.values = values
        self.job = job
        self.p = profile
        self.res = job.resources
        self.name = shlex.quote(f"template {template.template_id}")

    # ---- words ---------------------------------------------------------------------------------------------
    def _runtime_word(self, name: str) -> str:
        return f'"${{{RUNTIME_PLACEHOLDERS[name]}}}"'

    def _is_runtime(self, name: str) -> bool:
        return (
            self.t.entrypoint.launcher == "session"
            and name in RUNTIME_PLACEHOLDERS
            and name not in self.values
        )

    def item(self, item: str) -> list[str]:
        """Shell words for one argv-template item; an item that needs an unset parameter is left out."""
        whole = _PLACEHOLDER_RE.fullmatch(item)
        if whole:
            name = whole.group(1)
            if self._is_runtime(name):
                return [self._runtime_word(name)]
            value = self.values.get(name)
            if value is None:
                return []
            if isinstance(value, tuple):
                return [self._tenant_word(w) for w in value]
            return [shlex.quote(_text(value))]
        pieces: list[str] = []
        pos = 0
        for match in _PLACEHOLDER_RE.finditer(item):
            if match.start() > pos:
                pieces.append(shlex.quote(item[pos : match.start()]))
            name = match.group(1)
            if self._is_runtime(name):
                pieces.append(self._runtime_word(name))
            else:
                value = self.values.get(name)
                if value is None:
                    return []
                pieces.append(shlex.quote(_text(value)))
            pos = match.end()
        if pos < len(item):
            pieces.append(shlex.quote(item[pos:]))
        return ["".join(pieces)] if pieces else []

    def _tenant_word(self, word: str) -> str:
        # A session's own command may name the port or host the job picks, as a whole word: {port}, {host}.
        if self.t.entrypoint.launcher == "session" and word in ("{port}", "{host}"):
            return self._runtime_word(word[1:-1])
        return shlex.quote(word)

    def argv(self, template: Sequence[str]) -> list[str]:
        return [word for item in template for word in self.item(item)]

    def fail(self, code: int, message: str) -> str:
        """A shell statement that explains on stderr and exits ``code`` (message is our text, quoted)."""
        return f"{{ echo {self.name}: {shlex.quote(message)} >&2; exit {code}; }}"

    def require(self, program: str, why: str) -> str:
        return f"command -v {shlex.quote(program)} >/dev/null 2>&1 || " + self.fail(
            127, f"{program} is not installed on this node ({why})"
        )

    # ---- sections ------------------------------------------------------------------------------------------
    def body(self) -> str:
        t = self.t
        lines = [
            f"# ---- virtengine-hpc workload template {t.template_id} {t.version} "
            f"({t.type}, launcher {t.entrypoint.launcher}, scheduler {self.p.scheduler}) ----",
            "# Rendered from the template and the job's validated parameters; every parameter value is shell-quoted.",
            "set -o pipefail",
            "vehpc_rc=0",
        ]
        lines += self.modules()
        if self.res.gpus_per_node:
            lines += self.gpu_banner()
        for pre in t.entrypoint.pre:
            lines.append(_line(self.argv(pre)) + " || exit $?")
        launcher = t.entrypoint.launcher
        main = {"direct": self.direct, "mpi": self.mpi, "data": self.data, "session": self.session}[launcher]
        lines += main()
        for post in t.entrypoint.post:
            lines.append(
                _line(self.argv(post))
                + " || echo "
                + shlex.quote(f"{t.template_id}: a post command failed")
                + " >&2"
            )
        lines.append('exit "$vehpc_rc"')
        return "\n".join(lines) + "\n"

    def modules(self) -> list[str]:
        wanted = list(self.t.runtime.modules)
        extra = self.values.get("modules")
        if isinstance(extra, tuple):
            wanted += extra
        if not wanted:
            return []
        names = " ".join(shlex.quote(m) for m in wanted)
        return [
            "# environment modules (Lmod / Environment Modules)",
            "for vehpc_f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do "
            '[ -r "$vehpc_f" ] && . "$vehpc_f"; done',
            "type module >/dev/null 2>&1 || "
            + self.fail(
                127, f"environment modules are not available on this node; cannot load {' '.join(wanted)}"
            ),
            f"module load {names} || " + self.fail(127, "module load failed"),
        ]

    def gpu_banner(self) -> list[str]:
        gpus = self.res.gpus_per_node
        return [
            f"# {gpus} GPU(s) per node requested (the scheduler's gres grants them and sets CUDA_VISIBLE_DEVICES)",
            'echo "GPUs visible: ${CUDA_VISIBLE_DEVICES:-none}" >&2',
            "if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L >&2 || true; fi",
        ]

    def container(self) -> list[str]:
        """Words that run the program in the container image, if the template or the tenant names one."""
        if not self.t.entrypoint.use_container:
            return []
        chosen = self.values.get("image")
        image = chosen if isinstance(chosen, str) else self.t.runtime.image
        if not image:
            return []
        if not image_ok(image) or (self.t.security.require_image_digest and "@sha256:" not in image):
            raise ValidationError(f"template {self.t.template_id}: image {image[:80]!r} is not allowed")
        runtime = self.t.runtime.container_runtime
        words = [runtime, "exec"]
        if self.res.gpus_per_node:
            words.append("--nv")
        return [*words, shlex.quote(f"docker://{image}")]

    def _container_check(self, container: list[str]) -> list[str]:
        if not container:
            return []
        return [self.require(container[0], "the job runs in a container image")]

    def _isolation(self) -> tuple[list[str], list[str]]:
        """(check lines, prefix words) that take the network away when the template forbids it (fail closed)."""
        if self.t.security.network_access:
            return [], []
        check = "unshare --net --map-root-user true 2>/dev/null || " + self.fail(
            126,
            "this template runs without network access and this node cannot isolate it (no user namespaces)",
        )
        return [check], ["unshare", "--net", "--map-root-user", "--"]

    def direct(self) -> list[str]:
        container = self.container()
        checks, prefix = self._isolation()
        command = self.argv(self.t.entrypoint.command)
        return [
            *self._container_check(container),
            *checks,
            _line([*prefix, *container, *command]) + " || vehpc_rc=$?",
        ]

    def _mpi_launcher(self) -> str:
        chosen = self.values.get("launcher")
        launcher = chosen if isinstance(chosen, str) and chosen != "auto" else self.p.mpi_launcher
        if launcher == "srun" and self.p.mpi_launcher != "srun":
            raise ValidationError(
                f"template {self.t.template_id}: launcher srun needs SLURM; scheduler {self.p.scheduler} uses mpirun"
            )
        return launcher

    def mpi(self) -> list[str]:
        container = self.container()
        command = self.argv(self.t.entrypoint.command)
        launcher = self._mpi_launcher()
        if launcher == "srun":
            words = ["srun", "--kill-on-bad-exit=1"]
            if self.t.runtime.srun_mpi:
                words.append(f"--mpi={shlex.quote(self.t.runtime.srun_mpi)}")
            lines = [self.require("srun", "MPI launch")]
        else:
            words = ["mpirun", "-np", '"${SLURM_NTASKS:-${VIRTENGINE_NTASKS:-1}}"']
            if self.p.host_local:
                words.append("--oversubscribe")  # nominal nodes: every rank shares this one host
            lines = [self.require("mpirun", "MPI launch")]
        lines.append(
            f'echo "mpi: {launcher} starting ${{SLURM_NTASKS:-${{VIRTENGINE_NTASKS:-1}}}} task(s)" >&2'
        )
        return [
            *lines,
            *self._container_check(container),
            _line([*words, *container, *command]) + " || vehpc_rc=$?",
        ]

    # ---- data processing -----------------------------------------------------------------------------------
    def _data_env(self) -> list[str]:
        lines = []
        for name, var in (("input", "DATA_INPUT"), ("output", "DATA_OUTPUT")):
            value = self.values.get(name)
            if isinstance(value, str):
                lines.append(f"export {var}={shlex.quote(value)}")
        if isinstance(self.values.get("output"), str):
            lines.append(
                'mkdir -p -- "$DATA_OUTPUT" || ' + self.fail(1, "cannot create the output directory")
            )
        return lines

    def _per_node(self, words: list[str], log: str) -> str:
        """A line that starts ``words`` once per node of the allocation, in the background, output to ``log``."""
        nodes = self.res.nodes
        out = f'>>"$vehpc_dir/{log}" 2>&1'
        if self.p.host_local:
            return f"for vehpc_i in $(seq 1 {nodes}); do {_line(words)} {out} & done"
        if self.p.mpi_launcher == "srun":
            return (
                _line(["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--overlap", *words]) + f" {out} &"
            )
        return _line(["mpirun", "-np", str(nodes), "--map-by", "ppr:1:node", *words]) + f" {out} &"

    def data(self) -> list[str]:
        engine = self.values.get("engine") or "dask"
        driver = self.argv(["{python}", "{application}", "{args}"]) if engine == "dask" else []
        lines = [
            "# data processing: a cluster inside the allocation (one worker per node), then the driver",
            'vehpc_dir="$PWD/.vehpc-data-${VIRTENGINE_JOB_ID:-$$}"',
            'mkdir -p -- "$vehpc_dir" || ' + self.fail(1, "cannot create the data-processing directory"),
            *self._data_env(),
            'vehpc_stop() { [ -n "${vehpc_pids:-}" ] && kill $vehpc_pids 2>/dev/null; wait 2>/dev/null; }',
            "trap vehpc_stop EXIT",
        ]
        if engine == "dask":
            lines += self._dask(driver)
        elif engine == "spark":
            lines += self._spark()
        else:
            raise ValidationError(f"template {self.t.template_id}: unknown data engine {engine!r}")
        return lines

    def _dask(self, driver: list[str]) -> list[str]:
        cpus, mem = self.res.cpus_per_node, self.res.memory_mb_per_node
        worker = [
            "dask-worker",
            "--scheduler-file",
            '"$DASK_SCHEDULER_FILE"',
            "--nthreads",
            str(cpus),
            "--nworkers",
            "1",
            "--memory-limit",
            f"{mem}MiB",
            "--local-directory",
            '"$vehpc_dir"',
            "--no-dashboard",
        ]
        return [
            self.require("dask-scheduler", "data engine dask"),
            self.require("dask-worker", "data engine dask"),
            'export DASK_SCHEDULER_FILE="$vehpc_dir/scheduler.json"',
            f"export DASK_WORKERS={self.res.nodes}",
            'rm -f -- "$DASK_SCHEDULER_FILE"',
            'dask-scheduler --scheduler-file "$DASK_SCHEDULER_FILE" --port 0 --no-dashboard '
            '>"$vehpc_dir/scheduler.log" 2>&1 &',
            'vehpc_pids="$!"',
            'for vehpc_i in $(seq 1 240); do [ -s "$DASK_SCHEDULER_FILE" ] && break; sleep 0.25; done',
            '[ -s "$DASK_SCHEDULER_FILE" ] || '
            + self.fail(1, "the dask scheduler did not start (see scheduler.log)"),
            self._per_node(worker, "workers.log"),
            'vehpc_pids="$(jobs -p | tr "\\n" " ")"',
            'echo "data: dask scheduler and $DASK_WORKERS worker(s) started" >&2',
            _line(driver) + " || vehpc_rc=$?",
        ]

    def _spark(self) -> list[str]:
        cpus, nodes = self.res.cpus_per_node, self.res.nodes
        memory = self.values.get("executor_memory_mb") or max(512, self.res.memory_mb_per_node * 3 // 4)
        app = self.argv(["{application}", "{args}"])
        submit = ["spark-submit", "--executor-memory", f"{memory}m"]
        lines = [self.require("spark-submit", "data engine spark")]
        if nodes == 1 or self.p.host_local:
            total = cpus * (1 if nodes == 1 else nodes)
            return [*lines, _line([*submit, "--master", f"'local[{total}]'", *app]) + " || vehpc_rc=$?"]
        worker = [
            "spark-class",
            "org.apache.spark.deploy.worker.Worker",
            "--cores",
            str(cpus),
            "--memory",
            f"{memory}m",
            '"$vehpc_master"',
        ]
        return [
            *lines,
            self.require("spark-class", "data engine spark"),
            'vehpc_host="$(hostname -f 2>/dev/null || hostname)"',
            'vehpc_port="$(python3 -c \'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])\' '
            '2>/dev/null || shuf -i 20000-60999 -n 1)"',
            'vehpc_master="spark://$vehpc_host:$vehpc_port"',
            'spark-class org.apache.spark.deploy.master.Master --host "$vehpc_host" --port "$vehpc_port" '
            '--webui-port 0 >"$vehpc_dir/master.log" 2>&1 &',
            'vehpc_pids="$!"',
            'for vehpc_i in $(seq 1 240); do (exec 3<>"/dev/tcp/$vehpc_host/$vehpc_port") 2>/dev/null && break; '
            "sleep 0.5; done",
            self._per_node(worker, "workers.log"),
            'vehpc_pids="$(jobs -p | tr "\\n" " ")"',
            _line([*submit, "--master", '"$vehpc_master"', *app]) + " || vehpc_rc=$?",
        ]

    # ---- interactive session -------------------------------------------------------------------------------
    def session(self) -> list[str]:
        service = self.values.get("service") or "jupyter"
        if service == "jupyter":
            command = [
                "jupyter",
                "lab",
                "--no-browser",
                "--ip=0.0.0.0",
                '--port="$SESSION_PORT"',
                "--ServerApp.port_retries=0",
            ]
            checks = [self.require("jupyter", "session service jupyter")]
            url_path = "lab"
        elif service == "http":
            command = self.argv(self.t.entrypoint.command)
            if not command:
                raise ValidationError(f"template {self.t.template_id}: service http needs a command")
            checks = []
            url_path = ""
        else:
            raise ValidationError(f"template {self.t.template_id}: unknown session service {service!r}")
        container = self.container()
        service_q = shlex.quote(str(service))
        json_line = (
            'printf \'{"job_id":"%s","service":"%s","host":"%s","port":%s,"url":"%s",'
            '"token":"%s","started_at":"%s","ends_by":"%s"}\\n\' '
            f'"${{VIRTENGINE_JOB_ID:-}}" {service_q} "$SESSION_HOST" "$SESSION_PORT" "$vehpc_url" '
            '"$SESSION_TOKEN" "$(date -u +%FT%TZ)" "$vehpc_ends_by"'
        )
        return [
            "# interactive session: a service on a free port; its endpoint goes to the session file until it ends",
            "umask 077",
            'SESSION_HOST="$(hostname -f 2>/dev/null || hostname)"',
            'SESSION_PORT="$(python3 -c \'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])\' '
            '2>/dev/null || shuf -i 20000-60999 -n 1)"',
            "SESSION_TOKEN=\"$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \\n')\"",
            'export SESSION_HOST SESSION_PORT SESSION_TOKEN PORT="$SESSION_PORT" JUPYTER_TOKEN="$SESSION_TOKEN"',
            f'vehpc_session_file="$PWD/{SESSION_FILE}"',
            f'vehpc_url="http://$SESSION_HOST:$SESSION_PORT/{url_path}"',
            f"vehpc_wall=${{VIRTENGINE_WALLTIME_SECONDS:-{self.job.walltime_seconds}}}",
            "vehpc_margin=$(( vehpc_wall / 10 < 60 ? vehpc_wall / 10 : 60 ))",
            "vehpc_limit=$(( vehpc_wall - vehpc_margin ))",
            'vehpc_ends_by="$(date -u -d "+${vehpc_limit} seconds" +%FT%TZ)"',
            'vehpc_cleanup() { rm -f -- "$vehpc_session_file" "$vehpc_session_file.tmp"; '
            '[ -n "${vehpc_pid:-}" ] && kill "$vehpc_pid" 2>/dev/null; }',
            "trap vehpc_cleanup EXIT",
            "trap 'exit 143' TERM INT",
            *checks,
            *self._container_check(container),
            # The session ends by itself shortly before the walltime, so a booked session ends "completed".
            _line(["timeout", "-s", "TERM", '"$vehpc_limit"', *container, *command]) + " &",
            "vehpc_pid=$!",
            "vehpc_up=0",
            "for vehpc_i in $(seq 1 480); do",
            '  if (exec 3<>"/dev/tcp/127.0.0.1/$SESSION_PORT") 2>/dev/null; then vehpc_up=1; break; fi',
            '  kill -0 "$vehpc_pid" 2>/dev/null || break',
            "  sleep 0.25",
            "done",
            'if [ "$vehpc_up" = 1 ]; then',
            f'  {json_line} >"$vehpc_session_file.tmp" && mv -f -- "$vehpc_session_file.tmp" "$vehpc_session_file"',
            f'  echo "virtengine-session: {service} ready at $vehpc_url until $vehpc_ends_by '
            '(endpoint and token in $vehpc_session_file)"',
            "else",
            '  echo "virtengine-session: the service did not listen on port $SESSION_PORT" >&2',
            "fi",
            'wait "$vehpc_pid"; vehpc_rc=$?',
            'if [ "$vehpc_rc" -eq 124 ]; then echo "virtengine-session: the booked time is over; session closed"; '
            "vehpc_rc=0; fi",
        ]
