"""The ledger's SQLite schema and the queries that decide which jobs a cluster's poller sees.

Tables (one SQLite file, shared with the node registry's ``node_*`` tables): ``meta`` (schema version, block
clock, counters), ``accounts`` and ``transfers`` (balances and every movement), ``clusters``, ``queues`` (priced
offerings), ``provider_keys``, ``jobs`` with ``job_history``, ``decisions``, ``usage_records``, ``job_prices`` (the
offering as fixed for a job), ``settlements``, ``publisher_keys`` and ``templates``. The text here is what every
existing ledger file was created with: change it only with a new ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import re

SCHEMA_VERSION = "1"

# A job belongs to the cluster it runs on: the one it reported running on, else the one its latest scheduling
# decision selects when that is an active cluster of its provider, else the one it asked for (or its offering's);
# a job that names no cluster is offered to every cluster of its provider. Listing it for the cluster it is
# decided for lets that cluster's poller take it within that cluster's max_concurrent_jobs; a decision for an
# offline cluster leaves it with the one it asked for, whose workflow may fall back to it (docs/routing.md).
_DECIDED = (
    "(SELECT c.cluster_id FROM clusters c WHERE c.provider = jobs.provider "
    "AND json_extract(c.data, '$.state') = 'active' AND c.cluster_id = "
    "(SELECT json_extract(d.data, '$.selected_cluster_id') FROM decisions d WHERE d.job_id = jobs.job_id "
    "ORDER BY d.seq DESC LIMIT 1))"
)
_DESTINATION = f"COALESCE(jobs.cluster_id, {_DECIDED}, jobs.target_cluster_id)"
_RUNS_ON = f"COALESCE({_DESTINATION}, ?2) = ?2"
# The queries below are built from these constants only (S608 flags any built query); every value is bound.
PENDING_SQL = (
    "SELECT * FROM jobs WHERE provider = ?1 AND state = 'pending' AND taken = 0 "  # noqa: S608
    f"AND {_RUNS_ON} "
    "AND seq > COALESCE((SELECT seq FROM jobs WHERE job_id = ?4), 0) "
    "ORDER BY seq LIMIT ?3"
)
COUNT_PENDING_SQL = (
    "SELECT COUNT(*) FROM jobs WHERE provider = ?1 AND state = 'pending' AND taken = 0 "  # noqa: S608
    f"AND {_RUNS_ON} "
    "AND seq > COALESCE((SELECT seq FROM jobs WHERE job_id = ?3), 0)"
)
# Cancel requests of jobs a workflow has taken (they may be running, and billed) before those of jobs still
# waiting to be taken; in each group in turns by tenant (each tenant's oldest first, then each one's second, ...):
# a flood of cancels, one tenant's or many tenants' pending jobs, does not push another's to the end of the list.
# At most ?4 of them, after job ?3 in that order (from the first when ?3 is not in the list).
CANCEL_SQL = (
    "WITH ordered AS (SELECT job_id, seq, waiting, "  # noqa: S608
    "ROW_NUMBER() OVER (PARTITION BY tenant, waiting ORDER BY seq) AS turn FROM "
    "(SELECT job_id, seq, tenant, (state = 'pending' AND taken = 0) AS waiting FROM jobs "
    "WHERE provider = ?1 AND cancel_requested = 1 "
    "AND state NOT IN ('completed', 'failed', 'timeout', 'cancelled') "
    f"AND {_RUNS_ON})), "
    "mark AS (SELECT waiting, turn, seq FROM ordered WHERE job_id = ?3) "
    "SELECT job_id FROM ordered WHERE NOT EXISTS (SELECT 1 FROM mark) "
    "OR (waiting, turn, seq) > (SELECT waiting, turn, seq FROM mark) "
    "ORDER BY waiting, turn, seq LIMIT ?4"
)
OPEN_SQL = (
    "SELECT * FROM jobs WHERE provider = ?1 "  # noqa: S608
    "AND state NOT IN ('completed', 'failed', 'timeout', 'cancelled') "
    f"AND {_RUNS_ON} "
    "AND seq > COALESCE((SELECT seq FROM jobs WHERE job_id = ?3), 0) "
    "ORDER BY seq LIMIT ?4"
)
RAN_SQL = (
    "SELECT 1 FROM job_history WHERE job_id = ? AND to_state IN ('starting', 'running', 'suspended') LIMIT 1"
)
HISTORY_SQL = (
    "INSERT INTO job_history (job_id, from_state, to_state, message, exit_code, at, block_height) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS accounts (account TEXT PRIMARY KEY, balance TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS transfers (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    kind TEXT NOT NULL,
    account TEXT NOT NULL,
    amount TEXT NOT NULL,
    job_id TEXT
);
CREATE INDEX IF NOT EXISTS transfers_job ON transfers (job_id);
CREATE TABLE IF NOT EXISTS clusters (cluster_id TEXT PRIMARY KEY, provider TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queues (offering_id TEXT PRIMARY KEY, cluster_id TEXT NOT NULL, data TEXT NOT
NULL); CREATE TABLE IF NOT EXISTS provider_keys (
    provider TEXT NOT NULL,
    key_id TEXT NOT NULL,
    public_key TEXT NOT NULL,
    registered_at TEXT NOT NULL,
    PRIMARY KEY (provider, key_id)
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    provider TEXT NOT NULL,
    offering_id TEXT NOT NULL,
    target_cluster_id TEXT,
    cluster_id TEXT,
    raw_spec TEXT NOT NULL,
    state TEXT NOT NULL,
    status_message TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    scheduler_job_id TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    taken INTEGER NOT NULL DEFAULT 0,
    escrow TEXT NOT NULL,
    block_height INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_provider ON jobs (provider, state, taken, seq);
CREATE TABLE IF NOT EXISTS job_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT NOT NULL,
    message TEXT NOT NULL,
    exit_code INTEGER,
    at TEXT NOT NULL,
    block_height INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS job_history_job ON job_history (job_id, id);
CREATE TABLE IF NOT EXISTS decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    decision_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS decisions_job ON decisions (job_id, seq);
CREATE TABLE IF NOT EXISTS usage_records (
    record_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    is_final INTEGER NOT NULL,
    data TEXT NOT NULL,
    received_at TEXT NOT NULL,
    UNIQUE (job_id, sequence)
);
CREATE TABLE IF NOT EXISTS job_prices (
    job_id TEXT PRIMARY KEY,
    fixed_at TEXT NOT NULL,
    fixed_when TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS settlements (
    job_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS publisher_keys (
    publisher TEXT NOT NULL,
    key_id TEXT NOT NULL,
    public_key TEXT NOT NULL,
    registered_at TEXT NOT NULL,
    PRIMARY KEY (publisher, key_id)
);
CREATE TABLE IF NOT EXISTS templates (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    template_id TEXT NOT NULL,
    version TEXT NOT NULL,
    publisher TEXT NOT NULL,
    status TEXT NOT NULL,
    data TEXT NOT NULL,
    UNIQUE (template_id, version)
);
CREATE INDEX IF NOT EXISTS templates_by_id ON templates (template_id, seq);
"""

SCHEMA_OBJECTS = frozenset(re.findall(r"CREATE (?:TABLE|INDEX) IF NOT EXISTS (\w+)", SCHEMA))

# The node registry (``NodeLedger``): its own tables in the same file.
NODE_SCHEMA = """
CREATE TABLE IF NOT EXISTS node_allowed_keys (
    cluster_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    public_key TEXT NOT NULL,
    scheduler_node TEXT NOT NULL,
    allowed_at TEXT NOT NULL,
    revoked_at TEXT,
    PRIMARY KEY (cluster_id, node_id)
);
CREATE TABLE IF NOT EXISTS node_registry (
    cluster_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    public_key TEXT NOT NULL,
    hostname TEXT NOT NULL DEFAULT '',
    agent_version TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    registered_at TEXT NOT NULL,
    state_changed_at TEXT NOT NULL,
    last_sequence INTEGER NOT NULL DEFAULT 0,
    last_heartbeat_at TEXT,
    capacity TEXT,
    health TEXT,
    placement TEXT,
    latency TEXT,
    PRIMARY KEY (cluster_id, node_id)
);
CREATE INDEX IF NOT EXISTS node_registry_cluster_state ON node_registry (cluster_id, state);
CREATE TABLE IF NOT EXISTS node_metadata_updates (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    update_id TEXT NOT NULL UNIQUE,
    cluster_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    previous_state TEXT,
    reason TEXT NOT NULL DEFAULT '',
    payload TEXT NOT NULL,
    created_at TEXT NOT NULL,
    audited INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS node_metadata_updates_node ON node_metadata_updates (cluster_id, node_id, seq);
"""
