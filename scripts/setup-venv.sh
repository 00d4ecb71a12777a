#!/usr/bin/env bash
# Create .venv (if missing) and install the project with the given extras (default: test), every package at the
# version requirements-test.lock pins (the versions CI tested; packages it does not list resolve freely). Quiet
# and idempotent: a venv whose install stamp is newer than pyproject.toml and the lock file is left as it is.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
extras=${1:-test}
py=${PYTHON:-python3}
lock=requirements-test.lock
cd "$repo"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
pip_install() { # pip's own notes about unused index locations are dropped; pip's exit status is kept
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }
}
stamp=.venv/.installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
  pip_install --upgrade pip || true # an older pip installs the project as well
  pip_install -c "$lock" -e ".[$extras]" || { echo "setup-venv: pip install failed" >&2; exit 1; }
  .venv/bin/python -c "import temporalio, virtengine_hpc.templates" || { echo "setup-venv: install failed" >&2; exit 1; }
  touch "$stamp"
fi
# Bytecode for the project's own modules. Temporal's workflow sandbox re-imports a workflow's module for every
# workflow run; without a .pyc (an editable install, or PYTHONDONTWRITEBYTECODE) that is a compile of
# workflows/hpc_job.py per job, ~3 ms of worker CPU (benchmarks/pipeline.py). A wheel install compiles at install.
.venv/bin/python -m compileall -q -j 0 virtengine_hpc workflows activities workers >/dev/null
