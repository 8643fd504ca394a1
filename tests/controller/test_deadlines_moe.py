"""The derived deadlines of an MoE model count what a token passes through (issue 38): every layer's attention,
a dense layer's MLP, an MoE layer's router, shared expert (with its gate) and top-k routed experts; a weight
sync moves every expert. Qwen2-57B-A14B's published config.json with a dense first layer, computed by hand."""
from __future__ import annotations

from omegaconf import OmegaConf, open_dict

from megatron_rl.config import load_config
from megatron_rl.controller.deadlines import derived_deadlines, model_params

QWEN2_57B_A14B = dict(
    architectures=["Qwen2MoeForCausalLM"], hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    decoder_sparse_step=1, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768,
)


def _config(**architecture):
    cfg = load_config(overrides=["+experiment=grpo_qwen3_30b_a3b", "actor_rollout_ref.model.path=/nonexistent"])
    with open_dict(cfg):
        cfg.plan.architecture = OmegaConf.create({**QWEN2_57B_A14B, **architecture})
    return cfg


# attention: h (q + 2 kv) + q h = 3584 x (3584 + 2 x 512) + 3584 x 3584          =     29,360,128
# dense MLP (layer 0): 3 x 3584 x 18944                                            =    203,685,888
# MoE layer: router 64 x 3584 = 229,376; shared expert 3 x 3584 x 20480 = 220,200,960 and its gate 3584;
#            top-8 experts 8 x 3 x 3584 x 2560 = 220,200,960                       ->   440,634,880
# embedding + output layer: 2 x 151936 x 3584                                      =  1,089,077,248
DENSE_LAYER = 29_360_128 + 203_685_888
MOE_LAYER = 29_360_128 + 229_376 + 220_200_960 + 3_584 + 220_200_960
VOCAB = 1_089_077_248


def test_active_params_count_shared_experts_and_dense_layers():
    params, source = model_params(_config(mlp_only_layers=[0]))
    assert source == "plan.architecture"
    assert params == DENSE_LAYER + 27 * MOE_LAYER + VOCAB == 14_011_988_480
    # the published model (every layer MoE): Qwen's "A14B"
    assert model_params(_config())[0] == 28 * MOE_LAYER + VOCAB == 14_248_937_472


def test_decoder_sparse_step_makes_every_other_layer_dense():
    params, _ = model_params(_config(decoder_sparse_step=2))  # layers 1, 3, ..., 27 MoE (transformers' rule)
    assert params == 14 * DENSE_LAYER + 14 * MOE_LAYER + VOCAB


def test_the_weight_sync_moves_every_expert_and_the_derivations_name_the_active_size():
    work = derived_deadlines(_config(mlp_only_layers=[0]))
    # all 64 experts of the 27 MoE layers: 64 x 3 x 3584 x 2560 = 1,761,607,680 each
    total = DENSE_LAYER + 27 * (MOE_LAYER - 220_200_960 + 1_761_607_680) + VOCAB
    assert total == 55_629_969_920
    assert work["sync"] == (720.0, "600 s + 111 GB of bf16 weights at 1 GB/s")  # 600 + 111.3 s, whole minutes
    assert "14.0 B active params (plan.architecture)" in work["update"][1]
