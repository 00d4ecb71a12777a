#!/usr/bin/env bash
# Stop the local Temporal dev server started by temporal-up.sh (its data stays in $VEHPC_DEV_DIR/temporal;
# --purge removes it). Idempotent.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dev=${VEHPC_DEV_DIR:-$repo/.dev}
state=$dev/temporal
pidfile=$state/server.pid
alive() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || return 1; [ -n "$st" ] && [ "${st#Z}" = "$st" ]; }
if [ -f "$pidfile" ]; then
  pid=$(cat "$pidfile")
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
    echo "temporal dev server stopped (pid $pid)"
  fi
  rm -f "$pidfile"
else
  echo "temporal dev server not running"
fi
if [ "${1:-}" = "--purge" ]; then rm -rf "$state"; echo "removed $state"; fi
