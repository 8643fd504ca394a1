"""The trainer end to end with ``rollout.name=sglang`` against the strict SGLang 0.5.23 stand-in: 4 ranks (Ray
actors, each given its own GPU id by Ray), actor TP 2, rollout TP 2 -> 2 engines. Every generation — the
training one, ``val_before_train``, validation after every step, ReMax's greedy baseline, DAPO's refills —
runs on the weights of the last sync (the stand-in refuses released or NaN weights, the trainer refuses a
sample of another weight version), and every sync is verified against the trainer's log-probs."""

from __future__ import annotations

import math

import pytest

from megatron_rl.config import load_config
from megatron_rl.demo import prepare_assets
from megatron_rl.trainer.tracking import read_metrics
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    return {"train": train, "val": val, "model": model}


def sglang_overrides(assets, out, *extra: str) -> list[str]:
    return [
        "+experiment=grpo_tiny_cpu",
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['val']}]",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"trainer.default_local_dir={out}",
        "trainer.device=auto",  # the stand-in runs on CPU; real SGLang needs CUDA
        "trainer.n_gpus_per_node=4",
        "ray_init.num_cpus=4",
        "ray_init.num_gpus=4",  # Ray hands each rank its own GPU id, as on a cluster
        "data.train_batch_size=4",
        "data.val_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        "actor_rollout_ref.rollout.weight_sync.verify_max_logprob_diff=1e-4",
        "trainer.test_freq=1",
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
        *extra,
    ]


def check_run(result, steps: int) -> dict[int, dict]:
    records = {r["step"]: r for r in read_metrics(result.metrics_path)}
    assert sorted(records) == list(range(steps + 1))  # step 0: validation before training
    for step in range(1, steps + 1):
        record = records[step]
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {step}: {bad}"
        assert record["rollout/logprob_diff_max"] < 1e-4  # both engines serve exactly the trainer's weights
        assert record["weight_sync/version"] == step
        assert any(k.startswith("val-core/") for k in record)
    return records


def test_grpo_on_two_sglang_engines_of_tp2(sglang_stand_in, assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(assets, tmp_path, "trainer.total_training_steps=3")))
    check_run(result, 3)


def test_remax_and_dapo_refills_run_on_current_weights_with_pp2(sglang_stand_in, assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(
        assets, tmp_path,
        "trainer.total_training_steps=2",
        "algorithm.adv_estimator=remax",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    )))
    records = check_run(result, 2)
    assert all(records[s]["dynamic_sampling/num_gen_batches"] >= 1 for s in (1, 2))
