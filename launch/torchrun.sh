#!/usr/bin/env bash
# Run megatron-rl without Ray: one torchrun per node, every rank hosting its colocated actor / reference /
# rollout shard (trainer.launcher=torchrun).
#
#   one node:        launch/torchrun.sh +experiment=grpo_7b [overrides...]
#   a SLURM job:     sbatch --nodes=8 --gpus-per-node=8 --exclusive --signal=B:USR1@300 --requeue \
#                        launch/torchrun.sh +experiment=grpo_70b
#                    (srun starts one torchrun per node; c10d rendezvous on the job's first node)
#   nodes by hand:   NNODES=2 MASTER_ADDR=node0 launch/torchrun.sh ...   on each of the nodes
#
# The plan is checked first. torchrun forwards SIGUSR1 (the SLURM time-limit warning) to every rank, which
# checkpoints and stops; in a SLURM job the job is then requeued and resumes (trainer.resume_mode=auto).
#
# Environment: see launch/lib.sh (MODEL_PATH, DATA_DIR, OUTPUT_DIR, EXTRA_OVERRIDES, NNODES, GPUS_PER_NODE,
# PYTHON, DRY_RUN, ...), and NPROC_PER_NODE (default GPUS_PER_NODE; required on CPU), MASTER_ADDR (default
# in a SLURM job: the address of MRL_HEAD_IFACE, else SLURM's address of the job's first node; see head_address
# in lib.sh), MASTER_PORT (29500), MEGATRON_RL_DIR (the checkout).
set -euo pipefail

# sbatch runs a copy of the submitted script from its spool directory: find the checkout from there too.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ -f $here/lib.sh ]] && default_repo=${here%/launch} || default_repo=${SLURM_SUBMIT_DIR:-$PWD}
REPO_DIR=${MEGATRON_RL_DIR:-$default_repo}
# shellcheck source=launch/lib.sh
source "$REPO_DIR/launch/lib.sh" 2>/dev/null \
    || { echo "torchrun: error: no $REPO_DIR/launch/lib.sh; submit from the checkout or set MEGATRON_RL_DIR" >&2; exit 1; }

launch_init "$@"
NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
((NPROC_PER_NODE > 0)) || die "no GPUs here (GPUS_PER_NODE=0): set NPROC_PER_NODE, the processes per node on CPU"
MASTER_PORT=${MASTER_PORT:-29500}
# The launcher owns these: the config must agree with the processes torchrun starts.
overrides+=("trainer.launcher=torchrun" "trainer.n_gpus_per_node=$NPROC_PER_NODE")

mapfile -t socket_vars < <(socket_env)  # NCCL_/GLOO_SOCKET_IFNAME when set: every agent, so every rank
torchrun=("${socket_vars[@]}" "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
          "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout="$REQUEUE_GRACE_S")
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    MASTER_ADDR=${MASTER_ADDR:-$(head_address)}  # the job's first node, where the batch script runs
    torchrun=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 "${GPU_FLAGS[@]}" "${torchrun[@]}"
              --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID")
elif ((NNODES == 1)); then
    torchrun+=(--standalone)
else
    [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES outside SLURM: set MASTER_ADDR to the first node's address on every node"
    torchrun+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-megatron-rl}")
fi
driver=("${torchrun[@]}" -m megatron_rl.train "${overrides[@]}")

log "$NNODES node(s) x $NPROC_PER_NODE process(es)${SLURM_JOB_ID:+, job $SLURM_JOB_ID run $RUN}"
check_plan
exit_if_dry_run "driver: $(quoted "${driver[@]}")"
run_driver "${driver[@]}"
finish
