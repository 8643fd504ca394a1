#!/usr/bin/env bash
# Run megatron-rl on a Ray cluster spanning the nodes of the current SLURM job.
#
#   sbatch --nodes=4 --gpus-per-node=8 --exclusive launch/ray_on_slurm.sh +experiment=grpo_32b [overrides...]
#   or exec'd by a preset script with its #SBATCH lines (launch/grpo_70b.sh).
#
# Steps: check the plan (python -m megatron_rl.plan) before any node is touched; start the Ray head on
# this node (the job's first) and a Ray worker on every other node, each as an srun step; wait until
# all nodes joined; run `python -m megatron_rl.train` against the cluster; stop the steps on exit.
# On SIGUSR1 (sbatch --signal=B:USR1@300) the driver is asked to checkpoint and stop, then the job is
# requeued; the requeued run finds that checkpoint in the same OUTPUT_DIR (trainer.resume_mode=auto).
#
# Environment (all optional):
#   MODEL_PATH        -> actor_rollout_ref.model.path
#   DATA_DIR          -> data.train_files=[$DATA_DIR/train.parquet] data.val_files=[$DATA_DIR/test.parquet]
#   OUTPUT_DIR        -> trainer.default_local_dir; default <submit dir>/outputs/<job name>-<job id>, the
#                        same after a requeue, so the run resumes there
#   EXTRA_OVERRIDES   more Hydra overrides, space-separated, applied after the arguments
#   NNODES            nodes to use; must equal the allocation (choose it with sbatch --nodes)
#   GPUS_PER_NODE     default: the job's --gpus-per-node; 0 runs on CPUs with no GPU flags anywhere
#   PYTHON, RAY       interpreter with megatron_rl and the ray CLI (default: python, ray on PATH)
#   MEGATRON_RL_DIR   the checkout (default: the submit directory); put on PYTHONPATH for every node
#   RAY_PORT (6379), RAY_JOIN_TIMEOUT_S (600), RAY_START_ARGS (extra `ray start` args for every node),
#   HEAD_IP (default: this node's first address), REQUEUE_GRACE_S (240: time to checkpoint after SIGUSR1),
#   RAY_AUTH_MODE (default: token, with a fresh RAY_AUTH_TOKEN per job)
set -euo pipefail

die() { echo "ray_on_slurm: error: $*" >&2; exit 1; }
log() { echo "ray_on_slurm: [$(date +%T)] $*"; }

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a SLURM job: submit with sbatch (e.g. sbatch launch/grpo_70b.sh)"
REPO_DIR=${MEGATRON_RL_DIR:-$SLURM_SUBMIT_DIR}
[[ -f $REPO_DIR/launch/ray_wait.py ]] \
    || die "$REPO_DIR is not a megatron-rl checkout: submit from one or set MEGATRON_RL_DIR"
(($# > 0)) || die "no Hydra overrides given; pass at least +experiment=NAME"

PYTHON=${PYTHON:-python}
RAY=${RAY:-ray}
NNODES=${NNODES:-$SLURM_JOB_NUM_NODES}
[[ $NNODES == "$SLURM_JOB_NUM_NODES" ]] \
    || die "NNODES=$NNODES but the job has $SLURM_JOB_NUM_NODES nodes; choose the node count with sbatch --nodes=$NNODES"
gpus=${SLURM_GPUS_PER_NODE:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus##*:}}  # --gpus-per-node=h100:8 -> 8
RAY_PORT=${RAY_PORT:-6379}
RAY_JOIN_TIMEOUT_S=${RAY_JOIN_TIMEOUT_S:-600}
REQUEUE_GRACE_S=${REQUEUE_GRACE_S:-240}
HEAD_NODE=${SLURMD_NODENAME:-$(hostname -s)}  # the batch script runs on the job's first node
HEAD_IP=${HEAD_IP:-$(hostname -I | awk '{print $1}')}
OUTPUT_DIR=${OUTPUT_DIR:-$SLURM_SUBMIT_DIR/outputs/${SLURM_JOB_NAME%.sh}-$SLURM_JOB_ID}
LOG_DIR=$OUTPUT_DIR/logs
RUN=${SLURM_RESTART_COUNT:-0}
mkdir -p "$LOG_DIR"
# Ray workers inherit the environment of `ray start`: this makes the checkout importable on every node.
export PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}
# Ray >= 2.5x turns token authentication on for `ray start` when ~/.ray/auth_token happens to exist, but a
# client given an explicit address only sends a token in token mode. Decide once for the whole job: a
# fresh token, handed to every node and to the driver through the environment (srun passes it on).
if [[ -z ${RAY_AUTH_MODE:-} ]]; then
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
fi

overrides=("$@" "trainer.nnodes=$NNODES" "ray_init.address=$HEAD_IP:$RAY_PORT"
           "trainer.default_local_dir=$OUTPUT_DIR" "trainer.resume_mode=auto")
gpu_flags=()
if ((GPUS_PER_NODE > 0)); then
    overrides+=("trainer.n_gpus_per_node=$GPUS_PER_NODE")
    gpu_flags=("--gpus-per-node=$GPUS_PER_NODE")
fi
[[ -n ${MODEL_PATH:-} ]] && overrides+=("actor_rollout_ref.model.path=$MODEL_PATH")
[[ -n ${DATA_DIR:-} ]] && overrides+=("data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]")
read -ra extra <<<"${EXTRA_OVERRIDES:-}"
overrides+=("${extra[@]}")
read -ra ray_args <<<"${RAY_START_ARGS:-}"

log "job $SLURM_JOB_ID run $RUN: $NNODES node(s) x $GPUS_PER_NODE GPU(s), head $HEAD_NODE ($HEAD_IP:$RAY_PORT), output $OUTPUT_DIR"
log "overrides: ${overrides[*]}"
"$PYTHON" -m megatron_rl.plan "${overrides[@]}" || die "the plan was rejected (above); nothing was started"

head_pid="" workers_pid="" driver_pid="" watchdog_pid="" requeue=0

stop_steps() {  # end what this script started, by pid: the driver, then the Ray srun steps
    local pid alive=""
    for pid in $watchdog_pid $driver_pid $workers_pid $head_pid; do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 30); do
        alive=""
        for pid in $driver_pid $workers_pid $head_pid; do kill -0 "$pid" 2>/dev/null && alive+=" $pid"; done
        [[ -z $alive ]] && return 0
        sleep 1
    done
    log "killing pids$alive, still running 30 s after SIGTERM"
    for pid in $alive; do kill -KILL "$pid" 2>/dev/null || true; done
}
trap stop_steps EXIT

# shellcheck disable=SC2317 # run by the USR1 trap
on_time_limit() {
    requeue=1
    if [[ -z $driver_pid ]]; then
        log "SIGUSR1: the time limit is near and training has not started; requeueing now"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    log "SIGUSR1: the time limit is near; asking the driver to checkpoint and stop, then requeueing"
    kill -USR1 "$driver_pid" 2>/dev/null || true
    (sleep "$REQUEUE_GRACE_S" && kill -TERM "$driver_pid" 2>/dev/null) &
    watchdog_pid=$!
}
trap on_time_limit USR1
trap 'log "SIGTERM: stopping"; exit 143' TERM

ray_step() {  # ray_step <log file> <srun node options...> -- <ray start options...>
    local log_file=$1 srun_opts=()
    shift
    while [[ $1 != -- ]]; do srun_opts+=("$1"); shift; done
    shift
    # --overlap: the steps share the allocation with each other and with this batch script.
    srun --overlap --ntasks-per-node=1 "${gpu_flags[@]}" "${srun_opts[@]}" --output="$log_file" \
        "$RAY" start --block --num-gpus="$GPUS_PER_NODE" "${ray_args[@]}" "$@" &
}

ray_step "$LOG_DIR/ray-head-$RUN.log" --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" -- \
    --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT"
head_pid=$!
watch=(--watch-pid "$head_pid")
# Workers start once the head answers: `ray start --address` gives up on a head that is not up yet.
"$PYTHON" "$REPO_DIR/launch/ray_wait.py" --address "$HEAD_IP:$RAY_PORT" --nodes 1 \
    --timeout-s "$RAY_JOIN_TIMEOUT_S" "${watch[@]}" || die "the Ray head did not start; see $LOG_DIR/ray-head-$RUN.log"
if ((NNODES > 1)); then
    ray_step "$LOG_DIR/ray-worker-%N-$RUN.log" --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) \
        --exclude="$HEAD_NODE" -- --address="$HEAD_IP:$RAY_PORT"
    workers_pid=$!
    watch+=(--watch-pid "$workers_pid")
    "$PYTHON" "$REPO_DIR/launch/ray_wait.py" --address "$HEAD_IP:$RAY_PORT" --nodes "$NNODES" \
        --timeout-s "$RAY_JOIN_TIMEOUT_S" --expected-hosts "$SLURM_JOB_NODELIST" "${watch[@]}" \
        || die "the Ray cluster is incomplete (above)"
fi

log "starting the driver"
"$PYTHON" -m megatron_rl.train "${overrides[@]}" &
driver_pid=$!
driver_rc=0
while :; do
    wait "$driver_pid" && driver_rc=0 || driver_rc=$?
    kill -0 "$driver_pid" 2>/dev/null || break  # else a trapped signal interrupted `wait`: keep waiting
done
driver_pid=""
[[ -n $watchdog_pid ]] && kill "$watchdog_pid" 2>/dev/null
watchdog_pid=""
log "driver exited with status $driver_rc"
stop_steps
if ((requeue)); then
    log "requeueing job $SLURM_JOB_ID; the next run resumes from $OUTPUT_DIR"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$driver_rc"
