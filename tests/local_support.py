"""What tests of the local executor need when its jobs run as tenant accounts (the tests run as root).

A job's account must reach its work directory and the files a test gives it, and pytest's own temporary root
(``/tmp/pytest-of-root``, mode 0700) lets no other account through: such state lives under one directory per test
session that others may pass through but not list (0711), removed at the session's end. Tenants' programs run
with the system's Python (``JOB_PYTHON``): the venv's interpreter may live under ``/root``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from activities.tenant_accounts import TenantAccounts

#: The tests' pool of tenant accounts (Unix users made by temporal-dev/slurm-up.sh, which the test runner calls).
TENANT_POOL = ("vehpc-t1", "vehpc-t2", "vehpc-t3", "vehpc-t4")
JOB_PYTHON = "python3"

_session_root: Path | None = None


def _root() -> Path:
    global _session_root
    if _session_root is None:
        _session_root = Path(tempfile.mkdtemp(prefix="vehpc-tests-"))
        _session_root.chmod(0o711)
        atexit.register(shutil.rmtree, _session_root, True)
    return _session_root


def reachable_dir(prefix: str = "d") -> Path:
    """A fresh directory every account may pass through (0711) but not list or write."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=_root()))
    path.chmod(0o711)
    return path


def shared_dir(prefix: str = "shared") -> Path:
    """A fresh directory every account may write to (sticky, like /tmp): where a test and its jobs meet."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=_root()))
    path.chmod(0o1777)
    return path


def running_as_root() -> bool:
    return os.geteuid() == 0


def tenant_accounts(mapping: dict[str, str] | None = None) -> TenantAccounts:
    """Tenants' accounts for an adapter the test builds: ``mapping`` (default ``tenant1`` -> ``vehpc-t1``,
    ``tenant2`` -> ``vehpc-t2``) when the tests run as root, else every job as the tests' own account."""
    from activities.tenant_accounts import TenantAccounts
    from virtengine_hpc.tenancy import TenantRules

    if not running_as_root():
        return TenantAccounts(TenantRules(isolated=False), None)
    fixed = {"tenant1": TENANT_POOL[0], "tenant2": TENANT_POOL[1]} if mapping is None else mapping
    return TenantAccounts(TenantRules(fixed=fixed), None)
