#!/usr/bin/env bash
# Run megatron-rl on a Ray cluster spanning the nodes of the current SLURM job.
#
#   sbatch --nodes=4 --gpus-per-node=8 --exclusive launch/ray_on_slurm.sh +experiment=grpo_32b [overrides...]
#   or exec'd by a preset script that carries its #SBATCH lines (launch/grpo_70b.sh).
#
# Checks the plan (python -m megatron_rl.plan) before any node is touched; starts the Ray head on this
# node (the job's first) and a Ray worker on every other node, each as an srun step; waits until all
# nodes joined; runs `python -m megatron_rl.train` against the cluster; stops the steps on exit. On
# SIGUSR1 (sbatch --signal=B:USR1@300) the driver checkpoints and stops, and the job is requeued; the
# requeued run resumes from that checkpoint in the same OUTPUT_DIR (trainer.resume_mode=auto).
#
# Environment: see launch/lib.sh (MODEL_PATH, DATA_DIR, OUTPUT_DIR, EXTRA_OVERRIDES, NNODES, GPUS_PER_NODE,
# PYTHON, DRY_RUN, ...), and for Ray: RAY (the ray CLI, default: ray on PATH), RAY_PORT (6379),
# RAY_JOIN_TIMEOUT_S (600), RAY_START_ARGS (extra `ray start` arguments for every node), HEAD_IP (default:
# the address of MRL_HEAD_IFACE, else SLURM's address of the job's first node; see head_address in lib.sh;
# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME reach every node's Ray and so every rank), RAY_AUTH_MODE (default: token, with a fresh RAY_AUTH_TOKEN per job),
# MEGATRON_RL_DIR (the checkout; default: this script's, or the submit directory under sbatch).
set -euo pipefail

# sbatch runs a copy of the submitted script from its spool directory: find the checkout from there too.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -f $here/lib.sh ]] && default_repo=${here%/launch} || default_repo=${SLURM_SUBMIT_DIR:-$PWD}
REPO_DIR=${MEGATRON_RL_DIR:-$default_repo}
# shellcheck source=launch/lib.sh
source "$REPO_DIR/launch/lib.sh" 2>/dev/null \
    || { echo "ray_on_slurm: error: no $REPO_DIR/launch/lib.sh; submit from the checkout or set MEGATRON_RL_DIR" >&2; exit 1; }

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a SLURM job: submit with sbatch (e.g. sbatch launch/grpo_70b.sh)"
launch_init "$@"
RAY=${RAY:-ray}
RAY_PORT=${RAY_PORT:-6379}
RAY_JOIN_TIMEOUT_S=${RAY_JOIN_TIMEOUT_S:-600}
HEAD_NODE=${SLURMD_NODENAME:-$(hostname -s)}  # the batch script runs on the job's first node
HEAD_IP=${HEAD_IP:-$(head_address)}
mapfile -t socket_vars < <(socket_env)  # `env NCCL_SOCKET_IFNAME=... ...` or nothing
LOG_DIR=$OUTPUT_DIR/logs
read -ra ray_args <<<"${RAY_START_ARGS:-}"
# On CPU (GPUS_PER_NODE=0) the preset's trainer.n_gpus_per_node (processes per node) stays.
((GPUS_PER_NODE > 0)) && overrides+=("trainer.n_gpus_per_node=$GPUS_PER_NODE")
# The cluster's size is what `ray start` found on the nodes; ray_init.num_cpus only sizes an embedded Ray.
overrides+=("ray_init.address=$HEAD_IP:$RAY_PORT" "ray_init.num_cpus=null")
driver=("$PYTHON" -m megatron_rl.train "${overrides[@]}")

# Ray >= 2.5x turns token authentication on for `ray start` when ~/.ray/auth_token happens to exist, but a
# client given an explicit address sends a token only in token mode. Decide once for the whole job: a
# fresh token, handed to every node and to the driver through the environment (srun passes it on).
if [[ -z ${RAY_AUTH_MODE:-} ]]; then
    export RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
fi

log "job $SLURM_JOB_ID run $RUN: $NNODES node(s) x $GPUS_PER_NODE GPU(s), Ray head $HEAD_NODE ($HEAD_IP:$RAY_PORT), output $OUTPUT_DIR"
check_plan
exit_if_dry_run "Ray head on $HEAD_NODE at $HEAD_IP:$RAY_PORT, Ray workers on the $((NNODES - 1)) other node(s)" \
    "ray start: $(quoted "${socket_vars[@]}" "$RAY" start --block --num-gpus="$GPUS_PER_NODE" "${ray_args[@]}")" \
    "driver: $(quoted "${driver[@]}")"
mkdir -p "$LOG_DIR"

ray_step() {  # ray_step LOG_FILE SRUN_OPTION... -- RAY_START_OPTION...
    local log_file=$1 srun_opts=()
    shift
    while [[ $1 != -- ]]; do srun_opts+=("$1"); shift; done
    shift
    # --overlap: the steps share the allocation with each other and with this batch script.
    srun --overlap --ntasks-per-node=1 "${GPU_FLAGS[@]}" "${srun_opts[@]}" --output="$log_file" \
        "${socket_vars[@]}" "$RAY" start --block --num-gpus="$GPUS_PER_NODE" "${ray_args[@]}" "$@" &
    own_pid $!
}

wait_for_nodes() {  # wait_for_nodes COUNT: until COUNT nodes are alive, failing early if a Ray step died
    local watch=() pid
    for pid in "${OWNED_PIDS[@]}"; do watch+=(--watch-pid "$pid"); done
    "$PYTHON" "$REPO_DIR/launch/ray_wait.py" --address "$HEAD_IP:$RAY_PORT" --nodes "$1" \
        --timeout-s "$RAY_JOIN_TIMEOUT_S" --expected-hosts "$SLURM_JOB_NODELIST" "${watch[@]}" \
        || die "the Ray cluster did not come up (above); Ray's output is in $LOG_DIR/ray-*-$RUN.log"
}

ray_step "$LOG_DIR/ray-head-$RUN.log" --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" -- \
    --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT"
# Workers start once the head answers: `ray start --address` gives up on a head that is not up yet.
wait_for_nodes 1
if ((NNODES > 1)); then
    ray_step "$LOG_DIR/ray-worker-%N-$RUN.log" --nodes=$((NNODES - 1)) --ntasks=$((NNODES - 1)) \
        --exclude="$HEAD_NODE" -- --address="$HEAD_IP:$RAY_PORT"
    wait_for_nodes "$NNODES"
fi

run_driver "${driver[@]}"
finish
