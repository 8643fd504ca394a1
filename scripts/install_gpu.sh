#!/usr/bin/env bash
# Installs one GPU environment (Linux x86-64, CUDA 13.0 wheels, NVIDIA driver >= 580, a CUDA 13.x toolkit for the
# source builds) into the Python it is given, the checkout editable:
#
#   scripts/install_gpu.sh sglang      constraints/gpu-sglang.txt: sglang 0.5.23, torch 2.14.1
#   scripts/install_gpu.sh vllm        constraints/gpu-vllm.txt:   vllm 0.32.0,   torch 2.13.0
#
# One environment per engine: their torch pins differ (docs/launching.md, "GPU install"), so use a venv for each.
# Both hold Megatron-Core 0.16.1 and Transformer Engine 2.11.0 (constraints/gpu-megatron.txt); the HF engine runs in
# either. The pinned CUDA torch and the build tools come first: the checkout (megatron_rl._C) and Transformer
# Engine's torch extension are then built without build isolation, against that torch, as pyproject.toml says.
#
# PYTHON   the interpreter to install into (default python3; a venv's python for a venv)
# DRY_RUN  1: print the pip commands, run nothing
# NVTE_CUDA_ARCHS, MAX_JOBS, TORCH_CUDA_ARCH_LIST reach the source builds as usual (scripts/gpu_check.sh sets them
# to the GPU it sees).
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "install_gpu.sh: $*" >&2; exit 2; }

engines=()
for file in constraints/gpu-*.txt; do
  engine=${file#constraints/gpu-}
  engine=${engine%.txt}
  [[ $engine == megatron ]] || engines+=("$engine")  # the trainer's half, included by every environment
done
[[ $# -eq 1 ]] || die "usage: scripts/install_gpu.sh ENGINE, ENGINE one of: ${engines[*]}"
ENGINE=$1
CONSTRAINTS=constraints/gpu-$ENGINE.txt
[[ " ${engines[*]} " == *" $ENGINE "* ]] \
  || die "no GPU environment '$ENGINE' ($CONSTRAINTS does not exist); one of: ${engines[*]}"

PY=${PYTHON:-python3}
run() {
  echo "+ $*"
  [[ ${DRY_RUN:-0} == 1 ]] || "$@"
}
run "$PY" -m pip install -c "$CONSTRAINTS" pip setuptools wheel packaging ninja torch
run "$PY" -m pip install --no-build-isolation -c "$CONSTRAINTS" -e ".[gpu,$ENGINE]"
