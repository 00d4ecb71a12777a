"""What every section shares: the frozen ``Section`` base, the ``Duration`` type and how durations are read."""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    TypeAdapter,
    ValidationInfo,
    field_validator,
)
from pydantic import ValidationError as PydanticValidationError

MAX_DURATION_SECONDS = 10 * 365 * 86400
"""No setting needs a duration longer than ten years; a longer one is a typo (or would overflow ``timedelta``)."""
# re.ASCII: ``\d`` alone matches every script's digits (an Arabic-Indic one followed by "s" would be a second).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.ASCII)
_SECONDS = re.compile(r"\d+(\.\d+)?", re.ASCII)
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
ACCOUNT_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"
"""A Unix account name as Slurm, MOAB and sshd accept it (what useradd allows by default)."""


def parse_duration(value: Any) -> timedelta:
    """Parse ``15s``, ``5m``, ``24h``, ``1h30m``, ``500ms``, a number of seconds, or a ``timedelta``."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("a duration must be like 15s, 5m or 24h, not a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration must not be negative")
        return _seconds(value, value)
    if isinstance(value, str) and value.strip().upper().startswith("P"):
        # ISO 8601 (``PT15S``): how a dumped config writes durations, so configs round-trip through JSON.
        try:
            return _ISO_DURATION.validate_python(value.strip())
        except PydanticValidationError:
            pass
    if isinstance(value, str):
        text = value.strip().lower()
        if _SECONDS.fullmatch(text):
            return _seconds(float(text), value)
        pos, total = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos == len(text) and pos > 0:
            return _seconds(total, value)
    raise ValueError(f"invalid duration {_shown(value)} (use e.g. 500ms, 15s, 5m, 24h or 1h30m)")


def _seconds(seconds: float, given: Any) -> timedelta:
    # timedelta raises OverflowError (not ValueError) for inf, nan and huge numbers; pydantic would let that
    # escape as a crash instead of naming the key. Compare before anything converts an int to float: a
    # 400-digit integer overflows that conversion too.
    if not seconds <= MAX_DURATION_SECONDS or not math.isfinite(seconds):
        raise ValueError(f"invalid duration {_shown(given)} (at most {MAX_DURATION_SECONDS // 86400} days)")
    return timedelta(seconds=seconds)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_ISO_DURATION = TypeAdapter(timedelta)
Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1: `max_concurrent_jobs: yes` would silently mean one job at a time.
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and field.annotation in (int, float):
            raise ValueError("must be a number, not true/false")
        return value
