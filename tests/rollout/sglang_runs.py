"""The trainer's settings for runs against the SGLang stand-in (tests/stand_ins), and what every such run must
show; shared by the end-to-end and the two-node tests."""

from __future__ import annotations

import math
from pathlib import Path

from megatron_rl.trainer.tracking import read_metrics


def sglang_overrides(assets, out, *extra: str) -> list[str]:
    return [
        "+experiment=grpo_tiny_cpu",
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['val']}]",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"trainer.default_local_dir={out}",
        "trainer.device=auto",  # the stand-in runs on CPU; real SGLang needs CUDA
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",  # the preset's before issue 39
        "actor_rollout_ref.actor.megatron.share_prompts=false",
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


def check_run(metrics_path: Path, steps: int) -> dict[int, dict]:
    """Every step finite, verified (both engines serve exactly the trainer's weights) and validated."""
    records = {r["step"]: r for r in read_metrics(metrics_path)}
    assert sorted(records) == list(range(steps + 1))  # step 0: validation before training
    for step in range(1, steps + 1):
        record = records[step]
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {step}: {bad}"
        assert record["rollout/logprob_diff_max"] < 1e-4  # both engines serve exactly the trainer's weights
        assert record["weight_sync/version"] == step
        assert any(k.startswith("val-core/") for k in record)
    return records
