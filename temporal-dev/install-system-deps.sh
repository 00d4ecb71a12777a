#!/usr/bin/env bash
# Install the Debian packages that the local SLURM stack needs (slurm-up.sh), and promtool for the alert tests.
#
# Idempotent: when every package is already installed it does not touch apt at all.
# Must run as root on Debian 12 (bookworm). apt never starts the daemons: a temporary
# /usr/sbin/policy-rc.d (exit 101) is put in place when none exists, and removed after.
set -euo pipefail

PACKAGES=(
  slurmctld slurmd slurm-client slurmdbd slurmrestd slurm-wlm-jwt-plugin libslurm-dev
  munge
  mariadb-server mariadb-client
  openssh-server openssh-client
  procps iproute2 curl passwd util-linux
  # workload templates: real MPI (mpirun, mpi4py; libpmix-dev lets srun --mpi=pmix load PMIx), Dask (data-processing)
  openmpi-bin python3-mpi4py libpmix-dev python3-distributed
  # promtool, which tests the operators' alert rules (deploy/prometheus/alerts.yml; apt never starts the server)
  prometheus
)

log() { printf 'install-system-deps: %s\n' "$*" >&2; }

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)
  [[ "$status" == ii* ]] || missing+=("$pkg")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  log "all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
  log "must run as root to install: ${missing[*]}"
  exit 1
fi

POLICY=/usr/sbin/policy-rc.d
made_policy=0
cleanup() {
  if [[ $made_policy -eq 1 ]]; then rm -f "$POLICY"; fi
}
trap cleanup EXIT
if [[ ! -e "$POLICY" ]]; then
  printf '#!/bin/sh\n# temporary, from %s: keep apt from starting daemons\nexit 101\n' "$0" >"$POLICY"
  chmod 0755 "$POLICY"
  made_policy=1
fi

export DEBIAN_FRONTEND=noninteractive
log "installing: ${missing[*]}"
start=$(date +%s.%N)
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
  "${missing[@]}" >/dev/null
log "done in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}') s"
