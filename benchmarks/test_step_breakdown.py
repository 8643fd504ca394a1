"""Where a training step's time goes: the tiny CPU GRPO run (the demo's preset, Ray, Megatron TP=2,
HF rollout colocated), reported as shares of the step: generation, log-prob, update, weight sync,
reward scoring, and the driver's own overhead (advantages, metrics, and everything not inside a timed
stage). Worker calls are timed from the driver, so their Ray dispatch and transfer count in their stage.

    pytest benchmarks/test_step_breakdown.py -s
"""
from __future__ import annotations

import numpy as np

from megatron_rl.config import load_config
from megatron_rl.demo import prepare_assets
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics

STEPS = 12
WARMUP = 2  # the first steps include one-off costs (allocations, first gloo collectives)
STAGES = {"generation": "timing_s/gen", "log_prob": "timing_s/old_log_prob", "update": "timing_s/update_actor",
          "weight_sync": "timing_s/sync_weights", "reward": "timing_s/reward"}


def test_step_time_breakdown(benchmark, tmp_path):
    train, val, model = prepare_assets(tmp_path / "assets")
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false",
    ])
    result = benchmark.pedantic(run, args=(cfg,), rounds=1, iterations=1)
    records = read_metrics(result.metrics_path)[WARMUP:]
    step = float(np.mean([r["timing_s/step"] for r in records]))
    shares = {name: float(np.mean([r[key] for r in records])) / step for name, key in STAGES.items()}
    shares["driver_overhead"] = 1.0 - sum(shares.values())
    benchmark.extra_info.update({"step_seconds": step, **{f"share/{k}": v for k, v in shares.items()}})
    print(f"\nmean step {step:.3f} s over steps {WARMUP + 1}..{STEPS}: "
          + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))
    assert all(v >= -0.05 for v in shares.values()), shares  # stages are disjoint parts of the step
