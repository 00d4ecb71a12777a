"""Parameter patterns of templates, matched in time linear in the value.

A publisher writes the pattern and a tenant writes the value it is matched against. With a backtracking engine
(Python's ``re``) a pattern such as ``([a-z0-9]+)+`` takes exponential time on a value like ``aaaa...a!``: one
job would hold the worker's event loop for hours. Patterns are therefore compiled and matched by RE2 (the
``google-re2`` package), which never backtracks. RE2 has no backreferences and no lookaround; a pattern that
uses them, or is too large for RE2's memory budget, is refused when the template is read (and so when it is
published), with RE2's reason.
"""

from __future__ import annotations

import functools
from typing import Any

import re2

MAX_PATTERN_MEMORY = 8 << 20
"""Bytes RE2 may use for one compiled pattern; a larger pattern is refused."""


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> Any:
    """The RE2 program of ``pattern``; ``ValueError`` with RE2's reason when RE2 cannot run it."""
    options = re2.Options()
    options.log_errors = False  # the reason goes into the error, not to stderr
    options.max_mem = MAX_PATTERN_MEMORY
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(
            f"pattern {pattern[:80]!r} is refused: {reason} (patterns are matched in linear time by RE2, which "
            "has no backreferences or lookaround)"
        ) from None


def full_match(pattern: str, value: str) -> bool:
    """Whether the whole of ``value`` matches ``pattern`` (compiled once per pattern)."""
    return compile_pattern(pattern).fullmatch(value) is not None


__all__ = ["MAX_PATTERN_MEMORY", "compile_pattern", "full_match"]
