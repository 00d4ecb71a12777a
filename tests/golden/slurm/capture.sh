#!/usr/bin/env bash
# Re-capture the golden SLURM outputs in this folder from the local cluster (temporal-dev/slurm-up.sh).
# Runs as root, submits the golden-* jobs as hpcuser, takes ~2.5 minutes (the TIMEOUT job needs
# --time=1), and rewrites every capture plus README.md. Jobs of other users are never touched.
set -euo pipefail

OUT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$OUT/../../.." && pwd)
STATE=${VEHPC_DEV_DIR:-$REPO/.dev}/slurm
[[ -f $STATE/env.sh ]] || { echo "capture: no cluster; run temporal-dev/slurm-up.sh" >&2; exit 1; }
# shellcheck disable=SC1091
source "$STATE/env.sh"
U=$VEHPC_SLURM_JOB_USER
W=$VEHPC_SLURM_JOBS_DIR/golden
REST=$VEHPC_SLURMRESTD_URL
API=$VEHPC_SLURMRESTD_API_VERSION
PY=${PYTHON:-python3}

log() { printf 'capture: %s\n' "$*" >&2; }
install -d -m 0755 -o "$U" -g "$U" "$W"
rm -f "$OUT"/*.txt "$OUT"/*.json
ROWS=()

as_user() { (cd "$W" && runuser -u "$U" -- env SLURM_CONF="$SLURM_CONF" "$@"); }

# cap FILE [--user] [--stderr] -- CMD...: stdout (and stderr with --stderr) of CMD into FILE
cap() {
  local file=$1 who=root merge=0 rc=0
  shift
  while [[ $1 != -- ]]; do
    case $1 in --user) who=$U ;; --stderr) merge=1 ;; esac
    shift
  done
  shift
  if [[ $who == root ]]; then
    if ((merge)); then "$@" >"$OUT/$file" 2>&1 || rc=$?; else "$@" >"$OUT/$file" || rc=$?; fi
  else
    if ((merge)); then as_user "$@" >"$OUT/$file" 2>&1 || rc=$?; else as_user "$@" >"$OUT/$file" || rc=$?; fi
  fi
  local cmd
  cmd=$(shell_words "$@")
  ROWS+=("| \`$file\` | $who | \`${cmd//|/\\|}\` | $rc |")
  return 0
}

# the command line as one would type it: plain words bare, anything else in single quotes
shell_words() {
  local arg out=() q="'"
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      out+=("$arg")
    else
      out+=("$q${arg//$q/$q\\$q$q}$q")
    fi
  done
  printf '%s' "${out[*]}"
}

# submit as hpcuser, print the job id
submit() { as_user sbatch --parsable "$@"; }

state_of() { squeue -h -t all -j "$1" -o %T 2>/dev/null || true; }
wait_state() { # id regex timeout_s
  local deadline=$((SECONDS + $3))
  until [[ $(state_of "$1") =~ ^($2)$ ]]; do
    ((SECONDS < deadline)) || { log "job $1 not in state $2 after $3 s (is $(state_of "$1"))"; exit 1; }
    sleep 0.5
  done
}

headers() { printf 'X-SLURM-USER-NAME: %s\nX-SLURM-USER-TOKEN: %s\nContent-Type: application/json\n' "$1" "$(<"$VEHPC_SLURM_JWT_FILE")"; }
# rest FILE METHOD PATH [BODY]: raw response body into FILE, HTTP status into the README row
rest() {
  local file=$1 method=$2 path=$3 body=${4:-} code
  if [[ -n $body ]]; then
    code=$(headers "$U" | curl -s -o "$OUT/$file" -w '%{http_code}' -X "$method" -H @- --data-binary "$body" "$REST$path")
  else
    code=$(headers "$U" | curl -s -o "$OUT/$file" -w '%{http_code}' -X "$method" -H @- "$REST$path")
  fi
  local shown="curl -X $method -H 'X-SLURM-USER-NAME: $U' -H 'X-SLURM-USER-TOKEN: <jwt>' $REST$path"
  [[ -z $body ]] || shown+=" -d @$(basename "$file" .json).request.json"
  [[ -z $body ]] || printf '%s\n' "$body" >"$OUT/$(basename "$file" .json).request.json"
  ROWS+=("| \`$file\` | $U (REST) | \`$shown\` | HTTP $code |")
}

# trim_json FILE KEY NAMES...: keep only the list items under KEY whose name is one of NAMES
trim_json() {
  local file=$1 key=$2
  shift 2
  "$PY" - "$OUT/$file" "$key" "$@" <<'EOF'
import json, sys
path, key, names = sys.argv[1], sys.argv[2], set(sys.argv[3:])
doc = json.load(open(path))
doc[key] = [j for j in doc[key] if j.get("name") in names]
with open(path, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
EOF
}

# ------------------------------------------------------------------------------------------
log "job scripts in $W"
cat >"$W/completed.sh" <<'EOF'
#!/bin/bash
# one srun step that burns ~3 s of CPU holding ~150 MB, then the batch step exits 0
srun python3 -c '
import time
b = b"x" * (150 * 2**20)
t = time.time()
while time.time() - t < 3:
    pass
'
echo done
EOF
cat >"$W/failed.sh" <<'EOF'
#!/bin/bash
echo "failing on purpose" >&2
exit 3
EOF
cat >"$W/oom.sh" <<'EOF'
#!/bin/bash
# asks for 100M (sbatch --mem=100M) and touches 400 MB
python3 -c 'b = b"x" * (400 * 2**20); import time; time.sleep(2)'
EOF
cat >"$W/running.sh" <<'EOF'
#!/bin/bash
# holds ~60 MB and sleeps, for sstat and cancellation while running
python3 -c 'b = b"x" * (60 * 2**20); import time; time.sleep(300)'
EOF
chown "$U:$U" "$W"/*.sh

# ------------------------------------------------------------------------------------------
log "sbatch: output and rejections"
cap sbatch_parsable.txt --user -- sbatch --parsable -J golden-parsable --hold -o "$W/%x-%j.out" --wrap true
PARSABLE=$(tr -d '\n' <"$OUT/sbatch_parsable.txt")
cap sbatch_plain.txt --user -- sbatch -J golden-plain --hold -o "$W/%x-%j.out" --wrap true
PLAIN=$(awk '{print $4}' "$OUT/sbatch_plain.txt")
scancel "$PARSABLE" "$PLAIN"
cap sbatch_reject_bad_partition.txt --user --stderr -- sbatch --parsable -J golden-reject -p nosuchpartition --wrap true
cap sbatch_reject_too_many_nodes.txt --user --stderr -- sbatch --parsable -J golden-reject -N 2 --wrap true
cap sbatch_reject_invalid_account.txt --user --stderr -- sbatch --parsable -J golden-reject -A nosuchaccount --wrap true
cap sbatch_reject_invalid_qos.txt --user --stderr -- sbatch --parsable -J golden-reject --qos=nosuchqos --wrap true
cap sbatch_reject_too_much_memory.txt --user --stderr -- sbatch --parsable -J golden-reject --mem=100T --wrap true

log "submitting golden jobs"
O=(-o "$W/%x-%j.out")
HELD=$(submit -J golden-held --hold --comment=wf:golden-held "${O[@]}" --wrap 'sleep 10')
BEGIN=$(submit -J golden-cancelled-pending --begin=now+3600 --comment=wf:golden-cancelled-pending "${O[@]}" --wrap 'sleep 10')
TIMEOUT=$(submit -J golden-timeout --time=1 --comment=wf:golden-timeout "${O[@]}" --wrap 'sleep 300')
COMPLETED=$(submit -J golden-completed --comment=wf:golden-completed "${O[@]}" "$W/completed.sh")
wait_state "$COMPLETED" COMPLETED 60
FAILED=$(submit -J golden-failed --comment=wf:golden-failed "${O[@]}" "$W/failed.sh")
wait_state "$FAILED" FAILED 60
OOM=$(submit -J golden-oom --mem=100M --comment=wf:golden-oom "${O[@]}" "$W/oom.sh")
wait_state "$OOM" 'OUT_OF_MEMORY|FAILED|COMPLETED' 60
ARRAY=$(submit -J golden-array --array=1-2 --comment=wf:golden-array "${O[@]}" --wrap 'exit $((SLURM_ARRAY_TASK_ID - 1))')
wait_state "${ARRAY}_2" 'COMPLETED|FAILED' 60
LONGNAME=golden-long-name-0123456789-abcdefghijklmnopqrstuvwxyz-0123456789-abcdefghijklmnopqrstuvwxyz
LONG=$(submit -J "$LONGNAME" --hold --comment="wf:$LONGNAME with spaces|and a pipe" "${O[@]}" --wrap true)

RUNNING=$(submit -J golden-cancelled-running --comment=wf:golden-cancelled-running "${O[@]}" "$W/running.sh")
wait_state "$RUNNING" RUNNING 60
RESOURCES=$(submit -J golden-pending-resources -c 2 --comment=wf:golden-pending-resources "${O[@]}" --wrap true)
sleep 6 # let jobacct_gather sample the running step (task=2) and the scheduler set reasons

log "running-job captures"
cap sstat_running_batch.txt -- sstat -P -n -j "$RUNNING.batch" --format=JobID,MaxRSS,AveRSS,MaxVMSize,AveCPU,MinCPU,NTasks,TRESUsageInTot,TRESUsageInMax
cap sstat_running_allsteps.txt -- sstat -P -a -j "$RUNNING" --format=JobID,MaxRSS,AveCPU,TRESUsageInTot
cap scontrol_show_job_running.txt -- scontrol show job "$RUNNING"
cap scontrol_show_job_oneliner_held.txt -- scontrol -o show job "$HELD"
cap scontrol_show_job_failed.txt -- scontrol show job "$FAILED"

log "slurmrestd captures"
BODY=$(printf '{"script": "#!/bin/bash\\necho rest; sleep 60", "job": {"name": "golden-rest", "comment": "wf:golden-rest", "partition": "%s", "current_working_directory": "%s", "environment": {"PATH": "/usr/bin:/bin"}, "standard_output": "%s/golden-rest-%%j.out"}}' \
  "$VEHPC_SLURM_PARTITION" "$W" "$W")
rest rest_job_submit.json POST "/slurm/$API/job/submit" "$BODY"
RESTJOB=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["job_id"])' "$OUT/rest_job_submit.json")
BAD_BODY='{"script": "#!/bin/bash\ntrue", "job": {"name": "golden-rest-bad", "current_working_directory": "/tmp"}}'
rest rest_job_submit_error_no_environment.json POST "/slurm/$API/job/submit" "$BAD_BODY"
HOLD_BODY=$(printf '{"script": "#!/bin/bash\\ntrue", "job": {"name": "golden-rest-held", "hold": true, "current_working_directory": "%s", "environment": {"PATH": "/usr/bin:/bin"}}}' "$W")
rest rest_job_submit_held.json POST "/slurm/$API/job/submit" "$HOLD_BODY"
RESTHELD=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["job_id"])' "$OUT/rest_job_submit_held.json")
rest rest_job_get_pending_or_running.json GET "/slurm/$API/job/$RESTJOB"
rest rest_job_get_completed.json GET "/slurm/$API/job/$COMPLETED"
rest rest_job_get_unknown.json GET "/slurm/$API/job/999999"
rest rest_jobs.json GET "/slurm/$API/jobs"
trim_json rest_jobs.json jobs golden-held golden-cancelled-running golden-oom
rest rest_job_cancel.json DELETE "/slurm/$API/job/$RESTJOB"
rest rest_job_cancel_held.json DELETE "/slurm/$API/job/$RESTHELD"
rest rest_ping.json GET "/slurm/$API/ping"
BADTOK=not.a.valid-token
code=$(printf 'X-SLURM-USER-NAME: %s\nX-SLURM-USER-TOKEN: %s\n' "$U" "$BADTOK" |
  curl -s -o "$OUT/rest_jobs_bad_token.json" -w '%{http_code}' -H @- "$REST/slurm/$API/jobs")
ROWS+=("| \`rest_jobs_bad_token.json\` | $U (REST) | \`curl -H 'X-SLURM-USER-NAME: $U' -H 'X-SLURM-USER-TOKEN: $BADTOK' $REST/slurm/$API/jobs\` | HTTP $code |")
code=$(curl -s -o "$OUT/rest_jobs_no_token.txt" -w '%{http_code}' "$REST/slurm/$API/jobs")
ROWS+=("| \`rest_jobs_no_token.txt\` | (none) | \`curl $REST/slurm/$API/jobs\` | HTTP $code |")

log "squeue while jobs pend, run and have ended"
IDS="$HELD,$BEGIN,$TIMEOUT,$COMPLETED,$FAILED,$OOM,$ARRAY,$LONG,$RUNNING,$RESOURCES"
cap squeue_all_states.txt -- squeue -h -t all -j "$IDS" -o '%i|%j|%T|%r|%k'
cap squeue_wide.txt -- squeue -h -t all -j "$IDS" -o '%i|%A|%F|%K|%j|%u|%a|%P|%T|%t|%r|%M|%l|%D|%C|%m|%V|%S|%e|%Z|%k'
cap squeue_default_states.txt -- squeue -h -j "$IDS" -o '%i|%j|%T|%r|%k'
cap squeue_unknown_job.txt --stderr -- squeue -h -j 999999 -o '%i|%j|%T|%r|%k'
squeue --json >"$OUT/squeue_json.json"
ROWS+=("| \`squeue_json.json\` | root | \`squeue --json\` (trimmed to 2 golden jobs) | 0 |")
trim_json squeue_json.json jobs golden-held golden-oom

log "cancelling (as root: 'CANCELLED by 0')"
scancel "$RUNNING" "$BEGIN" "$RESOURCES"
wait_state "$RUNNING" CANCELLED 30
cap squeue_after_cancel.txt -- squeue -h -t all -j "$RUNNING,$BEGIN,$RESOURCES" -o '%i|%j|%T|%r|%k'
log "waiting for the TIMEOUT job (--time=1)"
wait_state "$TIMEOUT" TIMEOUT 150
sleep 7 # slurmctld pushes to slurmdbd on a ~5 s cycle

log "sacct"
FMT=JobID,JobName,State,ExitCode,Elapsed,TotalCPU,CPUTime,MaxRSS,AllocTRES,TRESUsageInTot,Start,End,Comment
ENDED="$COMPLETED,$FAILED,$TIMEOUT,$BEGIN,$RUNNING,$OOM,$ARRAY,$HELD"
cap sacct_steps.txt -- sacct -P -n -j "$ENDED" --format="$FMT"
cap sacct_jobs.txt -- sacct -X -P -n -j "$ENDED" --format="$FMT"
cap sacct_raw_fields.txt -- sacct -X -P -n -j "$ENDED" --format=JobIDRaw,JobID,State,ExitCode,DerivedExitCode,ElapsedRaw,CPUTimeRAW,Reason,Submit,Eligible,Start,End,Timelimit,TimelimitRaw,Account,User,Partition,NodeList,WorkDir
cap sacct_window.txt -- sacct -X -P -n -a --starttime now-1hours --name=golden-completed,golden-failed,golden-timeout,golden-oom --format=JobID,JobName,State,ExitCode
cap sacct_unknown_job.txt --stderr -- sacct -P -n -j 999999 --format=JobID,State

rest slurmdb_job_completed.json GET "/slurmdb/$API/job/$COMPLETED"
rest slurmdb_job_oom.json GET "/slurmdb/$API/job/$OOM"
rest slurmdb_job_timeout.json GET "/slurmdb/$API/job/$TIMEOUT"
rest slurmdb_job_cancelled_running.json GET "/slurmdb/$API/job/$RUNNING"
rest slurmdb_job_unknown.json GET "/slurmdb/$API/job/999999"

log "node captures"
cap sinfo_partitions.txt -- sinfo -h -o '%P|%a|%l|%D|%T|%N'
cap scontrol_show_node.txt -- scontrol show node "$VEHPC_SLURM_NODE"
cap scontrol_update_drain.txt --stderr -- scontrol update nodename="$VEHPC_SLURM_NODE" state=drain reason=golden-capture
cap scontrol_show_node_drained.txt -- scontrol show node "$VEHPC_SLURM_NODE"
cap sinfo_nodes_drained.txt -- sinfo -N -h -o '%N|%T|%t|%c|%m|%e|%O|%E|%H'
cap scontrol_update_resume.txt --stderr -- scontrol update nodename="$VEHPC_SLURM_NODE" state=resume
cap sinfo_nodes_resumed.txt -- sinfo -N -h -o '%N|%T|%t|%c|%m|%e|%O|%E|%H'
for _ in $(seq 100); do [[ $(sinfo -h -N -n "$VEHPC_SLURM_NODE" -o %T) == idle ]] && break; sleep 0.1; done
cap sinfo_nodes_resumed_later.txt -- sinfo -N -h -o '%N|%T|%t|%c|%m|%e|%O|%E|%H'
cap scontrol_update_bad_node.txt --stderr -- scontrol update nodename=nosuchnode state=drain reason=x
cap scontrol_ping.txt -- scontrol ping
cap sacctmgr_assoc.txt -- sacctmgr -n -P show assoc format=cluster,account,user

scancel "$HELD" "$LONG" 2>/dev/null || true

# ------------------------------------------------------------------------------------------
{
  cat <<EOF
# Golden outputs of a real Slurm $(sinfo -V | awk '{print $2}')

Captured by \`tests/golden/slurm/capture.sh\` on the local one-node cluster of \`temporal-dev/slurm-up.sh\`
(Debian 12 slurm-wlm 22.05.8, cluster \`$VEHPC_SLURM_CLUSTER\`, partition \`$VEHPC_SLURM_PARTITION\`, node \`$VEHPC_SLURM_NODE\` on host \`$(hostname -s)\`,
slurmdbd on MariaDB, cgroup v1 memory enforcement: $( ((VEHPC_SLURM_MEMORY_ENFORCED)) && echo on || echo off)). Nothing here is edited by hand;
JSON lists marked "trimmed" were filtered to a few golden jobs and re-serialised by Python's json (indent 2),
so their escaping differs from slurmrestd's (which writes \`\\/\`). Everything else is byte for byte.
Re-run \`sudo tests/golden/slurm/capture.sh\` to refresh (about 2 minutes); job ids then change.

## Jobs (submitted as \`$U\` with \`--comment=wf:<name>\`, work dir \`$W\`)

| job id | name | how | expected end |
|---|---|---|---|
| $COMPLETED | golden-completed | \`completed.sh\`: one \`srun\` step burning ~3 s CPU with ~150 MB | COMPLETED 0:0, steps \`.batch\` and \`.0\` |
| $FAILED | golden-failed | \`exit 3\` | FAILED 3:0 |
| $TIMEOUT | golden-timeout | \`--time=1 --wrap 'sleep 300'\` | TIMEOUT (batch step CANCELLED 0:15) |
| $BEGIN | golden-cancelled-pending | \`--begin=now+3600\`, then \`scancel\` as root | pending reason BeginTime, then CANCELLED by 0 |
| $RUNNING | golden-cancelled-running | sleeps holding 60 MB; \`scancel\` as root while running | CANCELLED by 0 |
| $OOM | golden-oom | \`--mem=100M\`, touches 400 MB | OUT_OF_MEMORY 0:125 |
| $ARRAY | golden-array | \`--array=1-2\`, task 2 exits 1 | ${ARRAY}_1 COMPLETED, ${ARRAY}_2 FAILED 1:0 |
| $HELD | golden-held | \`--hold\` | PENDING, reason JobHeldUser (cancelled after the captures) |
| $LONG | golden-long-name-... (92 chars) | \`--hold\`, comment with spaces and a \`\|\` | shows how \`%j\`/\`%k\` print long text and an unescaped delimiter |
| $RESOURCES | golden-pending-resources | \`-c 2\` while one CPU is busy | PENDING, reason Resources/Priority, then CANCELLED |
| $RESTJOB | golden-rest | POST /slurm/$API/job/submit, then DELETE | CANCELLED |
| $RESTHELD | golden-rest-held | POST with \`"hold": true\` (answer has error 2042 *and* a job_id), then DELETE | CANCELLED |

\`sbatch_parsable.txt\` ($PARSABLE) and \`sbatch_plain.txt\` ($PLAIN) were held jobs, cancelled at once.

## Worth knowing when parsing these

* \`squeue\` has no exit code field (\`-O ExitCode\` is "Invalid job format specification"): take it from
  \`sacct\` (\`ExitCode\` = \`code:signal\`), \`scontrol show job\` or REST.
* \`squeue -j IDS\` without \`-t all\` lists only pending/running jobs (\`squeue_default_states.txt\`); ended jobs
  stay visible with \`-t all\` for MinJobAge (300 s), then only accounting knows them.
* Text fields are not escaped: a \`|\` inside a comment splits the line (job $LONG); \`%j\`/\`%k\` are not truncated.
* Cancelling as root gives sacct state \`CANCELLED by 0\` (the uid); the running job's batch step is
  \`CANCELLED 0:15\`; squeue shows plain \`CANCELLED\`. OUT_OF_MEMORY is \`0:125\` in sacct and
  \`SIGNALED\`/signal 125 in slurmdbd JSON. TIMEOUT keeps \`0:0\` on the job line.
* Job-level \`MaxRSS\`/\`TRESUsageInTot\` are empty; usage is on the steps (\`.batch\`, \`.0\`). The job line's
  \`TotalCPU\` sums its steps only without \`-X\`: with \`-X\` it reads \`00:00:00\` (compare the two sacct files). The REST
  slurmdb job-level \`time.total\` is 0; usage is in \`steps[]\`.
* An accounting record appears in sacct only some seconds after submission; a held job is \`PENDING\` there
  with Start/End \`Unknown\`.
* A POST with \`"hold": true\` answers error 2042 together with a valid \`job_id\`: a success.
* slurmrestd answers an unknown job id with HTTP 500 and error 2017 (\`/slurm/.../job/{id}\`), but HTTP 200
  with error 9003 "Nothing found with query" on \`/slurmdb/.../job/{id}\`. A bad token is HTTP 500 too ("Failed while looking for jobs"),
  no token at all HTTP 401 with the plain-text body \`Authentication failure\`.
* After \`state=resume\` the node reads \`idle*\` (not responding) until the next slurmd ping, about a second.
* \`sstat_running_allsteps.txt\` keeps its header line (no \`-n\`); every other capture is headerless.

## Captures

Command lines are exact and shell-quoted (in the table \`\|\` is Markdown for \`|\`); "$U" rows ran as that user via \`runuser\` in \`$W\`;
\`--stderr\` captures (rejections, errors) hold stdout and stderr together; rc is the exit status.
REST rows show the HTTP status; the request body of each POST is in \`<name>.request.json\`.

| file | as | command | rc |
|---|---|---|---|
EOF
  printf '%s\n' "${ROWS[@]}"
} >"$OUT/README.md"
log "wrote $(ls "$OUT" | wc -l) files to $OUT"
