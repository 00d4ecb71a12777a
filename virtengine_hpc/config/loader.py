"""The loader of the configuration file: reading it, its size limits, the environment overrides, and errors that
name the key."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from virtengine_hpc.config.base import Section
from virtengine_hpc.config.root import Config
from virtengine_hpc.config.secrets import _refuse_secrets
from virtengine_hpc.errors import ConfigError

ENV_PREFIX = "VIRTENGINE_HPC__"
MAX_CONFIG_VALUES = 100_000
"""A configuration has a few hundred values; a file that expands to more (YAML aliases can make a 300-byte file
expand to hundreds of millions) is refused before anything walks it."""
MAX_CONFIG_DEPTH = 64
MAX_ERRORS_SHOWN = 10


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not parts:
            continue
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with another override")
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"{name}: conflicts with another override")
        node[parts[-1]] = _env_value(raw)
    return tree


def _env_value(raw: str) -> Any:
    """An override's value: YAML for mappings, lists, null and quoted strings; any other scalar stays text.

    YAML would read ``0123`` as the number 83, ``no`` as false and ``1:30`` as 90; handing such scalars over as
    text lets the key's own type decide (``0123`` stays a cluster id, becomes 123 for a number), exactly as
    pydantic converts them.
    """
    if not raw.strip():
        return ""
    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError, ValueError):  # ValueError: an integer past int()'s digit limit
        return raw
    if value is None or isinstance(value, str | dict | list):
        return value
    return raw.strip()


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _empty_sections_as_defaults(data: Any, model: type[BaseModel]) -> Any:
    """A section whose keys are all commented out (``routing:`` and nothing under it) is YAML null: read it as
    an empty section with every default, not as a type error."""
    if not isinstance(data, Mapping):
        return data
    out: dict[Any, Any] = {}
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        sub = field.annotation if field is not None else None
        if isinstance(sub, type) and issubclass(sub, Section):
            if value is None:
                continue
            value = _empty_sections_as_defaults(value, sub)
        out[key] = value
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return type(exc).__name__


def check_config_size(data: Any, where: str) -> None:
    """Refuse a tree with more than ``MAX_CONFIG_VALUES`` values or deeper than ``MAX_CONFIG_DEPTH``, counting
    each alias every time it is reached: what every later walk of the tree would have to visit. Iterative, so
    the check itself cannot exhaust the stack."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{where} holds more than {MAX_CONFIG_VALUES:,} values once YAML aliases are expanded; "
                "a configuration is never that large"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(node, Mapping):
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list | tuple):
            stack.extend((value, depth + 1) for value in node)


def _format_errors(err: PydanticValidationError) -> str:
    lines = []
    errors = err.errors()
    for item in errors[:MAX_ERRORS_SHOWN]:
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling against docs/configuration.md)"
        lines.append(f"{where}: {msg}")
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more")
    return "invalid configuration: " + "; ".join(lines)


def read_config_file(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The YAML mapping in the file at ``path`` (an empty file, or one of comments only, is ``{}``).

    ``ConfigError`` when the file cannot be read, is not UTF-8, not YAML or not a mapping; the message never
    quotes the file's text, which may hold a credential.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Not str(exc): PyYAML quotes the offending line, which may hold a credential.
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to read") from None
    except ValueError as exc:  # PyYAML's int(): a number past Python's 4,300-digit limit
        raise ConfigError(f"config file {path} holds a value that cannot be read: {exc}"[:300]) from None
    if raw is None:  # an empty file (or only comments): every default
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return raw


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    data: Mapping[str, Any] | None = None,
) -> Config:
    """Load the YAML file at ``path`` (or ``data``), apply environment overrides, validate.

    Raises ``ConfigError`` naming every bad key.
    """
    env = os.environ if env is None else env
    raw: Any = dict(data) if data is not None else {}
    if path is not None:
        raw = read_config_file(path)
    check_config_size(raw, f"config file {path}" if path is not None else "the configuration")
    _refuse_secrets(raw)
    overrides = _env_overrides(env)
    check_config_size(overrides, "the VIRTENGINE_HPC__* environment overrides")
    _refuse_secrets(overrides)
    merged = _empty_sections_as_defaults(_merge(dict(raw), overrides), Config)
    try:
        return Config.model_validate(merged)
    except PydanticValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None
