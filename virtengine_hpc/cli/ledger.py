"""``virtengine-hpc ledger``: the embedded chain (LocalLedger) from the command line.

The operator sets it up (``init``, ``fund``, ``decide``, ``cluster-state``, ``register-key``, ``refund``), a
tenant uses it as it would use the chain (``submit-job``, ``cancel``, ``balance``), and anyone inspects it
(``jobs``, ``show``, ``clusters``, ``queues``, ``settlement``, ``height``, ``keys``). The file is the config's
``chain.ledger_path`` (default ``<hpc.job_service.state_store_path>/ledger.db``). See ``docs/ledger.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from activities.chain.local_ledger import UNIT, ChargeBreakdown, JobCharge, LocalLedger
from virtengine_hpc.cli.common import config_from_args, print_json
from virtengine_hpc.config import Config, Secrets, parse_duration
from virtengine_hpc.errors import ChainError, ValidationError
from virtengine_hpc.models import Cluster, JobSpec, Partition, PricedQueue, Pricing, Resources
from virtengine_hpc.signing import load_private_key, public_key_b64, write_private_key
from virtengine_hpc.states import JobState

# Prices of the default offering that ``ledger init`` registers (chain units per hour, or per GB-hour).
DEFAULT_PRICING = Pricing(
    node_hour=Decimal("1"),
    core_hour=Decimal("0.05"),
    gpu_hour=Decimal("2"),
    memory_gb_hour=Decimal("0.01"),
    storage_gb_hour=Decimal("0.001"),
    minimum_charge=Decimal("0.01"),
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ledger",
        help="the embedded chain (LocalLedger): jobs, escrow, decisions, settlement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="ledger_command", metavar="COMMAND", required=True)
    _register_admin(sub)
    _register_tenant(sub)
    _register_inspection(sub)


def _register_admin(sub: Any) -> None:
    p = sub.add_parser("init", help="create the ledger and register this provider's cluster, queue and key")
    p.add_argument("--no-defaults", action="store_true", help="only create the file")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the default cluster (default 1)")
    p.add_argument("--partition", help="partition of the default queue (default: the scheduler's default)")
    p.add_argument("--offering", help="id of the default offering (default <cluster_id>-standard)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--public-key", metavar="B64", help="provider usage-signing public key (raw, base64)")
    keys.add_argument("--key-file", metavar="PEM", help="provider key file (public or private PEM)")
    keys.add_argument(
        "--generate-key", metavar="PATH", help="create a new private signing key here (0600) unless it exists"
    )
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("fund", help="credit an account (a faucet for tenants)")
    p.add_argument("account")
    p.add_argument("amount")
    p.set_defaults(func=cmd_fund)

    p = sub.add_parser("decide", help="record a scheduling decision for a job")
    p.add_argument("job_id")
    p.add_argument("--cluster", required=True)
    p.add_argument("--fallback", metavar="REASON", help="mark the decision as a fallback, with its reason")
    p.add_argument("--height", type=int, help="block height (an old one makes a stale decision)")
    p.add_argument("--reason", default="recorded by operator", help="decision reason")
    p.set_defaults(func=cmd_decide)

    p = sub.add_parser("cluster-state", help="set a cluster's state and optionally its free nodes")
    p.add_argument("cluster_id")
    p.add_argument("state", choices=["pending", "active", "draining", "offline", "deregistered"])
    p.add_argument("--available-nodes", type=int)
    p.set_defaults(func=cmd_cluster_state)

    p = sub.add_parser("register-key", help="register a provider's usage-signing public key")
    p.add_argument("provider")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--public-key", metavar="B64")
    group.add_argument("--key-file", metavar="PEM")
    p.set_defaults(func=cmd_register_key)

    p = sub.add_parser("refund", help="refund the escrow of a finished job that has no usage records")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_refund)


def _register_tenant(sub: Any) -> None:
    p = sub.add_parser(
        "submit-job",
        help="submit a job as a tenant (escrows --max-price)",
        description="Submit a job as a tenant would on chain. The ledger stores the spec as given; the "
        "provider validates it when it picks the job up. Prints the job id.",
    )
    p.add_argument("--tenant", required=True, help="tenant account (pays the escrow)")
    p.add_argument("--provider", help="provider account (default: the config's provider.address)")
    p.add_argument("--offering", help="offering id (default <cluster_id>-standard from ledger init)")
    p.add_argument("--cluster", help="cluster the job asks for")
    p.add_argument("--name", help="job name")
    body = p.add_mutually_exclusive_group()
    body.add_argument("--script-file", metavar="F", help="batch script ('-' reads stdin)")
    body.add_argument("--template", metavar="ID", help="workload template id")
    p.add_argument("--param", action="append", default=[], metavar="K=V", help="template parameter")
    p.add_argument("--nodes", type=int)
    p.add_argument("--tasks-per-node", type=int)
    p.add_argument("--cpus", type=int, help="CPU cores per task")
    p.add_argument("--memory-mb", type=int, help="memory per node in MiB")
    p.add_argument("--gpus", type=int, help="GPUs per node")
    p.add_argument("--gpu-type")
    p.add_argument("--walltime", help="maximum run time, e.g. 30m, 1h, 1h30m")
    p.add_argument("--partition")
    p.add_argument("--workdir", help="working directory (absolute path)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment variable")
    p.add_argument("--max-price", default="0", help="budget to escrow (default 0)")
    p.add_argument("--job-id", help="choose the job id (default JOB-<n>)")
    p.add_argument("--spec-file", metavar="JSON", help="start from this raw spec (flags override its fields)")
    p.set_defaults(func=cmd_submit_job)

    p = sub.add_parser("cancel", help="ask the provider to cancel a job (as its tenant)")
    p.add_argument("job_id")
    p.add_argument("--tenant", help="check that the job belongs to this tenant")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("balance", help="an account's balance")
    p.add_argument("account")
    p.set_defaults(func=cmd_balance)


def _register_inspection(sub: Any) -> None:
    p = sub.add_parser("jobs", help="list jobs")
    p.add_argument("--state", choices=[s.value for s in JobState])
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("show", help="everything about one job (JSON)")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("clusters", help="registered clusters")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_clusters)

    p = sub.add_parser("queues", help="priced queues (offerings)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_queues)

    p = sub.add_parser("settlement", help="a job's settlement (JSON); exit 1 if not settled")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_settlement)

    p = sub.add_parser("height", help="the current block height")
    p.set_defaults(func=cmd_height)

    p = sub.add_parser(
        "keys",
        help="registered usage-signing public keys (raw Ed25519, base64: what a verifier needs)",
        description="Every registered usage-signing key: provider, key id (hex SHA-256 of the raw key), the raw "
        "32-byte public key in base64 (the form docs/usage-records.md's verifier takes) and when it was "
        "registered. --quiet prints only the base64 keys, one per line.",
    )
    p.add_argument("--provider", help="only this provider's keys")
    p.add_argument("--key-id", metavar="HEX", help="only the key with this id (a record's key_id)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true")
    group.add_argument("--quiet", "-q", action="store_true", help="only the base64 public keys")
    p.set_defaults(func=cmd_keys)
    _register_pricing(sub)


def _register_pricing(sub: Any) -> None:
    p = sub.add_parser(
        "charges", help="what a tenant's jobs cost (escrow, charged, refunded); --job itemizes one"
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--job", dest="job_id", help="itemize this job's charge (usage x prices, minimum, cap)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_charges)

    p = sub.add_parser("earnings", help="what a provider earned, per job and in total")
    p.add_argument("--provider", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_earnings)

    p = sub.add_parser(
        "quote", help="the budget (max_price) a job needs at an offering: allocation x walltime"
    )
    p.add_argument("--offering", help="default: <cluster_id>-standard")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1)
    p.add_argument("--cpus", type=int, default=1, help="CPUs per task")
    p.add_argument("--memory-mb", type=int, default=1024, help="memory per node (MiB)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    p.add_argument("--storage-gb", type=int, default=0)
    p.add_argument("--walltime", default="1h")
    p.set_defaults(func=cmd_quote)


# ---- helpers -----------------------------------------------------------------------------------------------


def open_ledger(args: argparse.Namespace, *, create: bool = False) -> LocalLedger:
    """The ledger the config points at; refuses to create one implicitly (a typo'd path would start a new
    chain)."""
    config = config_from_args(args)
    if not create and not config.ledger_path.exists():
        raise ChainError(f"no ledger at {config.ledger_path}; create it with `virtengine-hpc ledger init`")
    return LocalLedger.from_config(config)


def default_offering(config: Config) -> str:
    return f"{config.hpc.cluster_id}-standard"


def _money(amount: Decimal) -> str:
    return format(amount.quantize(UNIT), "f")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValidationError(f"{what} {item!r} must look like KEY=VALUE")
        out[key] = value
    return out


def _param_value(text: str) -> str | int | bool:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lstrip("-").isdigit():
        return int(text)
    return text


def provider_public_key(args: argparse.Namespace) -> str | None:
    """The base64 public key given by ``--public-key``/``--key-file``/``--generate-key`` or, failing those,
    derived from ``PROVIDER_SIGNING_KEY_PATH``; ``None`` if there is none."""
    from virtengine_hpc.cli.usage import load_public_key

    if getattr(args, "public_key", None):
        return str(args.public_key)
    if getattr(args, "key_file", None):
        return public_key_b64(load_public_key(args.key_file))
    generate = getattr(args, "generate_key", None)
    if generate:
        path = Path(generate)
        key = load_private_key(path) if path.exists() else write_private_key(path)
        return public_key_b64(key.public_key())
    env_path = Secrets.from_env().provider_signing_key_path
    if env_path is not None and env_path.exists():
        return public_key_b64(load_private_key(env_path).public_key())
    return None


# ---- commands ----------------------------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    ledger = open_ledger(args, create=True)
    print(f"ledger: {ledger.path} (block time {ledger.seconds_per_block:g} s, height {ledger.height()})")
    if args.no_defaults:
        return 0
    provider = config.provider.address
    cluster_id = config.hpc.cluster_id
    if ledger.cluster(cluster_id) is None:
        partition = args.partition or _default_partition(config)
        max_runtime = max(60, int(config.hpc.job_service.job_timeout_default.total_seconds()))
        ledger.register_cluster(
            Cluster(
                cluster_id=cluster_id,
                provider=provider,
                name=cluster_id[:64],
                scheduler_type=config.hpc.scheduler_type,
                partitions=(
                    Partition(
                        name=partition,
                        nodes=args.nodes,
                        max_nodes=max(1, args.nodes),
                        max_runtime_seconds=max_runtime,
                        cpus_per_node=os.cpu_count() or 1,
                    ),
                ),
                total_nodes=args.nodes,
                available_nodes=args.nodes,
            )
        )
        print(f"cluster: {cluster_id} (provider {provider}, {args.nodes} node(s), partition {partition})")
    offering = args.offering or default_offering(config)
    if ledger.queue(offering) is None:
        cluster = ledger.cluster(cluster_id)
        part = cluster.partition(None) if cluster else None
        ledger.add_queue(
            PricedQueue(
                offering_id=offering,
                cluster_id=cluster_id,
                partition=args.partition or (part.name if part else _default_partition(config)),
                pricing=DEFAULT_PRICING,
                max_duration_seconds=part.max_runtime_seconds if part else 86400,
            )
        )
        print(f"queue: {offering} on {cluster_id}")
    public = provider_public_key(args)
    if public is None:
        print(
            "key: none registered (pass --generate-key PATH, --key-file or --public-key, or set "
            "PROVIDER_SIGNING_KEY_PATH); usage records are refused until a key is registered"
        )
    else:
        kid = ledger.register_provider_key(provider, public)
        print(f"key: {kid[:16]}... registered for {provider}")
    return 0


def _default_partition(config: Config) -> str:
    scheduler = config.hpc.scheduler_type
    if scheduler == "slurm":
        return config.hpc.slurm.default_partition
    if scheduler == "moab":
        return config.hpc.moab.default_queue
    return "local" if scheduler == "local" else "default"


def cmd_fund(args: argparse.Namespace) -> int:
    balance = open_ledger(args).fund(args.account, args.amount)
    print(f"{args.account}: {_money(balance)}")
    return 0


def cmd_balance(args: argparse.Namespace) -> int:
    print(f"{args.account}: {_money(open_ledger(args).balance(args.account))}")
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    decision = open_ledger(args).create_decision(
        args.job_id,
        args.cluster,
        is_fallback=args.fallback is not None,
        fallback_reason=args.fallback,
        decision_reason=args.reason,
        block_height=args.height,
    )
    print_json(decision)
    return 0


def cmd_cluster_state(args: argparse.Namespace) -> int:
    print_json(
        open_ledger(args).set_cluster_state(args.cluster_id, args.state, available_nodes=args.available_nodes)
    )
    return 0


def cmd_register_key(args: argparse.Namespace) -> int:
    public = provider_public_key(args)
    assert public is not None  # one of the two options is required
    kid = open_ledger(args).register_provider_key(args.provider, public)
    print(f"key {kid} registered for {args.provider}")
    return 0


def cmd_refund(args: argparse.Namespace) -> int:
    print_json(open_ledger(args).refund_unstarted(args.job_id))
    return 0


def build_raw_spec(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    """The raw job spec a tenant's flags describe (not validated here: the provider does that)."""
    raw: dict[str, Any] = {}
    if args.spec_file:
        try:
            loaded = json.loads(Path(args.spec_file).read_text())
        except (OSError, ValueError) as exc:
            raise ValidationError(f"--spec-file {args.spec_file}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValidationError(f"--spec-file {args.spec_file}: must hold a JSON object")
        raw.update(loaded)
    raw["tenant"] = args.tenant
    raw["provider"] = args.provider or raw.get("provider") or config.provider.address
    raw["offering_id"] = args.offering or raw.get("offering_id") or default_offering(config)
    optional = {
        "job_id": args.job_id,
        "cluster_id": args.cluster,
        "name": args.name,
        "partition": args.partition,
    }
    raw.update({key: value for key, value in optional.items() if value is not None})
    if args.workdir:
        raw["working_directory"] = args.workdir
    if args.script_file:
        try:
            raw["script"] = (
                sys.stdin.read() if args.script_file == "-" else Path(args.script_file).read_text()
            )
        except (OSError, UnicodeDecodeError) as exc:
            raise ValidationError(f"--script-file {args.script_file}: {exc}") from None
    if args.template:
        raw["template_id"] = args.template
    if args.param:
        raw["template_parameters"] = {k: _param_value(v) for k, v in _pairs(args.param, "--param").items()}
    if args.env:
        raw["environment"] = _pairs(args.env, "--env")
    resources = dict(raw.get("resources") or {})
    fields = {
        "nodes": args.nodes,
        "tasks_per_node": args.tasks_per_node,
        "cpus_per_task": args.cpus,
        "memory_mb_per_node": args.memory_mb,
        "gpus_per_node": args.gpus,
        "gpu_type": args.gpu_type,
    }
    resources.update({key: value for key, value in fields.items() if value is not None})
    if resources:
        raw["resources"] = resources
    if args.walltime:
        try:
            raw["walltime_seconds"] = int(parse_duration(args.walltime).total_seconds())
        except ValueError as exc:
            raise ValidationError(f"--walltime: {exc}") from None
    if args.max_price != "0" or "max_price" not in raw:
        raw["max_price"] = args.max_price
    return raw


def cmd_submit_job(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    raw = build_raw_spec(args, config)
    ledger = open_ledger(args)
    _apply_template_defaults(raw, ledger)
    _warn_budget(raw, ledger)
    print(ledger.submit_job(raw))
    return 0


def _apply_template_defaults(raw: dict[str, Any], ledger: LocalLedger) -> None:
    """Fill the resources and walltime a template job leaves out with the template's defaults (tenant side)."""
    from virtengine_hpc.templates import builtin_templates

    template_id = raw.get("template_id")
    if not isinstance(template_id, str):
        return
    template = builtin_templates().get(template_id)
    if template is None:
        record = ledger.template(template_id)
        template = record.signed.template if record else None
    if template is None:
        return
    bounds = template.resources
    resources = dict(raw.get("resources") or {})
    resources.setdefault("nodes", bounds.nodes.default)
    tasks = resources.get("tasks_per_node", 1)
    if "cpus_per_task" not in resources and isinstance(tasks, int) and tasks > 0:
        resources["cpus_per_task"] = max(1, bounds.cpus_per_node.default // tasks)
    resources.setdefault("memory_mb_per_node", bounds.memory_mb_per_node.default)
    if bounds.gpus_per_node.default:
        resources.setdefault("gpus_per_node", bounds.gpus_per_node.default)
    if bounds.storage_gb.default:
        resources.setdefault("storage_gb", bounds.storage_gb.default)
    raw["resources"] = resources
    raw.setdefault("walltime_seconds", 60 * bounds.runtime_minutes.default)


def _warn_budget(raw: dict[str, Any], ledger: LocalLedger) -> None:
    """Tell the tenant now (stderr) when the provider will refuse the job's budget; the ledger stores it anyway."""
    from virtengine_hpc.pricing import check_job_against_queue

    queue = ledger.queue(str(raw.get("offering_id")))
    if queue is None:
        print(f"warning: offering {raw.get('offering_id')} has no priced queue", file=sys.stderr)
        return
    try:
        spec = JobSpec.model_validate(
            {"job_id": "JOB-check", **{k: v for k, v in raw.items() if k != "job_id"}}
        )
        check_job_against_queue(spec, queue)
    except ValidationError as exc:
        print(f"warning: the provider will refuse this job: {exc}", file=sys.stderr)
    except ValueError:
        pass  # malformed on purpose (tests, demos): the provider's validation reports it


def cmd_charges(args: argparse.Namespace) -> int:
    ledger = open_ledger(args)
    if args.job_id:
        breakdown = ledger.charge_breakdown(args.job_id)
        if breakdown.job.tenant != args.tenant:
            raise ChainError(f"job {args.job_id} does not belong to {args.tenant}")
        if args.json:
            print_json(breakdown)
            return 0
        _print_breakdown(breakdown)
        return 0
    charges = ledger.charges(tenant=args.tenant)
    return _print_charges(charges, args.json, who=args.tenant, provider_view=False)


def cmd_earnings(args: argparse.Namespace) -> int:
    charges = open_ledger(args).charges(provider=args.provider)
    return _print_charges(charges, args.json, who=args.provider, provider_view=True)


def _print_charges(charges: list[JobCharge], as_json: bool, *, who: str, provider_view: bool) -> int:
    settled = [c for c in charges if c.settled]
    total_charged = sum((c.charged for c in settled), Decimal(0))
    total_refunded = sum((c.refunded for c in settled), Decimal(0))
    held = sum((c.escrow for c in charges if not c.settled), Decimal(0))
    totals = {
        "jobs": len(charges),
        "settled": len(settled),
        "charged": total_charged,
        "refunded": total_refunded,
        "in_escrow": held,
    }
    if as_json:
        print(
            json.dumps(
                {"account": who, "jobs": [c.model_dump(mode="json") for c in charges], "totals": totals},
                indent=2,
                default=str,
            )
        )
        return 0
    other = "TENANT" if provider_view else "PROVIDER"
    rows: list[tuple[str, ...]] = [
        ("JOB", "STATE", other, "OFFERING", "ESCROW", "CHARGED", "REFUNDED", "SETTLED")
    ]
    for c in charges:
        rows.append(
            (
                c.job_id,
                c.state.value,
                c.tenant if provider_view else c.provider,
                c.offering_id,
                _money(c.escrow),
                _money(c.charged) if c.settled else "-",
                _money(c.refunded) if c.settled else "-",
                c.settled_at.strftime("%Y-%m-%d %H:%M:%S") if c.settled_at else "in escrow",
            )
        )
    _table(rows)
    if provider_view:
        print(
            f"earned {_money(total_charged)} from {len(settled)} settled job(s); {_money(held)} still in escrow"
        )
    else:
        print(
            f"charged {_money(total_charged)}, refunded {_money(total_refunded)} over {len(settled)} settled "
            f"job(s); {_money(held)} held in escrow"
        )
    return 0


def _print_breakdown(b: ChargeBreakdown) -> None:
    job = b.job
    print(f"job {job.job_id} ({job.state.value}) at offering {job.offering_id}, escrow {_money(job.escrow)}")
    if b.totals is None:
        print("no usage records" + (f"; refunded {_money(job.refunded)}" if job.settled else ""))
        return
    rows: list[tuple[str, ...]] = [("ITEM", "QUANTITY", "UNIT", "RATE", "AMOUNT")]
    for line in b.lines:
        rows.append((line.item, _plain(line.quantity), line.unit, _plain(line.rate), _plain(line.amount)))
    _table(rows)
    print(f"rated {_plain(b.rated)}, rounded to the unit {_money(b.rounded)}")
    if b.minimum_applied:
        print(f"minimum charge {_money(b.minimum_charge)} applies")
    if b.capped_at_escrow:
        print(f"capped at the escrow {_money(job.escrow)}")
    if job.settled:
        print(f"charged {_money(job.charged)}, refunded {_money(job.refunded)} ({job.kind})")
    else:
        print("not settled yet")


def _plain(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "") else text


def cmd_quote(args: argparse.Namespace) -> int:
    from virtengine_hpc.pricing import describe, quote

    config = config_from_args(args)
    offering = args.offering or default_offering(config)
    queue = open_ledger(args).queue(offering)
    if queue is None:
        raise ChainError(f"unknown offering {offering}")
    try:
        resources = Resources(
            nodes=args.nodes,
            tasks_per_node=args.tasks_per_node,
            cpus_per_task=args.cpus,
            memory_mb_per_node=args.memory_mb,
            gpus_per_node=args.gpus,
            storage_gb=args.storage_gb,
        )
        walltime = int(parse_duration(args.walltime).total_seconds())
    except ValueError as exc:
        raise ValidationError(f"invalid request: {exc}") from None
    priced = quote(resources, walltime, queue)
    print(f"{_money(priced.total)}  ({describe(priced)}) at {offering}")
    low, high = queue.min_duration_seconds, queue.max_duration_seconds
    if not low <= walltime <= high:
        print(
            f"warning: walltime {walltime} s is outside the offering's bounds {low}..{high} s",
            file=sys.stderr,
        )
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if open_ledger(args).request_cancel(args.job_id, tenant=args.tenant):
        print(f"{args.job_id}: cancellation requested")
    else:
        print(f"{args.job_id}: already finished, nothing to cancel")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs = open_ledger(args).jobs(state=args.state, tenant=args.tenant)
    if args.json:
        print(json.dumps([j.model_dump(mode="json", exclude={"raw_spec"}) for j in jobs], indent=2))
        return 0
    rows: list[tuple[str, ...]] = [
        ("JOB", "STATE", "TENANT", "CLUSTER", "ESCROW", "CANCEL", "SCHED-ID", "CREATED")
    ]
    for job in jobs:
        rows.append(
            (
                job.job_id,
                job.state.value,
                job.tenant,
                job.cluster_id or job.target_cluster_id or "-",
                _money(job.escrow),
                "yes" if job.cancel_requested else "",
                job.scheduler_job_id or "",
                job.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            )
        )
    _table(rows)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    ledger = open_ledger(args)
    job = ledger.job(args.job_id)
    if job is None:
        raise ChainError(f"unknown job {args.job_id}")
    settlement = ledger.settlement(args.job_id)
    out = {
        "job": job.model_dump(mode="json"),
        "history": [t.model_dump(mode="json") for t in ledger.history(args.job_id)],
        "decisions": [d.model_dump(mode="json") for d in ledger.decisions(args.job_id)],
        "usage_records": [
            {"record_id": r.record_id, "sequence": r.sequence, "is_final": r.is_final, "state": r.job_state}
            for r in ledger.usage_records(args.job_id)
        ],
        "settlement": settlement.model_dump(mode="json") if settlement else None,
        "transfers": [t.model_dump(mode="json") for t in ledger.transfers(job_id=args.job_id)],
    }
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    clusters = open_ledger(args).clusters()
    if args.json:
        print(json.dumps([c.model_dump(mode="json") for c in clusters], indent=2))
        return 0
    rows: list[tuple[str, ...]] = [
        ("CLUSTER", "PROVIDER", "STATE", "SCHEDULER", "NODES", "FREE", "PARTITIONS")
    ]
    for c in clusters:
        parts = ",".join(p.name for p in c.partitions) or "-"
        rows.append(
            (
                c.cluster_id,
                c.provider,
                c.state,
                c.scheduler_type,
                str(c.total_nodes),
                str(c.available_nodes),
                parts,
            )
        )
    _table(rows)
    return 0


def cmd_queues(args: argparse.Namespace) -> int:
    queues = open_ledger(args).queues()
    if args.json:
        print(json.dumps([q.model_dump(mode="json") for q in queues], indent=2))
        return 0
    rows: list[tuple[str, ...]] = [
        ("OFFERING", "CLUSTER", "PARTITION", "NODE-H", "CORE-H", "GPU-H", "MEM-GB-H", "STORE-GB-H", "MIN")
    ]
    for q in queues:
        p = q.pricing
        prices = (p.node_hour, p.core_hour, p.gpu_hour, p.memory_gb_hour, p.storage_gb_hour, p.minimum_charge)
        rows.append((q.offering_id, q.cluster_id, q.partition, *(format(v, "f") for v in prices)))
    _table(rows)
    return 0


def cmd_settlement(args: argparse.Namespace) -> int:
    settlement = open_ledger(args).settlement(args.job_id)
    if settlement is None:
        print(f"{args.job_id}: no settlement yet", file=sys.stderr)
        return 1
    print_json(settlement)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    keys = [k for k in open_ledger(args).registered_keys(args.provider) if args.key_id in (None, k[1])]
    if not keys:
        what = f" for {args.provider}" if args.provider else ""
        raise ValidationError(
            f"no usage-signing key{' ' + args.key_id if args.key_id else ''} registered{what}"
        )
    if args.json:
        fields = ("provider", "key_id", "public_key", "registered_at")
        print(json.dumps([dict(zip(fields, k, strict=True)) for k in keys], indent=2))
    elif args.quiet:
        print("\n".join(public for _, _, public, _ in keys))
    else:
        _table([("PROVIDER", "KEY ID", "PUBLIC KEY (BASE64)", "REGISTERED"), *keys])
    return 0


def cmd_height(args: argparse.Namespace) -> int:
    print(open_ledger(args).height())
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
