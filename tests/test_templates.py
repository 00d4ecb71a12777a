"""Workload templates without a scheduler: the built-ins, bounds and schema checks, rendering for each scheduler
(hostile values stay literal when the body really runs), signatures, governance approval on the LocalLedger, the
resolver's refusals with their security audit events, and the ``templates`` commands."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.audit import AuditLog, read_events
from activities.chain.local_ledger import LocalLedger
from activities.schedulers.base import SubmitRequest
from activities.schedulers.local import LocalAdapter
from activities.schedulers.moab.script import msub_argv, render_mws_job
from activities.schedulers.slurm.script import plan_submission, render_batch_script, render_rest_job
from activities.templates import TemplateResolver
from tests.conftest import make_config
from virtengine_hpc.cli import main as cli_main
from virtengine_hpc.config import Config
from virtengine_hpc.errors import ChainError, SecurityError, ValidationError
from virtengine_hpc.models import JobSpec
from virtengine_hpc.signing import Signer, canonical_bytes, public_key_b64, write_private_key
from virtengine_hpc.templates import (
    BUILTIN_IDS,
    TEMPLATE_DOMAIN,
    LaunchProfile,
    WorkloadTemplate,
    builtin_templates,
    check_job,
    render,
    sign_template,
)

LOCAL = LaunchProfile.of("local", "mpirun")
SLURM = LaunchProfile.of("slurm", "srun")
MOAB = LaunchProfile.of("moab", "mpirun")
PUBLISHER = "virtengine1publisher0bob"


def job(template_id: str, params: dict[str, Any] | None = None, **extra: Any) -> JobSpec:
    data: dict[str, Any] = {
        "job_id": "JOB-1",
        "tenant": "virtengine1tenant0alice",
        "provider": "virtengine1provider0test",
        "offering_id": "offering-standard",
        "template_id": template_id,
        "template_parameters": params or {},
        "walltime_seconds": 600,
    }
    data.update(extra)
    return JobSpec.model_validate(data)


def body(template_id: str, params: dict[str, Any], profile: LaunchProfile = LOCAL, **extra: Any) -> str:
    template = builtin_templates()[template_id]
    spec = job(template_id, params, **extra)
    return render(template, check_job(template, spec), spec, profile)


def custom_document(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "template_id": "bob-echo",
        "name": "Echo",
        "version": "1.0.0",
        "description": "prints its words",
        "type": "custom",
        "publisher": PUBLISHER,
        "resources": {
            "nodes": {"min": 1, "max": 2, "default": 1},
            "cpus_per_node": {"min": 1, "max": 4, "default": 1},
            "memory_mb_per_node": {"min": 64, "max": 4096, "default": 512},
            "runtime_minutes": {"min": 1, "max": 60, "default": 10},
        },
        "entrypoint": {"launcher": "direct", "command": ["printf", "%s\\n", "{words}"]},
        "parameters": {"words": {"type": "argv", "required": True}},
    }
    doc.update(changes)
    return doc


# ---- built-ins ------------------------------------------------------------------------------------------------


def test_five_builtins_with_the_reference_bounds() -> None:
    templates = builtin_templates()
    assert tuple(templates) == BUILTIN_IDS
    types = {t.template_id: t.type for t in templates.values()}
    assert types == {
        "mpi-standard": "mpi",
        "gpu-compute": "gpu",
        "batch-standard": "batch",
        "data-processing": "data_processing",
        "interactive-session": "interactive",
    }
    mpi, gpu = templates["mpi-standard"].resources, templates["gpu-compute"].resources
    assert (mpi.nodes.min, mpi.nodes.max, mpi.nodes.default) == (1, 128, 4)
    assert (mpi.runtime_minutes.default, mpi.runtime_minutes.max) == (60, 2880)
    assert (gpu.gpus_per_node.min, gpu.gpus_per_node.max, gpu.memory_mb_per_node.default) == (1, 8, 64000)
    assert templates["gpu-compute"].security.require_image_digest
    assert templates["batch-standard"].resources.nodes.max == 1
    assert not templates["batch-standard"].security.network_access
    assert templates["data-processing"].resources.storage_gb.default == 100
    assert templates["interactive-session"].resources.runtime_minutes.max == 480
    # Digests are stable: the canonical form does not depend on dict order or process.
    assert all(len(t.digest()) == 64 for t in templates.values())


def test_each_builtin_renders_for_every_scheduler() -> None:
    params = {
        "mpi-standard": {"command": "hostname"},
        "gpu-compute": {"command": "nvidia-smi"},
        "batch-standard": {"command": "hostname"},
        "data-processing": {"application": "job.py", "engine": "dask"},
        "interactive-session": {"service": "jupyter"},
    }
    for template_id in BUILTIN_IDS:
        extra = {"resources": {"gpus_per_node": 1}} if template_id == "gpu-compute" else {}
        for profile in (LOCAL, SLURM, MOAB):
            text = body(template_id, params[template_id], profile, **extra)
            assert f"workload template {template_id} 1.0.0" in text
            assert text.endswith('exit "$vehpc_rc"\n')
            completed = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
            assert completed.returncode == 0, f"{template_id}/{profile.scheduler}: {completed.stderr}"


def test_mpi_launches_with_srun_on_slurm_and_mpirun_elsewhere() -> None:
    params = {"command": "./solver", "args": "--steps 10"}
    on_slurm = body("mpi-standard", params, SLURM)
    assert "srun --kill-on-bad-exit=1 ./solver --steps 10 || vehpc_rc=$?" in on_slurm
    assert "mpirun" not in on_slurm
    local = body("mpi-standard", params, LOCAL)
    assert 'mpirun -np "${SLURM_NTASKS:-${VIRTENGINE_NTASKS:-1}}" --oversubscribe ./solver' in local
    assert "--oversubscribe" not in body("mpi-standard", params, MOAB), "real clusters place ranks themselves"
    chosen = body("mpi-standard", {**params, "launcher": "mpirun"}, SLURM)
    assert 'mpirun -np "${SLURM_NTASKS' in chosen and "srun " not in chosen
    with pytest.raises(ValidationError, match="srun needs SLURM"):
        body("mpi-standard", {**params, "launcher": "srun"}, LOCAL)


def test_gpu_template_gets_gres_from_the_slurm_script_builder() -> None:
    digest = "sha256:" + "ab" * 32
    params = {"command": "python3", "args": "train.py", "image": f"ghcr.io/acme/train@{digest}"}
    spec = job(
        "gpu-compute", params, resources={"gpus_per_node": 2, "gpu_type": "a100", "memory_mb_per_node": 4096}
    )
    template = builtin_templates()["gpu-compute"]
    text = render(template, check_job(template, spec), spec, SLURM)
    script = render_batch_script(
        plan_submission(
            SubmitRequest(workflow_id="JOB-1", job=spec, body=text),
            name="vehpc-JOB-1",
            cluster_id="c1",
            default_partition="gpu",
        )
    )
    assert "#SBATCH --gres=gpu:a100:2" in script
    assert f"apptainer exec --nv docker://ghcr.io/acme/train@{digest} python3 train.py" in script
    assert "nvidia-smi -L" in script
    # The tenant's body comes after the directive block, so nothing in it can change the #SBATCH lines.
    assert script.index("#SBATCH --gres") < script.index("# ---- job body ----") < script.index("apptainer")


async def test_a_template_for_whole_nodes_asks_every_scheduler_for_them(
    config: Config, tmp_path: Path
) -> None:
    resolver = TemplateResolver()  # built-ins only, no price check
    adapter = LocalAdapter(config.hpc.local, config.local_state_dir, "c1")
    specs = {
        "gpu-compute": job("gpu-compute", {"command": "nvidia-smi"}, resources={"gpus_per_node": 1}),
        "batch-standard": job("batch-standard", {"command": "hostname"}),
    }
    for template_id, spec in specs.items():
        resolved = await resolver(spec, adapter)
        whole = builtin_templates()[template_id].resources.exclusive_nodes
        assert resolved.exclusive is whole
        plan = plan_submission(
            SubmitRequest(workflow_id="JOB-1", job=spec, body=resolved.text, exclusive=resolved.exclusive),
            name="vehpc-JOB-1",
            cluster_id="c1",
            default_partition="debug",
            work_dir="/srv/jobs",
        )
        assert ("#SBATCH --exclusive" in render_batch_script(plan)) is whole, template_id
        assert (render_rest_job(plan)["job"].get("exclusive") == "exclusive") is whole, template_id
        assert ("naccesspolicy=singlejob" in msub_argv(plan)) is whole, template_id
        requirement = render_mws_job(plan, user=None)["requirements"][0]
        assert (requirement.get("nodeAccessPolicy") == "SINGLEJOB") is whole, template_id
    assert builtin_templates()["gpu-compute"].resources.exclusive_nodes  # so both cases above were exercised


def test_data_processing_launchers() -> None:
    dask_slurm = body(
        "data-processing", {"engine": "dask", "application": "etl.py"}, SLURM, resources={"nodes": 3}
    )
    assert "srun --nodes=3 --ntasks-per-node=1 --overlap dask-worker" in dask_slurm
    assert "export DASK_WORKERS=3" in dask_slurm and "python3 etl.py || vehpc_rc=$?" in dask_slurm
    dask_local = body(
        "data-processing", {"engine": "dask", "application": "etl.py"}, LOCAL, resources={"nodes": 2}
    )
    assert "for vehpc_i in $(seq 1 2); do dask-worker" in dask_local
    spark_one = body("data-processing", {"application": "etl.py", "args": "--day 1"}, SLURM)
    assert "spark-submit --executor-memory 768m --master 'local[1]' etl.py --day 1" in spark_one
    spark_many = body(
        "data-processing",
        {"application": "etl.jar", "executor_memory_mb": 2048},
        SLURM,
        resources={"nodes": 4, "cpus_per_task": 8, "memory_mb_per_node": 8192},
    )
    assert "org.apache.spark.deploy.master.Master" in spark_many
    assert (
        "srun --nodes=4 --ntasks-per-node=1 --overlap spark-class org.apache.spark.deploy.worker.Worker"
        in (spark_many)
    )
    assert 'spark-submit --executor-memory 2048m --master "$vehpc_master" etl.jar' in spark_many


def test_interactive_session_publishes_an_endpoint_and_ends_before_walltime() -> None:
    text = body("interactive-session", {"service": "http", "command": "python3 -m http.server {port}"})
    assert 'timeout -s TERM "$vehpc_limit" python3 -m http.server "${SESSION_PORT}" &' in text
    assert 'vehpc_session_file="$PWD/virtengine-session-${VIRTENGINE_JOB_ID:-job}.json"' in text
    jupyter = body("interactive-session", {})
    assert '--port="$SESSION_PORT"' in jupyter and "JUPYTER_TOKEN" in jupyter
    with pytest.raises(ValidationError, match="service http needs a command"):
        body("interactive-session", {"service": "http"})


# ---- hostile values -------------------------------------------------------------------------------------------

HOSTILE = [
    "$(touch pwned1)",
    "`touch pwned2`",
    "; touch pwned3",
    "a' ; touch pwned4; '",
    "&& touch pwned5",
    "$HOME",
]


def test_hostile_parameter_values_reach_the_program_literally(tmp_path: Path) -> None:
    words = " ".join(json.dumps(w) for w in HOSTILE)  # a shell-like command line of the hostile words
    template = WorkloadTemplate.model_validate(custom_document())
    spec = job("bob-echo", {"words": words})
    text = render(template, check_job(template, spec), spec, LOCAL)
    done = subprocess.run(["bash", "-c", text], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == HOSTILE
    assert list(tmp_path.iterdir()) == [], "nothing the values name was run"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"command": "$(reboot)"}, "must be a program name"),
        ({"command": "-rf"}, "must be a program name"),
        ({"command": "echo", "args": "one\ntwo"}, "control characters"),
        ({"command": "echo", "args": "'unbalanced"}, "not a valid command line"),
        ({"command": "echo", "modules": "gcc; rm -rf /"}, "module"),
        ({"command": "echo", "launcher": "ssh"}, "must be one of auto, srun, mpirun"),
        ({"command": "echo", "image": "Ubuntu;latest"}, "not a container image"),
        ({"command": "echo", "color": "red"}, "unknown parameter"),
        ({"command": 7}, "must be a string"),
        ({}, "parameter command is required"),
    ],
)
def test_parameters_are_checked_against_the_schema(params: dict[str, Any], message: str) -> None:
    template = builtin_templates()["mpi-standard"]
    with pytest.raises(ValidationError, match=message):
        check_job(template, job("mpi-standard", params))


def test_schema_bounds_paths_and_image_digests() -> None:
    data = builtin_templates()["data-processing"]
    with pytest.raises(ValidationError, match="executor_memory_mb 100 is below its minimum 256"):
        check_job(data, job("data-processing", {"application": "a.py", "executor_memory_mb": 100}))
    with pytest.raises(ValidationError, match=re.escape("no '..'")):
        check_job(data, job("data-processing", {"application": "../../etc/passwd"}))
    gpu = builtin_templates()["gpu-compute"]
    with pytest.raises(ValidationError, match="pinned by digest"):
        check_job(
            gpu,
            job(
                "gpu-compute",
                {"command": "x", "image": "nvcr.io/nvidia/pytorch:24.01"},
                resources={"gpus_per_node": 1},
            ),
        )


def test_resources_outside_the_templates_bounds_are_all_named() -> None:
    mpi = builtin_templates()["mpi-standard"]
    spec = job(
        "mpi-standard",
        {"command": "x"},
        resources={"nodes": 200, "tasks_per_node": 300, "memory_mb_per_node": 100, "gpus_per_node": 1},
        walltime_seconds=3 * 86400,
    )
    with pytest.raises(ValidationError) as err:
        check_job(mpi, spec)
    message = str(err.value)
    for expected in (
        "template mpi-standard",
        "nodes 200 is outside 1..128",
        "cpus per node 300 is outside 1..256",
        "memory per node 100 MB is outside 256..1048576 MB",
        "GPUs per node 1 is outside 0..0",
        "walltime 4320 min is outside 1..2880 min",
    ):
        assert expected in message
    with pytest.raises(ValidationError, match=re.escape("GPUs per node 0 is outside 1..8")):
        check_job(builtin_templates()["gpu-compute"], job("gpu-compute", {"command": "x"}))
    with pytest.raises(ValidationError, match=re.escape("nodes 2 is outside 1..1")):
        check_job(
            builtin_templates()["batch-standard"],
            job("batch-standard", {"command": "x"}, resources={"nodes": 2}),
        )


def test_template_documents_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        WorkloadTemplate.model_validate(
            custom_document(entrypoint={"launcher": "direct", "command": ["{nope}"]})
        )
    with pytest.raises(ValueError, match="must not start with '-'"):
        WorkloadTemplate.model_validate(custom_document(entrypoint={"launcher": "direct", "command": ["-x"]}))
    with pytest.raises(ValueError, match="needs a pattern"):
        WorkloadTemplate.model_validate(custom_document(parameters={"words": {"type": "string"}}))
    bad_range = custom_document()
    bad_range["resources"]["nodes"] = {"min": 2, "max": 1, "default": 1}
    with pytest.raises(ValueError, match="min <= default <= max"):
        WorkloadTemplate.model_validate(bad_range)


# ---- signatures and governance ------------------------------------------------------------------------------


def test_signature_covers_the_canonical_form_under_its_own_domain() -> None:
    signer = Signer.generate()
    template = WorkloadTemplate.model_validate(custom_document())
    signed = sign_template(template, signer)
    assert signed.verify()
    payload = canonical_bytes(template, TEMPLATE_DOMAIN, exclude=())
    assert payload.startswith(b"virtengine-hpc/workload-template/v1\n{")
    assert json.loads(payload.split(b"\n", 1)[1])["entrypoint"]["command"] == ["printf", "%s\\n", "{words}"]
    modified = signed.model_copy(
        update={
            "template": template.model_copy(
                update={"entrypoint": template.entrypoint.model_copy(update={"command": ("rm", "{words}")})}
            )
        }
    )
    assert not modified.verify()
    other = sign_template(template, Signer.generate())
    assert not signed.model_copy(update={"signature": other.signature}).verify()


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return make_config(tmp_path)


@pytest.fixture
def ledger(config: Config) -> LocalLedger:
    return LocalLedger(config.ledger_path)


def publish(ledger: LocalLedger, signer: Signer, **changes: Any) -> None:
    ledger.register_publisher_key(PUBLISHER, public_key_b64(signer.public_key))
    ledger.publish_template(
        sign_template(WorkloadTemplate.model_validate(custom_document(**changes)), signer)
    )


def rejections(config: Config) -> list[dict[str, Any]]:
    return [e for e in read_events(config.hpc.audit.log_path) if e["event_type"] == "template_rejected"]


async def test_custom_template_usable_only_after_approval(
    config: Config, ledger: LocalLedger, tmp_path: Path
) -> None:
    resolver = TemplateResolver(ledger, AuditLog(config.hpc.audit))
    adapter = LocalAdapter(config.hpc.local, config.local_state_dir, "c1")
    publish(ledger, Signer.generate())
    spec = job("bob-echo", {"words": "hello world"})
    with pytest.raises(ValidationError, match="not approved by governance \\(status pending\\)"):
        await resolver.template_for(spec)
    [event] = rejections(config)
    assert event["category"] == "security" and event["severity"] == 4 and event["job_id"] == "JOB-1"
    assert event["details"]["status"] == "pending"
    record = ledger.approve_template("bob-echo", decided_by="gov-proposal-7")
    assert record.status == "approved" and record.approved_digest == record.digest
    template = await resolver.template_for(spec)
    text = render(template, check_job(template, spec), spec, LOCAL)
    assert "printf '%s\\n' hello world || vehpc_rc=$?" in text
    with pytest.raises(ValidationError, match="offering none has no priced queue"):
        await resolver(spec.model_copy(update={"offering_id": "none"}), adapter)
    ledger.decide_template("bob-echo", "revoked", reason="abuse")
    with pytest.raises(ValidationError, match="status revoked"):
        await resolver.template_for(spec)


async def test_modified_or_forged_templates_are_refused_with_an_audit_event(
    config: Config, ledger: LocalLedger
) -> None:
    resolver = TemplateResolver(ledger, AuditLog(config.hpc.audit))
    publish(ledger, Signer.generate())
    ledger.approve_template("bob-echo")
    spec = job("bob-echo", {"words": "x"})
    # Someone edits the stored template after approval (the command now deletes files).
    with sqlite3.connect(config.ledger_path) as db:
        (data,) = db.execute("SELECT data FROM templates WHERE template_id = 'bob-echo'").fetchone()
        stored = json.loads(data)
        stored["signed"]["template"]["entrypoint"]["command"] = ["rm", "-rf", "{words}"]
        db.execute("UPDATE templates SET data = ?", (json.dumps(stored),))
    with pytest.raises(ValidationError, match="signature does not verify"):
        await resolver.template_for(spec)
    # Re-signed by an attacker's key, digest fixed up too: still not what governance approved.
    attacker = Signer.generate()
    forged_template = WorkloadTemplate.model_validate(stored["signed"]["template"])
    forged = sign_template(forged_template, attacker)
    stored.update(signed=forged.model_dump(mode="json"), digest=forged_template.digest())
    with sqlite3.connect(config.ledger_path) as db:
        db.execute("UPDATE templates SET data = ?", (json.dumps(stored),))
    with pytest.raises(ValidationError, match="not the content governance approved"):
        await resolver.template_for(spec)
    assert len(rejections(config)) == 2


def test_ledger_refuses_bad_publications(ledger: LocalLedger) -> None:
    bob, mallory = Signer.generate(), Signer.generate()
    template = WorkloadTemplate.model_validate(custom_document())
    with pytest.raises(SecurityError, match="not a registered key of publisher"):
        ledger.publish_template(sign_template(template, bob))
    ledger.register_publisher_key(PUBLISHER, public_key_b64(bob.public_key))
    with pytest.raises(SecurityError, match="not a registered key"):
        ledger.publish_template(sign_template(template, mallory))  # forged: claims bob, signed by mallory
    bad = sign_template(template, bob).model_copy(
        update={"signature": sign_template(template, mallory).signature}
    )
    with pytest.raises(SecurityError, match="signature does not verify"):
        ledger.publish_template(bad)
    first = ledger.publish_template(sign_template(template, bob))
    assert ledger.publish_template(sign_template(template, bob)).digest == first.digest, (
        "same bytes: idempotent"
    )
    changed = template.model_copy(update={"description": "other"})
    with pytest.raises(ChainError, match="already published with other content"):
        ledger.publish_template(sign_template(changed, bob))
    builtin = WorkloadTemplate.model_validate(custom_document(template_id="mpi-standard"))
    with pytest.raises(ChainError, match="built-in"):
        ledger.publish_template(sign_template(builtin, bob))
    ledger.register_publisher_key("virtengine1mallory0x", public_key_b64(mallory.public_key))
    squat = WorkloadTemplate.model_validate(
        custom_document(publisher="virtengine1mallory0x", version="2.0.0")
    )
    with pytest.raises(SecurityError, match="belongs to publisher"):
        ledger.publish_template(sign_template(squat, mallory))
    with pytest.raises(ChainError, match="cannot become revoked"):
        ledger.decide_template("bob-echo", "revoked")
    # A new version waits for approval while the approved one stays in use.
    ledger.approve_template("bob-echo")
    v2 = template.model_copy(update={"version": "1.1.0"})
    ledger.publish_template(sign_template(v2, bob))
    in_use = ledger.template("bob-echo")
    assert in_use is not None and (in_use.version, in_use.status) == ("1.0.0", "approved")
    assert [r.status for r in ledger.templates()] == ["approved", "pending"]


# ---- the commands ---------------------------------------------------------------------------------------------


def test_cli_publish_approve_verify(
    config: Config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json(exclude_defaults=True))
    LocalLedger(config.ledger_path)
    key = tmp_path / "bob.key"
    write_private_key(key)
    doc = tmp_path / "echo.yaml"
    doc.write_text(yaml.safe_dump(custom_document()))
    signed = tmp_path / "echo.signed.json"

    def run(*argv: str) -> tuple[int, str]:
        code = cli_main(["--config", str(config_file), *argv])
        out = capsys.readouterr()
        return code, out.out + out.err

    assert run("templates", "publish", str(doc), "--key-file", str(key))[0] == 2, "key not registered yet"
    assert run("templates", "register-publisher", PUBLISHER, "--key-file", str(key))[0] == 0
    code, out = run("templates", "publish", str(doc), "--key-file", str(key), "-o", str(signed))
    assert code == 0 and "pending" in out
    code, out = run("templates", "verify", "bob-echo")
    assert code == 1 and "not approved" in out
    assert run("templates", "approve", "bob-echo", "--by", "gov-7")[0] == 0
    code, out = run("templates", "verify", "bob-echo")
    assert code == 0 and "usable" in out
    code, out = run("templates", "verify", str(signed))
    assert code == 0 and "signature: valid" in out and "key registered for" in out
    tampered = json.loads(signed.read_text())
    tampered["template"]["entrypoint"]["command"] = ["rm", "{words}"]
    signed.write_text(json.dumps(tampered))
    code, out = run("templates", "verify", str(signed))
    assert code == 1 and "INVALID" in out
    code, out = run("templates", "list", "--type", "custom")
    assert code == 0 and "bob-echo" in out and "mpi-standard" not in out
    code, out = run("templates", "list", "--type", "gpu")
    assert "gpu-compute" in out and "bob-echo" not in out
    code, out = run("templates", "show", "mpi-standard")
    assert code == 0 and "template_id: mpi-standard" in out and "builtin: True" in out
    code, out = run(
        "templates", "render", "gpu-compute", "--param", "command=nvidia-smi", "--gpus", "2", "--full"
    )
    assert code == 0 and "#SBATCH --gres=gpu:2" in out


# ---- parameter patterns: linear time ------------------------------------------------------------------------

NESTED = "([a-z0-9]+)+"
"""Catastrophic for a backtracking engine: ``a`` * n + ``!`` takes about 2^n steps in Python's ``re``."""


@pytest.mark.timeout(60)
async def test_a_nested_quantifier_pattern_refuses_a_hostile_value_at_once(
    config: Config, ledger: LocalLedger
) -> None:
    """40 characters would keep Python's ``re`` (and the worker's event loop) busy for hours; RE2 answers at once
    and the tenant gets the ordinary refusal."""
    resolver = TemplateResolver(ledger, AuditLog(config.hpc.audit))
    publish(
        ledger,
        Signer.generate(),
        entrypoint={"launcher": "direct", "command": ["printf", "%s\\n", "{name}"]},
        parameters={"name": {"type": "string", "required": True, "pattern": NESTED}},
    )
    ledger.approve_template("bob-echo")
    template = await resolver.template_for(job("bob-echo", {"name": "ok"}))
    assert check_job(template, job("bob-echo", {"name": "run42"}))  # the pattern still does its job
    hostile = "a" * 40 + "!"
    with pytest.raises(ValidationError, match=re.escape(f"parameter name '{hostile}' must match {NESTED}")):
        check_job(template, job("bob-echo", {"name": hostile}))


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", "invalid escape sequence"),
        ("(?=a)a", "invalid perl operator"),
        ("a{2000}", "invalid repetition size"),
    ],
)
def test_patterns_that_need_backtracking_are_refused_when_the_template_is_read(
    pattern: str, reason: str
) -> None:
    document = custom_document(parameters={"words": {"type": "string", "pattern": pattern}})
    document["entrypoint"] = {"launcher": "direct", "command": ["printf", "%s\\n", "{words}"]}
    with pytest.raises(ValueError, match=f"pattern .* is refused: {reason}.*linear time by RE2"):
        WorkloadTemplate.model_validate(document)


def test_session_reads_only_the_jobs_own_endpoint_file_never_through_a_link(
    config: Config, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The provider runs ``templates session`` and hands the tenant what it prints. The tenant controls the job's
    working directory and what is in it: a link there named like the endpoint file made the provider's command
    read, and print, any JSON file the provider may read."""
    config_file = tmp_path / "config.json"
    config_file.write_text(config.model_dump_json(exclude_defaults=True))
    ledger = LocalLedger(config.ledger_path)
    secret = tmp_path / "provider-only.json"
    secret.write_text(json.dumps({"credential": "provider-only-value"}))
    workdir = tmp_path / "tenant-dir"
    workdir.mkdir()
    spec = {
        "tenant": "virtengine1tenant0session",
        "provider": config.provider.address,
        "offering_id": f"{config.hpc.cluster_id}-standard",
        "template_id": "interactive-session",
        "working_directory": str(workdir),
    }
    job_id = ledger.submit_job(spec, escrow=0)
    (workdir / f"virtengine-session-{job_id}.json").symlink_to(secret)

    code = cli_main(["--config", str(config_file), "templates", "session", job_id])

    out = capsys.readouterr()
    assert "provider-only-value" not in out.out + out.err
    assert code == 2 and "not a regular file of its own" in out.err, out.err
