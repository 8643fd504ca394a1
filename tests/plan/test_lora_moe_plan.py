"""The planner with LoRA on MoE models: a targeted linear_fc1 / linear_fc2 of an MoE layer is an adapter on every
routed expert's fc1 / fc2 (and the shared expert's). The counts are held against the adapters' shapes written out by
hand (per GPU: E / EP experts, each split over ETP; the shared expert and the attention over TP), the expert
adapters' Adam state against expert-DP sharding, and a dense model's numbers against the values the planner gave
before MoE LoRA was counted."""
from __future__ import annotations

import math

import pytest

from megatron_rl.config import load_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.hf_config import parse_hf_config
from megatron_rl.plan import build_plan, lora_memory, memory
from megatron_rl.plan.lora import lora_trainable_params
from megatron_rl.plan.memory import Layout

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
L = "actor_rollout_ref.model.lora"
M = "actor_rollout_ref.actor.megatron"
A = "+plan.architecture"
# tiny Qwen3-MoE: h 64, q 64 (4 heads x 16), kv 32 (2 KV heads), 4 layers of which layer 0 dense (ffn 96), the
# others 4 experts of ffn 32, top-2
H, Q, KV, FFN, FFN_E, E, TOPK, LAYERS = 64, 64, 32, 96, 32, 4, 2, 4
QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=H, intermediate_size=FFN,
                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=FFN_E, mlp_only_layers=[0])
# the same with Qwen2-MoE's gated shared expert of width 48
SHARED = 48
QWEN2_MOE = {**QWEN3_MOE, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": SHARED}


def tiny(shared: bool):
    return parse_hf_config(QWEN2_MOE if shared else QWEN3_MOE)


# ---------------------------------------------------------------------------- the adapters' shapes, by hand
def attention_shapes(r: int, tp: int) -> list[tuple[int, int]]:
    """q, k, v adapters (A [r, h], B [part / TP, r]) and proj's (A [r, q / TP], B [h, r])."""
    return [(r, H)] * 3 + [(Q // tp, r), (KV // tp, r), (KV // tp, r)] + [(r, Q // tp), (H, r)]


def swiglu_shapes(r: int, width: int, split: int) -> list[tuple[int, int]]:
    """gate and up (A [r, h], B [width / split, r]) and down (A [r, width / split], B [h, r])."""
    return [(r, H), (width // split, r)] * 2 + [(r, width // split), (H, r)]


def count(shapes: list[tuple[int, int]]) -> int:
    return sum(math.prod(s) for s in shapes)


def hand_layer(layer: int, r: int, tp: int, ep: int, etp: int, shared: bool) -> tuple[int, int]:
    """(non-expert, routed-expert) adapter parameters of one layer on one GPU, all four linears targeted."""
    if layer == 0:  # mlp_only_layers: a dense MLP
        return count(attention_shapes(r, tp) + swiglu_shapes(r, FFN, tp)), 0
    dense = count(attention_shapes(r, tp)) + (count(swiglu_shapes(r, SHARED, tp)) if shared else 0)
    return dense, E // ep * count(swiglu_shapes(r, FFN_E, etp))


def hand(layers, r: int, tp: int, ep: int, etp: int, shared: bool) -> tuple[int, int]:
    parts = [hand_layer(i, r, tp, ep, etp, shared) for i in layers]
    return sum(d for d, _ in parts), sum(e for _, e in parts)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tp, ep, etp", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2), (1, 2, 2)])
def test_stage_adapters_against_the_shapes(tp, ep, etp, shared):
    model, r = tiny(shared), 4
    layout = Layout(tp=tp, pp=1, cp=1, dp=8 // tp, ep=ep, etp=etp)
    dense, experts = hand(range(LAYERS), r, tp, ep, etp, shared)
    assert lora_memory.lora_stage_params(model, layout, "first", r, lambda i: ALL) == dense + experts
    assert lora_memory.lora_stage_expert_params(model, layout, "first", r, lambda i: ALL) == experts


@pytest.mark.parametrize("shared", [False, True])
def test_pipeline_stages_hold_their_own_layers(shared):
    """PP 2: the first stage holds the dense layer 0 and MoE layer 1, the last MoE layers 2 and 3."""
    model, r = tiny(shared), 8
    layout = Layout(tp=2, pp=2, cp=1, dp=2, ep=2, etp=1)
    for stage, layers in (("first", [0, 1]), ("last", [2, 3])):
        dense, experts = hand(layers, r, 2, 2, 1, shared)
        assert lora_memory.lora_stage_params(model, layout, stage, r, lambda i: ALL) == dense + experts
        assert lora_memory.lora_stage_expert_params(model, layout, stage, r, lambda i: ALL) == experts


@pytest.mark.parametrize("shared", [False, True])
def test_whole_model_and_target_subsets(shared):
    model, r = tiny(shared), 4
    assert lora_trainable_params(model, LoRAConfig(rank=r)) == sum(hand(range(LAYERS), r, 1, 1, 1, shared))
    # attention only: no expert adapter
    attention = LoRAConfig(rank=r, target_modules=["linear_qkv", "linear_proj"])
    assert lora_trainable_params(model, attention) == LAYERS * count(attention_shapes(r, 1))
    # fc2 only, layer 3 excluded: layer 0's dense down projection, layers 1-2's experts' (and shared expert's)
    fc2 = LoRAConfig(rank=r, target_modules=["linear_fc2"], exclude_modules=["decoder.layers.3.*"])
    down = [(r, FFN_E), (H, r)]
    expected = count([(r, FFN), (H, r)]) + 2 * (E * count(down) + (count([(r, SHARED), (H, r)]) if shared else 0))
    assert lora_trainable_params(model, fc2) == expected


def test_qwen3_30b_a3b_trainable_at_rank_32():
    """Qwen3-30B-A3B (h 2048, 48 layers, 128 experts of ffn 768, q 32 x 128, kv 4 x 128), rank 32 on all four."""
    model = parse_hf_config(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True))
    r, h, q, kv, f = 32, 2048, 32 * 128, 4 * 128, 768
    qkv = 3 * r * h + (q + 2 * kv) * r  # 360,448
    proj = r * q + h * r  # 196,608
    expert = 2 * (r * h + f * r) + (r * f + h * r)  # gate, up, down: 270,336
    expected = 48 * (qkv + proj + 128 * expert)
    assert expected == 1_687_683_072
    assert lora_trainable_params(model, LoRAConfig(rank=32)) == expected


# ---------------------------------------------------------------------------- activations
@pytest.mark.parametrize("tp, etp", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("shared", [False, True])
def test_activation_bytes_of_an_moe_layer(tp, etp, dropout, shared):
    model, r, b = tiny(shared), 4, memory.BF16
    layout = Layout(tp=tp, pp=1, cp=1, dp=1, ep=2, etp=etp)
    pairs = TOPK * etp / tp  # the (token, expert) pairs mlp_activation_bytes_per_token counts per token
    fc1 = 2 * r * b + (H * (b + 1) if dropout else 0)
    fc2 = r * b + (FFN_E / etp * (b + 1) if dropout else 0)
    assert lora_memory.lora_expert_activation_bytes_per_token(model, layout, "linear_fc1", r, dropout) == pairs * fc1
    assert lora_memory.lora_expert_activation_bytes_per_token(model, layout, "linear_fc2", r, dropout) == pairs * fc2
    attention = 4 * r * b + ((H + Q / tp) * (b + 1) if dropout else 0)
    shared_mlp = 3 * r * b + ((H + SHARED / tp) * (b + 1) if dropout else 0) if shared else 0
    moe_layer = lora_memory.lora_activation_bytes_per_token_layer(model, layout, r, dropout, ALL, b, False, layer=1)
    assert moe_layer == attention + pairs * (fc1 + fc2) + shared_mlp
    # the dense layer 0 of the same model: a dense MLP of intermediate_size
    dense_layer = lora_memory.lora_activation_bytes_per_token_layer(model, layout, r, dropout, ALL, b, False, layer=0)
    assert dense_layer == attention + 3 * r * b + ((H + FFN / tp) * (b + 1) if dropout else 0)


def test_expert_pairs_match_the_experts_own_count():
    """The LoRA path's pairs per token are the ones the experts' activations are counted with."""
    model = tiny(False)
    for layout in (Layout(tp=2, pp=1, cp=1, dp=1, ep=2, etp=1), Layout(tp=2, pp=1, cp=1, dp=1, ep=1, etp=2)):
        experts = memory.mlp_activation_bytes_per_token(model, layout, 1, memory.BF16) \
            - 2 * E * memory.FP32  # less the router's logits and scores
        per_pair = (2 * H + 3 * FFN_E / layout.expert_tp) * memory.BF16
        assert memory.routed_pairs_per_token(model, layout) == experts / per_pair


# ---------------------------------------------------------------------------- the plan's rows
TINY_MOE = ["actor_rollout_ref.model.path=/none", "data.train_files=[/d.parquet]", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "data.max_prompt_length=16", "data.max_response_length=16", f"{M}.use_distributed_optimizer=true",
            f"{M}.params_dtype=bf16", "actor_rollout_ref.actor.use_kl_loss=true",
            f"{A}.architectures=[Qwen3MoeForCausalLM]", f"{A}.hidden_size={H}", f"{A}.intermediate_size={FFN}",
            f"{A}.num_hidden_layers={LAYERS}", f"{A}.num_attention_heads=4", f"{A}.num_key_value_heads=2",
            f"{A}.head_dim=16", f"{A}.num_experts={E}", f"{A}.num_experts_per_tok={TOPK}",
            f"{A}.moe_intermediate_size={FFN_E}", f"{A}.mlp_only_layers=[0]", f"{A}.vocab_size=256",
            f"{A}.tie_word_embeddings=false", f"{L}.rank=4"]


def row(plan, label: str, phase: str = "actor update") -> float:
    (match,) = [r for r in plan.rows if r.label == label]
    return match.per_phase[phase]


@pytest.mark.parametrize("tp, ep, etp, dp, expert_dp", [
    (2, 2, 1, 2, 2),  # 4 GPUs: expert-DP = TP x DP / (EP x ETP) = 2
    (2, 2, 2, 2, 1),  # every expert adapter on one rank only: its Adam state is not sharded
    (1, 2, 1, 4, 2),
])
def test_plan_rows_shard_expert_adam_over_expert_dp(tp, ep, etp, dp, expert_dp):
    plan = build_plan(load_config(overrides=[*TINY_MOE, f"{M}.tensor_model_parallel_size={tp}",
                                             f"{M}.expert_model_parallel_size={ep}",
                                             f"{M}.expert_tensor_parallel_size={etp}"]))
    assert (plan.actor_layout.dp, memory.expert_data_parallel(plan.actor_layout)) == (dp, expert_dp)
    dense, experts = hand(range(LAYERS), 4, tp, ep, etp, False)
    assert row(plan, "actor LoRA adapters (rank 4, bf16)") == (dense + experts) * 2
    assert row(plan, "actor grads (fp32, adapters)") == (dense + experts) * 4
    assert row(plan, f"actor optimizer (Adam, adapters, /{dp} shards, experts /{expert_dp})") \
        == dense * 12 / dp + experts * 12 / expert_dp
    # the LoRA path of the busiest layer: the MoE layers' (attention 4 x r, TOPK x ETP / TP pairs x 3 x r, 2 B)
    # against the dense layer's (7 x r); 4 layers, 2 x 32 tokens, one micro-batch in flight
    per_token_layer = max(7 * 4 * 2, 4 * 4 * 2 + TOPK * etp / tp * 3 * 4 * 2)
    assert row(plan, "actor LoRA activations") == LAYERS * per_token_layer * 64
    (note,) = [n for n in plan.notes if n.startswith("actor LoRA rank 4")]
    assert "on linear_qkv, linear_proj, linear_fc1, linear_fc2 (and every routed expert's fc1/fc2: 4 experts x 3 " \
           "layers): trainable" in note


def test_shared_expert_in_the_note():
    plan = build_plan(load_config(overrides=[
        *TINY_MOE, f"{A}.architectures=[Qwen2MoeForCausalLM]", f"+plan.architecture.shared_expert_intermediate_size"
        f"={SHARED}", f"{L}.target_modules=[linear_fc2]"]))
    (note,) = [n for n in plan.notes if n.startswith("actor LoRA rank 4")]
    assert "on linear_fc2 (and the shared expert's and every routed expert's fc2: 4 experts x 3 layers)" in note
    attention_only = build_plan(load_config(overrides=[*TINY_MOE, f"{L}.target_modules=[linear_qkv]"]))
    (note,) = [n for n in attention_only.notes if n.startswith("actor LoRA rank 4")]
    assert "on linear_qkv: trainable" in note


def test_qwen3_30b_a3b_preset_rows():
    """The preset's layout (TP 2, EP 8, ETP 1, DP 8 on 16 GPUs; expert-DP 2) at rank 32: per GPU the attention's
    adapters at TP 2 (qkv 196,608 + 81,920, proj 65,536 + 65,536) and 16 experts x 270,336, x 48 layers."""
    plan = build_plan(load_config(overrides=["+experiment=grpo_qwen3_30b_a3b", f"{L}.rank=32", f"{L}.alpha=64"]))
    attention, experts = 48 * (196_608 + 81_920 + 65_536 + 65_536), 48 * 16 * 270_336
    assert row(plan, "actor LoRA adapters (rank 32, bf16)") == (attention + experts) * 2
    assert row(plan, "actor optimizer (Adam, adapters, /8 shards, experts /2)") == attention * 12 / 8 + experts * 6
    assert any("(and every routed expert's fc1/fc2: 128 experts x 48 layers): trainable 1.69 B" in n
               for n in plan.notes)


# ---------------------------------------------------------------------------- dense models: unchanged
# the values below are what the planner gave before LoRA on MoE experts was counted
DENSE = dict(architectures=["Qwen3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=96,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def test_a_dense_model_is_counted_as_before():
    model = parse_hf_config(DENSE)
    assert lora_trainable_params(model, LoRAConfig(rank=8)) == 35_840
    for layout, first in ((Layout(tp=2, pp=1, cp=1, dp=2), 25_088), (Layout(tp=2, pp=2, cp=1, dp=1), 12_544),
                          (Layout(tp=1, pp=1, cp=1, dp=4), 35_840)):
        assert lora_memory.lora_stage_params(model, layout, "first", 8, lambda i: ALL) == first
        assert lora_memory.lora_stage_expert_params(model, layout, "first", 8, lambda i: ALL) == 0
    tp2 = Layout(tp=2, pp=1, cp=1, dp=2)
    for sp, dropout, before in ((False, 0.0, 112.0), (False, 0.1, 832.0), (True, 0.0, 96.0), (True, 0.1, 816.0)):
        assert lora_memory.lora_activation_bytes_per_token_layer(model, tp2, 8, dropout, ALL, 2, sp) == before
        assert lora_memory.lora_activation_bytes_per_token_layer(model, tp2, 8, dropout, ALL, 2, sp, layer=1) == before


def test_the_7b_preset_rows_are_as_before():
    plan = build_plan(load_config(overrides=["+experiment=grpo_7b", f"{L}.rank=32", f"{L}.alpha=64",
                                             f"{L}.dropout=0.1"]))
    assert row(plan, "actor LoRA adapters (rank 32, bf16)") == 74_088_448
    assert row(plan, "actor grads (fp32, adapters)") == 148_176_896
    assert row(plan, "actor optimizer (Adam, adapters, /2 shards)") == 222_265_344
    assert row(plan, "actor LoRA activations") == 6_666_584_064
