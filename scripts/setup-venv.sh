#!/usr/bin/env bash
# Create .venv (if missing) and install the project with the given extras (default: test). Quiet and idempotent:
# a venv whose install stamp is newer than pyproject.toml is left as it is.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
extras=${1:-test}
py=${PYTHON:-python3}
cd "$repo"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$extras]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import temporalio, virtengine_hpc" || { echo "setup-venv: install failed" >&2; exit 1; }
  touch "$stamp"
fi
# Bytecode for the project's own modules. Temporal's workflow sandbox re-imports a workflow's module for every
# workflow run; without a .pyc (an editable install, or PYTHONDONTWRITEBYTECODE) that is a compile of
# workflows/hpc_job.py per job, ~3 ms of worker CPU (benchmarks/pipeline.py). A wheel install compiles at install.
.venv/bin/python -m compileall -q -j 0 virtengine_hpc workflows activities workers >/dev/null
