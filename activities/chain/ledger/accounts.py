"""Accounts: balances and the log of every movement (fund, escrow, payment, refund); nothing overdraws."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from decimal import Decimal

from activities.chain.ledger.common import _iso, _text, _time, to_amount
from activities.chain.ledger.core import LedgerCore
from activities.chain.ledger.views import Transfer
from virtengine_hpc.errors import ChainError


class AccountsArea(LedgerCore):
    """Balances and transfers."""

    @staticmethod
    def _balance(db: sqlite3.Connection, account: str) -> Decimal:
        row = db.execute("SELECT balance FROM accounts WHERE account = ?", (account,)).fetchone()
        return Decimal(row["balance"]) if row else Decimal(0)

    def _move(
        self,
        db: sqlite3.Connection,
        kind: str,
        account: str,
        amount: Decimal,
        job_id: str | None,
        now: datetime,
    ) -> None:
        """Add ``amount`` (negative to take) to ``account`` and log the transfer; refuses to overdraw."""
        balance = self._balance(db, account) + amount
        if balance < 0:
            raise ChainError(
                f"insufficient funds: account {account} has {_text(balance - amount)}, needs {_text(-amount)}"
            )
        db.execute(
            "INSERT INTO accounts (account, balance) VALUES (?, ?) "
            "ON CONFLICT (account) DO UPDATE SET balance = excluded.balance",
            (account, _text(balance)),
        )
        db.execute(
            "INSERT INTO transfers (at, kind, account, amount, job_id) VALUES (?, ?, ?, ?, ?)",
            (_iso(now), kind, account, _text(amount), job_id),
        )

    def fund(self, account: str, amount: Decimal | str | int) -> Decimal:
        """Credit ``account`` (a faucet for tenants in the demo and tests); returns the new balance."""
        value = to_amount(amount)
        if not account or len(account) > 256:
            raise ChainError("account must be a non-empty string of at most 256 characters")
        with self._tx(write=True) as db:
            self._move(db, "fund", account, value, None, self._now())
            return self._balance(db, account)

    def balance(self, account: str) -> Decimal:
        with self._tx(write=False) as db:
            return self._balance(db, account)

    def transfers(self, *, job_id: str | None = None, account: str | None = None) -> list[Transfer]:
        with self._tx(write=False) as db:
            rows = db.execute(
                "SELECT * FROM transfers WHERE (?1 IS NULL OR job_id = ?1) AND (?2 IS NULL OR account = ?2) "
                "ORDER BY id",
                (job_id, account),
            ).fetchall()
        return [
            Transfer(
                at=_time(r["at"]),
                kind=r["kind"],
                account=r["account"],
                amount=Decimal(r["amount"]),
                job_id=r["job_id"],
            )
            for r in rows
        ]
