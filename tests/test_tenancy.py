"""One account per tenant: hpc.tenants validation, the mapping rules and the provider-side pool assignments.

The SLURM and MOAB behaviour (jobs really running as these accounts) is in tests/test_slurm_tenants.py and
tests/test_moab_adapter.py; this module covers what every scheduler relies on.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.audit import read_events
from activities.tenant_accounts import AssignmentStore, TenantAccounts
from tests.local_support import running_as_root
from virtengine_hpc.config import Config, load_config
from virtengine_hpc.errors import ConfigError
from virtengine_hpc.tenancy import TenantAccountError, TenantRules, check_account, uid_min

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


# ---- system and service accounts are never a tenant's -------------------------------------------------------------


@pytest.mark.parametrize("account", ["munge", "slurm"])
def test_munge_and_slurm_are_refused_by_name_at_load(account: str) -> None:
    with pytest.raises(ConfigError, match=f"{account} can never be a tenant's account"):
        load_config(data={"hpc": {"tenants": {"accounts": {ALICE: account}}}}, env={})
    with pytest.raises(ConfigError, match=f"{account} can never be a tenant's account"):
        load_config(data={"hpc": {"tenants": {"pool": ["t1", account]}}}, env={})


def _system_accounts() -> list[str]:
    """Accounts of this host below UID_MIN (Debian has these; each one can do more than a tenant may)."""
    found = []
    for name in ("daemon", "bin", "mysql", "www-data"):
        try:
            if pwd.getpwnam(name).pw_uid < uid_min():
                found.append(name)
        except KeyError:
            continue
    return found


@pytest.mark.parametrize("account", _system_accounts())
def test_a_system_account_of_this_host_is_refused_when_the_worker_starts(
    tmp_path: Path, account: str
) -> None:
    for tenants in ({"accounts": {ALICE: account}}, {"pool": ["t1", account]}):
        with pytest.raises(
            ConfigError, match=rf"refusing to run a tenant's job as {account}: uid \d+ is a system"
        ):
            TenantAccounts.from_config(config(tmp_path, **tenants))


@pytest.mark.parametrize(
    ("uid", "privileged", "message"),
    [
        (0, {}, "uid 0"),
        (999, {}, "uid 999 is a system account's (below UID_MIN 1000"),
        (1, {}, "uid 1 is a system account's"),
        (5000, {"alice": "the cluster's SlurmUser"}, "the cluster's SlurmUser"),
        (5000, {"alice": "a Slurm Operator (sacctmgr AdminLevel)"}, "a Slurm Operator"),
    ],
)
def test_a_privileged_account_is_refused_at_every_submission(
    uid: int, privileged: dict[str, str], message: str
) -> None:
    """The uid as the worker's host knows it, and what the scheduler says is privileged (the SLURM adapter reads
    SlurmUser, operators and administrators from the cluster): a job of that tenant is refused, typed and
    non-retryable; other tenants go on."""
    accounts = TenantAccounts(
        TenantRules(fixed={ALICE: "alice", BOB: "bob"}), None, uid_of=lambda a: uid if a == "alice" else 5000
    )
    accounts.refuse(privileged, cluster_id="c1")
    with pytest.raises(TenantAccountError, match=re.escape(message)) as caught:
        accounts.account_for(ALICE, submit_account="vehpc")
    assert caught.value.code == "tenant_account_refused" and caught.value.transient is False
    assert accounts.account_for(BOB, submit_account="vehpc") == "bob"


def test_uid_min_comes_from_login_defs(tmp_path: Path) -> None:
    defs = tmp_path / "login.defs"
    defs.write_text("# comment\nUID_MIN\t\t\t 2000\nUID_MAX 60000\n")
    assert uid_min(defs) == 2000
    assert uid_min(tmp_path / "missing") == 1000
    with pytest.raises(TenantAccountError, match="below UID_MIN 2000"):
        check_account("t1", submit_account=None, uid=1500, lowest_uid=uid_min(defs))


@pytest.mark.skipif(not running_as_root(), reason="the local executor switches accounts only as root")
@pytest.mark.parametrize("account", ["munge", "slurm", *_system_accounts()])
def test_the_local_executor_refuses_a_system_or_service_account(account: str) -> None:
    """munge reads munge.key (a Slurm credential for any uid); slurm is SlurmUser; the others are system accounts:
    the local executor never runs a tenant's script as one."""
    from activities.schedulers.local import LocalAdapter
    from tests.local_support import reachable_dir
    from virtengine_hpc.config import LocalSchedulerConfig

    adapter = LocalAdapter(
        LocalSchedulerConfig(allow_unisolated=True),
        reachable_dir("tenancy") / "state",
        "c",
        TenantAccounts(TenantRules(fixed={"tenant1": account}), None),
    )
    with pytest.raises(TenantAccountError, match=f"refusing to run a tenant's job as {account}"):
        adapter._run_as("tenant1")


# ---- two tenants never share one account ----------------------------------------------------------------------------

X, Z = "virtengine1tenantx", "virtengine1tenantz"


def test_an_account_moved_from_the_pool_to_a_fixed_tenant_is_refused_while_its_pool_tenant_holds_it(
    tmp_path: Path,
) -> None:
    """X got vehpc-t1 from the pool; the operator then fixes vehpc-t1 for Z. The worker refuses to start, naming
    both tenants and the remedy; a worker that started before the edit refuses both tenants' jobs."""
    before = TenantAccounts.from_config(config(tmp_path, pool=["vehpc-t1", "vehpc-t2"]))
    assert before.account_for(X, submit_account="hpcuser") == "vehpc-t1"
    moved = {"accounts": {Z: "vehpc-t1"}, "pool": ["vehpc-t2"]}
    with pytest.raises(
        ConfigError, match=rf"account vehpc-t1 is fixed for tenant {Z} .* gave it to tenant {X}"
    ):
        TenantAccounts.from_config(config(tmp_path, **moved))
    running = TenantAccounts(TenantRules.from_config(config(tmp_path, **moved).hpc.tenants), before.store)
    for tenant in (X, Z):
        with pytest.raises(TenantAccountError, match="two tenants would share one account") as caught:
            running.account_for(tenant, submit_account="hpcuser")
        assert caught.value.code == "tenant_account_refused"
        assert str(caught.value).startswith(f"tenant {tenant}'s job is refused")


def test_an_assigned_account_that_left_the_pool_stays_its_tenants_and_is_still_looked_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    TenantAccounts.from_config(config(tmp_path, pool=["vehpc-t1", "vehpc-t2"])).account_for(
        X, submit_account=None
    )
    after = TenantAccounts.from_config(config(tmp_path, pool=["vehpc-t2"]))
    assert "pool account vehpc-t1 is no longer in hpc.tenants.pool but tenant" in caplog.text
    assert "vehpc-t1" in after.accounts(), "its jobs are still looked up and swept"
    assert after.account_for(X, submit_account=None) == "vehpc-t1"
    assert after.account_for(Z, submit_account=None) == "vehpc-t2"
    assert after.tenant_of("vehpc-t1") == X
    emptied = TenantAccounts.from_config(config(tmp_path, accounts={Z: "zed"}))
    assert "vehpc-t1" in emptied.accounts() and emptied.account_for(X, submit_account=None) == "vehpc-t1"


def test_a_pool_account_in_use_on_the_cluster_is_never_handed_to_a_new_tenant(tmp_path: Path) -> None:
    """The assignments file was deleted (or another host keeps its own): X's vehpc-t1 looks free in the new file.
    The SLURM adapter asks the cluster before the pool hands out an account (tests/test_slurm_tenants.py on the
    real cluster); what it finds in use is held back."""
    path = tmp_path / "tenant-accounts.db"
    rules = TenantRules(pool=("vehpc-t1", "vehpc-t2"))
    worker_a = TenantAccounts(rules, AssignmentStore(path), uid_of=lambda a: 5000)
    assert worker_a.account_for(X, submit_account="hpcuser") == "vehpc-t1"
    path.unlink()
    worker_b = TenantAccounts(rules, AssignmentStore(path), uid_of=lambda a: 5000)
    assert worker_b.needs_assignment(Z) and worker_b.unassigned_pool() == ["vehpc-t1", "vehpc-t2"]
    worker_b.hold_back({"vehpc-t1": "2 live job(s)"}, cluster_id="c1")
    assert worker_b.unassigned_pool() == ["vehpc-t2"]
    assert worker_b.account_for(Z, submit_account="hpcuser") == "vehpc-t2"
    with pytest.raises(TenantAccountError, match=re.escape("all 2 accounts of hpc.tenants.pool are taken")):
        worker_b.account_for("virtengine1tenanty", submit_account="hpcuser")


def test_the_operator_releases_a_pool_assignment_to_move_its_account_to_another_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The remedy the start refusal names: ``virtengine-hpc tenants release X`` once X's jobs ended and its files
    are gone; then the worker starts, Z runs as the account and X gets another one from the pool."""
    from virtengine_hpc.cli import main

    TenantAccounts.from_config(config(tmp_path, pool=["vehpc-t1", "vehpc-t2"])).account_for(
        X, submit_account=None
    )
    moved = {"accounts": {Z: "vehpc-t1"}, "pool": ["vehpc-t2"]}
    path = tmp_path / "config.yaml"
    audit_log = tmp_path / "audit.log"
    path.write_text(
        yaml.safe_dump(
            {
                "hpc": {
                    "job_service": {"state_store_path": str(tmp_path)},
                    "tenants": moved,
                    "audit": {"log_path": str(audit_log)},
                }
            }
        )
    )
    assert main(["-c", str(path), "tenants", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"tenant": Z, "account": "vehpc-t1", "source": "accounts"},
        {"tenant": X, "account": "vehpc-t1", "source": "pool"},
    ]
    assert main(["-c", str(path), "tenants", "release", X]) == 0
    assert f"released vehpc-t1 from tenant {X}" in capsys.readouterr().out
    assert main(["-c", str(path), "tenants", "release", X]) == 2, "nothing left to release: a clear error"
    [released] = [e for e in read_events(audit_log) if e["event_type"] == "tenant_account_released"]
    assert released["success"] is True and released["category"] == "security"
    assert {k: released["details"][k] for k in ("tenant", "account", "forced", "released_by")} == {
        "tenant": X,
        "account": "vehpc-t1",
        "forced": False,
        "released_by": pwd.getpwuid(os.getuid()).pw_name,
    }
    after = TenantAccounts.from_config(config(tmp_path, **moved))
    assert after.account_for(Z, submit_account=None) == "vehpc-t1"
    assert after.account_for(X, submit_account=None) == "vehpc-t2"
