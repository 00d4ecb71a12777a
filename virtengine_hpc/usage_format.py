"""The JSON form of a usage record, checked the way ``docs/usage-records.md`` writes it down.

Pydantic reads leniently (``"no"`` becomes ``False``, ``598.25`` becomes a ``Decimal``, a time without a zone
becomes UTC), which is right for our own messages and wrong for a record someone hands over to be verified: a
verifier that quietly repairs a record would vouch for bytes that were never signed. ``form_problems`` says what
in a record departs from the documented form, before the record is read as a model; ``load_json`` refuses
nothing but remembers duplicate keys (which ``json`` would silently collapse to the last one) so that they can be
reported per record.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, Literal

_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})", re.ASCII
)
_DECIMAL = re.compile(r"-?[0-9]{1,40}(\.[0-9]{1,40})?", re.ASCII)

Kind = Literal["string", "integer", "boolean", "time", "decimal", "object"]
Field = tuple[Kind, bool]
"""A field's JSON kind, and whether it may be ``null``."""

RECORD_FIELDS: dict[str, Field] = {
    "record_id": ("string", False),
    "job_id": ("string", False),
    "cluster_id": ("string", False),
    "scheduler_job_id": ("string", False),
    "provider": ("string", False),
    "tenant": ("string", False),
    "sequence": ("integer", False),
    "period_start": ("time", False),
    "period_end": ("time", False),
    "job_state": ("string", False),
    "is_final": ("boolean", False),
    "metrics": ("object", False),
    "created_at": ("time", False),
    "key_id": ("string", False),
    "signature": ("string", False),
}
METRIC_FIELDS: dict[str, Field] = {
    "wall_clock_seconds": ("decimal", False),
    "cpu_core_seconds": ("decimal", False),
    "memory_gb_seconds": ("decimal", False),
    "gpu_seconds": ("decimal", False),
    "node_hours": ("decimal", False),
    "storage_gb_hours": ("decimal", False),
    "network_bytes_in": ("integer", True),
    "network_bytes_out": ("integer", True),
    "energy_joules": ("decimal", True),
    "memory_bytes_max": ("integer", True),
}
# Format 2 adds the allocation a record priced, the basis of each metric, and measured use.
RECORD_FIELDS_V2: dict[str, Field] = {
    **RECORD_FIELDS,
    "version": ("integer", False),
    "allocation": ("object", False),
    "basis": ("object", False),
}
METRIC_FIELDS_V2: dict[str, Field] = {
    **METRIC_FIELDS,
    "cpu_time_seconds": ("decimal", True),
    "memory_used_gb_seconds": ("decimal", True),
    "disk_bytes_read": ("integer", True),
    "disk_bytes_written": ("integer", True),
}
ALLOCATION_FIELDS: dict[str, Field] = {
    "nodes": ("integer", False),
    "cpus": ("integer", False),
    "gpus": ("integer", False),
    "memory_bytes": ("integer", False),
    "storage_gb": ("integer", False),
}
BASES = ("measured", "allocated")
_OBJECTS = {
    1: {"metrics": METRIC_FIELDS},
    2: {"metrics": METRIC_FIELDS_V2, "allocation": ALLOCATION_FIELDS},
}


class JSONObject(dict[str, Any]):
    """A JSON object as ``load_json`` reads it: ``duplicates`` names the keys that occurred more than once."""

    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> JSONObject:
    out = JSONObject(pairs)
    if len(out) != len(pairs):
        counts = Counter(key for key, _ in pairs)
        out.duplicates = tuple(key for key, n in counts.items() if n > 1)
    return out


def load_json(text: str) -> Any:
    """``json.loads`` that keeps what a duplicate key would otherwise hide (``JSONObject.duplicates``)."""
    return json.loads(text, object_pairs_hook=_object)


def _kind_problem(value: Any, kind: Kind, nullable: bool) -> str | None:
    if value is None:
        return None if nullable else "must not be null"
    if kind == "integer":
        ok = type(value) is int
    elif kind == "boolean":
        ok = type(value) is bool
    elif kind == "object":
        ok = isinstance(value, dict)
    elif not isinstance(value, str):
        ok = False
    elif kind == "time":
        ok = bool(_TIME.fullmatch(value))
    elif kind == "decimal":
        ok = bool(_DECIMAL.fullmatch(value))
    else:
        ok = True
    if ok:
        return None
    shown = json.dumps(value)[:40]
    return {
        "decimal": f'is {shown}: a decimal is written as a JSON string of digits ("1.5"), never a JSON number',
        "time": f'is {shown}: a time is a JSON string in RFC 3339 with its zone ("...Z")',
        "integer": f"is {shown}: an integer is a JSON number without a fraction",
        "boolean": f"is {shown}: true or false, never a string or a number",
        "object": f"is {shown}: an object",
        "string": f"is {shown}: a JSON string",
    }[kind]


def _duplicates(item: Any, where: str) -> list[str]:
    return [f"{where}duplicate key {key!r}" for key in getattr(item, "duplicates", ())]


def _basis_problems(item: dict[str, Any], metrics: dict[str, Field]) -> list[str]:
    problems = _duplicates(item, "basis.")
    for key, value in item.items():
        if key not in metrics:
            problems.append(f"basis.{key}: not a metric of the format")
        elif value not in BASES:
            problems.append(f"basis.{key} is {json.dumps(value)[:40]}: one of {', '.join(BASES)}")
    return problems


def _object_problems(item: Any, fields: dict[str, Field], where: str, version: int) -> list[str]:
    problems = _duplicates(item, where)
    problems += [f"{where}{key}: missing" for key in fields if key not in item]
    problems += [f"{where}{key}: not a field of format {version}" for key in item if key not in fields]
    for key, (kind, nullable) in fields.items():
        if key not in item:
            continue
        problem = _kind_problem(item[key], kind, nullable)
        if problem is not None:
            problems.append(f"{where}{key} {problem}")
        elif key == "basis":
            problems += _basis_problems(item[key], _OBJECTS[version]["metrics"])
        elif kind == "object":
            problems += _object_problems(item[key], _OBJECTS[version][key], f"{where}{key}.", version)
    return problems


def form_problems(item: Any) -> list[str]:
    """What in ``item`` (a record as JSON gives it) the documented form forbids; empty when nothing.

    A record without ``version`` is format 1; format 2 says ``"version": 2``.
    """
    if not isinstance(item, dict):
        return [f"a record is a JSON object, not {type(item).__name__}"]
    if "version" not in item:
        return _object_problems(item, RECORD_FIELDS, "", 1)
    if type(item["version"]) is not int or item["version"] != 2:
        return [f"version is {json.dumps(item['version'])[:40]}: 2 (format 1 records have no version)"]
    return _object_problems(item, RECORD_FIELDS_V2, "", 2)
