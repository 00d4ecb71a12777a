#!/usr/bin/env bash
# Write requirements-test.lock: every package a fresh venv gets from `pip install -e ".[test]"`, at the version it
# got. scripts/setup-venv.sh installs with it as constraints, so CI runs on what was tested. Run it after changing
# the dependencies in pyproject.toml (or to take newer releases), then run the tests and commit both files.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip 2>&1 | { grep -v '^WARNING: Location' || true; }
"$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$repo[test]" 2>&1 | { grep -v '^WARNING: Location' || true; }
{
  echo "# Versions of the test environment CI runs (pip constraints). Written by scripts/lock-test-deps.sh from a fresh"
  echo "# venv with the project's [test] extra; scripts/setup-venv.sh installs with -c requirements-test.lock."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check
} >"$repo/requirements-test.lock"
echo "wrote $repo/requirements-test.lock ($(grep -vc '^#' "$repo/requirements-test.lock") packages)"
