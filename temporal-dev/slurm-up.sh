#!/usr/bin/env bash
# Bring up a one-node SLURM 22.05 cluster on loopback, with all state in one folder:
#   munged, MariaDB (own datadir) + slurmdbd, slurmctld, slurmd,
#   slurmrestd (JWT, user slurmrest, 127.0.0.1:6820), sshd (127.0.0.1:2222, user hpcuser, key auth),
#   and a pool of tenant accounts (vehpc-t1..vehpc-t4: Unix users with a 0700 job directory each in the jobs
#   directory, which is root's and 0755, an SSH key each, Slurm associations with MaxWall), as the provider gives
#   each tenant its own account. PrivateData hides every user's jobs, usage and accounts from the others. hpcuser,
#   the provider's own submit account, is a Slurm operator (it cancels and reads every tenant's jobs) and runs no
#   tenant job.
#
# State folder: ${VEHPC_DEV_DIR:-<repo>/.dev}/slurm. Config stays out of /etc (SLURM_CONF).
# Idempotent: daemons that already run (per their pid files) are left alone, stale pid files
# from a crash are ignored, and every daemon is checked for readiness. Writes <state>/env.sh and
# <state>/env.json for clients. Run as root; packages come from install-system-deps.sh.
#
# Environment knobs:
#   VEHPC_DEV_DIR          base folder (default <repo>/.dev)
#   VEHPC_SLURM_CGROUP     auto (default) | 1 (require cgroup v1 memory enforcement) | 0 (linuxproc)
#   VEHPC_SLURM_JWT_LIFESPAN  token lifespan in seconds (default 86400)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
DEV_DIR=${VEHPC_DEV_DIR:-$REPO/.dev}
mkdir -p "$DEV_DIR"
DEV_DIR=$(cd "$DEV_DIR" && pwd)
STATE=$DEV_DIR/slurm

CLUSTER=localcluster
PARTITION=debug
ACCOUNT=vehpc
# not "localhost": Slurm maps any unknown node name to a lone node called localhost, so
# `scontrol update nodename=typo state=drain` would drain it instead of failing
NODE=node1
JOB_USER=hpcuser
TENANTS=(vehpc-t1 vehpc-t2 vehpc-t3 vehpc-t4)
REST_DAEMON_USER=slurmrest
HOST=127.0.0.1
CTLD_PORT=6817
SLURMD_PORT=6818
DBD_PORT=6819
REST_PORT=6820
MYSQL_PORT=3306
SSH_PORT=2222
REST_API=v0.0.38
JWT_LIFESPAN=${VEHPC_SLURM_JWT_LIFESPAN:-86400}
# The longest walltime this dev provider accepts (hpc.job_service.job_timeout_default): partition MaxTime and each
# tenant association's MaxWall. Slurm lets a job's owner raise its pending job's time limit up to these, no further.
MAX_TIME=1-00:00:00
# The most jobs one tenant account may have in the system at once (association MaxSubmitJobs), and the controller's
# bound on all jobs: a tenant's script that submits in a loop stops at its own limit, long before the controller's
# (four tenants' limits fit under it with room for the provider), so nobody else's sbatch is refused. 12,000 leaves
# the benchmarks room for 10,000 watched jobs of one tenant.
MAX_SUBMIT=12000
MAX_JOB_COUNT=60000

ETC=$STATE/etc
RUN=$STATE/run
LOG=$STATE/log
SSH_DIR=$STATE/ssh
AUTH=$STATE/auth
JOBS=$STATE/jobs
export SLURM_CONF=$ETC/slurm.conf
MUNGE_SOCKET=$RUN/munge/munge.socket.2
MYSQL_SOCKET=$RUN/mysql/mysqld.sock
TOKEN_FILE=$AUTH/$JOB_USER.jwt
# a token of SlurmUser: slurmrestd accepts X-SLURM-USER-NAME of another account only with it (per-tenant submits)
SUBMIT_TOKEN_FILE=$AUTH/slurm.jwt
TENANT_KEYS=$SSH_DIR/tenants
CLIENT_KEY=$SSH_DIR/client_ed25519
KNOWN_HOSTS=$SSH_DIR/known_hosts

T0=$(date +%s%N)
log() { printf 'slurm-up: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
elapsed() { echo $((($(date +%s%N) - T0) / 1000000)); }

[[ $(id -u) -eq 0 ]] || die "must run as root"
for bin in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd slurmrestd sshd; do
  [[ -x /usr/sbin/$bin || -x /usr/bin/$bin ]] || die "/usr/sbin/$bin missing: run temporal-dev/install-system-deps.sh"
done

# ---------------------------------------------------------------------------------------------
# daemon bookkeeping: name -> pid file and binary. A pid counts as ours only when the process is
# alive (not a zombie), runs the expected binary and mentions our state folder in its command line
# or environment, so a stale pid file whose pid was reused is ignored.
declare -A PIDFILE=(
  [munged]=$RUN/munge/munged.pid
  [mariadbd]=$RUN/mysql/mariadbd.pid
  [slurmdbd]=$RUN/slurm/slurmdbd.pid
  [slurmctld]=$RUN/slurm/slurmctld.pid
  [slurmd]=$RUN/slurm/slurmd.pid
  [slurmrestd]=$RUN/slurmrestd.pid
  [sshd]=$RUN/sshd.pid
)
declare -A LOGFILE=(
  [munged]=$LOG/munged.log [mariadbd]=$LOG/mariadbd.log [slurmdbd]=$LOG/slurmdbd.log
  [slurmctld]=$LOG/slurmctld.log [slurmd]=$LOG/slurmd.log [slurmrestd]=$LOG/slurmrestd.log
  [sshd]=$LOG/sshd.log
)

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

port_owner() { ss -Hltnp "sport = :$1" 2>/dev/null | head -1; }

fail_with_log() { # name message
  local name=$1
  shift
  log "ERROR: $*"
  if [[ -f ${LOGFILE[$name]} ]]; then
    log "--- last lines of ${LOGFILE[$name]} ---"
    tail -n 25 "${LOGFILE[$name]}" >&2
  fi
  exit 1
}

wait_until() { # name timeout_s description command...
  local name=$1 timeout=$2 what=$3
  shift 3
  local now deadline=$(($(date +%s%N) + timeout * 1000000000)) gone_since=0
  until "$@" >/dev/null 2>&1; do
    now=$(date +%s%N)
    if ((now > deadline)); then
      fail_with_log "$name" "$name: timed out after ${timeout}s waiting for $what"
    fi
    # a daemon that is gone for more than 2 s (its pid file may lag its start a little) has failed
    if daemon_pid "$name" >/dev/null; then
      gone_since=0
    elif ((gone_since == 0)); then
      gone_since=$now
    elif ((now - gone_since > 2000000000)); then
      fail_with_log "$name" "$name exited while waiting for $what"
    fi
    sleep 0.05
  done
  log "$name ready ($(elapsed) ms)"
}

# stale pid file -> remove it; a foreign process on our port -> clear error
prepare_start() { # name [port]
  local name=$1 port=${2:-} owner=
  rm -f "${PIDFILE[$name]}"
  [[ -z $port ]] || owner=$(port_owner "$port")
  if [[ -n $owner ]]; then
    die "$name: port $port is already taken by another process: $owner"
  fi
}

started=()
# ---------------------------------------------------------------------------------------------
# folders, users, keys

install -d -m 0755 "$STATE"
exec 9>>"$STATE/.lock"
flock -w 120 9 || die "another slurm-up/slurm-down holds $STATE/.lock"

install -d -m 0755 "$ETC" "$RUN" "$SSH_DIR" "$SSH_DIR/authorized_keys"
# slurmctld/slurmdbd chdir() to their log folder as user slurm (sticky: munged accepts it)
install -d -m 1775 -g slurm "$LOG"
install -d -m 0700 "$AUTH"
install -d -m 0755 -o munge -g munge "$RUN/munge" "$STATE/munge"
install -d -m 0755 -o mysql -g mysql "$RUN/mysql"
install -d -m 0755 -o slurm -g slurm "$RUN/slurm"
install -d -m 0700 -o slurm -g slurm "$STATE/spool/ctld"
install -d -m 0755 "$STATE/spool/d"
install -d -m 0755 /run/sshd
for name in "${!LOGFILE[@]}"; do
  [[ -e ${LOGFILE[$name]} ]] || touch "${LOGFILE[$name]}"
done
chown munge:munge "$LOG/munged.log"
chown mysql:mysql "$LOG/mariadbd.log"
chown slurm:slurm "$LOG/slurmdbd.log" "$LOG/slurmctld.log"
chown "$REST_DAEMON_USER" "$LOG/slurmrestd.log" 2>/dev/null || true

if ! id -u "$REST_DAEMON_USER" >/dev/null 2>&1; then
  useradd -r -M -d /nonexistent -s /usr/sbin/nologin -U "$REST_DAEMON_USER"
  chown "$REST_DAEMON_USER" "$LOG/slurmrestd.log"
fi
if ! id -u "$JOB_USER" >/dev/null 2>&1; then
  useradd -m -s /bin/bash -U "$JOB_USER"
fi
# useradd leaves the password locked ("!"); sshd with UsePAM=no then refuses even key logins.
if [[ $(getent shadow "$JOB_USER" | cut -d: -f2) == !* ]]; then
  usermod -p '*' "$JOB_USER"
fi
# the tenants' job directories' parent is root's and no tenant may write it: a tenant able to add or replace an
# entry there could link another tenant's directory to one it reads (an earlier layout had it 1777)
install -d -m 0755 -o root -g root "$JOBS"
# tenant accounts: a login shell (the ssh transport runs sbatch as them), a private home and job directory
for tenant in "${TENANTS[@]}"; do
  if ! id -u "$tenant" >/dev/null 2>&1; then
    useradd -m -s /bin/bash -U "$tenant"
  fi
  if [[ $(getent shadow "$tenant" | cut -d: -f2) == !* ]]; then
    usermod -p '*' "$tenant"
  fi
  chmod 0700 "$(getent passwd "$tenant" | cut -d: -f6)"
  # never chown through a link or hand over a directory someone else made under that name: set it aside
  dir=$JOBS/$tenant
  if [[ -L $dir || (-e $dir && ! -d $dir) || (-d $dir && $(stat -c %U "$dir") != "$tenant") ]]; then
    install -d -m 0700 "$STATE/quarantine"
    log "WARNING: $dir was not $tenant's own directory; moved to $STATE/quarantine"
    mv "$dir" "$STATE/quarantine/$tenant.$(date +%s%N)"
  fi
  install -d -m 0700 -o "$tenant" -g "$tenant" "$dir"
done

secret_file() { # path owner bytes: create a random secret once
  local path=$1 owner=$2 bytes=$3
  if [[ ! -s $path ]]; then
    (umask 077 && head -c "$bytes" /dev/urandom >"$path.tmp" && mv "$path.tmp" "$path")
  fi
  chown "$owner" "$path"
  chmod 0600 "$path"
}
secret_file "$STATE/munge/munge.key" munge:munge 1024
secret_file "$ETC/jwt_hs256.key" slurm:slurm 32
if [[ ! -s $ETC/mysql.pass ]]; then
  (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$ETC/mysql.pass")
fi
chmod 0600 "$ETC/mysql.pass"
MYSQL_PASS=$(<"$ETC/mysql.pass")

[[ -s $SSH_DIR/ssh_host_ed25519_key ]] ||
  ssh-keygen -q -t ed25519 -N '' -C "vehpc-dev-sshd" -f "$SSH_DIR/ssh_host_ed25519_key"
[[ -s $CLIENT_KEY ]] || ssh-keygen -q -t ed25519 -N '' -C "vehpc-dev-client" -f "$CLIENT_KEY"
chmod 0600 "$SSH_DIR/ssh_host_ed25519_key" "$CLIENT_KEY"
install -m 0644 "$CLIENT_KEY.pub" "$SSH_DIR/authorized_keys/$JOB_USER"
install -d -m 0700 "$TENANT_KEYS"
for tenant in "${TENANTS[@]}"; do
  [[ -s $TENANT_KEYS/$tenant ]] || ssh-keygen -q -t ed25519 -N '' -C "vehpc-dev-$tenant" -f "$TENANT_KEYS/$tenant"
  chmod 0600 "$TENANT_KEYS/$tenant"
  install -m 0644 "$TENANT_KEYS/$tenant.pub" "$SSH_DIR/authorized_keys/$tenant"
done
host_pub=$(cut -d' ' -f1,2 "$SSH_DIR/ssh_host_ed25519_key.pub")
printf '[%s]:%s %s\n[localhost]:%s %s\n' "$HOST" "$SSH_PORT" "$host_pub" "$SSH_PORT" "$host_pub" >"$KNOWN_HOSTS"
chmod 0644 "$KNOWN_HOSTS"

# ---------------------------------------------------------------------------------------------
# configuration (rewritten only when its content changes)

CONFIG_CHANGED=()
write_config() { # path owner mode  (content on stdin)
  local path=$1 owner=$2 mode=$3 tmp
  tmp=$(mktemp "$path.XXXXXX")
  cat >"$tmp"
  if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
    rm -f "$tmp"
  else
    mv "$tmp" "$path"
    CONFIG_CHANGED+=("$(basename "$path")")
  fi
  chown "$owner" "$path"
  chmod "$mode" "$path"
}

mounted_v1() { awk -v p="/sys/fs/cgroup/$1" '$2 == p && $3 == "cgroup" {f=1} END {exit !f}' /proc/mounts; }
CGROUP=0
case ${VEHPC_SLURM_CGROUP:-auto} in
  0) ;;
  1 | auto)
    if mounted_v1 memory && mounted_v1 freezer && mounted_v1 cpuset; then
      CGROUP=1
    elif [[ ${VEHPC_SLURM_CGROUP:-auto} == 1 ]]; then
      die "VEHPC_SLURM_CGROUP=1 but cgroup v1 memory/freezer/cpuset are not mounted"
    fi
    ;;
  *) die "VEHPC_SLURM_CGROUP must be auto, 0 or 1" ;;
esac
if ((CGROUP)); then
  PLUGINS="ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup,task/affinity
JobAcctGatherType=jobacct_gather/cgroup"
else
  PLUGINS="ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux"
fi

# hardware line as slurmd sees it (CPUs, sockets, cores, threads, RealMemory), renamed to our node
HW=$(/usr/sbin/slurmd -C | head -1 | sed -E 's/^NodeName=[^ ]+ //')
[[ $HW == *CPUs=* && $HW == *RealMemory=* ]] || die "cannot read hardware from 'slurmd -C': $HW"

# A requeued job may start again only after the job credential lifetime (AuthInfo cred_expire) plus 1 s: 121 s
# with Slurm's default of 120. Every requeue test waits it out, so the dev cluster keeps credentials for 30 s (Slurm
# takes 5 s and up; a job's launch on this one node is checked well within it). A site keeps its own value.
CRED_EXPIRE=30

write_config "$ETC/slurm.conf" root:root 0644 <<EOF
# generated by temporal-dev/slurm-up.sh - edits are overwritten
ClusterName=$CLUSTER
SlurmctldHost=localhost($HOST)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$CRED_EXPIRE
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key=$ETC/jwt_hs256.key
CryptoType=crypto/munge
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=${PIDFILE[slurmctld]}
SlurmdPidFile=${PIDFILE[slurmd]}
SlurmctldLogFile=${LOGFILE[slurmctld]}
SlurmdLogFile=${LOGFILE[slurmd]}
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
$PLUGINS
JobAcctGatherFrequency=task=2
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HOST
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCKET
AccountingStorageEnforce=associations,limits,qos
EnforcePartLimits=ALL
AccountingStoreFlags=job_comment
JobSubmitPlugins=lua
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=$NODE NodeAddr=$HOST $HW State=UNKNOWN
PrivateData=accounts,jobs,usage,users
MaxJobCount=$MAX_JOB_COUNT
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=$MAX_TIME State=UP
EOF

# Slurm lets a job's owner raise its pending job's time limit up to MaxTime/MaxWall: only root, SlurmUser and the
# provider's account may raise one (a tenant may still lower its own). slurmctld reads it beside slurm.conf.
write_config "$ETC/job_submit.lua" root:root 0644 <<EOF
-- generated by temporal-dev/slurm-up.sh - edits are overwritten
local provider = { [0] = true, [$(id -u slurm)] = true, [$(id -u "$JOB_USER")] = true }

function slurm_job_submit(job_desc, part_list, submit_uid)
  return slurm.SUCCESS
end

-- What a job runs with and where: the provider's to set, priced when the job was accepted. A tenant changing
-- its own pending job (after a requeue, say) would run with more than it pays for.
local fixed = {
  "min_cpus", "max_cpus", "pn_min_cpus", "cpus_per_task", "num_tasks", "ntasks_per_node", "min_nodes",
  "max_nodes", "pn_min_memory", "tres_per_job", "tres_per_node", "tres_per_socket", "tres_per_task",
  "partition", "account", "qos", "reservation", "features", "licenses", "shared", "contiguous",
}

local function given(value)
  return value ~= nil and value ~= slurm.NO_VAL and value ~= slurm.NO_VAL16 and value ~= slurm.NO_VAL64
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  if provider[modify_uid] then
    return slurm.SUCCESS
  end
  for _, field in ipairs(fixed) do
    if given(job_desc[field]) then
      slurm.log_user("a job's resources, partition, account and QOS are the provider's to set: its " .. field ..
        " is what the job was accepted and paid for")
      return slurm.ERROR
    end
  end
  local asked, limit = job_desc.time_limit, job_rec.time_limit
  if not given(asked) or limit == nil or asked <= limit then
    return slurm.SUCCESS
  end
  slurm.log_user("a job's time limit may be lowered, never raised: it is what the job was accepted and paid for")
  return slurm.ERROR
end

return slurm.SUCCESS
EOF

write_config "$ETC/cgroup.conf" root:root 0644 <<EOF
# generated by temporal-dev/slurm-up.sh (used only with proctrack/cgroup)
CgroupPlugin=cgroup/v1
ConstrainCores=yes
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
EOF

write_config "$ETC/slurmdbd.conf" slurm:slurm 0600 <<EOF
# generated by temporal-dev/slurm-up.sh - edits are overwritten
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key=$ETC/jwt_hs256.key
DbdHost=localhost
DbdAddr=$HOST
DbdPort=$DBD_PORT
SlurmUser=slurm
DebugLevel=info
LogFile=${LOGFILE[slurmdbd]}
PidFile=${PIDFILE[slurmdbd]}
StorageType=accounting_storage/mysql
StorageHost=$HOST
StoragePort=$MYSQL_PORT
StorageUser=slurm
StoragePass=$MYSQL_PASS
StorageLoc=slurm_acct_db
PrivateData=accounts,jobs,usage,users
EOF

write_config "$ETC/mysql-init.sql" mysql:mysql 0600 <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$MYSQL_PASS';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$MYSQL_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF

# StrictModes no: the repository (and so authorized_keys) may live below a world-writable directory such as /tmp,
# where a CI clone often is; sshd's StrictModes refuses every login then ("bad ownership or modes for directory
# /tmp"). The key files themselves are root-owned and not writable by others; this sshd listens on loopback only.
write_config "$SSH_DIR/sshd_config" root:root 0644 <<EOF
# generated by temporal-dev/slurm-up.sh - edits are overwritten
Port $SSH_PORT
ListenAddress $HOST
HostKey $SSH_DIR/ssh_host_ed25519_key
PidFile ${PIDFILE[sshd]}
AuthorizedKeysFile $SSH_DIR/authorized_keys/%u
AllowUsers $JOB_USER ${TENANTS[*]}
PermitRootLogin no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
X11Forwarding no
PrintMotd no
MaxStartups 100:30:200
MaxSessions 100
SetEnv SLURM_CONF=$SLURM_CONF
Subsystem sftp internal-sftp
EOF

# sshd rereads its configuration on SIGHUP (sessions in progress go on): no restart needed for it
if [[ " ${CONFIG_CHANGED[*]} " == *" sshd_config "* ]] && pid=$(daemon_pid sshd); then
  log "sshd_config changed: reloading sshd (pid $pid)"
  kill -HUP "$pid"
  CONFIG_CHANGED=("${CONFIG_CHANGED[@]/sshd_config/}")
fi
if [[ -n ${CONFIG_CHANGED[*]// /} ]]; then
  for name in slurmdbd slurmctld slurmd mariadbd; do
    if daemon_pid "$name" >/dev/null; then
      log "WARNING: ${CONFIG_CHANGED[*]} changed while $name runs; run slurm-down.sh then slurm-up.sh to apply"
      break
    fi
  done
fi

# ---------------------------------------------------------------------------------------------
# daemons, in dependency order

# munge: own key and socket (slurm.conf AuthInfo points every Slurm component at it)
if pid=$(daemon_pid munged); then
  log "munged already running (pid $pid)"
else
  prepare_start munged
  runuser -u munge -- /usr/sbin/munged --key-file="$STATE/munge/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="${PIDFILE[munged]}" --log-file="${LOGFILE[munged]}" --seed-file="$STATE/munge/munged.seed" \
    </dev/null >>"${LOGFILE[munged]}" 2>&1 9>&- || fail_with_log munged "munged failed to start"
  started+=(munged)
fi
munge_ok() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }
wait_until munged 10 "a munge round trip" munge_ok

# MariaDB: own datadir, TCP on loopback for slurmdbd
if [[ ! -f $STATE/mysql/.vehpc-initialized ]]; then
  rm -rf "$STATE/mysql"
  install -d -m 0700 -o mysql -g mysql "$STATE/mysql"
  log "initializing MariaDB datadir"
  mariadb-install-db --no-defaults --user=mysql --datadir="$STATE/mysql" --skip-test-db \
    --auth-root-authentication-method=socket >>"${LOGFILE[mariadbd]}" 2>&1 9>&- ||
    fail_with_log mariadbd "mariadb-install-db failed"
  touch "$STATE/mysql/.vehpc-initialized"
fi
if pid=$(daemon_pid mariadbd); then
  log "mariadbd already running (pid $pid)"
else
  prepare_start mariadbd "$MYSQL_PORT"
  setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql" \
    --socket="$MYSQL_SOCKET" --pid-file="${PIDFILE[mariadbd]}" --log-error="${LOGFILE[mariadbd]}" \
    --bind-address="$HOST" --port="$MYSQL_PORT" --skip-name-resolve --init-file="$ETC/mysql-init.sql" \
    --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 --innodb-flush-log-at-trx-commit=2 \
    </dev/null >>"${LOGFILE[mariadbd]}" 2>&1 9>&- &
  started+=(mariadbd)
fi
wait_until mariadbd 30 "mariadb-admin ping" \
  mariadb-admin --no-defaults --socket="$MYSQL_SOCKET" -uroot --connect-timeout=1 ping

# slurmdbd: ready when it logs "slurmdbd version ... started" (a bare TCP probe makes it log errors)
if pid=$(daemon_pid slurmdbd); then
  log "slurmdbd already running (pid $pid)"
else
  prepare_start slurmdbd "$DBD_PORT"
  dbd_log_offset=$(stat -c %s "${LOGFILE[slurmdbd]}")
  /usr/sbin/slurmdbd </dev/null >>"${LOGFILE[slurmdbd]}" 2>&1 9>&- || fail_with_log slurmdbd "slurmdbd failed to start"
  started+=(slurmdbd)
  dbd_started() {
    tail -c +$((dbd_log_offset + 1)) "${LOGFILE[slurmdbd]}" | grep -q 'slurmdbd version .* started'
  }
  wait_until slurmdbd 30 "'slurmdbd version ... started' in its log" dbd_started
fi

# accounting: cluster, account and users (before slurmctld, so it loads them at start)
assocs=$(sacctmgr -n -P show assoc format=cluster,account,user 2>&1) ||
  fail_with_log slurmdbd "sacctmgr cannot reach slurmdbd: $assocs"
if ! grep -qx "$CLUSTER|$ACCOUNT|$JOB_USER" <<<"$assocs"; then
  log "creating cluster $CLUSTER, account $ACCOUNT, users root and $JOB_USER in slurmdbd"
  grep -q "^$CLUSTER|" <<<"$assocs" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
  sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="virtengine-hpc dev" organization=vehpc >/dev/null
  # a new user's first account becomes its default account
  sacctmgr -i add user "$JOB_USER",root account="$ACCOUNT" cluster="$CLUSTER" >/dev/null
  assocs=$(sacctmgr -n -P show assoc format=cluster,account,user)
  grep -qx "$CLUSTER|$ACCOUNT|$JOB_USER" <<<"$assocs" || die "association $CLUSTER/$ACCOUNT/$JOB_USER missing after sacctmgr add"
fi
new_tenants=()
for tenant in "${TENANTS[@]}"; do
  grep -qx "$CLUSTER|$ACCOUNT|$tenant" <<<"$assocs" || new_tenants+=("$tenant")
done
if ((${#new_tenants[@]})); then
  log "adding tenant accounts ${new_tenants[*]} to Slurm account $ACCOUNT"
  sacctmgr -i add user "$(
    IFS=,
    echo "${new_tenants[*]}"
  )" account="$ACCOUNT" cluster="$CLUSTER" >/dev/null
fi
# a tenant's own jobs may ask (or be raised to) no more than the provider offers, and be no more than MAX_SUBMIT
for tenant in "${TENANTS[@]}"; do
  if [[ $(sacctmgr -n -P show assoc where user="$tenant" account="$ACCOUNT" cluster="$CLUSTER" format=maxwall,maxsubmit) != "$MAX_TIME|$MAX_SUBMIT" ]]; then
    sacctmgr -i modify user where name="$tenant" account="$ACCOUNT" cluster="$CLUSTER" \
      set maxwall="$MAX_TIME" maxsubmitjobs="$MAX_SUBMIT" >/dev/null
  fi
done
# the submit account cancels and reads tenants' jobs, whatever PrivateData hides from others: a Slurm operator
# (not an administrator)
if [[ $(sacctmgr -n -P show user "$JOB_USER" format=adminlevel) != Operator ]]; then
  sacctmgr -i modify user "$JOB_USER" set adminlevel=Operator >/dev/null
fi

# slurmctld
if pid=$(daemon_pid slurmctld); then
  log "slurmctld already running (pid $pid)"
else
  prepare_start slurmctld "$CTLD_PORT"
  /usr/sbin/slurmctld </dev/null >>"${LOGFILE[slurmctld]}" 2>&1 9>&- || fail_with_log slurmctld "slurmctld failed to start"
  started+=(slurmctld)
fi
ctld_up() { scontrol ping | grep -q ' is UP'; }
wait_until slurmctld 30 "'scontrol ping' to report UP" ctld_up

# slurmd
if pid=$(daemon_pid slurmd); then
  log "slurmd already running (pid $pid)"
else
  prepare_start slurmd "$SLURMD_PORT"
  slurmd_launch=$(date +%s)
  /usr/sbin/slurmd -N "$NODE" </dev/null >>"${LOGFILE[slurmd]}" 2>&1 9>&- || fail_with_log slurmd "slurmd failed to start"
  started+=(slurmd)
fi
slurmd_launch=${slurmd_launch:-0}
# the saved node state can read "idle" before slurmd registers: also require that the controller
# has seen this slurmd (SlurmdStartTime not older than its launch)
node_ready() {
  local info start
  info=$(scontrol -o show node "$NODE") || return 1
  start=$(grep -o 'SlurmdStartTime=[^ ]*' <<<"$info" | cut -d= -f2)
  [[ $start != None && -n $start ]] && (($(date -d "$start" +%s) >= slurmd_launch)) || return 1
  [[ $(sinfo -h -n "$NODE" -o %T) =~ ^(idle|mixed|allocated|completing|drained|draining)$ ]]
}
wait_until slurmd 30 "node $NODE to leave state UNKNOWN/DOWN (sinfo)" node_ready
node_state=$(sinfo -h -n "$NODE" -o %T)
[[ $node_state != drain* ]] ||
  log "WARNING: node $NODE is $node_state ($(sinfo -h -n "$NODE" -o %E)); 'scontrol update nodename=$NODE state=resume' clears it"

# JWT for the REST user (never printed)
token_line=$(scontrol token username="$JOB_USER" lifespan="$JWT_LIFESPAN") || die "scontrol token failed"
[[ $token_line == SLURM_JWT=* ]] || die "unexpected 'scontrol token' output"
(umask 077 && printf '%s\n' "${token_line#SLURM_JWT=}" >"$TOKEN_FILE.tmp" && mv "$TOKEN_FILE.tmp" "$TOKEN_FILE")
unset token_line
TOKEN_EXPIRES=$(($(date +%s) + JWT_LIFESPAN))
token_line=$(scontrol token username=slurm lifespan="$JWT_LIFESPAN") || die "scontrol token username=slurm failed"
[[ $token_line == SLURM_JWT=* ]] || die "unexpected 'scontrol token' output"
(umask 077 && printf '%s\n' "${token_line#SLURM_JWT=}" >"$SUBMIT_TOKEN_FILE.tmp" && mv "$SUBMIT_TOKEN_FILE.tmp" "$SUBMIT_TOKEN_FILE")
unset token_line

# slurmrestd: non-root user, SLURM_JWT=daemon, v0.0.38 + dbv0.0.38
if pid=$(daemon_pid slurmrestd); then
  log "slurmrestd already running (pid $pid)"
else
  prepare_start slurmrestd "$REST_PORT"
  SLURM_JWT=daemon setsid /usr/sbin/slurmrestd -u "$REST_DAEMON_USER" -a rest_auth/jwt \
    -s "openapi/$REST_API,openapi/db$REST_API" "$HOST:$REST_PORT" \
    </dev/null >>"${LOGFILE[slurmrestd]}" 2>&1 9>&- &
  echo $! >"${PIDFILE[slurmrestd]}"
  started+=(slurmrestd)
fi
rest_ping() {
  printf 'X-SLURM-USER-NAME: %s\nX-SLURM-USER-TOKEN: %s\n' "$JOB_USER" "$(<"$TOKEN_FILE")" |
    curl -sf --max-time 2 -H @- "http://$HOST:$REST_PORT/slurm/$REST_API/ping" | grep -q '"ping": *"UP"'
}
wait_until slurmrestd 15 "GET /slurm/$REST_API/ping to answer UP" rest_ping

# sshd
if pid=$(daemon_pid sshd); then
  log "sshd already running (pid $pid)"
else
  prepare_start sshd "$SSH_PORT"
  /usr/sbin/sshd -f "$SSH_DIR/sshd_config" -E "${LOGFILE[sshd]}" </dev/null 9>&- ||
    fail_with_log sshd "sshd failed to start"
  started+=(sshd)
fi
ssh_ok() {
  ssh -F /dev/null -i "$CLIENT_KEY" -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes \
    -o UserKnownHostsFile="$KNOWN_HOSTS" -o ConnectTimeout=2 -p "$SSH_PORT" "$JOB_USER@$HOST" \
    "sinfo -h -p $PARTITION -o %P" </dev/null 9>&- | grep -q "^$PARTITION"
}
wait_until sshd 15 "ssh $JOB_USER@$HOST:$SSH_PORT to run sinfo" ssh_ok

# ---------------------------------------------------------------------------------------------
# client environment

SLURM_VERSION=$(sinfo -V | awk '{print $2}')
json_str() { local s=${1//\\/\\\\}; printf '"%s"' "${s//\"/\\\"}"; }
write_config "$STATE/env.sh" root:root 0644 <<EOF
# generated by temporal-dev/slurm-up.sh; source it to talk to the local SLURM cluster
export SLURM_CONF='$SLURM_CONF'
export VEHPC_SLURM_STATE_DIR='$STATE'
export VEHPC_SLURM_CLUSTER='$CLUSTER'
export VEHPC_SLURM_PARTITION='$PARTITION'
export VEHPC_SLURM_ACCOUNT='$ACCOUNT'
export VEHPC_SLURM_NODE='$NODE'
export VEHPC_SLURM_CONTROLLER_HOST='$HOST'
export VEHPC_SLURM_CONTROLLER_PORT='$CTLD_PORT'
export VEHPC_SLURMRESTD_URL='http://$HOST:$REST_PORT'
export VEHPC_SLURMRESTD_API_VERSION='$REST_API'
export VEHPC_SLURM_REST_USER='$JOB_USER'
export VEHPC_SLURM_JWT_FILE='$TOKEN_FILE'
export VEHPC_SLURM_JOB_USER='$JOB_USER'
export VEHPC_SLURM_JOBS_DIR='$JOBS'
export VEHPC_SLURM_MEMORY_ENFORCED='$CGROUP'
export VEHPC_SSH_HOST='$HOST'
export VEHPC_SSH_PORT='$SSH_PORT'
export VEHPC_SSH_USER='$JOB_USER'
export VEHPC_SSH_KEY_FILE='$CLIENT_KEY'
export VEHPC_SSH_KNOWN_HOSTS='$KNOWN_HOSTS'
export VEHPC_TENANT_ACCOUNTS='${TENANTS[*]}'
export VEHPC_TENANT_KEY_DIR='$TENANT_KEYS'
export VEHPC_SLURM_SUBMIT_JWT_FILE='$SUBMIT_TOKEN_FILE'
# the token itself is read from the file (readable by root only), never written here
if [ -r '$TOKEN_FILE' ]; then SLURM_JWT_TOKEN=\$(cat '$TOKEN_FILE'); export SLURM_JWT_TOKEN; fi
EOF

write_config "$STATE/env.json" root:root 0644 <<EOF
{
  "state_dir": $(json_str "$STATE"),
  "slurm_conf": $(json_str "$SLURM_CONF"),
  "slurm_version": $(json_str "$SLURM_VERSION"),
  "cluster": $(json_str "$CLUSTER"),
  "partition": $(json_str "$PARTITION"),
  "account": $(json_str "$ACCOUNT"),
  "node": $(json_str "$NODE"),
  "controller_host": $(json_str "$HOST"),
  "controller_port": $CTLD_PORT,
  "slurmdbd_port": $DBD_PORT,
  "slurmrestd_url": $(json_str "http://$HOST:$REST_PORT"),
  "slurmrestd_api_version": $(json_str "$REST_API"),
  "rest_user": $(json_str "$JOB_USER"),
  "jwt_token_file": $(json_str "$TOKEN_FILE"),
  "jwt_expires_at": $TOKEN_EXPIRES,
  "job_user": $(json_str "$JOB_USER"),
  "jobs_dir": $(json_str "$JOBS"),
  "memory_enforced": $( ((CGROUP)) && echo true || echo false),
  "ssh_host": $(json_str "$HOST"),
  "ssh_port": $SSH_PORT,
  "ssh_user": $(json_str "$JOB_USER"),
  "ssh_key_file": $(json_str "$CLIENT_KEY"),
  "ssh_known_hosts": $(json_str "$KNOWN_HOSTS"),
  "tenant_accounts": [$(
    sep=
    for tenant in "${TENANTS[@]}"; do
      printf '%s%s' "$sep" "$(json_str "$tenant")"
      sep=', '
    done
  )],
  "tenant_key_dir": $(json_str "$TENANT_KEYS"),
  "submit_jwt_token_file": $(json_str "$SUBMIT_TOKEN_FILE"),
  "log_dir": $(json_str "$LOG")
}
EOF

if ((${#started[@]})); then
  log "started ${started[*]}; SLURM up in $(elapsed) ms (state: $STATE)"
else
  log "already up, token refreshed ($(elapsed) ms; state: $STATE)"
fi
log "clients: source $STATE/env.sh   or read $STATE/env.json"
