#!/usr/bin/env bash
# Compile-checks CUDA sources with nvcc for sm_80 and sm_90, warnings as errors (host compiler, nvcc front end and
# ptxas alike), with the flags the extension build gives them (setup.py's nvcc flags and torch's own
# cpp_extension.COMMON_NVCC_FLAGS, which take away cuda_bf16/cuda_fp16's implicit conversions and operators).
# The CUDA sources include no torch headers, so this runs on machines without a GPU or a CUDA torch.
#
#   scripts/check_cuda.sh [file.cu ...]     default: every csrc/cuda/*.cu (make check-cuda)
#   scripts/check_cuda.sh --print-flags     the nvcc flags, one a line (tests/kernels/test_cuda_build.py)
#
# PTXAS_LOG=path: also write ptxas's register / spill report of each file there (scripts/ptxas_table.py reads it).
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHS=(80 90)
FLAGS=(
  -std=c++20 -O3 -Icsrc --expt-relaxed-constexpr -lineinfo  # setup.py's, and the C++ standard torch builds with
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__  # torch's cpp_extension.COMMON_NVCC_FLAGS
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  -Xcompiler -fPIC,-Wall,-Wextra,-Werror --Werror all-warnings
  -Xptxas -v  # registers and spills of every kernel: information, never an error
)
for arch in "${ARCHS[@]}"; do FLAGS+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done
ARCH_NAMES="$(printf 'sm_%s,' "${ARCHS[@]}")"
ARCH_NAMES="${ARCH_NAMES%,}"

if [[ "${1:-}" == "--print-flags" ]]; then
  printf '%s\n' "${FLAGS[@]}"
  exit 0
fi

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$NVCC" ]]; then
  echo "check_cuda.sh: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi
sources=("$@")
[[ ${#sources[@]} -gt 0 ]] || sources=(csrc/cuda/*.cu)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
if [[ -n "${PTXAS_LOG:-}" ]]; then
  echo "# nvcc: $("$NVCC" --version | sed -n 's/^Cuda compilation tools, //p')" > "$PTXAS_LOG"
fi
status=0
for src in "${sources[@]}"; do
  log="$out/$(basename "$src").log"
  start=$SECONDS
  # one nvcc call per file for all architectures: the host side is compiled once
  if "$NVCC" "${FLAGS[@]}" -c "$src" -o "$out/$(basename "$src").o" > "$log" 2>&1; then
    echo "ok   $ARCH_NAMES $src ($((SECONDS - start)) s)"
    if [[ -n "${PTXAS_LOG:-}" ]]; then
      { echo "== $src"; cat "$log"; echo; } >> "$PTXAS_LOG"  # nvcc ends its report without a newline
    fi
  else
    echo "FAIL $ARCH_NAMES $src:" >&2
    grep -v '^ptxas info\|^    [0-9]* bytes stack frame' "$log" >&2 || true
    status=1
  fi
done
exit "$status"
