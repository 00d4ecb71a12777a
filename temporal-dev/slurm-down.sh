#!/usr/bin/env bash
# Stop the local SLURM cluster that slurm-up.sh started: exactly the daemons named by the pid files
# in the state folder, newest first, waiting until each has exited. The state folder stays for
# inspection; `--purge` also ends the job processes this cluster left behind and removes the folder.
# Stopping a cluster that is not running succeeds.
#
# Running jobs survive a plain down (their slurmstepd keeps going, and slurmd re-adopts them on the
# next up), as on a real cluster when its daemons restart.
set -euo pipefail

PURGE=0
for arg in "$@"; do
  case $arg in
    --purge) PURGE=1 ;;
    -h | --help)
      sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "usage: $0 [--purge]" >&2
      exit 2
      ;;
  esac
done

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
DEV_DIR=${VEHPC_DEV_DIR:-$REPO/.dev}
T0=$(date +%s%N)
log() { printf 'slurm-down: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root"
if [[ ! -d $DEV_DIR/slurm ]]; then
  log "nothing to stop: $DEV_DIR/slurm does not exist"
  exit 0
fi
DEV_DIR=$(cd "$DEV_DIR" && pwd)
STATE=$DEV_DIR/slurm
RUN=$STATE/run

exec 9>>"$STATE/.lock"
flock -w 120 9 || die "another slurm-up/slurm-down holds $STATE/.lock"

declare -A PIDFILE=(
  [munged]=$RUN/munge/munged.pid
  [mariadbd]=$RUN/mysql/mariadbd.pid
  [slurmdbd]=$RUN/slurm/slurmdbd.pid
  [slurmctld]=$RUN/slurm/slurmctld.pid
  [slurmd]=$RUN/slurm/slurmd.pid
  [slurmrestd]=$RUN/slurmrestd.pid
  [sshd]=$RUN/sshd.pid
)

# same test as slurm-up.sh: alive, not a zombie, the expected binary, and one of ours
pid_alive() {
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null | tr -d ' ') || true
  [[ -n $stat && $stat != Z* ]]
}
daemon_pid() {
  local name=$1 pidfile=${PIDFILE[$1]} pid exe
  [[ -s $pidfile ]] || return 1
  pid=$(tr -dc '0-9' <"$pidfile")
  [[ -n $pid ]] && pid_alive "$pid" || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  exe=${exe% (deleted)}
  [[ $exe == "$(readlink -f "/usr/sbin/$name")" ]] || return 1 # e.g. slurmctld -> slurmctld-wlm
  grep -qaF "$STATE/" "/proc/$pid/cmdline" "/proc/$pid/environ" 2>/dev/null || return 1
  echo "$pid"
}

stopped=()
# stop a group of daemons at once: SIGTERM, wait up to 30 s for all to exit, then SIGKILL
stop_group() {
  local name pid pids=() names=() deadline
  for name in "$@"; do
    if pid=$(daemon_pid "$name"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      names+=("$name")
    elif [[ -e ${PIDFILE[$name]} ]]; then
      log "$name: stale pid file removed"
      rm -f "${PIDFILE[$name]}"
    fi
  done
  deadline=$(($(date +%s) + 30))
  local i
  for i in "${!pids[@]}"; do
    while pid_alive "${pids[$i]}"; do
      if (($(date +%s) > deadline)); then
        log "WARNING: ${names[$i]} (pid ${pids[$i]}) still running after 30 s, sending SIGKILL"
        kill -KILL "${pids[$i]}" 2>/dev/null || true
        sleep 0.2
        break
      fi
      sleep 0.05
    done
    rm -f "${PIDFILE[${names[$i]}]}"
    stopped+=("${names[$i]}")
  done
}

stop_group sshd slurmrestd slurmd
stop_group slurmctld
stop_group slurmdbd
stop_group mariadbd munged

# processes still tied to this cluster (job steps and their children carry our SLURM_CONF)
leftovers() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ $p != "$$" ]] || continue
    grep -qaF "SLURM_CONF=$STATE/etc/slurm.conf" "/proc/$p/environ" 2>/dev/null && pid_alive "$p" && echo "$p"
  done
  return 0
}
mapfile -t left < <(leftovers)
if ((${#left[@]})); then
  if ((PURGE)); then
    log "ending ${#left[@]} job process(es) left by this cluster"
    kill -KILL "${left[@]}" 2>/dev/null || true
  else
    log "note: ${#left[@]} job process(es) still run (slurmd re-adopts them on the next up; --purge ends them)"
  fi
fi

ms=$((($(date +%s%N) - T0) / 1000000))
if ((${#stopped[@]})); then
  log "stopped ${stopped[*]} in $ms ms"
else
  log "nothing was running"
fi

if ((PURGE)); then
  # wait for the killed job processes before deleting the folder they may write into
  for _ in $(seq 50); do
    mapfile -t left < <(leftovers)
    ((${#left[@]})) || break
    sleep 0.1
  done
  rm -rf "$STATE"
  log "removed $STATE"
else
  log "state kept in $STATE (logs in $STATE/log)"
fi
