"""Checks a job against its template: resource bounds, then parameters against the template's schema.

Every error is a ``ValidationError`` that names the template, the field, the value and the allowed range, and all
violations are reported at once, so a tenant fixes a job in one round. Parameter values are tenant strings: they
are checked here against strict patterns and bounds, and only then rendered, always shell-quoted.
"""

from __future__ import annotations

import math
import re
import shlex
from decimal import Decimal, InvalidOperation
from typing import Any

from virtengine_hpc.errors import ValidationError
from virtengine_hpc.models import JobSpec
from virtengine_hpc.templates.model import ParameterSpec, ParamValue, WorkloadTemplate
from virtengine_hpc.templates.patterns import full_match

_PATH_RE = re.compile(r"^[A-Za-z0-9._/+-]{1,1023}$")
_COMMAND_RE = re.compile(r"^[A-Za-z0-9._/+-]{1,255}$")
_MODULE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+/-]{0,127}$")
_IMAGE_RE = re.compile(
    # A first component is a registry only if it has a dot or a port or is localhost (as Docker decides).
    r"^(?:(?P<registry>(?:[a-z0-9-]+\.)+[a-z0-9-]+(?::[0-9]{1,5})?|localhost(?::[0-9]{1,5})?|[a-z0-9-]+:[0-9]{1,5})/)?"
    r"(?P<name>[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_ARGV_WORDS = 256

Values = dict[str, "ParamValue | tuple[str, ...] | None"]
"""Validated parameters: scalars, or a tuple of words for ``argv`` and ``modules``; None for an unset optional."""


def check_resources(template: WorkloadTemplate, job: JobSpec) -> None:
    """Raise ``ValidationError`` listing every resource of ``job`` outside the template's bounds."""
    bounds, res = template.resources, job.resources
    problems: list[str] = []

    def within(what: str, value: int, low: int, high: int, unit: str = "") -> None:
        if not low <= value <= high:
            problems.append(f"{what} {value}{unit} is outside {low}..{high}{unit}")

    within("nodes", res.nodes, bounds.nodes.min, bounds.nodes.max)
    within("cpus per node", res.cpus_per_node, bounds.cpus_per_node.min, bounds.cpus_per_node.max)
    within(
        "memory per node",
        res.memory_mb_per_node,
        bounds.memory_mb_per_node.min,
        bounds.memory_mb_per_node.max,
        " MB",
    )
    within("GPUs per node", res.gpus_per_node, bounds.gpus_per_node.min, bounds.gpus_per_node.max)
    within("storage", res.storage_gb, bounds.storage_gb.min, bounds.storage_gb.max, " GB")
    minutes = math.ceil(job.walltime_seconds / 60)
    runtime = bounds.runtime_minutes
    if not runtime.min * 60 <= job.walltime_seconds <= runtime.max * 60:
        problems.append(f"walltime {minutes} min is outside {runtime.min}..{runtime.max} min")
    if res.gpus_per_node and bounds.gpu_types:
        if res.gpu_type is None:
            problems.append(f"a GPU type is required, one of {', '.join(bounds.gpu_types)}")
        elif res.gpu_type not in bounds.gpu_types:
            problems.append(f"GPU type {res.gpu_type!r} is not one of {', '.join(bounds.gpu_types)}")
    if problems:
        raise ValidationError(f"template {template.template_id}: " + "; ".join(problems))


def check_parameters(template: WorkloadTemplate, given: dict[str, Any]) -> Values:
    """The job's parameters, validated and completed with defaults; ``ValidationError`` lists every problem."""
    problems: list[str] = []
    unknown = sorted(set(given) - set(template.parameters))
    if unknown:
        known = ", ".join(sorted(template.parameters)) or "none"
        problems.append(f"unknown parameter(s) {', '.join(unknown)} (this template takes: {known})")
    values: Values = {}
    for name, spec in template.parameters.items():
        raw = given.get(name, spec.default)
        if raw is None:
            if spec.required:
                problems.append(f"parameter {name} is required ({spec.description or spec.type})")
            values[name] = None
            continue
        try:
            values[name] = _check_value(name, spec, raw, template)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValidationError(f"template {template.template_id}: " + "; ".join(problems))
    return values


def check_job(template: WorkloadTemplate, job: JobSpec) -> Values:
    """Bounds, then parameters: what the resolver runs before rendering."""
    check_resources(template, job)
    return check_parameters(template, dict(job.template_parameters))


def _show(value: Any) -> str:
    text = str(value)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _check_value(
    name: str, spec: ParameterSpec, raw: Any, template: WorkloadTemplate
) -> ParamValue | tuple[str, ...]:
    kind = spec.type
    if kind == "boolean":
        if not isinstance(raw, bool):
            raise ValueError(f"parameter {name} must be true or false, not {_show(raw)}")
        return raw
    if kind in ("integer", "number"):
        return _check_number(name, spec, raw)
    if not isinstance(raw, str):
        raise ValueError(f"parameter {name} must be a string, not {_show(raw)}")
    if len(raw) > spec.max_length:
        raise ValueError(f"parameter {name} is longer than {spec.max_length} characters")
    if kind == "argv":
        return _check_argv(name, raw)
    if kind == "modules":
        words = tuple(w for w in re.split(r"[\s,]+", raw) if w)
        for word in words:
            if not _MODULE_RE.fullmatch(word):
                raise ValueError(f"parameter {name}: module {_show(word)} must match {_MODULE_RE.pattern}")
        return words
    if _CONTROL_RE.search(raw):
        raise ValueError(f"parameter {name} contains control characters (newline, NUL, ...)")
    checks = {
        "string": lambda: None,
        "enum": lambda: _check_enum(name, spec, raw),
        "path": lambda: _check_path(name, raw),
        "command": lambda: _check_command(name, raw),
        "image": lambda: _check_image(name, raw, template),
    }
    checks[kind]()
    if spec.pattern is not None and not full_match(spec.pattern, raw):
        raise ValueError(f"parameter {name} {_show(raw)} must match {spec.pattern}")
    return raw


def _check_number(name: str, spec: ParameterSpec, raw: Any) -> int | Decimal:
    if isinstance(raw, bool):
        raise ValueError(f"parameter {name} must be a number, not {_show(raw)}")
    if spec.type == "integer":
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if not isinstance(raw, int):
            raise ValueError(f"parameter {name} must be an integer, not {_show(raw)}")
        value: int | Decimal = raw
    else:
        try:
            value = raw if isinstance(raw, Decimal) else Decimal(str(raw))
        except (InvalidOperation, ValueError):
            raise ValueError(f"parameter {name} must be a number, not {_show(raw)}") from None
        if not value.is_finite():
            raise ValueError(f"parameter {name} must be a finite number")
    if spec.minimum is not None and value < spec.minimum:
        raise ValueError(f"parameter {name} {value} is below its minimum {spec.minimum}")
    if spec.maximum is not None and value > spec.maximum:
        raise ValueError(f"parameter {name} {value} is above its maximum {spec.maximum}")
    return value


def _check_argv(name: str, raw: str) -> tuple[str, ...]:
    if _CONTROL_RE.search(raw.replace("\t", " ")):
        raise ValueError(f"parameter {name} contains control characters (newline, NUL, ...)")
    try:
        words = tuple(shlex.split(raw))
    except ValueError as exc:
        raise ValueError(f"parameter {name} is not a valid command line: {exc}") from None
    if len(words) > MAX_ARGV_WORDS:
        raise ValueError(f"parameter {name} has more than {MAX_ARGV_WORDS} words")
    for word in words:
        if _CONTROL_RE.search(word):
            raise ValueError(f"parameter {name} contains control characters (newline, NUL, ...)")
    return words


def _check_enum(name: str, spec: ParameterSpec, raw: str) -> None:
    if raw not in spec.choices:
        raise ValueError(f"parameter {name} {_show(raw)} must be one of {', '.join(spec.choices)}")


def _check_path(name: str, raw: str) -> None:
    if not _PATH_RE.fullmatch(raw) or raw.startswith("-") or ".." in raw.split("/"):
        raise ValueError(
            f"parameter {name} {_show(raw)} must be a path of letters, digits and ._/+- "
            "(not starting with '-', no '..')"
        )


def _check_command(name: str, raw: str) -> None:
    if not _COMMAND_RE.fullmatch(raw) or raw.startswith("-") or ".." in raw.split("/"):
        raise ValueError(
            f"parameter {name} {_show(raw)} must be a program name or path of letters, digits and ._/+- "
            "(not starting with '-')"
        )


def _check_image(name: str, raw: str, template: WorkloadTemplate) -> None:
    match = _IMAGE_RE.fullmatch(raw)
    if match is None:
        raise ValueError(f"parameter {name} {_show(raw)} is not a container image reference")
    security = template.security
    if security.require_image_digest and match.group("digest") is None:
        raise ValueError(f"parameter {name}: this template requires an image pinned by digest (@sha256:...)")
    registry = match.group("registry") or "docker.io"
    if security.allowed_registries and registry not in security.allowed_registries:
        raise ValueError(
            f"parameter {name}: registry {registry} is not allowed (allowed: {', '.join(security.allowed_registries)})"
        )


def image_ok(reference: str) -> bool:
    """Whether ``reference`` is a syntactically valid image reference (for fixed images in templates)."""
    return _IMAGE_RE.fullmatch(reference) is not None
