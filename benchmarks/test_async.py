"""Synchronous colocated vs synchronous disaggregated vs one-step off-policy vs fully async with partial
rollouts (all disaggregated but the first) on the demo task (the grpo_tiny_cpu preset: Megatron TP=2 on two
ranks, Ray), one after the other in the same process on the same cores, same data and seeds: steady-state
steps/s and samples/s (steps after warm-up), the run's wall clock, mean score per stage of training (reward vs
samples seen), staleness, dropped samples. Every layout runs without the per-sync verification probe (fully
async with partial rollouts cannot run it: the probe would wait behind the pause), so they compare alike.

    pytest benchmarks/test_async.py -s
    MRL_ASYNC_LAYOUTS=sync_colocated,one_step_off,fully_async_b1 pytest benchmarks/test_async.py -s
    MRL_ASYNC_STEPS=40 MRL_ASYNC_OVERRIDES="data.train_batch_size=16" pytest benchmarks/test_async.py -s
    MRL_ASYNC_SIZE=30M pytest benchmarks/test_async.py -s   # the ~30M model of test_vs_trl.py, its batch sizes

Timings on a shared machine are noisy; the ratios are paired (same run of this file).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from bench_sizes import SIZES, model_dir, size_overrides
from megatron_rl.config import load_config
from megatron_rl.demo import DEMO_TASK, prepare_assets
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics

STEPS = int(os.environ.get("MRL_ASYNC_STEPS", "24"))
WARMUP = 2  # one-off costs (allocations, first collectives, the first step of one_step_off generates inline)
SERVER = ["actor_rollout_ref.rollout.mode=server", f"actor_rollout_ref.rollout.num_servers={os.environ.get('MRL_ASYNC_SERVERS', '1')}"]
CORRECTION = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
              "actor_rollout_ref.rollout.weight_sync.verify_freq=0"]
LAYOUTS = {
    "sync_colocated": [*CORRECTION],
    "sync_disaggregated": [*SERVER, *CORRECTION],
    "one_step_off": [*SERVER, *CORRECTION, "async_training.mode=one_step_off"],
    # 1-token chunks: a pause can cut every response (the demo's are <= 4 tokens), at the cost of re-encoding
    # the prefix per chunk; buffer 2 lets the rollouter run two batches ahead
    "fully_async": [*SERVER, *CORRECTION, "async_training.mode=fully_async", "async_training.max_staleness=2",
                    "async_training.buffer_batches=2", "actor_rollout_ref.rollout.server_chunk_tokens=1"],
    # one batch ahead, default 8-token chunks: the one_step_off bound with the fully async loop
    "fully_async_b1": [*SERVER, *CORRECTION, "async_training.mode=fully_async", "async_training.max_staleness=1",
                       "async_training.buffer_batches=1"],
}
CHOSEN = os.environ.get("MRL_ASYNC_LAYOUTS", ",".join(LAYOUTS)).split(",")
# the demo runs at its preset's sizes; another size brings its model and its batch sizes (bench_sizes.py)
SIZE = os.environ.get("MRL_ASYNC_SIZE", "demo")


def _run(name: str, overrides: list[str], train, model, out) -> dict[str, float]:
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
        # the preset's layout before issue 39 (now one rank): what these figures were measured on
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.share_prompts=false",
        f"trainer.default_local_dir={out / name}", f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]", "trainer.save_hf_at_end=false", "trainer.save_freq=-1",
        *([] if SIZE == "demo" else size_overrides(SIZES[SIZE])), *overrides,
        *os.environ.get("MRL_ASYNC_OVERRIDES", "").split(),
    ])
    start = time.perf_counter()
    result = run(cfg)
    wall = time.perf_counter() - start
    records = read_metrics(result.metrics_path)
    steady = records[WARMUP:]
    step_s = float(np.mean([r["timing_s/step"] for r in steady]))
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    scores = [r["critic/score/mean"] for r in records]
    thirds = np.array_split(np.asarray(scores), 3)
    return {"step_s": step_s, "steps_per_s": 1 / step_s, "samples_per_s": samples / step_s, "wall_s": wall,
            "score_first_third": float(thirds[0].mean()), "score_last_third": float(thirds[-1].mean()),
            "score_mean": float(np.mean(scores)),
            "gen_s": float(np.mean([r["timing_s/gen"] for r in steady])),
            "update_s": float(np.mean([r["timing_s/update_actor"] for r in steady])),
            "staleness_mean": float(np.mean([r.get("async/staleness_mean", 0.0) for r in steady])),
            "staleness_max": float(max(r.get("async/staleness_max", 0.0) for r in steady)),
            "dropped_samples": float(sum(r.get("async/dropped_samples", 0.0) for r in records)),
            "partial_samples": float(sum(r.get("async/partial_samples", 0.0) for r in records))}


def test_sync_vs_one_step_off_vs_fully_async(benchmark, tmp_path):
    train, _val, assets_model = prepare_assets(tmp_path / "assets")
    model = model_dir(assets_model, SIZES[SIZE]["model"], tmp_path / "model")
    results = {}

    def all_layouts():
        for name in CHOSEN:
            results[name] = _run(name, LAYOUTS[name], train, model, tmp_path)

    benchmark.pedantic(all_layouts, rounds=1, iterations=1)
    base = results[CHOSEN[0]]["samples_per_s"]
    print(f"\ntask {DEMO_TASK}, size {SIZE}, {STEPS} steps, steady state from step {WARMUP + 1}:")
    for name, r in results.items():
        print(f"  {name:20s} {r['steps_per_s']:.3f} steps/s  {r['samples_per_s']:7.1f} samples/s "
              f"({r['samples_per_s'] / base:.2f}x)  step {r['step_s']:.3f} s (gen wait {r['gen_s']:.3f}, "
              f"update {r['update_s']:.3f})  wall {r['wall_s']:.0f} s  score first/last third "
              f"{r['score_first_third']:.3f}/{r['score_last_third']:.3f}  staleness {r['staleness_mean']:.2f} "
              f"(max {r['staleness_max']:.0f})  partial {r['partial_samples']:.0f}  dropped {r['dropped_samples']:.0f}")
    benchmark.extra_info.update({f"{name}/{k}": v for name, r in results.items() for k, v in r.items()})
    print(json.dumps(results))
    assert all(r["staleness_mean"] == 0.0 for n, r in results.items() if n.startswith("sync"))
    assert results.get("one_step_off", {"staleness_mean": 1.0})["staleness_mean"] == 1.0
    assert all(r["staleness_max"] <= int(dict(o.split("=") for o in LAYOUTS[n])["async_training.max_staleness"])
               for n, r in results.items() if n.startswith("fully_async"))
