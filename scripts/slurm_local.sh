#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for CI and for trying the launch/ scripts.
#
#   scripts/slurm_local.sh start    install slurm-wlm + munge if missing, write slurm.conf, start the daemons
#   scripts/slurm_local.sh status   say which daemons run, show sinfo
#   scripts/slurm_local.sh stop     cancel this cluster's jobs, stop the daemons this script started (by pid)
#   scripts/slurm_local.sh env      print `export SLURM_CONF=...` for eval in a shell
#
# Every command is idempotent. Clients (sbatch, squeue, ...) find the cluster through SLURM_CONF, which
# points into a private state directory, so a system-wide /etc/slurm is neither needed nor touched.
# Needs root: munged --force and slurmd run as root (SlurmUser=root), and apt-get installs the packages.
#
# Environment: SLURM_LOCAL_DIR (state directory, default /tmp/megatron-rl-slurm),
# SLURM_LOCAL_CTLD_PORT / SLURM_LOCAL_SLURMD_PORT (default 6817 / 6818), SLURM_LOCAL_START_TIMEOUT_S (60).
set -euo pipefail

STATE_DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-rl-slurm}
CONF=$STATE_DIR/slurm.conf
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
START_TIMEOUT_S=${SLURM_LOCAL_START_TIMEOUT_S:-60}
MUNGE_PID_FILE=/run/munge/munged.pid
# Written only when this script started munged, so `stop` never ends a munged someone else runs.
MUNGE_OURS=$STATE_DIR/munged.started-here
NODE=$(hostname -s)

die() { echo "slurm_local: error: $*" >&2; exit 1; }
log() { echo "slurm_local: $*"; }

running_pid() {  # print the pid in file $1 if that process is alive
    local pid
    [[ -f $1 ]] || return 1
    pid=$(<"$1")
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    [[ $EUID -eq 0 ]] || die "slurm-wlm/munge are not installed and installing them needs root (uid is $EUID)"
    command -v apt-get >/dev/null || die "slurm-wlm/munge are not installed and apt-get is not available"
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; } \
        || die "apt-get could not install slurm-wlm and munge"
}

start_munge() {
    if running_pid "$MUNGE_PID_FILE" >/dev/null; then
        log "munged already running (pid $(<"$MUNGE_PID_FILE"))"
        return
    fi
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    mkdir -p /run/munge
    # --force: run as root and accept a key/socket directory owned by root (no munge system user needed).
    munged --force
    touch "$MUNGE_OURS"
    started munged "$MUNGE_PID_FILE"
}

write_conf() {
    mkdir -p "$STATE_DIR/state" "$STATE_DIR/spool"
    cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: one node, root everywhere, no cgroups (works inside containers).
ClusterName=megatronrl
SlurmctldHost=$NODE
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
NodeName=$NODE CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

started() {  # daemons fork before writing their pid file: wait for it, then report the pid
    local name=$1 file=$2 deadline=$((SECONDS + START_TIMEOUT_S))
    until running_pid "$file" >/dev/null; do
        ((SECONDS < deadline)) || die "$name wrote no pid file $file within ${START_TIMEOUT_S}s; see its log in $STATE_DIR"
        sleep 0.2
    done
    log "started $name (pid $(<"$file"))"
}

wait_for_node() {
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while ((SECONDS < deadline)); do
        state=$(SLURM_CONF=$CONF sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null || true)
        [[ $state == idle* || $state == mixed* || $state == allocated* ]] && { log "node $NODE is $state"; return; }
        sleep 1
    done
    die "node $NODE is not usable after ${START_TIMEOUT_S}s (state: '${state:-no answer from slurmctld}'); see $STATE_DIR/slurmctld.log and $STATE_DIR/slurmd.log"
}

start() {
    install_packages
    mkdir -p "$STATE_DIR"
    start_munge
    # A running slurmctld keeps the slurm.conf it started with; rewrite it only for a fresh start.
    if ! running_pid "$STATE_DIR/slurmctld.pid" >/dev/null || [[ ! -f $CONF ]]; then
        write_conf
    fi
    if ! running_pid "$STATE_DIR/slurmctld.pid" >/dev/null; then
        # -c: forget jobs of an earlier session of this throwaway cluster.
        slurmctld -c -f "$CONF" || die "slurmctld did not start; see $STATE_DIR/slurmctld.log"
        started slurmctld "$STATE_DIR/slurmctld.pid"
    fi
    if ! running_pid "$STATE_DIR/slurmd.pid" >/dev/null; then
        slurmd -f "$CONF" || die "slurmd did not start; see $STATE_DIR/slurmd.log"
        started slurmd "$STATE_DIR/slurmd.pid"
    fi
    wait_for_node
    echo "export SLURM_CONF=$CONF"
}

stop_pid_file() {  # stop the daemon whose pid is in $2 (named $1): TERM, then KILL after 10 s
    local name=$1 pid
    pid=$(running_pid "$2") || { log "$name not running"; return 0; }
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || { log "stopped $name (pid $pid)"; return 0; }; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    log "killed $name (pid $pid) after it ignored SIGTERM for 10 s"
}

stop() {
    if running_pid "$STATE_DIR/slurmctld.pid" >/dev/null; then
        # Jobs left on this private cluster were submitted through SLURM_CONF=$CONF: end them with it.
        local jobs
        jobs=$(SLURM_CONF=$CONF squeue --noheader --format=%i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling jobs still on the cluster: $(echo "$jobs" | tr '\n' ' ')"
            # shellcheck disable=SC2086 # one job id per word
            SLURM_CONF=$CONF scancel $jobs || true
        fi
    fi
    stop_pid_file slurmd "$STATE_DIR/slurmd.pid"
    stop_pid_file slurmctld "$STATE_DIR/slurmctld.pid"
    if [[ -f $MUNGE_OURS ]]; then
        stop_pid_file munged "$MUNGE_PID_FILE"
        rm -f "$MUNGE_OURS"
    fi
}

status() {
    local name file rc=0
    for name in munged slurmctld slurmd; do
        file=$STATE_DIR/$name.pid
        [[ $name == munged ]] && file=$MUNGE_PID_FILE
        if pid=$(running_pid "$file"); then log "$name running (pid $pid)"; else log "$name not running"; rc=3; fi
    done
    ((rc == 0)) && SLURM_CONF=$CONF sinfo
    return "$rc"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
