"""What every area of the ledger shares: its unit of amounts and how amounts and times are written.

Amounts are ``Decimal`` stored as TEXT and never pass through a float or an SQL ``SUM``. The ledger's unit is
``0.000001`` (six decimal places): an amount with more places is refused, a computed charge is rounded to it
with ``ROUND_HALF_EVEN``. Times are stored as ISO 8601 text in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any

from virtengine_hpc.errors import ChainError

UNIT = Decimal("0.000001")
"""The ledger's smallest amount. Amounts with more decimal places are refused; charges are rounded to it."""


ROUNDING = ROUND_HALF_EVEN


def to_amount(value: Any, what: str = "amount") -> Decimal:
    """Parse an amount exactly; refuse negatives, non-numbers and more than six decimal places."""
    if isinstance(value, bool) or value is None:
        raise ChainError(f"{what} must be a number, not {value!r}")
    try:
        amount = Decimal(str(value)) if not isinstance(value, Decimal) else value
    except (InvalidOperation, ValueError):
        raise ChainError(f"{what} {str(value)[:40]!r} is not a number") from None
    if not amount.is_finite() or amount < 0:
        raise ChainError(f"{what} {str(value)[:40]!r} must be a finite, non-negative number")
    if amount != amount.quantize(UNIT, rounding=ROUNDING):
        raise ChainError(f"{what} {value} has more than six decimal places (the ledger's unit is {UNIT})")
    return amount


def _text(amount: Decimal) -> str:
    """Plain-notation text of an amount (never an exponent), exact."""
    return format(amount, "f")


def _iso(moment: datetime) -> str:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat()


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)
