#!/usr/bin/env bash
# Print a fresh slurmrestd JWT for USER (default hpcuser) to stdout, nothing else.
#   temporal-dev/slurm-token.sh [USER] [LIFESPAN_SECONDS (default 3600)]
# Minting a token for another user needs root (or SlurmUser). Keep it out of logs:
#   SLURM_JWT_TOKEN=$(temporal-dev/slurm-token.sh hpcuser 600)
# Submitting as each tenant's account through slurmrestd needs a token of SlurmUser:
#   SLURM_JWT_TOKEN=$(temporal-dev/slurm-token.sh slurm 600)
# Never one for root: it is refused here.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${VEHPC_DEV_DIR:-$(dirname "$HERE")/.dev}/slurm
USER_NAME=${1:-hpcuser}
LIFESPAN=${2:-3600}

[[ $USER_NAME =~ ^[a-z_][a-z0-9_-]*$ ]] || { echo "slurm-token: bad user name" >&2; exit 2; }
[[ $USER_NAME != root ]] || { echo "slurm-token: no token for root (use slurm, SlurmUser, to act as others)" >&2; exit 2; }
[[ $LIFESPAN =~ ^[0-9]+$ ]] || { echo "slurm-token: lifespan must be seconds" >&2; exit 2; }
[[ -f $STATE/etc/slurm.conf ]] || { echo "slurm-token: no cluster in $STATE (run slurm-up.sh)" >&2; exit 1; }

line=$(SLURM_CONF=$STATE/etc/slurm.conf scontrol token username="$USER_NAME" lifespan="$LIFESPAN")
[[ $line == SLURM_JWT=* ]] || { echo "slurm-token: unexpected 'scontrol token' output" >&2; exit 1; }
printf '%s\n' "${line#SLURM_JWT=}"
