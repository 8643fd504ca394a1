"""Two one-rank trainer runs in this process, the same seeds: old log-probs recomputed by the actor, then
the rollout's (``algorithm.rollout_correction.bypass_mode=true``). Writes each run's per-step metrics and
final weights for tests/e2e/test_bypass_mode.py to compare.

    python tests/e2e/bypass_job.py OUT_DIR TRAIN_FILE MODEL_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from megatron_rl.config import load_config
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics


def main(out: Path, train: str, model: str) -> None:
    results = {}
    for name, extra in (("recomputed", []), ("bypass", ["algorithm.rollout_correction.bypass_mode=true"])):
        cfg = load_config(overrides=[
            "+experiment=grpo_tiny_cpu", f"data.train_files=[{train}]", f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={out / name}", "trainer.launcher=torchrun", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "data.train_batch_size=8",
            "actor_rollout_ref.actor.megatron.share_prompts=false",  # the preset's before issue 39
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
            "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]", "trainer.save_hf_at_end=true", "trainer.val_before_train=false", *extra,
        ])
        result = run(cfg)
        weights = load_file(str(result.hf_dir / "model.safetensors"))
        results[name] = {"steps": read_metrics(result.metrics_path),
                         "weights": {k: v.flatten().tolist() for k, v in weights.items()}}
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
