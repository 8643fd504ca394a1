"""The planner with LoRA (issue 36, item 3): adapters and their grads and Adam state only, the base frozen in its
dtype, no reference model; the trainable count of a tiny model against a hand count, and the 7B / 70B presets'
figures (docs/launching.md, 'LoRA')."""
from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, load_config, typed_config
from megatron_rl.plan import build_plan, memory
from megatron_rl.plan.planner import checkpoint_host_ram, lora_trainable_params

GIB = 2**30
L = "actor_rollout_ref.model.lora"
# a tiny Llama: h 64, q 64 (4 heads x 16), kv 32 (2 KV heads), ffn 128, 4 layers
TINY = ["actor_rollout_ref.model.path=/none", "data.train_files=[/d.parquet]", "trainer.nnodes=1",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "data.max_prompt_length=16", "data.max_response_length=16",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.params_dtype=bf16", "actor_rollout_ref.actor.use_kl_loss=true",
        "+plan.architecture.architectures=[LlamaForCausalLM]", "+plan.architecture.hidden_size=64",
        "+plan.architecture.intermediate_size=128", "+plan.architecture.num_hidden_layers=4",
        "+plan.architecture.num_attention_heads=4", "+plan.architecture.num_key_value_heads=2",
        "+plan.architecture.vocab_size=256", "+plan.architecture.tie_word_embeddings=false"]


def plan_for(*overrides: str):
    return build_plan(load_config(overrides=list(overrides)))


def row(plan, label: str, phase: str = "actor update") -> float:
    (match,) = [r for r in plan.rows if r.label == label]
    return match.per_phase[phase]


def labels(plan) -> list[str]:
    return [r.label for r in plan.rows]


def test_tiny_model_adapters_against_a_hand_count():
    plan = plan_for(*TINY, f"{L}.rank=4", f"{L}.alpha=8")
    # Per layer, whole model (r = 4): qkv 3 x (A 4x64) + B (64 + 2 x 32) x 4 = 768 + 512 = 1280; proj A 4x64 +
    # B 64x4 = 512; fc1 2 x (A 4x64) + 2 x (B 128x4) = 512 + 1024 = 1536; fc2 A 4x128 + B 64x4 = 768 -> 4096;
    # x 4 layers = 16,384.
    assert lora_trainable_params(plan.model, load_config(overrides=[*TINY, f"{L}.rank=4"]).actor_rollout_ref.model.lora) \
        == 16_384
    # One GPU at TP 2: column-parallel B split, row-parallel A split: qkv 768 + 256, proj 128 + 256,
    # fc1 512 + 512, fc2 256 + 256 = 2944 per layer -> 11,776.
    adapters = 11_776
    assert row(plan, "actor LoRA adapters (rank 4, bf16)") == adapters * 2
    assert row(plan, "actor grads (fp32, adapters)") == adapters * 4
    assert row(plan, "actor optimizer (Adam, adapters)") == adapters * 12
    # the base: every weight on the GPU, bf16, no grads, no Adam state
    base = memory.stage_params(plan.model, plan.actor_layout, "first")
    assert row(plan, "actor weights (bf16, frozen)") == base * 2
    assert not any(label.startswith("ref") for label in labels(plan))  # the reference is the actor, adapters off
    assert any(note.startswith("reference: the actor with its LoRA adapters off") for note in plan.notes)
    # the LoRA path: 7 adapters (q, k, v, proj, gate, up, fc2) x r 4 x 2 B per token and layer, no dropout;
    # 2 x 32 tokens per micro-batch, 4 layers, one micro-batch in flight (PP 1)
    assert row(plan, "actor LoRA activations") == 7 * 4 * 2 * 64 * 4
    # with dropout: each adapted linear's dropped-out input (h, h, q / TP, ffn / TP) x (2 + 1 mask) B per token
    dropped = plan_for(*TINY, f"{L}.rank=4", f"{L}.dropout=0.1")
    assert row(dropped, "actor LoRA activations") == (56 + (64 + 64 + 32 + 64) * 3) * 64 * 4


def test_full_fine_tuning_has_grads_adam_and_a_reference():
    plan = plan_for(*TINY)
    assert "ref weights (bf16)" in labels(plan) and "actor grads (fp32)" in labels(plan)
    assert not any("LoRA" in label for label in labels(plan))


def test_targets_and_excludes_and_fp32_adapters():
    plan = plan_for(*TINY, f"{L}.rank=4", f"{L}.target_modules=[linear_qkv]",
                    f"{L}.exclude_modules=['decoder.layers.0.*']", f"{L}.dtype=fp32")
    adapters = 3 * 1024  # linear_qkv of layers 1-3 at TP 2
    assert row(plan, "actor LoRA adapters (rank 4, fp32)") == adapters * 4
    assert row(plan, "actor optimizer (Adam, adapters)") == adapters * 8  # fp32: m, v; the weights are the master


def test_critic_lora_trains_adapters_and_the_value_head():
    plan = plan_for(*TINY, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2",
                    "critic.model.lora.rank=4", "critic.megatron.params_dtype=bf16")
    trainable = 11_776 + 64  # the adapters on one GPU and the value head (hidden -> 1)
    assert row(plan, "critic LoRA adapters + value head (rank 4, bf16)", "critic update") == trainable * 2
    assert row(plan, "critic optimizer (Adam, adapters + value head)", "critic update") == trainable * 12
    assert "actor grads (fp32)" in labels(plan)  # the actor without LoRA is trained in full
    assert any("critic LoRA rank 4" in n and "value head (hidden -> 1) is trained in full" in n for n in plan.notes)


def test_lora_on_an_moe_preset_plans_and_refuses_grouped_experts():
    plan_for("+experiment=grpo_qwen3_30b_a3b", f"{L}.rank=8")  # counts: tests/plan/test_lora_moe_plan.py
    with pytest.raises(ConfigError, match=r"moe_grouped_gemm=true with LoRA on the experts"):
        plan_for("+experiment=grpo_qwen3_30b_a3b", f"{L}.rank=8",
                 "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=true")


@pytest.mark.parametrize("preset, trainable, full_peak, lora_peak, full_update, lora_update", [
    # Qwen2.5-7B (h 3584, q 3584, kv 512, ffn 18944, 28 layers), r 32 per layer: qkv 3 x 32 x 3584 +
    # (3584 + 1024) x 32 = 491,520; proj 229,376; fc1 1,441,792; fc2 720,896 -> 2,883,584 x 28 = 80,740,352
    ("grpo_7b", 80_740_352, 57.8, 43.8, 36.5, 15.7),
    # Llama-3-70B (h 8192, kv 1024, ffn 28672, 80 layers): 1,114,112 + 524,288 + 2,359,296 + 1,179,648
    # = 5,177,344 x 80 = 414,187,520
    ("grpo_70b", 414_187_520, 58.1, 40.7, 41.5, 16.7),
])
def test_preset_figures_with_lora(preset, trainable, full_peak, lora_peak, full_update, lora_update):
    cfg = load_config(overrides=[f"+experiment={preset}", f"{L}.rank=32", f"{L}.alpha=64"])
    plan = build_plan(cfg)
    assert lora_trainable_params(plan.model, cfg.actor_rollout_ref.model.lora) == trainable
    full = plan_for(f"+experiment={preset}")
    assert round(full.total(full.peak_phase()) / GIB, 1) == full_peak
    assert round(plan.total(plan.peak_phase()) / GIB, 1) == lora_peak
    assert round(full.total("actor update") / GIB, 1) == full_update
    assert round(plan.total("actor update") / GIB, 1) == lora_update
    (line,) = [n for n in plan.notes if n.startswith("vs full fine-tuning")]
    assert f"update {full_update} GiB -> {lora_update} GiB" in line
    assert f"KV cache per engine {full.rollout.kv_tokens:,} -> {plan.rollout.kv_tokens:,} tokens" in line
    assert plan.rollout.kv_tokens > full.rollout.kv_tokens
    assert "Adam state: 0." in checkpoint_host_ram(typed_config(cfg))


def test_70b_adapters_per_gpu_by_hand():
    plan = plan_for("+experiment=grpo_70b", f"{L}.rank=32", f"{L}.alpha=64")
    # stage 0 at TP 8, per layer: qkv 786,432 + 40,960; proj 32,768 + 262,144; fc1 524,288 + 229,376;
    # fc2 114,688 + 262,144 = 2,252,800 x 20 layers = 45,056,000 (docs/launching.md, 'LoRA')
    assert plan.actor_stage == "first"
    assert row(plan, "actor LoRA adapters (rank 32, bf16)") == 45_056_000 * 2
    assert row(plan, "actor optimizer (Adam, adapters, /2 shards)") == 45_056_000 * 12 / 2
