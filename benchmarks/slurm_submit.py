"""Benchmark of the SLURM adapter on the local cluster: submissions per second against the transport's raw limit
(and PSI/J, a peer, beside them), and scheduler queries per poll interval with held jobs watched through the
worker's ``StatusBatcher``.

Run (root, cluster up via ``temporal-dev/slurm-up.sh``)::

    .venv/bin/python -m benchmarks.slurm_submit [--transport all|cli|ssh|rest] [--raw 100] [--sequential 100]
        [--submit-rounds 3] [--switch-user runuser|setpriv] [--concurrent] [--jobs 1000] [--concurrency 32]
        [--interval 1.0] [--rounds 5]
    .venv/bin/python -m benchmarks.slurm_submit --ssh-parts 40   # where a submission over SSH spends its time

The adapter submits as a real deploy does, with per-tenant accounts (``hpc.tenants``): the benchmark's tenant is
mapped to the cluster's first tenant account, and the cli transport switches to it with ``hpc.slurm.switch_user``
(the configuration's default unless ``--switch-user`` says otherwise).

All jobs are submitted held (``--hold``: they never run; PSI/J's with ``--begin`` an hour ahead, its template
has no flag without a value), named ``vehpc-bench-<run>-*``, and cancelled at the end (also after an error).
Figures go to ``docs/benchmarks.md``. Each round runs, one submission at a time and side by side:

* raw loop: a plain loop of the transport's own submission, as the same tenant account the adapter submits as,
  into the account's own job directory: for the CLI a bash loop of ``sbatch --parsable --hold``, each through the
  adapter's ``switch_user`` (``runuser -u <account> --`` by default), and beside it the same loop running inside
  the account (no switch per command); ``sbatch`` over one kept SSH login of the account, with its own key;
  keep-alive ``POST /slurm/<v>/job/submit`` with SlurmUser's token and ``X-SLURM-USER-NAME: <account>`` for
  slurmrestd.
* the adapter as the submit activity's first attempt calls it when it runs on time (``alone_until`` ahead: no
  retry can have started, so ``sbatch`` and nothing else).
* the adapter with a check for duplicates after each submission (one controller query): what every first attempt
  paid before, and what an attempt past its window (a zombie) still pays.
* PSI/J's SLURM executor (``psij-python``, if installed: ``pip install psij-python``; a benchmark dependency, not
  the project's), one ``submit`` at a time. PSI/J submits with the local ``sbatch`` only, as this process's own
  account (root here: it has no way to submit as another account): its figure is printed beside every transport
  as the peer's rate on this cluster.

``--concurrent`` adds the adapter with ``--concurrency`` submits in flight (a worker runs many submit activities
at once), and ``--jobs`` watchers the batching part: one watcher per job calls ``StatusBatcher.status`` round
after round, as every ``watch_job`` activity of a worker does; the benchmark counts the scheduler queries the
adapter actually makes per interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pwd
import shlex
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from activities.schedulers.base import SubmitRequest
from activities.schedulers.batch.workdir import Verified, guarded
from activities.schedulers.batcher import StatusBatcher
from activities.schedulers.slurm import SlurmAdapter
from activities.schedulers.slurm.script import plan_submission, render_batch_script, render_rest_job
from activities.schedulers.slurm.transports import AccountRunner, LocalRunner, SSHRunner
from virtengine_hpc.config import Secrets, load_config
from virtengine_hpc.errors import SchedulerUnavailable
from virtengine_hpc.models import JobSpec

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("VEHPC_DEV_DIR", REPO / ".dev")) / "slurm"
TENANT = "virtengine1tenant0bench"


def load_env() -> dict[str, Any]:
    env_file = STATE / "env.json"
    if not env_file.exists():
        raise SystemExit(f"{env_file} missing: start the cluster with sudo temporal-dev/slurm-up.sh")
    return json.loads(env_file.read_text())  # type: ignore[no-any-return]


def tenant_account(env: dict[str, Any]) -> str:
    """The account the benchmark's tenant submits as (the adapter) and the raw loops run as."""
    return str(env["tenant_accounts"][0])


def make_adapter(env: dict[str, Any], transport: str, switch_user: str | None = None) -> SlurmAdapter:
    slurm: dict[str, Any] = {
        "cluster_name": env["cluster"],
        "controller_host": env["controller_host"],
        "default_partition": env["partition"],
        "account": env["account"],
        "work_dir": env["jobs_dir"],
        "slurm_conf": env["slurm_conf"],
        "transport": transport,
        "connection_timeout": "60s",
    }
    if transport == "ssh":
        slurm.update(
            ssh_host=env["ssh_host"],
            ssh_port=env["ssh_port"],
            ssh_user=env["ssh_user"],
            ssh_key_path=env["ssh_key_file"],
            known_hosts_path=env["ssh_known_hosts"],
            tenant_key_dir=env["tenant_key_dir"],
        )
    if transport == "rest":
        slurm.update(auth_method="jwt", rest_url=env["slurmrestd_url"], rest_user=env["rest_user"])
    if switch_user is not None:
        slurm["switch_user"] = switch_user
    # The adapter submits as the tenant's own account, as in production (runuser/setpriv, its SSH login, or
    # slurmrestd's user header with SlurmUser's token); the raw loops below submit as that same account.
    tenants = {"accounts": {TENANT: tenant_account(env)}}
    config = load_config(
        data={"hpc": {"scheduler_type": "slurm", "slurm": slurm, "tenants": tenants}}, env={}
    )
    from pydantic import SecretStr

    token = Path(env["submit_jwt_token_file"]).read_text().strip()
    adapter = SlurmAdapter.from_config(config, Secrets(slurm_jwt_token=SecretStr(token)), "bench")
    adapter.hold = True
    return adapter


ON_TIME = timedelta(seconds=5)
"""How long the submit activity's first attempt runs alone with the workflow's 10 s heartbeat timeout."""


def request(run: str, n: int, *, alone: bool = False) -> SubmitRequest:
    """The request of a first attempt; ``alone``: one that runs on time (``alone_until`` ahead, no check)."""
    wf = f"bench-{run}-{n}"
    job = JobSpec(
        job_id=wf,
        tenant=TENANT,
        provider="virtengine1provider0bench",
        offering_id="bench",
        script="true\n",
        resources={"memory_mb_per_node": 64},
    )
    return SubmitRequest(
        workflow_id=wf,
        job=job,
        body="true\n",
        first_attempt=True,
        alone_until=datetime.now(UTC) + ON_TIME if alone else None,
    )


# ---- raw limits ------------------------------------------------------------------------------------------------


def tenant_dir(env: dict[str, Any]) -> str:
    return f"{env['jobs_dir']}/{tenant_account(env)}"


def raw_sbatch_loop(
    env: dict[str, Any], run: str, count: int, switch: str | None = None
) -> tuple[float, list[str]]:
    """A plain bash loop of ``sbatch --parsable --hold`` as the tenant's account: each ``sbatch`` through
    ``switch`` (``runuser``, ``setpriv``, ``sudo``: the cli transport as the adapter runs it), or, with no
    ``switch``, the whole loop running as the account (what ``sbatch`` alone costs that account)."""
    account = tenant_account(env)
    per_command = shlex.join(AccountRunner(LocalRunner(), account, switch).prefix) if switch else ""
    script = (
        f"for i in $(seq {count}); do {per_command} sbatch --parsable --hold -J vehpc-bench-{run}-raw-$i "
        f"-A {env['account']} -D {tenant_dir(env)} -o /dev/null --wrap true; done"
    )
    entry = pwd.getpwnam(account)
    as_account = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--"]
    started = time.perf_counter()
    out = subprocess.run(
        [*([] if switch else as_account), "bash", "-c", script],
        cwd="/",
        env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    return count / seconds, [line.split(";")[0] for line in out.stdout.split()]


async def raw_ssh_loop(
    env: dict[str, Any], run: str, count: int, verified: Verified | None = None
) -> tuple[float, list[str]]:
    """``sbatch`` over one kept SSH login of the tenant's account, with its own key; with ``verified``, each
    ``sbatch`` behind the adapter's check of the job directory in the same command (``workdir.guarded``)."""
    account = tenant_account(env)
    runner = SSHRunner(
        host=env["ssh_host"],
        port=env["ssh_port"],
        user=account,
        key_path=Path(env["tenant_key_dir"]) / account,
        known_hosts=Path(env["ssh_known_hosts"]),
        timeout=60,
    )
    ids = []
    await runner.run(["true"], timeout=60)  # connect outside the timing
    started = time.perf_counter()
    for i in range(count):
        argv = ["sbatch", "--parsable", "--hold", "-J", f"vehpc-bench-{run}-raw-{i}", "-A", env["account"]]
        argv += ["-D", tenant_dir(env), "-o", "/dev/null"]
        result = await runner.run(
            guarded(verified, argv) if verified else argv, stdin="#!/bin/bash\ntrue\n", timeout=60
        )
        ids.append(result.stdout.strip().split(";")[0])
    seconds = time.perf_counter() - started
    await runner.close()
    return count / seconds, ids


async def raw_rest_loop(env: dict[str, Any], run: str, count: int) -> tuple[float, list[str]]:
    """Keep-alive POSTs as the tenant's account (SlurmUser's token, ``X-SLURM-USER-NAME``), as the adapter sends."""
    token = Path(env["submit_jwt_token_file"]).read_text().strip()
    headers = {"X-SLURM-USER-NAME": tenant_account(env), "X-SLURM-USER-TOKEN": token}
    url = f"{env['slurmrestd_url']}/slurm/{env['slurmrestd_api_version']}/job/submit"
    ids = []
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        started = time.perf_counter()
        for i in range(count):
            plan = plan_submission(
                request(run, -i - 1),
                name=f"vehpc-bench-{run}-raw-{i}",
                cluster_id="bench",
                default_partition=env["partition"],
                account=env["account"],
                work_dir=tenant_dir(env),
                hold=True,
            )
            body = render_rest_job(plan)
            answer = (await client.post(url, json=body)).json()
            ids.append(str(answer["job_id"]))
        seconds = time.perf_counter() - started
    return count / seconds, ids


# ---- the adapter -----------------------------------------------------------------------------------------------


async def adapter_sequential(
    adapter: SlurmAdapter, run: str, start: int, count: int, *, alone: bool
) -> tuple[float, list[str]]:
    started = time.perf_counter()
    ids = [
        (await adapter.submit(request(run, n, alone=alone))).scheduler_job_id
        for n in range(start, start + count)
    ]
    return count / (time.perf_counter() - started), ids


async def ssh_dir_checked(adapter: SlurmAdapter, env: dict[str, Any]) -> Verified:
    """The provider's own check of the tenant's job directory, as the adapter's first submission makes it."""
    backend: Any = adapter.backend
    path = await backend.tenant_dir(env["jobs_dir"], tenant_account(env))
    verified = backend.executors.dirs.verified(path)
    assert verified is not None, path
    return verified


async def squeue_checked(adapter: SlurmAdapter, run: str, start: int, count: int) -> tuple[float, list[str]]:
    """The adapter over SSH checking each answer with a new ``squeue`` command of the provider's login, as it did
    before it kept ``scontrol`` running there (same connections, same rounds)."""
    backend: Any = adapter.backend
    kept, backend.job_records = backend.job_records, None
    try:
        return await adapter_sequential(adapter, run, start, count, alone=True)
    finally:
        backend.job_records = kept


async def ssh_parts(env: dict[str, Any], run: str, count: int) -> dict[str, float]:
    """Where a submission over SSH spends its time: median milliseconds of each command the adapter or the raw
    loop runs, interleaved (``count`` of each): a bare SSH command of the tenant's login (``true``), the raw loop's
    ``sbatch``, the adapter's ``sbatch`` behind the directory's check (and, for comparison, behind a check made of
    the shell's own tests, which the adapter does not use), the check of the answer as a new ``squeue`` command of
    the provider's login (before) and as a ``show job`` of its kept ``scontrol`` (now)."""
    adapter = make_adapter(env, "ssh")
    backend: Any = adapter.backend
    account = tenant_account(env)
    try:
        verified = await ssh_dir_checked(adapter, env)
        tenant, own = backend.executors.get(account).runner, backend.executors.own.runner
        times: dict[str, list[float]] = {}

        async def timed(key: str, call: Any) -> Any:
            started = time.perf_counter()
            result = await call
            times.setdefault(key, []).append((time.perf_counter() - started) * 1000)
            return result

        for i in range(count):
            argv = [
                "sbatch",
                "--parsable",
                "--hold",
                "-J",
                f"vehpc-bench-{run}-parts-{i}",
                "-A",
                env["account"],
            ]
            argv += ["-D", tenant_dir(env), "-o", "/dev/null"]
            script = "#!/bin/bash\ntrue\n"
            await timed("ssh true (tenant)", tenant.run(["true"], timeout=60))
            await timed("sbatch (raw)", tenant.run(argv, stdin=script, timeout=60))
            done = await timed(
                "sbatch behind the directory's check",
                tenant.run(guarded(verified, argv), stdin=script, timeout=60),
            )
            # not what the adapter runs: the same place checked by the shell's own tests (kind, link, owner: no
            # process started), for the figures of docs/benchmarks.md
            tests = (
                f'if [ -d "$0" ] && [ ! -h "$0" ] && [ -O "$0" ]; then exec {shlex.join(argv)}; fi; exit 97'
            )
            builtin = ["sh", "-c", tests, tenant_dir(env)]
            await timed(
                "sbatch behind the shell's own tests (not used)",
                tenant.run(builtin, stdin=script, timeout=60),
            )
            job_id = done.stdout.strip().split(";")[0]
            plan = plan_submission(
                request(run, -i - 1),
                name=f"vehpc-bench-{run}-parts-script-{i}",
                cluster_id="bench",
                default_partition=env["partition"],
                account=env["account"],
                work_dir=tenant_dir(env),
                hold=True,
            )
            job_script = render_batch_script(plan)  # the whole job the adapter submits: its directives
            await timed(
                "sbatch of the adapter's script (raw)",
                tenant.run(["sbatch", "--parsable"], stdin=job_script, timeout=60),
            )
            squeue = ["squeue", "-h", "-t", "all", "-j", job_id, "-O", "JobID,UserName,Name"]
            await timed("squeue -j (new command, before)", own.run(squeue, timeout=60))
            await timed("scontrol show job (kept, now)", backend.job_records.show_job(job_id))
    finally:
        await adapter.close()
    return {key: round(statistics.median(values), 2) for key, values in times.items()}


@contextlib.contextmanager
def directory_checked_by_shell_tests() -> Any:
    """What-if, not the adapter's behaviour: the job directory's check in ``sbatch``'s command made of the shell's
    own tests (a directory, not a link, the account's own: no process started) instead of ``stat`` comparing kind,
    owner and mode of every directory up to ``/`` (``workdir.guarded``); docs/benchmarks.md says what it would
    give up."""
    from activities.schedulers.slurm import backends

    def tests(verified: Verified, argv: list[str]) -> list[str]:
        script = (
            f'if [ -d "$0" ] && [ ! -h "$0" ] && [ -O "$0" ]; then exec {shlex.join(argv)}; fi; '
            f"echo {shlex.quote(backends.CHANGED)} >&2; exit {backends.CHANGED_EXIT}"
        )
        return ["sh", "-c", script, verified.path]

    real = backends.guarded
    backends.guarded = tests  # type: ignore[assignment]
    try:
        yield
    finally:
        backends.guarded = real


class Psij:
    """PSI/J's SLURM executor on the local cluster, one ``submit`` at a time (``None`` if not installed)."""

    def __init__(self, env: dict[str, Any]) -> None:
        os.environ["SLURM_CONF"] = env["slurm_conf"]  # PSI/J runs sbatch with this process's environment
        import psij  # type: ignore[import-not-found,unused-ignore]
        from psij.executors.batch.slurm import (  # type: ignore[import-not-found,unused-ignore]
            SlurmExecutorConfig,
        )

        self.psij = psij
        self.account = env["account"]
        self.work = Path(tempfile.mkdtemp(prefix="vehpc-bench-psij-"))
        config = SlurmExecutorConfig(
            work_directory=self.work, queue_polling_interval=3600, initial_queue_polling_delay=3600
        )
        self.executor = psij.JobExecutor.get_instance("slurm", config=config)
        self.submitted: list[str] = []

    @classmethod
    def load(cls, env: dict[str, Any]) -> Psij | None:
        try:
            return cls(env)
        except ImportError:
            return None

    def loop(self, run: str, count: int) -> tuple[float, list[str]]:
        ids = []
        started = time.perf_counter()
        for i in range(count):
            spec = self.psij.JobSpec(
                executable="/bin/true",
                name=f"vehpc-bench-{run}-psij-{i}",
                directory=Path("/tmp"),
                attributes=self.psij.JobAttributes(
                    account=self.account,
                    # PSI/J's template names the job after its script file unless told: the name is how the
                    # benchmark finds its jobs to cancel them (and the ids, in case).
                    custom_attributes={
                        "slurm.begin": "now+3600",
                        "slurm.job-name": f"vehpc-bench-{run}-psij-{i}",
                    },
                ),
            )
            job = self.psij.Job(spec)
            self.executor.submit(job)
            ids.append(str(job.native_id))
        self.submitted += ids
        return count / (time.perf_counter() - started), ids

    def cancel(self, env: dict[str, Any]) -> None:
        for chunk in range(0, len(self.submitted), 500):
            subprocess.run(
                ["scancel", *self.submitted[chunk : chunk + 500]],
                env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
                check=False,
            )
        self.submitted = []


async def adapter_concurrent(
    adapter: SlurmAdapter, run: str, start: int, count: int, concurrency: int
) -> tuple[float, list[str], int]:
    slots = asyncio.Semaphore(concurrency)
    batches_before = adapter._live_finder.batches

    async def one(n: int) -> str:
        async with slots:
            return (await adapter.submit(request(run, n, alone=True))).scheduler_job_id

    started = time.perf_counter()
    ids = await asyncio.gather(*(one(n) for n in range(start, start + count)))
    seconds = time.perf_counter() - started
    return count / seconds, list(ids), adapter._live_finder.batches - batches_before


# ---- batching ----------------------------------------------------------------------------------------------------


async def batched_polling(
    adapter: SlurmAdapter, ids: list[str], interval: float, rounds: int
) -> dict[str, Any]:
    batcher = StatusBatcher(adapter, interval)
    before = dict(adapter.calls)
    states: dict[str, int] = {}

    async def watch(job_id: str) -> None:
        for _ in range(rounds):
            status = await batcher.status(job_id)
            states[status.state.value] = states.get(status.state.value, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(watch(i) for i in ids))
    seconds = time.perf_counter() - started
    calls = {k: v - before.get(k, 0) for k, v in adapter.calls.items() if v - before.get(k, 0)}
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        await adapter.status_batch(ids)
        timings.append(time.perf_counter() - t0)
    single = []
    for job_id in ids[:20]:
        t0 = time.perf_counter()
        await adapter.status_batch([job_id])
        single.append(time.perf_counter() - t0)
    return {
        "watchers": len(ids),
        "rounds": batcher.queries,
        "seconds": seconds,
        "scheduler_calls": calls,
        "calls_per_round": sum(calls.values()) / max(1, batcher.queries),
        "states": states,
        "one_batched_query_s": statistics.median(timings),
        "per_job_queries_s_extrapolated": statistics.median(single) * len(ids),
    }


def cancel_run(env: dict[str, Any], run: str) -> int:
    for _ in range(10):  # a busy controller can time squeue out: the jobs must still go
        listed = subprocess.run(
            ["squeue", "-h", "-o", "%A|%j"],
            env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
            capture_output=True,
            text=True,
        )
        if listed.returncode == 0:
            break
        time.sleep(3)
    out = listed.stdout
    ids = [x.split("|")[0] for x in out.splitlines() if f"vehpc-bench-{run}" in x]
    for chunk in range(0, len(ids), 500):
        subprocess.run(
            ["scancel", *ids[chunk : chunk + 500]],
            env={**os.environ, "SLURM_CONF": env["slurm_conf"]},
            check=False,
        )
    return len(ids)


async def raw_loop(
    env: dict[str, Any], transport: str, run: str, count: int, switch: str | None = None
) -> tuple[float, list[str]]:
    if transport == "cli":
        return raw_sbatch_loop(env, run, count, switch)
    if transport == "ssh":
        return await raw_ssh_loop(env, run, count)
    return await raw_rest_loop(env, run, count)


async def one_at_a_time(
    env: dict[str, Any], transport: str, run: str, args: argparse.Namespace, psij: Psij | None
) -> dict[str, Any]:
    """Alternating rounds of the raw loop, the adapter (first attempt on time, and with the check), PSI/J."""
    adapter = make_adapter(env, transport, args.switch_user)
    rates: dict[str, list[float]] = {"raw": [], "first_attempt": [], "checked": [], "psij": []}
    switch = adapter.config.switch_user if transport == "cli" else None
    n = 0
    try:
        await adapter.status_batch(["1"])  # connect and check the cluster outside the timings
        verified = await ssh_dir_checked(adapter, env) if transport == "ssh" else None
        for r in range(args.submit_rounds):
            raw_run = f"{run}{transport}r{r}"
            rates["raw"].append((await raw_loop(env, transport, raw_run, args.raw, switch))[0])
            if switch is not None:  # the loop inside the account: no switch per command
                rate = raw_sbatch_loop(env, f"{raw_run}a", args.raw)[0]
                rates.setdefault("raw_in_account", []).append(rate)
            if verified is not None:  # what the directory's check in sbatch's command costs, alone
                rate = (await raw_ssh_loop(env, f"{raw_run}g", args.raw, verified))[0]
                rates.setdefault("raw_guarded", []).append(rate)
            for key, alone, count in (
                ("first_attempt", True, args.sequential),
                ("checked", False, args.checked),
            ):
                if not count:
                    continue
                try:
                    rate, _ = await adapter_sequential(adapter, f"{run}{transport}", n, count, alone=alone)
                except (
                    SchedulerUnavailable
                ) as exc:  # slurmrestd's job list can take minutes on a busy cluster
                    print(f"{transport} {key}: {exc}", flush=True)
                    rate = 0.0
                rates[key].append(rate)
                n += count
            if transport == "ssh" and args.sequential and args.shell_tests:
                with directory_checked_by_shell_tests():
                    rate, _ = await adapter_sequential(
                        adapter, f"{run}{transport}", n, args.sequential, alone=True
                    )
                rates.setdefault("shell_tests", []).append(rate)
                n += args.sequential
            if transport == "ssh" and args.sequential:  # the check of sbatch's answer as a new squeue command
                rate, _ = await squeue_checked(adapter, f"{run}{transport}", n, args.sequential)
                rates.setdefault("squeue_check", []).append(rate)
                n += args.sequential
            if psij is not None:
                rates["psij"].append(psij.loop(f"{run}{transport}r{r}", args.sequential)[0])
        calls = adapter.calls
    finally:
        with contextlib.suppress(Exception):
            await adapter.close()
        cancel_run(env, f"{run}{transport}")  # the next transport's figures do not pay for these jobs
        if psij is not None:
            psij.cancel(env)
    medians = {k: statistics.median(v) for k, v in rates.items() if v}
    return {
        "transport": transport,
        "account": tenant_account(env),
        "switch_user": switch,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "per_s": {k: [round(x, 1) for x in v] for k, v in rates.items() if v},
        "median_per_s": {k: round(v, 1) for k, v in medians.items()},
        "ratio_to_raw": {k: round(v / medians["raw"], 2) for k, v in medians.items() if k != "raw"},
        "scheduler_calls": calls,
    }


def _cell(result: dict[str, Any], key: str) -> str:
    """``median [min-max] (ratio to the raw loop)`` of one submitter's rounds."""
    median, rounds = result["median_per_s"], result["per_s"]
    if key not in median:
        return "-"
    spread = f"{median[key]:.0f} [{min(rounds[key]):.0f}-{max(rounds[key]):.0f}]"
    return spread if key == "raw" else f"{spread} ({result['ratio_to_raw'][key]:.2f})"


def print_table(results: list[dict[str, Any]]) -> None:
    account = results[0]["account"] if results else "?"
    print(
        f"\none submission at a time as {account}, jobs/s (median of rounds; ratio to the transport's raw loop "
        "as the same account)"
    )
    print("[min-max of the rounds]")
    print(
        f"{'transport':9} {'raw loop':>19} {'first attempt':>26} {'checked (before)':>26} {'PSI/J (local)':>26}"
    )
    for result in results:
        cells = [_cell(result, k) for k in ("raw", "first_attempt", "checked", "psij")]
        print(f"{result['transport']:9} {cells[0]:>19} {cells[1]:>26} {cells[2]:>26} {cells[3]:>26}")
        if "squeue_check" in result["median_per_s"]:
            print(
                f"  (ssh: the adapter checking each answer with a new squeue command, as before: "
                f"{_cell(result, 'squeue_check')}; the raw loop with the directory's check in each sbatch "
                f"command: {_cell(result, 'raw_guarded')})"
            )
        if "shell_tests" in result["median_per_s"]:
            print(
                f"  (ssh, what-if: the directory checked by the shell's own tests: {_cell(result, 'shell_tests')})"
            )
        inside = result["median_per_s"].get("raw_in_account")
        if inside:
            print(
                f"  (cli: the raw loop runs each sbatch through {result['switch_user']}, as the adapter does; the "
                f"loop running inside the account: {_cell(result, 'raw_in_account')}, first attempt "
                f"{result['median_per_s']['first_attempt'] / inside:.2f} of it)"
            )


async def concurrent_and_batching(
    env: dict[str, Any], transport: str, run: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Submits in flight against the raw loop, then the queries per poll of ``--jobs`` watchers."""
    adapter = make_adapter(env, transport, args.switch_user)
    report: dict[str, Any] = {}
    ids: list[str] = []
    n = 100_000
    try:
        await adapter.status_batch(["1"])
        raw_rates, conc_rates, batches = [], [], 0
        for r in range(args.submit_rounds):
            rate, got = await raw_loop(env, transport, f"{run}{transport}c{r}", args.raw)
            raw_rates.append(rate)
            ids += got
            rate, got, b = await adapter_concurrent(
                adapter, f"{run}{transport}", n, args.raw, args.concurrency
            )
            conc_rates.append(rate)
            batches += b
            ids += got
            n += args.raw
        report["concurrent"] = {
            "raw_loop_per_s": [round(x) for x in raw_rates],
            "adapter_concurrent_per_s": [round(x) for x in conc_rates],
            "concurrency": args.concurrency,
            "check_batches": batches,
            "ratio_concurrent_median": round(statistics.median(conc_rates) / statistics.median(raw_rates), 2),
        }
        print(json.dumps(report["concurrent"], indent=1), flush=True)
        if len(ids) < args.jobs:  # fill up to --jobs held jobs for the batching part
            _, got, _ = await adapter_concurrent(
                adapter, f"{run}{transport}", n, args.jobs - len(ids), args.concurrency
            )
            ids += got
        report["batching"] = await batched_polling(adapter, ids[: args.jobs], args.interval, args.rounds)
        print(json.dumps(report["batching"], indent=1), flush=True)
    finally:
        with contextlib.suppress(Exception):
            await adapter.close()
    return report


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--transport", choices=("all", "cli", "ssh", "rest"), default="all")
    parser.add_argument("--raw", type=int, default=100, help="jobs per raw loop (and per concurrent run)")
    parser.add_argument(
        "--sequential", type=int, default=100, help="jobs per round of each one-at-a-time submitter"
    )
    parser.add_argument(
        "--checked",
        type=int,
        default=20,
        help="jobs per round of the adapter checking after each submit (slow over slurmrestd: its check lists "
        "every job the controller holds; 0 leaves it out)",
    )
    parser.add_argument("--submit-rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--no-psij", action="store_true", help="leave PSI/J out even if installed")
    parser.add_argument(
        "--switch-user",
        choices=("runuser", "setpriv", "sudo"),
        default=None,
        help="cli: how the adapter runs sbatch as the tenant's account (default: hpc.slurm.switch_user's default)",
    )
    parser.add_argument(
        "--concurrent", action="store_true", help="also submits in flight and the batching part"
    )
    parser.add_argument("--jobs", type=int, default=1000, help="held jobs watched in the batching part")
    parser.add_argument("--concurrency", type=int, default=32, help="adapter submits in flight")
    parser.add_argument("--interval", type=float, default=1.0, help="StatusBatcher poll interval (s)")
    parser.add_argument("--rounds", type=int, default=5, help="polls per watcher")
    parser.add_argument(
        "--shell-tests",
        action="store_true",
        help="ssh: also the adapter with the directory's check made of the shell's own tests (a what-if)",
    )
    parser.add_argument(
        "--ssh-parts",
        type=int,
        default=0,
        help="only time each command of a submission over SSH, this many each",
    )
    args = parser.parse_args()
    env = load_env()
    run = uuid.uuid4().hex[:6]
    transports = ("cli", "ssh", "rest") if args.transport == "all" else (args.transport,)
    psij = None if args.no_psij else Psij.load(env)
    if psij is None and not args.no_psij:
        print("psij-python is not installed: PSI/J left out (pip install psij-python)", flush=True)
    results = []
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)  # still cancel the jobs
    try:
        if args.ssh_parts:
            print(f"load average {os.getloadavg()}", flush=True)
            print(json.dumps(await ssh_parts(env, run, args.ssh_parts), indent=1), flush=True)
            print(f"load average {os.getloadavg()}", flush=True)
            return
        for transport in transports:
            results.append(await one_at_a_time(env, transport, run, args, psij))
            print(json.dumps(results[-1], indent=1), flush=True)
        print_table(results)
        if args.concurrent:
            for transport in transports:
                await concurrent_and_batching(env, transport, run, args)
    finally:
        print(f"cancelled {cancel_run(env, run)} benchmark jobs", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
