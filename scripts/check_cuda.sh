#!/usr/bin/env bash
# Compile-checks every csrc/cuda/*.cu with nvcc for sm_80 and sm_90, warnings as errors.
# The CUDA sources include no torch headers, so this runs on machines without a GPU or a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "check_cuda.sh: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for src in csrc/cuda/*.cu; do
  for arch in 80 90; do
    if "$NVCC" -std=c++20 -O3 -Icsrc --expt-relaxed-constexpr \
        -gencode "arch=compute_${arch},code=sm_${arch}" \
        -Xcompiler -Wall,-Wextra,-Werror --Werror all-warnings \
        -c "$src" -o "$out/$(basename "$src").sm${arch}.o"; then
      echo "ok   sm_${arch} $src"
    else
      echo "FAIL sm_${arch} $src" >&2
      status=1
    fi
  done
done
exit "$status"
