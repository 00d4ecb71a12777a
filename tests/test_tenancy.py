"""One account per tenant: hpc.tenants validation, the mapping rules and the provider-side pool assignments.

The SLURM and MOAB behaviour (jobs really running as these accounts) is in tests/test_slurm_tenants.py and
tests/test_moab_adapter.py; this module covers what every scheduler relies on.
"""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path
from typing import Any

import pytest

from activities.tenant_accounts import AssignmentStore, TenantAccounts
from virtengine_hpc.config import Config, load_config
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.tenancy import TenantAccountError, TenantRules

ALICE, BOB, CAROL = "virtengine1tenant0alice", "virtengine1tenant0bob", "virtengine1tenant0carol"


def config(tmp_path: Path, **tenants: Any) -> Config:
    return load_config(
        data={"hpc": {"job_service": {"state_store_path": str(tmp_path)}, "tenants": tenants}}, env={}
    )


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ({"pool": ["root"]}, "root can never be a tenant's account"),
        ({"accounts": {ALICE: "root"}}, "root can never be a tenant's account"),
        ({"pool": ["t1", "t1"]}, "account t1 is in the pool more than once"),
        ({"accounts": {ALICE: "t1", BOB: "t1"}}, "account t1 is mapped to more than one tenant"),
        ({"pool": ["t1"], "accounts": {ALICE: "t1"}}, "account t1 is both in pool and fixed"),
        ({"pool": ["Bad Name"]}, "is not a valid account name"),
        ({"accounts": {"not an address!": "t1"}}, "is not a tenant address"),
    ],
)
def test_bad_tenant_mappings_are_refused_at_load(tenants: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(data={"hpc": {"tenants": tenants}}, env={})


@pytest.mark.parametrize(
    "section",
    [
        {"slurm": {"ssh_user": "vehpc"}},
        {"slurm": {"rest_user": "vehpc"}},
        {"moab": {"ssh_user": "vehpc"}},
        {"moab": {"mws_job_user": "vehpc"}},
        {"clusters": [{"cluster_id": "c2", "slurm": {"ssh_user": "vehpc"}}]},
    ],
)
def test_the_submit_account_can_never_be_a_tenant_account(section: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="the provider's own account must never run a tenant's job"):
        load_config(data={"hpc": {"tenants": {"pool": ["t1", "vehpc"]}, **section}}, env={})


def test_rest_user_has_no_root_default_and_refuses_root() -> None:
    assert load_config(data={}, env={}).hpc.slurm.rest_user is None
    with pytest.raises(ConfigError, match=re.escape("hpc.slurm.rest_user: root is refused")):
        load_config(data={"hpc": {"slurm": {"rest_user": "root"}}}, env={})


def test_ood_user_mapping_moved_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=re.escape("user_mapping moved to hpc.tenants.accounts")):
        load_config(data={"hpc": {"ood": {"user_mapping": {ALICE: "u1"}}}}, env={})


def test_fixed_accounts_win_and_the_pool_is_handed_out_in_order(tmp_path: Path) -> None:
    accounts = TenantAccounts.from_config(config(tmp_path, accounts={ALICE: "alice"}, pool=["t1", "t2"]))
    assert accounts.account_for(ALICE, submit_account="vehpc") == "alice"
    assert accounts.account_for(BOB, submit_account="vehpc") == "t1"
    assert accounts.account_for(CAROL, submit_account="vehpc") == "t2"
    assert accounts.account_for(BOB, submit_account="vehpc") == "t1"
    assert accounts.accounts() == {"alice", "t1", "t2"}
    assert accounts.assigned(CAROL) == "t2"
    assert accounts.assigned("virtengine1tenant0dave") is None  # asking does not assign


def test_a_tenant_without_an_account_is_refused_with_a_typed_non_retryable_error(tmp_path: Path) -> None:
    none_at_all = TenantAccounts.from_config(config(tmp_path))
    with pytest.raises(TenantAccountError, match=re.escape("hpc.tenants.pool is empty")) as caught:
        none_at_all.account_for(ALICE, submit_account="vehpc")
    assert caught.value.transient is False
    assert caught.value.code == "tenant_account_missing"
    full = TenantAccounts.from_config(config(tmp_path, pool=["t1"]))
    full.account_for(ALICE, submit_account="vehpc")
    with pytest.raises(TenantAccountError, match=re.escape("all 1 accounts of hpc.tenants.pool are taken")):
        full.account_for(BOB, submit_account="vehpc")
    assert full.account_for(ALICE, submit_account="vehpc") == "t1"  # the others go on


def test_assignments_survive_a_restart_and_are_shared_by_every_worker(tmp_path: Path) -> None:
    first = TenantAccounts.from_config(config(tmp_path, pool=["t1", "t2", "t3"]))
    assert first.account_for(BOB, submit_account=None) == "t1"
    # A restarted worker, with the pool reordered by the operator: Bob keeps t1, Alice gets the next free one.
    again = TenantAccounts.from_config(config(tmp_path, pool=["t3", "t2", "t1"]))
    assert again.account_for(BOB, submit_account=None) == "t1"
    assert again.account_for(ALICE, submit_account=None) == "t3"
    assert first.account_for(ALICE, submit_account=None) == "t3"  # the other worker reads the same row
    assert (tmp_path / "tenant-accounts.db").stat().st_mode & 0o777 == 0o600


def _assign_many(path: str, tenants: list[str], out: Any) -> None:
    rules = TenantRules(pool=tuple(f"t{i}" for i in range(40)))
    store = AssignmentStore(Path(path))
    out.put({tenant: store.assign(tenant, rules) for tenant in tenants})


def test_workers_assigning_at_once_never_share_an_account(tmp_path: Path) -> None:
    path = str(tmp_path / "assign.db")
    AssignmentStore(Path(path))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    groups = [[f"tenant{p}x{i}" for i in range(10)] for p in range(4)]
    procs = [ctx.Process(target=_assign_many, args=(path, group, out)) for group in groups]
    for proc in procs:
        proc.start()
    answers: dict[str, str] = {}
    for _ in procs:
        answers.update(out.get(timeout=60))
    for proc in procs:
        proc.join(60)
    assert len(answers) == 40
    assert len(set(answers.values())) == 40  # 40 tenants, 40 different accounts
    assert AssignmentStore(Path(path)).all() == answers


def test_root_and_the_submit_account_are_refused_at_submit(tmp_path: Path) -> None:
    accounts = TenantAccounts.from_config(config(tmp_path, accounts={ALICE: "alice", BOB: "bob"}))
    with pytest.raises(TenantAccountError, match="the provider's own submit account") as caught:
        accounts.account_for(ALICE, submit_account="alice")
    assert caught.value.code == "tenant_account_refused"
    uid0 = TenantAccounts(accounts.rules, None, uid_of=lambda a: 0 if a == "bob" else 1000)
    with pytest.raises(TenantAccountError, match="uid 0"):
        uid0.account_for(BOB, submit_account="vehpc")
    assert uid0.account_for(ALICE, submit_account="vehpc") == "alice"


def test_isolation_none_runs_as_the_submit_account_but_never_as_root(tmp_path: Path) -> None:
    shared = TenantAccounts.from_config(config(tmp_path, isolation="none", pool=["t1"]))
    assert shared.account_for(ALICE, submit_account="vehpc") == "vehpc"
    assert shared.accounts() == frozenset()
    with pytest.raises(TenantAccountError, match="uid 0"):
        shared.account_for(ALICE, submit_account="root")


def test_a_worker_says_at_start_that_every_job_would_be_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from activities.schedulers.slurm import SlurmAdapter
    from virtengine_hpc.config import Secrets

    data = {"hpc": {"job_service": {"state_store_path": str(tmp_path)}, "slurm": {"transport": "cli"}}}
    SlurmAdapter.from_config(load_config(data=data, env={}), Secrets(), "c1")
    assert "every job of cluster c1 will be refused with tenant_account_missing" in caplog.text
    caplog.clear()
    data["hpc"]["tenants"] = {"pool": ["t1"]}
    SlurmAdapter.from_config(load_config(data=data, env={}), Secrets(), "c1")
    assert "will be refused" not in caplog.text
