"""The house stays readable: what the layer contract (``lint-imports``, run by ``make lint``) cannot check.

Each name (an activity's, an audit event's) is spelled once, modules stay small, workflow modules import their
project modules through the sandbox's pass-through, and no two modules import each other. Where the code does not
meet a rule yet, the exception is listed below with the work that removes it; a listed exception that no longer
applies fails too, so each list only shrinks (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from temporalio.activity import _Definition

from activities.jobs import JobActivities
from activities.monitor import MonitorActivities
from activities.nodes import NodeActivities
from virtengine_hpc import activity_names
from virtengine_hpc.audit_events import AuditEvent
from virtengine_hpc.errors import (
    NODE_LEDGER_NON_RETRYABLE_TYPES,
    NODE_SCHEDULER_NON_RETRYABLE_TYPES,
    NON_RETRYABLE,
    NON_RETRYABLE_TYPES,
)
from workflows import hpc_job, node

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("virtengine_hpc", "workflows", "activities", "workers", "cli", "node_agent")
MAX_LINES = 700

# ---- the ratchet: exceptions that only shrink ---------------------------------------------------------------------
LONG_MODULES = {
    # Issue 16, WP2: the virtengine-hpc command leaves the domain package, its ledger report printed apart.
    "virtengine_hpc/cli/ledger.py",
    # Issue 16, WP5: the batch base owns what SLURM and MOAB both do.
    "activities/schedulers/batch/base.py",
    "activities/schedulers/slurm/adapter.py",
    "activities/schedulers/slurm/backends.py",
    "activities/schedulers/slurm/parsers.py",
    # Issue 16, WP6: the local executor split; its supervisor runs isolated (python -I -S) from one file.
    "activities/schedulers/local.py",
    "activities/schedulers/local_supervisor.py",
    # Issue 16, WP7: the job workflow and its activities split into mixin modules.
    "workflows/hpc_job.py",
    "activities/jobs.py",
}
MODULE_CYCLES = [
    # Issue 16, WP2: a shared helper moves to cli/common.py.
    {"virtengine_hpc.cli.ledger", "virtengine_hpc.cli.usage"},
]
MODEL_COPY_IN_WORKFLOWS = {
    # Issue 16, WP7: workflow state changes through typed setters, whose keys mypy checks.
    "workflows/hpc_job.py",
    "workflows/node.py",
}
NOT_AN_EVENT = {
    # Strings that happen to equal an audit event's name but mean something else.
    (
        "virtengine_hpc/errors.py",
        "security_violation",
    ): "SecurityError.code, the error's machine-readable name",
    ("workers/node_api.py", "signature_invalid"): "a rejected heartbeat's reason code",
}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")) if (REPO / package).is_dir() else ():
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def string_constants(path: Path) -> Iterator[str]:
    for node_ in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node_, ast.Constant) and isinstance(node_.value, str):
            yield node_.value


# ---- names spelled once -------------------------------------------------------------------------------------------


def test_every_activity_is_registered_under_a_name_of_activity_names() -> None:
    defined = [
        definition.name
        for cls in (JobActivities, MonitorActivities, NodeActivities)
        for attr in vars(cls).values()
        if (definition := _Definition.from_callable(attr)) is not None
    ]
    assert sorted(defined) == sorted(activity_names.ALL)
    assert len(set(activity_names.ALL)) == len(activity_names.ALL) == 17


def test_activity_and_audit_event_names_are_not_spelled_out() -> None:
    """A name written as a literal string can drift from the one registered or documented: every module uses the
    constants of ``virtengine_hpc.activity_names`` and ``virtengine_hpc.audit_events`` instead."""
    events = {event.value for event in AuditEvent}
    spelled: list[str] = []
    for path in modules().values():
        if path.name in ("activity_names.py", "audit_events.py"):
            continue
        for value in string_constants(path):
            if value in activity_names.ALL or (value in events and (rel(path), value) not in NOT_AN_EVENT):
                spelled.append(f"{rel(path)}: {value!r}")
    assert spelled == []


def test_exceptions_to_the_event_names_rule_still_apply() -> None:
    stale = [key for key in NOT_AN_EVENT if key[1] not in set(string_constants(REPO / key[0]))]
    assert stale == []


def test_non_retryable_error_types_keep_their_names_and_order() -> None:
    """The names travel in the retry policies of the commands a workflow issues: the workflows' lists are
    built from the error classes and must stay what running histories recorded."""
    assert NON_RETRYABLE_TYPES == (
        "ValidationError",
        "ConfigError",
        "SubmissionRejected",
        "SecurityError",
        "IllegalTransition",
        "TenantAccountError",
    )
    assert all(not error.transient for error in NON_RETRYABLE)
    assert list(NON_RETRYABLE_TYPES) == hpc_job._NON_RETRYABLE
    assert NODE_LEDGER_NON_RETRYABLE_TYPES == ("ValidationError",)
    assert NODE_SCHEDULER_NON_RETRYABLE_TYPES == (
        "ValidationError",
        "SubmissionRejected",
        "JobNotFound",
        "ConfigError",
    )
    assert node._LEDGER_RETRY.non_retryable_error_types == ["ValidationError"]
    assert node._SCHEDULER_RETRY.non_retryable_error_types == list(NODE_SCHEDULER_NON_RETRYABLE_TYPES)


# ---- small modules, no cycles -------------------------------------------------------------------------------------


def test_modules_stay_under_700_lines() -> None:
    lengths = {rel(path): len(path.read_text(encoding="utf-8").splitlines()) for path in modules().values()}
    assert sorted(name for name, n in lengths.items() if n > MAX_LINES and name not in LONG_MODULES) == []
    assert sorted(name for name in LONG_MODULES if lengths.get(name, 0) <= MAX_LINES) == [], (
        "no longer long (or gone): delete it from LONG_MODULES"
    )


def test_workflow_state_is_copied_with_update_dicts_only_where_listed() -> None:
    using = {rel(p) for p in (REPO / "workflows").glob("*.py") if "model_copy(update" in p.read_text()}
    assert using == MODEL_COPY_IN_WORKFLOWS


def test_workflow_modules_import_project_modules_through_the_sandbox() -> None:
    """Temporal's sandbox re-imports a workflow's module for every run: a project module imported outside
    ``workflow.unsafe.imports_passed_through()`` would be imported again inside it, per run, and fail on what the
    sandbox restricts."""
    outside = []
    for path in sorted((REPO / "workflows").glob("*.py")):
        for statement in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            elif isinstance(statement, ast.ImportFrom) and not statement.level:
                names = [statement.module or ""]
            else:
                continue
            outside += [
                f"{rel(path)}: {n}"
                for n in names
                if n.split(".")[0] in PACKAGES and not n.startswith("workflows")
            ]
    assert outside == []


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere (functions too), except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(parent: ast.AST) -> None:
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in child.names]
            for target in targets:
                parts = target.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != module:
                    found.add(".".join(parts))
            visit(child)

    visit(tree)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module: each is a set of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def walk(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                walk(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in list(graph):
        if v not in index:
            walk(v)
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    """lint-imports' acyclic contract sees cycles between siblings; this one sees every cycle, a package and
    its own modules too, lazy imports included."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        graph[module] |= imports(module, path, known)
    cycles = strongly_connected(graph)
    assert [c for c in cycles if c not in MODULE_CYCLES] == []
    assert [c for c in MODULE_CYCLES if c not in cycles] == [], "gone: delete it from MODULE_CYCLES"


def test_the_cycle_check_finds_a_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert strongly_connected(graph) == [{"a", "b", "c"}]
