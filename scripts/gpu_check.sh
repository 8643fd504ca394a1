#!/usr/bin/env bash
# On a machine with a GPU, nvcc and a CUDA build of torch: build megatron_rl._C with its CUDA kernels
# for this GPU only, run tests/gpu and the GPU kernel benchmarks, and write the results to $OUT
# (default ./gpu_check_out): build.log, tests.xml, tests.log, bench.json, bench.log, summary.json.
# Budget: under 8 minutes (the build is ~1-2 min with 16 cores; each step has its own timeout).
# Megatron (tests/gpu/test_megatron_cuda.py): the actor on CUDA with the TE spec when TE imports, packed
# sequences vs padded vs fp32 transformers (bf16 tolerance), offload freeing device memory, peak memory next
# to the planned state (recorded as junit properties in tests.xml).
# Rollout: SGLang cannot be installed on a lent GPU, so tests/gpu/test_rollout_cuda.py covers what the colocated
# SGLang path relies on there instead: CUDA IPC buckets copied asynchronously by another process while the
# producer allocates fresh ones (no reuse, exact copies), and the HF engine's sleep / weight-update cycle.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

arch="$("$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print("%d.%d" % torch.cuda.get_device_capability())')" \
  || { echo "gpu_check.sh: torch sees no CUDA device" >&2; exit 1; }
echo "gpu_check.sh: building for sm_${arch/./} with $("$PY" -c 'import torch; print(torch.__version__)')"

start=$SECONDS
MEGATRON_RL_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" \
  timeout 300 "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
build_rc=$?
build_s=$((SECONDS - start))
echo "build rc=$build_rc (${build_s}s)"

tests_rc=1
bench_rc=1
if [[ $build_rc -eq 0 ]]; then
  timeout 210 "$PY" -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
  tests_rc=${PIPESTATUS[0]}
  timeout 150 "$PY" -m pytest benchmarks/test_kernels_gpu.py -q -s -p no:cacheprovider \
    --benchmark-columns=min,mean,rounds --benchmark-json="$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi

"$PY" - "$OUT" "$build_rc" "$build_s" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, pathlib, sys
import torch
out, build_rc, build_s, tests_rc, bench_rc = sys.argv[1], *map(int, sys.argv[2:])
bench = pathlib.Path(out, "bench.json")
results = {}
if bench.exists():
    for b in json.loads(bench.read_text())["benchmarks"]:
        results[b["name"]] = {"min_s": b["stats"]["min"], **b.get("extra_info", {})}
summary = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, build_rc=build_rc, build_s=build_s,
               tests_rc=tests_rc, bench_rc=bench_rc, benchmarks=results)
pathlib.Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PYEOF
[[ $build_rc -eq 0 && $tests_rc -eq 0 && $bench_rc -eq 0 ]]
