#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages (SLURM, MariaDB, munge, sshd), the venv, the local
# SLURM cluster; then lint, types and pytest; then stops what it started. Temporal dev servers are started by the
# tests themselves (tests/conftest.py). Extra arguments go to pytest.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
log() { printf '\n== %s\n' "$*"; }

log "system packages"
if [ "$(id -u)" = 0 ]; then
  temporal-dev/install-system-deps.sh || { echo "system packages failed" >&2; exit 1; }
else
  echo "not root: skipping apt (SLURM tests need the cluster from temporal-dev/slurm-up.sh)"
fi
log "python environment"
scripts/setup-venv.sh test || exit 1

started_slurm=0
if [ "$(id -u)" = 0 ] && [ -z "${VEHPC_NO_SLURM:-}" ]; then
  log "local SLURM cluster"
  if ! temporal-dev/slurm-up.sh; then echo "slurm-up failed" >&2; exit 1; fi
  started_slurm=1
  export VEHPC_REQUIRE_SLURM=1  # the cluster is up: a SLURM test that cannot reach it fails instead of skipping
fi
cleanup() {
  if [ "$started_slurm" = 1 ]; then log "stopping the SLURM cluster"; temporal-dev/slurm-down.sh || true; fi
}
trap cleanup EXIT

log "lint, types and the layer contract"
make --no-print-directory lint || exit 1

log "pytest"
# --durations: the 30 slowest tests close the report, to keep the suite's time in view (it should stay under 45 min)
.venv/bin/pytest -q --durations=30 "$@"
rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests: that is a failure" >&2; rc=1; fi
exit "$rc"
