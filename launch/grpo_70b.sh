#!/usr/bin/env bash
#SBATCH --job-name=grpo_70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#
# GRPO on a 70B model (configs/experiment/grpo_70b.yaml) with Ray on SLURM; submit from the checkout:
#
#   MODEL_PATH=/models/Meta-Llama-3-70B-Instruct DATA_DIR=/data/gsm8k sbatch launch/grpo_70b.sh [overrides...]
#
# sbatch options override the lines above (sbatch --nodes=16 ..., --time=...); check a layout first with
#   python -m megatron_rl.plan +experiment=grpo_70b trainer.nnodes=16
# EXPERIMENT picks another preset for the same launch (CI runs the tiny CPU one on a 1-node cluster):
#   EXPERIMENT=grpo_tiny_cpu sbatch --nodes=1 --gpus-per-node=0 launch/grpo_70b.sh
# The other variables (MODEL_PATH, DATA_DIR, OUTPUT_DIR, EXTRA_OVERRIDES, NNODES, GPUS_PER_NODE, DRY_RUN,
# ...) are described in launch/lib.sh, launch/ray_on_slurm.sh and docs/launching.md.
set -euo pipefail

# sbatch runs a copy of this file from its spool directory: find the checkout through the submit dir.
REPO_DIR=${MEGATRON_RL_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
launcher=$REPO_DIR/launch/ray_on_slurm.sh
[[ -x $launcher ]] || { echo "grpo_70b: error: no $launcher; submit from the megatron-rl checkout or set MEGATRON_RL_DIR" >&2; exit 1; }
exec "$launcher" "+experiment=${EXPERIMENT:-grpo_70b}" "$@"
