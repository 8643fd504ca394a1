#!/usr/bin/env bash
# The GPU check: one short script (a few minutes on one H200) that verifies the GPU stack this checkout pins
# (one GPU environment per engine, scripts/install_gpu.sh sglang|vllm: torch 2.14.1 or 2.13.0, both CUDA 13,
# Transformer Engine 2.11 built from source, megatron-core 0.16.1) and runs what a CPU cannot show. Results go
# to $OUT (default ./gpu_check_out):
#   <stage>.log for every stage, <stage>.xml (junit) for the pytest stages, env.json, summary.json
#   (per stage: status pass | fail | timeout | skipped, exit code, seconds, why; plus versions and test counts).
# Exit status: 0 when no stage failed or timed out.
#
# Stages, in order, each under its own timeout (seconds; GPU_CHECK_<STAGE>_S overrides, e.g.
# GPU_CHECK_TE_BUILD_S=600) so one hang does not eat the machine's budget, and all of them under
# GPU_CHECK_BUDGET_S (default 540: one 10-minute device command with time left to write the summary): a
# stage's timeout is cut to what is left, and a stage with under 20 s left is skipped, saying so.
#   env         60  nvidia-smi, torch / CUDA / nvcc versions, the device; no CUDA device ends the check here
#   ext_build  240  megatron_rl._C with its CUDA kernels (MEGATRON_RL_BUILD_CUDA=1, TORCH_CUDA_ARCH_LIST=this GPU)
#   kernels    120  tests/gpu/test_kernels_cuda.py: CUDA kernels against the plain-torch reference
#   rollout    120  tests/gpu/test_rollout_cuda.py: CUDA IPC buckets (fresh buffer per load), HF engine sleep
#   vllm       240  tests/gpu/test_vllm_cuda.py (needs vLLM's CUDA build: scripts/install_gpu.sh vllm): placement (each
#                   engine on its replica's GPU only; two engines on two GPUs) and memory (the trainer holds 60% of
#                   the GPU cached at engine start and at wake: start, sleep, wake, generate), weights over vLLM's
#                   CUDA IPC weight transfer read back exactly, nothing staged in /dev/shm
#   te_build   360  Transformer Engine's torch extension built from source for this GPU (pip,
#                   constraints/gpu-megatron.txt: every environment's TE, against the torch installed;
#                   --no-build-isolation, NVTE_CUDA_ARCHS=this GPU) unless it imports already; an offline node
#                   needs PIP_FIND_LINKS=<wheelhouse> PIP_NO_INDEX=1 (pip reads them)
#   imports     60  transformer_engine.pytorch, megatron.core, megatron_rl._C's CUDA backend, their versions
#   megatron   210  tests/gpu/test_megatron_cuda.py: the actor on CUDA (TE spec when TE imports), packed vs
#                   padded vs fp32 transformers, offload, peak memory
#   attention  120  tests/gpu/test_attention_cuda.py when it exists (SDPA / varlen backend choice on the device)
#   context_parallel 150  tests/gpu/test_context_parallel_cuda.py: TE CP attention at CP=2 (2 GPUs; skips on one)
#   bench      150  benchmarks/test_kernels_gpu.py, only with GPU_CHECK_BENCH=1
#   moe_grouped 150 tests/gpu/test_moe_grouped_cuda.py: TEGroupedMLP vs SequentialMLP experts (export, bf16 logits
#                   and grads) and the step time of each (junit properties step_ms_*)
# With TE installed already the whole check takes about 5-7 minutes; a TE source build adds 5-10, so on a bare
# machine run it twice (the second with GPU_CHECK_ONLY="imports megatron attention" while the machine is warm).
# A stage whose prerequisite failed is skipped, saying which. GPU_CHECK_ONLY="kernels rollout" runs only those
# (plus env; the stages they need are taken as done). DRY_RUN=1 prints the stages and their commands and
# writes summary.json without running them.
#
# Adding a check: one block at the end of the stages below, e.g.
#   pytest_stage my_check 120 "ext_build imports" tests/gpu/test_my_check.py
# or, for anything else,  stage NAME TIMEOUT_S "NEEDS" -- COMMAND ARGS...
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAGES="$OUT/stages.tsv"  # name, status, rc, seconds, why (one line per stage)
: >"$STAGES"
declare -A STATUS=()

log() { echo "gpu_check.sh: [$(date +%T)] $*"; }

record() {  # record NAME STATUS RC SECONDS WHY
  STATUS[$1]=$2
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >>"$STAGES"
  log "$1: $2 (rc=$3, ${4}s)${5:+: $5}"
}

# stage NAME TIMEOUT_S "NEEDS..." -- COMMAND ARGS...: run COMMAND with its output in $OUT/NAME.log, killed
# after GPU_CHECK_<NAME>_S (default TIMEOUT_S) seconds; skipped when a stage it needs did not pass or when
# GPU_CHECK_ONLY leaves it out.
stage() {
  local name=$1 limit=$2 needs=$3 var dep start rc left
  shift 3
  [[ ${1:-} == -- ]] && shift
  var="GPU_CHECK_${name^^}_S"
  limit=${!var:-$limit}
  if [[ -n ${GPU_CHECK_ONLY:-} && $name != env && " $GPU_CHECK_ONLY " != *" $name "* ]]; then
    record "$name" not-selected 0 0 "not in GPU_CHECK_ONLY"
    return 0
  fi
  for dep in $needs; do
    case ${STATUS[$dep]:-missing} in
      pass | dry-run | not-selected) ;;
      *) record "$name" skipped 0 0 "needs $dep, which is ${STATUS[$dep]:-missing}"; return 0 ;;
    esac
  done
  if [[ $DRY_RUN == 1 ]]; then
    record "$name" dry-run 0 0 "timeout ${limit}s: $(printf '%q ' "$@")"
    return 0
  fi
  left=$((BUDGET_S - SECONDS))
  if ((left < 20)); then
    record "$name" skipped 0 0 "GPU_CHECK_BUDGET_S=$BUDGET_S spent; run it alone with GPU_CHECK_ONLY=$name"
    return 0
  fi
  ((limit > left)) && limit=$left
  log "$name: started (timeout ${limit}s, log $OUT/$name.log)"
  start=$SECONDS
  # bash -c: a stage may be one of the functions below (exported), not only a program
  timeout --kill-after=15 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) record "$name" pass 0 $((SECONDS - start)) "" ;;
    124 | 137) record "$name" timeout "$rc" $((SECONDS - start)) "killed after ${limit}s (raise $var); the log's tail shows where it was" ;;
    *) record "$name" fail "$rc" $((SECONDS - start)) "$(tail -n 1 "$OUT/$name.log" 2>/dev/null)" ;;
  esac
  return 0
}

# pytest_stage NAME TIMEOUT_S "NEEDS..." TEST_PATHS...: a stage running pytest with a junit report; skipped
# (saying so) when none of the test files exists yet.
pytest_stage() {
  local name=$1 limit=$2 needs=$3 path present=()
  shift 3
  for path in "$@"; do [[ -e $path ]] && present+=("$path"); done
  if ((${#present[@]} == 0)); then
    record "$name" skipped 0 0 "no such test file yet: $*"
    return 0
  fi
  stage "$name" "$limit" "$needs" -- "$PY" -m pytest "${present[@]}" -q -p no:cacheprovider -rfEs \
    --junitxml="$OUT/$name.xml"
}

# ---------------------------------------------------------------------------- env
env_probe() {
  nvidia-smi || echo "nvidia-smi: not available"
  command -v nvcc >/dev/null && nvcc --version
  "$PY" - "$OUT/env.json" <<'PYEOF'
import json, subprocess, sys
import torch
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability()
    info.update(device=torch.cuda.get_device_name(), capability=f"{major}.{minor}",
                memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                device_count=torch.cuda.device_count())
for name in ("transformer_engine", "megatron-core", "transformer-engine-torch", "sglang", "flash-attn"):
    try:
        from importlib.metadata import version
        info[name] = version(name)
    except Exception:
        info[name] = None
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info, indent=2))
if not info["cuda_available"]:
    sys.exit("no CUDA device visible to torch")
PYEOF
}

export -f env_probe
export PY OUT
stage env 60 "" -- env_probe
ARCH=""
if [[ $DRY_RUN != 1 ]]; then
  if [[ ${STATUS[env]} != pass ]]; then
    log "no CUDA device visible to torch (or torch does not import): the other stages need one (see $OUT/env.log)"
  else
    ARCH=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["capability"])' "$OUT/env.json")
  fi
else
  ARCH=9.0
fi
ARCH_DIGITS=${ARCH/./}
export ARCH ARCH_DIGITS

# ---------------------------------------------------------------------------- ext_build
stage ext_build 240 "env" -- env MEGATRON_RL_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" \
  "$PY" setup.py build_ext --inplace

# ---------------------------------------------------------------------------- kernels, rollout (tests/gpu)
pytest_stage kernels 120 "ext_build" tests/gpu/test_kernels_cuda.py
pytest_stage rollout 120 "env" tests/gpu/test_rollout_cuda.py
pytest_stage vllm 240 "env" tests/gpu/test_vllm_cuda.py

# ---------------------------------------------------------------------------- te_build
te_build() {
  if "$PY" -c 'import transformer_engine.pytorch' 2>/dev/null; then
    echo "transformer_engine.pytorch imports already: $("$PY" -c 'import transformer_engine as t; print(t.__version__)')"
    return 0
  fi
  # transformer-engine-torch is a source package compiled against the installed torch, whichever environment's
  # (constraints/gpu-megatron.txt pins TE alone, so pip keeps that torch); only this GPU's arch.
  NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="$ARCH_DIGITS" MAX_JOBS="$(nproc)" \
    "$PY" -m pip install --no-build-isolation -c constraints/gpu-megatron.txt "transformer-engine[pytorch]" \
    && "$PY" -c 'import transformer_engine.pytorch, transformer_engine as t; print("built", t.__version__)'
}
export -f te_build
stage te_build 360 "env" -- te_build

# ---------------------------------------------------------------------------- imports
stage imports 60 "ext_build te_build" -- "$PY" -c '
import torch, transformer_engine, transformer_engine.pytorch as te, megatron.core
from megatron_rl import ops
from megatron_rl.models.builder import te_available
print("torch", torch.__version__, "cuda", torch.version.cuda, "te", transformer_engine.__version__,
      "megatron.core", megatron.core.__version__, "kernels", ops.backend_summary(), "te spec", te_available())
assert "cuda" in ops.backend_summary(), ops.backend_summary()
assert te_available(), "megatron_rl.models.builder.te_available() is False although TE imports"
'

# ---------------------------------------------------------------------------- megatron, attention (tests/gpu)
pytest_stage megatron 210 "ext_build" tests/gpu/test_megatron_cuda.py
pytest_stage attention 120 "ext_build" tests/gpu/test_attention_cuda.py
if [[ ${GPU_CHECK_BENCH:-0} == 1 ]]; then
  stage bench 150 "ext_build" -- "$PY" -m pytest benchmarks/test_kernels_gpu.py -q -s -p no:cacheprovider \
    --benchmark-columns=min,mean,rounds --benchmark-json="$OUT/bench.json"
else
  record bench skipped 0 0 "GPU_CHECK_BENCH=1 runs it"
fi
# New stages go here (one block each; see the header).

# ---------------------------------------------------------------------------- issue 32 items 11 and 2 (kernels, attention)
# log_prob_nan: NaN / +inf logits propagate through the CUDA log-prob kernel, forward and backward (item 11;
# also part of the kernels stage, named here so summary.json says it on its own).
stage log_prob_nan 60 "ext_build" -- "$PY" -m pytest tests/gpu/test_kernels_cuda.py -q -p no:cacheprovider -rfEs \
  -k nan_and_inf --junitxml="$OUT/log_prob_nan.xml"
# attention_dispatch: the padded path's SDPA calls run a fused kernel (never math) and the CPU tests' strict
# model of torch's backend rules is no more generous than this torch; which varlen_attn path runs (items 2, 17).
pytest_stage attention_dispatch 90 "ext_build" tests/gpu/test_attention_dispatch_cuda.py
# ---------------------------------------------------------------------------- end of issue 32 items 11 and 2

# ---------------------------------------------------------------------------- issue 35 (context parallelism)
# context_parallel: TE's CP attention (p2p) at CP=2 against CP=1 in bf16; needs 2 GPUs (the test skips on one,
# saying so: NCCL takes one rank per device). The CPU suite runs the same jobs at CP=2 through SDPAttention.
pytest_stage context_parallel 150 "ext_build" tests/gpu/test_context_parallel_cuda.py

# ---------------------------------------------------------------------------- issue 38 part 3 (grouped-GEMM experts)
# moe_grouped: one tiny MoE model with SequentialMLP and with TEGroupedMLP experts (weights through
# models/moe_experts.py): export bit-exact, logits and gradients within bf16 tolerance; the step time of each.
pytest_stage moe_grouped 150 "ext_build te_build" tests/gpu/test_moe_grouped_cuda.py

# ---------------------------------------------------------------------------- summary
python_for_summary=$PY
command -v "$python_for_summary" >/dev/null 2>&1 || python_for_summary=python3
"$python_for_summary" - "$OUT" "$DRY_RUN" <<'PYEOF'
import json, pathlib, sys
import xml.etree.ElementTree as ET
out, dry_run = pathlib.Path(sys.argv[1]), sys.argv[2] == "1"
stages = {}
for line in (out / "stages.tsv").read_text().splitlines():
    name, status, rc, seconds, why = (line.split("\t") + [""] * 5)[:5]
    entry = {"status": status, "rc": int(rc), "seconds": int(seconds), "why": why}
    if (out / f"{name}.log").exists():
        entry["log"] = f"{name}.log"
    junit = out / f"{name}.xml"
    if junit.exists() and status != "dry-run":
        try:
            suites = ET.parse(junit).getroot()
            suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
            entry["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        except ET.ParseError as exc:
            entry["tests"] = f"unreadable junit report: {exc}"
    stages[name] = entry
env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
bench = out / "bench.json"
benchmarks = {}
if bench.exists() and stages.get("bench", {}).get("status") == "pass":
    for b in json.loads(bench.read_text())["benchmarks"]:
        benchmarks[b["name"]] = {"min_s": b["stats"]["min"], **b.get("extra_info", {})}
bad = [n for n, s in stages.items() if s["status"] in ("fail", "timeout")]
summary = {"dry_run": dry_run, "ok": not bad and not dry_run and stages.get("env", {}).get("status") == "pass",
           "failed_stages": bad, "env": env, "stages": stages, "benchmarks": benchmarks}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PYEOF
log "results in $OUT (summary.json)"
for name in "${!STATUS[@]}"; do
  [[ ${STATUS[$name]} == fail || ${STATUS[$name]} == timeout ]] && exit 1
done
[[ $DRY_RUN == 1 || ${STATUS[env]} == pass ]]
