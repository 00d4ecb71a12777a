"""``LocalLedger``: the embedded stand-in for the chain, one SQLite file.

It holds what the chain would hold for the provider side: clusters, priced queues, provider usage-signing
keys, accounts with balances, tenant jobs with their escrow and state history, scheduling decisions, signed
usage records and settlements. It implements the ``ChainClient`` protocol (the provider's view) plus admin and
tenant methods that the CLI (``virtengine-hpc ledger ...``), the demo and the tests use. The full description,
with the settlement arithmetic, is in ``docs/ledger.md``.

The class is put together from one module per area, in ``activities/chain/ledger/``:

* ``core.py``: the file, the schema, the clock and block heights (``LedgerCore``);
* ``accounts.py``: balances and transfers;
* ``catalog.py``: clusters, priced queues, the price fixed for each job, provider keys;
* ``jobs.py``: tenant jobs, the provider's job lists (``pending_jobs`` ...) and status reports;
* ``decisions.py``: scheduling decisions;
* ``usage.py``: signed usage records;
* ``settlement.py``: final accounting, settlement, refunds, charges;
* ``templates.py``: custom workload templates;
* ``common.py`` and ``views.py``: amounts and times, and the models the inspection methods return.

Several processes use one file at once (worker, poller, CLI): every call goes through one ``SqliteStore``
(``activities/chain/store.py``): a connection per thread, opened once and reused, in WAL mode with a busy timeout,
every write one short ``BEGIN IMMEDIATE`` transaction (so two writers serialise instead of failing half way), a
busy file reported as ``ChainUnavailable``. The schema and the intake queries are in ``activities/chain/schema.py``.

The ``ChainClient`` methods are coroutines that run their SQLite work in a worker thread
(``asyncio.to_thread``), so a busy database never blocks a worker's event loop. The admin, tenant and
inspection methods are plain functions: the CLI and test set-up call them outside an event loop, and each is
one short transaction.

Amounts are ``Decimal`` stored as TEXT and never pass through a float or an SQL ``SUM``. The ledger's unit is
``0.000001`` (six decimal places): an amount with more places is refused, a computed charge is rounded to it
with ``ROUND_HALF_EVEN``.
"""

from __future__ import annotations

from activities.chain.ledger.common import ROUNDING, UNIT, to_amount
from activities.chain.ledger.core import DEFAULT_BUSY_TIMEOUT
from activities.chain.ledger.decisions import DecisionsArea
from activities.chain.ledger.jobs import MAX_RAW_SPEC_BYTES, JobsArea
from activities.chain.ledger.settlement import compute_charge, settle_amounts, used_anything
from activities.chain.ledger.templates import TemplatesArea
from activities.chain.ledger.usage import UsageArea
from activities.chain.ledger.views import ChargeBreakdown, JobCharge, LedgerJob, Transfer, Transition
from activities.chain.schema import SCHEMA_VERSION

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "MAX_RAW_SPEC_BYTES",
    "ROUNDING",
    "SCHEMA_VERSION",
    "UNIT",
    "ChargeBreakdown",
    "JobCharge",
    "LedgerJob",
    "LocalLedger",
    "Transfer",
    "Transition",
    "compute_charge",
    "settle_amounts",
    "to_amount",
    "used_anything",
]


class LocalLedger(JobsArea, DecisionsArea, UsageArea, TemplatesArea):
    """The chain, embedded: a SQLite file shared safely by every process of one provider host.

    Args:
        path: the SQLite file (created with its directory if missing).
        seconds_per_block: block time used when the file is created; afterwards the file's own value wins, so
        every
            process computes the same heights.
        genesis_time: when block 1 began (default: creation time); only used when the file is created.
        clock: the current time (tests inject one); must return an aware datetime.
        busy_timeout: seconds a call waits for another process's write before giving up with
        ``ChainUnavailable``.
    """
