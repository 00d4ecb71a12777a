"""``virtengine-hpc templates``: workload templates — the five built-ins and signed custom ones on the ledger.

Anyone lists, shows, renders and verifies templates; a publisher signs and publishes one (``publish FILE
--key-file K``, the key registered first with ``register-publisher``); governance approves, rejects or revokes
(``approve``/``reject``/``revoke``, recorded on the ledger); ``session JOB`` prints the endpoint of a running
interactive session. See ``docs/templates.md``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from activities.chain.local_ledger import LocalLedger
from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.cli.ledger import _pairs, _param_value, open_ledger
from virtengine_hpc.errors import ChainError, SecurityError, ValidationError
from virtengine_hpc.models import JobSpec, Resources
from virtengine_hpc.signing import Signer, public_key_b64
from virtengine_hpc.templates import (
    LaunchProfile,
    SignedTemplate,
    TemplateRecord,
    WorkloadTemplate,
    builtin_templates,
    check_job,
    render,
    sign_template,
)
from virtengine_hpc.templates.render import SESSION_FILE

TYPES = ("mpi", "gpu", "batch", "data_processing", "interactive", "custom")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "templates",
        help="workload templates: list, show, render, publish, approve, verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="templates_command", metavar="COMMAND", required=True)

    p = sub.add_parser("list", help="built-in and published templates")
    p.add_argument("--type", choices=TYPES, help="only templates of this type (gpu, mpi, ...)")
    p.add_argument("--status", choices=("approved", "pending", "rejected", "revoked"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="a template's document (YAML), status and digest")
    p.add_argument("template_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("render", help="the batch-script body a job would run (validated like a real job)")
    p.add_argument("template_id")
    p.add_argument("--param", action="append", default=[], metavar="K=V")
    p.add_argument("--scheduler", default="slurm", choices=("slurm", "local", "moab", "ood"))
    p.add_argument("--nodes", type=int)
    p.add_argument("--tasks-per-node", type=int)
    p.add_argument("--cpus", type=int, help="CPUs per task")
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpu-type")
    p.add_argument("--walltime-minutes", type=int)
    p.add_argument(
        "--full", action="store_true", help="slurm: the whole sbatch script with its #SBATCH lines"
    )
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("register-publisher", help="register a publisher's Ed25519 public key (governance)")
    p.add_argument("publisher")
    keys = p.add_mutually_exclusive_group(required=True)
    keys.add_argument("--public-key", metavar="B64")
    keys.add_argument("--key-file", metavar="PEM")
    p.set_defaults(func=cmd_register_publisher)

    p = sub.add_parser("publish", help="sign a template file (YAML/JSON) and publish it as pending")
    p.add_argument("file", help="a template document, or an already signed one")
    p.add_argument("--key-file", help="the publisher's private key (0600); not needed for a signed file")
    p.add_argument("--output", "-o", help="also write the signed document here")
    p.add_argument("--sign-only", action="store_true", help="sign (to --output or stdout), do not publish")
    p.set_defaults(func=cmd_publish)

    for name, status, what in (
        ("approve", "approved", "approve a published version (governance)"),
        ("reject", "rejected", "reject a pending version (governance)"),
        ("revoke", "revoked", "revoke an approved version (governance)"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("template_id")
        p.add_argument("--version", help="default: the latest published")
        p.add_argument("--by", default="governance", help="who decides (recorded)")
        p.add_argument("--reason", default="")
        p.set_defaults(func=cmd_decide, status=status)

    p = sub.add_parser("verify", help="check a signed template file, or a template id on the ledger")
    p.add_argument("target", help="FILE (signed document) or template id")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("session", help="the endpoint of a running interactive-session job")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_session)


# ---- helpers -----------------------------------------------------------------------------------------------


def _maybe_ledger(args: argparse.Namespace) -> LocalLedger | None:
    config = config_from_args(args)
    return LocalLedger.from_config(config) if config.ledger_path.exists() else None


def _load_document(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValidationError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError(f"{path}: must hold a mapping (a template document)")
    return data


def _validated(model: type[WorkloadTemplate] | type[SignedTemplate], data: dict[str, Any], path: str) -> Any:
    try:
        return model.model_validate(data)
    except ValueError as exc:
        raise ValidationError(f"{path}: not a valid {model.__name__}: {exc}") from None


def _find(args: argparse.Namespace, template_id: str) -> tuple[WorkloadTemplate, TemplateRecord | None]:
    builtin = builtin_templates().get(template_id)
    if builtin is not None:
        return builtin, None
    ledger = _maybe_ledger(args)
    record = ledger.template(template_id) if ledger else None
    if record is None:
        raise ValidationError(f"unknown template {template_id!r}")
    return record.signed.template, record


# ---- commands ----------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = [
        {
            "template_id": t.template_id,
            "type": t.type,
            "version": t.version,
            "status": "approved",
            "publisher": t.publisher,
            "builtin": True,
            "description": t.description,
        }
        for t in builtin_templates().values()
    ]
    ledger = _maybe_ledger(args)
    for record in ledger.templates() if ledger else []:
        t = record.signed.template
        rows.append(
            {
                "template_id": t.template_id,
                "type": t.type,
                "version": t.version,
                "status": record.status,
                "publisher": t.publisher,
                "builtin": False,
                "description": t.description,
            }
        )
    rows = [
        r
        for r in rows
        if (args.type is None or r["type"] == args.type)
        and (args.status is None or r["status"] == args.status)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("ID", "TYPE", "VERSION", "STATUS", "PUBLISHER", "DESCRIPTION")]
    table += [
        (r["template_id"], r["type"], r["version"], r["status"], r["publisher"], r["description"][:60])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    template, record = _find(args, args.template_id)
    info: dict[str, Any] = {
        "builtin": record is None,
        "status": "approved" if record is None else record.status,
        "digest": template.digest(),
    }
    if record is not None:
        info.update(
            key_id=record.signed.key_id,
            approved_digest=record.approved_digest,
            decided_by=record.decided_by,
            published_height=record.published_height,
        )
    document = template.model_dump(mode="json", exclude_defaults=False)
    if args.json:
        print(json.dumps({"template": document, **info}, indent=2))
        return 0
    print(yaml.safe_dump(document, sort_keys=False, width=110).rstrip())
    print("# " + ", ".join(f"{k}: {v}" for k, v in info.items() if v is not None))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    template, record = _find(args, args.template_id)
    if record is not None and record.status != "approved":
        print(f"warning: template {args.template_id} is {record.status}; jobs cannot use it", file=sys.stderr)
    bounds = template.resources
    res = Resources(
        nodes=args.nodes or bounds.nodes.default,
        tasks_per_node=args.tasks_per_node or 1,
        cpus_per_task=args.cpus or max(1, bounds.cpus_per_node.default // (args.tasks_per_node or 1)),
        memory_mb_per_node=args.memory_mb or bounds.memory_mb_per_node.default,
        gpus_per_node=bounds.gpus_per_node.default if args.gpus is None else args.gpus,
        gpu_type=args.gpu_type,
        storage_gb=bounds.storage_gb.default,
    )
    params = {k: _param_value(v) for k, v in _pairs(args.param, "--param").items()}
    job = JobSpec(
        job_id="JOB-render",
        tenant="tenant",
        provider="provider",
        offering_id="offering",
        template_id=template.template_id,
        template_parameters=params,
        resources=res,
        walltime_seconds=60 * (args.walltime_minutes or bounds.runtime_minutes.default),
    )
    values = check_job(template, job)
    launcher = "srun" if args.scheduler == "slurm" else "mpirun"
    body = render(template, values, job, LaunchProfile.of(args.scheduler, launcher))
    if args.full and args.scheduler == "slurm":
        from activities.schedulers.base import SubmitRequest
        from activities.schedulers.slurm.script import plan_submission, render_batch_script
        from virtengine_hpc.markers import bare_name

        request = SubmitRequest(workflow_id=job.job_id, job=job, body=body)
        # A preview: the real job name also carries the workflow's adoption marker (``.<tag>``).
        name = bare_name(job.job_id)
        body = render_batch_script(
            plan_submission(request, name=name, cluster_id="cluster", default_partition="default")
        )
    sys.stdout.write(body)
    return 0


def cmd_register_publisher(args: argparse.Namespace) -> int:
    from virtengine_hpc.cli.usage import load_public_key

    public = args.public_key or public_key_b64(load_public_key(args.key_file))
    kid = open_ledger(args).register_publisher_key(args.publisher, public)
    print(f"key {kid} registered for publisher {args.publisher}")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    data = _load_document(args.file)
    if "signature" in data:
        signed: SignedTemplate = _validated(SignedTemplate, data, args.file)
        if not signed.verify():
            raise SecurityError(f"{args.file}: the signature does not verify")
    else:
        if not args.key_file:
            raise ValidationError("an unsigned template needs --key-file (the publisher's private key)")
        template: WorkloadTemplate = _validated(WorkloadTemplate, data, args.file)
        signed = sign_template(template, Signer.from_file(args.key_file))
    document = json.dumps(signed.model_dump(mode="json"), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(document, encoding="utf-8")
    if args.sign_only:
        if not args.output:
            sys.stdout.write(document)
        return 0
    record = open_ledger(args).publish_template(signed)
    t = record.signed.template
    print(
        f"published {t.template_id} {t.version} by {t.publisher} (key {record.signed.key_id[:16]}..., "
        f"digest {record.digest[:16]}...): {record.status}"
    )
    if record.status == "pending":
        print(f"jobs can use it once governance approves: virtengine-hpc templates approve {t.template_id}")
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    record = open_ledger(args).decide_template(
        args.template_id, args.status, version=args.version, decided_by=args.by, reason=args.reason
    )
    print(f"{record.template_id} {record.version}: {record.status} by {record.decided_by}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from activities.templates import template_problem

    target = args.target
    if Path(target).is_file() or target == "-":
        signed: SignedTemplate = _validated(SignedTemplate, _load_document(target), target)
        t = signed.template
        ok = signed.verify()
        print(f"{target}: {t.template_id} {t.version} by {t.publisher}, key {signed.key_id[:16]}...")
        print(f"signature: {'valid' if ok else 'INVALID'}; digest {t.digest()}")
        ledger = _maybe_ledger(args)
        if ok and ledger is not None:
            known = signed.key_id in ledger.publisher_keys(t.publisher)
            print(f"key registered for {t.publisher}: {'yes' if known else 'NO'}")
            ok = known
        return 0 if ok else 1
    if target in builtin_templates():
        print(f"{target}: built-in (ships with this release), digest {builtin_templates()[target].digest()}")
        return 0
    ledger = _maybe_ledger(args)
    record = ledger.template(target) if ledger else None
    if record is None:
        raise ChainError(f"unknown template {target!r}")
    problem = template_problem(target, record)
    print(f"{target} {record.version}: {'usable' if problem is None else 'REFUSED: ' + problem}")
    return 0 if problem is None else 1


def _read_endpoint(path: Path) -> Any:
    """The session's endpoint file, opened without following a link: the directory is the tenant's (its job's
    working directory), and a link named like the file would have the provider's command read, and print, any
    file the provider may read. A link, or anything but a regular file, is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValidationError(
                f"{path}: not a regular file of its own (a symbolic link): refused"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValidationError(f"{path}: not a regular file of its own: refused")
        return json.loads(f.read(_ENDPOINT_MAX).decode("utf-8"))


_ENDPOINT_MAX = 64 * 1024
"""Bytes read of an endpoint file at most (it holds one small JSON object)."""


def cmd_session(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    job = open_ledger(args).job(args.job_id)
    if job is None:
        raise ChainError(f"unknown job {args.job_id}")
    if job.raw_spec.get("template_id") != "interactive-session" and not job.scheduler_job_id:
        raise ValidationError(f"job {args.job_id} is not a running session")
    workdir = job.raw_spec.get("working_directory")
    if not isinstance(workdir, str) or not workdir:
        if config.hpc.scheduler_type == "local" and job.scheduler_job_id:
            from activities.schedulers.local import LocalAdapter

            adapter = LocalAdapter(config.hpc.local, config.local_state_dir, config.hpc.cluster_id)
            workdir = str(adapter.work_dir(job.scheduler_job_id))
        elif config.hpc.scheduler_type == "slurm" and config.hpc.slurm.work_dir:
            from activities.tenant_accounts import TenantAccounts

            account = TenantAccounts.from_config(config).assigned(job.tenant)  # None: no per-tenant accounts
            workdir = str(config.hpc.slurm.work_dir / account if account else config.hpc.slurm.work_dir)
        else:
            raise ValidationError(f"job {args.job_id}: cannot tell its working directory")
    path = Path(workdir) / SESSION_FILE.replace("${VIRTENGINE_JOB_ID:-job}", job.job_id)
    try:
        endpoint = _read_endpoint(path)
    except FileNotFoundError:
        print(f"{args.job_id}: no endpoint yet ({job.state.value}); the session writes {path} once it serves")
        return 1
    except (OSError, ValueError) as exc:
        raise ValidationError(f"{path}: {exc}") from None
    print_json(endpoint)
    return 0
