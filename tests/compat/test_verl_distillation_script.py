"""verl's Megatron on-policy distillation script (examples/on_policy_distillation_trainer/run_qwen3_8b_megatron.sh at
1dda039b9, recorded in tests/compat/verl_scripts/distillation_qwen3_8b_megatron_vllm.args; its plan at full size is
checked in test_verl_current_scripts.py) scaled to the tiny models trains two steps through the compat entry: its
keys, with the sizes, paths and engine a 2-core CPU machine takes, and verl's served-teacher keys accepted without
effect (logged)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("verl_scripts") / "distillation_qwen3_8b_megatron_vllm.args"
REPO = Path(__file__).resolve().parents[2]


def scaled_args(assets: dict[str, Path], out: Path) -> list[str]:
    scaled = {"data.train_files": f"[{assets['train']}]", "data.val_files": f"[{assets['val']}]",
              "data.train_batch_size": "8", "data.max_prompt_length": "16", "data.max_response_length": "4",
              "actor_rollout_ref.model.path": str(assets["model"]),
              "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "256",
              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "1",
              "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
              "actor_rollout_ref.rollout.max_model_len": "21",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "256",
              "trainer.logger": "['console','file']", "trainer.n_gpus_per_node": "1", "trainer.save_freq": "-1",
              "distillation.teacher_models.teacher_model.model_path": str(assets["model"]),
              "distillation.distillation_loss.topk": "8"}
    args = [f"{line.partition('=')[0]}={scaled.get(line.partition('=')[0], line.partition('=')[2])}"
            for line in SCRIPT.read_text().splitlines() if line]
    return args + [f"trainer.default_local_dir={out}", "trainer.total_training_steps=2", "trainer.device=cpu"]


def test_the_scaled_distillation_script_trains_two_steps(tmp_path):
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path / "assets", 0, task="copy1", n_train=64, n_val=8)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-m", "megatron_rl.compat.verl.trainer.main_ppo",
                           *scaled_args({"train": train, "val": val, "model": model}, out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "distillation.n_gpus_per_node=4 accepted, no effect" in done.stderr
    assert "distillation.teacher_models.teacher_model.inference.name=vllm accepted, no effect" in done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records}
    assert max(steps) == 2 and steps[2]["distillation/loss"] >= 0 and "timing_s/teacher" in steps[2]
