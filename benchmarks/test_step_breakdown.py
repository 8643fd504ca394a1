"""Where a training step's time goes: the tiny CPU GRPO run (the demo's preset, Ray, Megatron TP=2,
HF rollout colocated), reported as shares of the step: generation, log-prob, update, weight sync,
reward scoring, and the driver's own overhead (advantages, metrics, and everything not inside a timed
stage). Each worker call is split into the slowest rank's time inside the method and the rest — Ray
dispatch, (de)serialisation, transfer, planning and collecting — with the DataProto bytes moved per
step (``megatron_rl.controller.call_stats``); the driver's own time is the step minus its worker calls.

    pytest benchmarks/test_step_breakdown.py -s
    MRL_BREAKDOWN_OVERRIDES="trainer.n_gpus_per_node=1 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1" \
        pytest benchmarks/test_step_breakdown.py -s     # another layout
    MRL_BREAKDOWN_OVERRIDES="reward.overlap.enable=true" pytest benchmarks/test_step_breakdown.py -s
        # scoring overlapped with generation: the reward share is what the step waited for, the rest is hidden
"""
from __future__ import annotations

import os

import numpy as np

from megatron_rl.config import load_config
from megatron_rl.controller import call_stats
from megatron_rl.demo import prepare_assets
from megatron_rl.train import run
from megatron_rl.trainer import rl_trainer
from megatron_rl.trainer.tracking import read_metrics

STEPS = 12
WARMUP = 2  # the first steps include one-off costs (allocations, first gloo collectives)
STAGES = {"generation": "timing_s/gen", "log_prob": "timing_s/old_log_prob", "update": "timing_s/update_actor",
          "weight_sync": "timing_s/sync_weights", "reward": "timing_s/reward"}


class StepCalls:
    """Records the worker calls of the steps after warm-up (RLTrainer.train_step, wrapped)."""

    def __init__(self) -> None:
        self.totals: dict[str, call_stats.CallTotals] = {}
        self.steps = 0

    def wrap(self, train_step):
        def recorded(trainer, batch, step, *args):
            if step <= WARMUP:
                return train_step(trainer, batch, step, *args)
            self.steps += 1
            with call_stats.recording() as totals:
                trained = train_step(trainer, batch, step, *args)  # (batch, metrics)
            for method, t in totals.items():
                self.totals.setdefault(method, call_stats.CallTotals()).add(t)
            return trained

        return recorded


def test_step_time_breakdown(benchmark, tmp_path, monkeypatch):
    train, val, model = prepare_assets(tmp_path / "assets")
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'run'}", f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false", "trainer.save_freq=-1",
        *os.environ.get("MRL_BREAKDOWN_OVERRIDES", "").split(),
    ])
    calls = StepCalls()
    monkeypatch.setattr(rl_trainer.RLTrainer, "train_step", calls.wrap(rl_trainer.RLTrainer.train_step))
    result = benchmark.pedantic(run, args=(cfg,), rounds=1, iterations=1)
    records = read_metrics(result.metrics_path)[WARMUP:]
    step = float(np.mean([r["timing_s/step"] for r in records]))
    stages = dict(STAGES)
    if "timing_s/reward_exposed" in records[0]:
        # reward.overlap: scoring runs beside generation; the step only waits for the exposed part of it
        stages["reward"] = "timing_s/reward_exposed"
        hidden = float(np.mean([r["timing_s/reward"] - r["timing_s/reward_exposed"] for r in records]))
        benchmark.extra_info["reward_hidden_s"] = hidden
        print(f"\nreward scoring hidden behind generation (reward.overlap): {hidden * 1e3:.1f} ms/step")
    shares = {name: float(np.mean([r.get(key, 0.0) for r in records])) / step for name, key in stages.items()}
    shares["driver_overhead"] = 1.0 - sum(shares.values())
    benchmark.extra_info.update({"step_seconds": step, **{f"share/{k}": v for k, v in shares.items()}})
    print(f"\nmean step {step:.3f} s over steps {WARMUP + 1}..{STEPS}: "
          + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))

    per_step = max(calls.steps, 1)
    in_calls = sum(t.wall_s for t in calls.totals.values()) / per_step
    for method, t in sorted(calls.totals.items()):
        row = {"calls": t.calls / per_step, "wall_s": t.wall_s / per_step, "worker_s": t.worker_s / per_step,
               "overhead_s": t.overhead_s / per_step, "sent_bytes": t.sent_bytes / per_step,
               "received_bytes": t.received_bytes / per_step}
        benchmark.extra_info.update({f"call/{method}/{k}": v for k, v in row.items()})
        print(f"  {method}: {row['calls']:.0f} call(s)/step, in the worker {row['worker_s'] * 1e3:.1f} ms, "
              f"dispatch+transfer {row['overhead_s'] * 1e3:.1f} ms, sent {row['sent_bytes'] / 1024:.1f} KiB, "
              f"received {row['received_bytes'] / 1024:.1f} KiB")
    driver_own = step - in_calls
    benchmark.extra_info["driver_own_s"] = driver_own
    print(f"  driver's own time (step minus its worker calls; reward scoring included): {driver_own * 1e3:.1f} ms")
    assert all(v >= -0.05 for v in shares.values()), shares  # stages are disjoint parts of the step
    if cfg.trainer.launcher == "ray":
        assert calls.totals and all(t.overhead_s >= 0 for t in calls.totals.values()), calls.totals
