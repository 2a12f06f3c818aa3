#!/usr/bin/env bash
# A one-node SLURM on this machine, for trying jddp's SLURM paths (and for its `slurm` tests).
#   bash scripts/slurm_local.sh start   # install slurm-wlm + munge if missing, start the daemons
#   bash scripts/slurm_local.sh stop    # stop the daemons this script started
#   bash scripts/slurm_local.sh status
# Needs root (apt-get, daemons as SlurmUser=root); no systemd needed (daemons started by hand).
# Writes /etc/slurm/slurm.conf (Debian's default path, so srun/sbatch find it) unless a config
# that this script did not write is there; state and logs in $JDDP_SLURM_DIR (/tmp/jddp-slurm).
# One node with CPUs=$(nproc), proctrack/linuxproc, task/none (no cgroups), select/cons_tres,
# auth/munge. A start that has to launch slurmctld drops the jobs of an earlier cluster.
# Exit 0 when the cluster answers `sinfo`; 1 with one line saying why otherwise.
set -euo pipefail
STATE=${JDDP_SLURM_DIR:-/tmp/jddp-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by jddp scripts/slurm_local.sh"
say() { echo "slurm_local: $*" >&2; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v srun >/dev/null && return
  command -v apt-get >/dev/null || { say "slurm-wlm/munge missing and no apt-get to install them"; exit 1; }
  [ "$(id -u)" = 0 ] || { say "installing slurm-wlm needs root"; exit 1; }
  say "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >"$STATE/apt.log" 2>&1 ||
    { apt-get update -q >>"$STATE/apt.log" 2>&1 && apt-get install -y -q slurm-wlm munge >>"$STATE/apt.log" 2>&1; } ||
    { say "apt-get install slurm-wlm munge failed (log: $STATE/apt.log)"; exit 1; }
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    say "$CONF exists and was not written by this script: using it as it is"
    return
  fi
  local host cpus
  host=$(hostname -s)
  cpus=$(nproc)
  mkdir -p /etc/slurm "$STATE/spool" "$STATE/state"
  cat >"$CONF" <<CONF
$MARK
ClusterName=jddp-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire s before it may start again (default 120); 20 s is still
# ample for a one-node step launch.
AuthInfo=cred_expire=20
# ... and then until a scheduler's next pass (sched_interval 60 s, bf_interval 30 s by
# default): every second here (one node, a handful of jobs), so it starts as soon as it may.
SchedulerParameters=bf_interval=1,sched_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmdSpoolDir=$STATE/spool
StateSaveLocation=$STATE/state
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start() {
  mkdir -p "$STATE"
  install
  write_conf
  if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || { mungekey -c 2>/dev/null || create-munge-key -f >/dev/null 2>&1; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge && chown -R munge: /run/munge /var/log/munge /var/lib/munge /etc/munge 2>/dev/null || true
    chmod 0700 /etc/munge 2>/dev/null || true
    (su -s /bin/sh munge -c munged 2>/dev/null || munged --force) || { say "munged did not start"; exit 1; }
  fi
  # -c: start from a clean slate. A machine that went down mid-job leaves that job in the saved
  # state; recovered, it holds the node's CPUs for ever (slurmd no longer knows it), and every
  # later srun waits "for resources". This cluster is a throwaway: its old jobs are not kept.
  pgrep -x slurmctld >/dev/null || slurmctld -c -f "$CONF"
  pgrep -x slurmd >/dev/null || slurmd -c -f "$CONF"
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      say "up: $(sinfo -h -o '%N %c CPUs %T')"
      return
    fi
    scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  say "the node did not become idle in 30 s (logs: $STATE/slurmctld.log, $STATE/slurmd.log)"
  exit 1
}

stop() {
  local pids=() pidfile pid alive=0
  for daemon in slurmd slurmctld; do
    pidfile="$STATE/$daemon.pid"
    if [ -s "$pidfile" ]; then pids+=("$(cat "$pidfile")"); fi
  done
  [ ${#pids[@]} = 0 ] || kill "${pids[@]}" 2>/dev/null || true
  # A step still ending as they stop (its slurmstepd retrying the slurmctld that is gone) keeps
  # slurmd from exiting, for good (seen after the tests' last srun), and a slurmd left running
  # keeps the next start's node down ("did not become idle"): the daemons get 15 s, then what
  # is left of them is killed, and with this script's cluster the steps' slurmstepd too.
  for _ in $(seq 30); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  if [ $alive = 1 ]; then
    kill -KILL "${pids[@]}" 2>/dev/null || true
    say "slurmd or slurmctld did not stop in 15 s: killed"
  fi
  if grep -qF "$MARK" "$CONF" 2>/dev/null && pkill -KILL -x slurmstepd; then
    say "killed the slurmstepd of steps still ending"
  fi
  say "stopped slurmd and slurmctld (munged left running)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: bash scripts/slurm_local.sh start|stop|status" >&2; exit 2 ;;
esac
