#!/usr/bin/env bash
# Builds megatron_rl._C with its CUDA kernels exactly as setup.py does on a GPU node, against a GPU environment's
# own CUDA torch (the torch== pin of its constraints file), in a venv of its own, then imports it and checks that
# every megatron_rl op has a CUDA kernel registered. No GPU is needed: nothing runs on a device.
#
#   scripts/build_cuda_extension.sh        (make check-cuda-extension; docs/kernels.md)
#
# CUDA_BUILD_CONSTRAINTS  the environment whose torch to build against (default constraints/gpu-sglang.txt, whose
#                  torch 2.14.1 lies on the development machines' disk; constraints/gpu-vllm.txt's comes from PyPI).
# CUDA_BUILD_VENV  the venv (default .cache/cuda-build-venv-torch<pin>, git-ignored; never .venv, whose torch is the
#                  CPU one).
#                  The CUDA torch is installed with its nvidia wheels: `import torch` loads cuBLAS, cuDNN, NCCL...,
#                  which a bare toolkit does not have, and setup.py imports torch.
# CUDA_HOME        the toolkit; default: the one the nvcc on PATH belongs to (nvcc may be a wrapper script, as
#                  /usr/local/bin/nvcc is here, whose parent torch would take for the toolkit).
# TORCH_CUDA_ARCH_LIST  unset: setup.py's choice for a node without a visible GPU (setup_cuda.DEFAULT_ARCH_LIST).
# MAX_JOBS         ninja's parallelism (default 1: the development machines have 2 shared cores).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
CONSTRAINTS="${CUDA_BUILD_CONSTRAINTS:-constraints/gpu-sglang.txt}"

die() { echo "build_cuda_extension.sh: $*" >&2; exit 1; }

NVCC="$(command -v nvcc || true)"
[[ -n "$NVCC" || -n "${CUDA_HOME:-}" ]] || die "nvcc not found on PATH and CUDA_HOME is unset"
if [[ -z "${CUDA_HOME:-}" ]]; then
  # nvcc -dryrun names its own toolkit ("#$ TOP=/usr/local/cuda-13.0/bin/..")
  top="$("$NVCC" -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)"
  [[ -n "$top" ]] || die "could not read the toolkit directory from '$NVCC -dryrun'; set CUDA_HOME"
  CUDA_HOME="$(realpath "$top")"
fi
[[ -x "$CUDA_HOME/bin/nvcc" && -f "$CUDA_HOME/include/cuda_runtime_api.h" ]] \
  || die "CUDA_HOME=$CUDA_HOME has no bin/nvcc or include/cuda_runtime_api.h"
export CUDA_HOME

[[ -f "$CONSTRAINTS" ]] || die "CUDA_BUILD_CONSTRAINTS=$CONSTRAINTS: no such file"
TORCH_PIN="$(sed -n 's/^torch==\([^[:space:]#]*\).*/\1/p' "$CONSTRAINTS")"
[[ -n "$TORCH_PIN" ]] || die "$CONSTRAINTS has no torch== pin"
VENV="${CUDA_BUILD_VENV:-$ROOT/.cache/cuda-build-venv-torch$TORCH_PIN}"
VPY="$VENV/bin/python"

t0=$SECONDS
venv_ready="import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN' or not torch.version.cuda)"
if ! "$VPY" -c "$venv_ready" 2>/dev/null; then
  echo "== installing torch==$TORCH_PIN (CUDA) and its nvidia wheels into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VPY" -m pip install -q --upgrade pip setuptools wheel ninja numpy  # numpy: torch warns at import without it
  # not the same release's +cpu wheel, which pip prefers where it lies in a find-links folder (/opt/wheels here)
  "$VPY" -m pip install -q "torch==$TORCH_PIN,!=$TORCH_PIN+cpu"
  "$VPY" -c "$venv_ready" || die "pip installed torch $("$VPY" -c 'import torch; print(torch.__version__)') into $VENV, \
not a CUDA build of $TORCH_PIN"
fi
echo "== venv ready: $("$VPY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)') \
($((SECONDS - t0)) s, $(du -sh "$VENV" | cut -f1))"

# A copy of what the build reads (tracked and untracked files, not ignored ones), so the build writes nothing into
# this tree: its megatron_rl/_C*.so is .venv's CPU build.
build="$ROOT/.cache/cuda-build-torch$TORCH_PIN"
rm -rf "$build"
mkdir -p "$build"
git ls-files --cached --others --exclude-standard -- setup.py setup_cuda.py pyproject.toml csrc megatron_rl \
  | while IFS= read -r f; do if [[ -e "$f" ]]; then echo "$f"; fi; done | tar -T - -cf - | tar -xf - -C "$build"

t1=$SECONDS
echo "== setup.py build_ext --inplace (MEGATRON_RL_BUILD_CUDA=1, CUDA_HOME=$CUDA_HOME, MAX_JOBS=${MAX_JOBS:-1})"
(cd "$build" && MEGATRON_RL_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-1}" "$VPY" setup.py -q build_ext --inplace)
echo "== built in $((SECONDS - t1)) s: $(cd "$build" && ls megatron_rl/_C*.so)"
grep -o -- '-gencode=[^ ]*' "$build"/build/temp*/build.ninja | sort -u | sed 's/^/   /'

# Import and registration: the module loads against the CUDA torch (every shared library resolves), reports its
# CUDA kernels, and every op of the megatron_rl namespace has a CPU and a CUDA kernel in the dispatcher.
(cd "$build" && "$VPY" - <<'EOF'
import torch

from megatron_rl import _C, ops
from megatron_rl.ops import reference

ops_defined = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("megatron_rl::"))
assert ops_defined, "no megatron_rl op is registered"
missing = [(op, key) for op in ops_defined for key in ("CPU", "CUDA")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]
assert not missing, f"ops without a kernel for a dispatch key: {missing}"
assert _C.cuda_compiled, "megatron_rl._C was built without its CUDA kernels"
# a CPU op of this build runs (the CUDA ones need a device)
rewards, mask = torch.randn(2, 5), torch.ones(2, 5)
torch.testing.assert_close(ops.masked_gae(rewards, rewards, mask, 0.9, 0.9),
                           reference.masked_gae(rewards, rewards, mask, 0.9, 0.9))
print(f"== import ok: torch {torch.__version__}, {ops.backend_summary()}; "
      f"{len(ops_defined)} ops with CPU and CUDA kernels: {', '.join(o.split('::')[1] for o in ops_defined)}")
EOF
)
echo "== build_cuda_extension.sh: ok in $((SECONDS - t0)) s"
