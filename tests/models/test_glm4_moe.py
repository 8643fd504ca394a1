"""GLM-4.5 (GQA attention with q/k/v bias, optional q/k norms and RoPE on the first part of each head, plus
DeepSeek-V3's sigmoid-routed MoE) built on Megatron-Core against transformers' Glm4MoeForCausalLM: config mapping,
refusals, logits (fp32, within 1e-5) and the exact export round trip at TP 1/2, EP 1/2, PP 2 on 2 gloo ranks, with
sequence parallelism and THD packing, with and without use_qk_norm / attention_bias.

One spawned group (2 gloo ranks) runs every Megatron-side check; the transformers references and assertions run
here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl_testing.tiny_models import TINY_GLM4_MOE, make_tiny_hf_checkpoint, padded_batch as batch, \
    tiny_hf_config

from deepseek_v3_jobs import assert_logits_match, hf_logits
from glm4_moe_jobs import glm4_moe_checks

TOLERANCE = 1e-5
# GLM-4.5's layout (q/k/v bias, q/k norms, half of each head rotated, expert groups) and GLM-4.5-Air's (no q/k
# norms), here also without q/k/v bias, a quarter rotated and one expert group
MODELS = {
    "qk_norm": {},
    "no_qk_norm": dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25, n_group=1, topk_group=1),
    "four_layers": dict(num_hidden_layers=4),  # for PP=2: a dense and an MoE layer on the first stage
}
ROTARY_DIMS = {"qk_norm": 8, "no_qk_norm": 4, "four_layers": 8}  # of head_dim 16
# (TP, PP, EP) on 2 gloo ranks; TP=2 with EP=2 splits no expert (ETP=1)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]


def _cases() -> list[tuple[str, int, int, int]]:
    """(checkpoint, TP, PP, EP): PP=2 only for the four-layer checkpoint."""
    return [(name, tp, pp, ep) for tp, pp, ep in LAYOUTS for name in MODELS if pp == 1 or name == "four_layers"]


def _config(**overrides) -> dict:
    config = tiny_hf_config("glm4_moe", vocab_size=300).to_dict()
    config.update(overrides)
    return config


# ---------------------------------------------------------------- config mapping (no Megatron)


def test_config_maps_to_gqa_with_partial_rope_and_deepseek_routing():
    from megatron_rl.models.moe import moe_transformer_kwargs

    hf = parse_hf_config(_config())
    assert (hf.architecture, hf.model_type) == ("Glm4MoeForCausalLM", "glm4_moe")
    assert hf.mla is None and hf.qkv_bias and hf.qk_norm and hf.rotary_percent == 0.5
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (4, 2, 16)
    moe = hf.moe
    assert moe.layer_pattern == (False, True, True) and moe.dense_ffn_hidden_size == 96
    assert moe.shared_expert_size == 32 and not moe.shared_expert_gate
    assert moe.shared_expert_name(1, "gate") == "model.layers.1.mlp.shared_experts.gate_proj.weight"
    assert moe.router_bias_name(2) == "model.layers.2.mlp.gate.e_score_correction_bias"
    kwargs = moe_transformer_kwargs(moe, ep=1, etp=1)
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_router_enable_expert_bias"]
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (2, 1)
    assert kwargs["moe_router_topk_scaling_factor"] == 2.5
    air = parse_hf_config(_config(use_qk_norm=False, attention_bias=False))
    assert not air.qk_norm and not air.qkv_bias
    # GLM-4.5's own config.json (transformers 4.x): partial_rotary_factor at the top level, no rope_parameters
    legacy = _config(partial_rotary_factor=0.25, rope_theta=1e6)
    del legacy["rope_parameters"]
    assert (parse_hf_config(legacy).rotary_percent, parse_hf_config(legacy).rope_theta) == (0.25, 1e6)
    # transformers' defaults for the fields a config.json may leave out (Glm4MoeConfig)
    sparse = {k: v for k, v in _config().items() if k not in ("first_k_dense_replace", "routed_scaling_factor",
                                                                 "n_group", "topk_group", "partial_rotary_factor")}
    sparse["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    defaults = parse_hf_config(sparse)
    assert defaults.moe.layer_pattern == (False, True, True) and defaults.moe.topk_scaling_factor == 1.0
    assert defaults.moe.num_groups is None and defaults.rotary_percent == 0.5


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"partial_rotary_factor": 0.2, "rope_parameters": None}, "partial_rotary_factor=0.2 gives 3 rotary dims"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "rope type 'linear' with partial_rotary_factor=0.5"),
        ({"n_group": 2, "topk_group": 2}, "num_experts_per_tok=2 / topk_group=2 must be 2"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_glm4_moe_fields_are_refused_by_name(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**fields), source="x/config.json")


def test_tiny_config_is_the_documented_one():
    config = tiny_hf_config("glm4_moe")
    assert config.first_k_dense_replace == TINY_GLM4_MOE["first_k_dense_replace"] == 1
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.use_qk_norm and config.attention_bias


# ---------------------------------------------------------------- Megatron vs transformers (2 gloo ranks)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    dirs = {
        name: str(make_tiny_hf_checkpoint(root / name, "glm4_moe", with_tokenizer=False, seed=i, **kwargs))
        for i, (name, kwargs) in enumerate(MODELS.items())
    }
    layouts = [(tp, pp, ep, 1 if tp > 1 and ep > 1 else None) for tp, pp, ep in LAYOUTS]
    return dirs, run_multiprocess(glm4_moe_checks, 2, dirs, layouts, timeout_s=900)


@pytest.mark.distributed
@pytest.mark.parametrize("name, tp, pp, ep", _cases())
def test_logits_match_transformers(setup, name, tp, pp, ep):
    assert_logits_match(*setup, name, tp, pp, ep, TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_and_packed_logits_match_transformers(setup, name):
    """TP=2 with sequence parallelism, and THD packs (the partial RoPE restarts at each sequence)."""
    dirs, results = setup
    expected = hf_logits(dirs[name])
    valid = batch()[1].bool()
    for result in results:
        sp = (result["logits"][name, 2, 1, 1, "sp"] - expected)[valid].abs().max().item()
        packed = (result["packed"][name] - expected[valid]).abs().max().item()
        print(f"{name} TP=2 SP: max |logit diff| {sp:.2e}; THD: {packed:.2e}")
        assert sp <= TOLERANCE and packed <= TOLERANCE, (name, sp, packed)


def test_partial_rope_router_bias_and_qk_norm_move_the_reference_logits(setup):
    """The tiny checkpoints exercise what the logits test checks: rotating whole heads, zeroing the router bias or
    dropping the q/k norms changes transformers' logits well beyond the tolerance."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    dirs, _ = setup
    input_ids, attention_mask = batch()
    expected = hf_logits(dirs["qk_norm"])

    def logits(**config) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(dirs["qk_norm"], dtype=torch.float32, **config).eval()
        return forward(model)

    def forward(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask)).logits

    full_rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}
    assert (logits(**full_rope) - expected).abs().max().item() > 1e-3
    assert (logits(use_qk_norm=False) - expected).abs().max().item() > 1e-3
    model = AutoModelForCausalLM.from_pretrained(dirs["qk_norm"], dtype=torch.float32).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert (forward(model) - expected).abs().max().item() > 1e-3


@pytest.mark.distributed
def test_megatron_rotates_the_configured_share_of_each_head(setup):
    _, results = setup
    for result in results:
        assert result["rotary_dims"] == ROTARY_DIMS


@pytest.mark.distributed
@pytest.mark.parametrize("name, tp, pp, ep", _cases())
def test_export_round_trip_is_exact(setup, name, tp, pp, ep):
    dirs, results = setup
    original = {}
    for file in Path(dirs[name]).glob("*.safetensors"):
        original.update(load_file(file))
    assert any(k.endswith("e_score_correction_bias") for k in original)
    assert any(k.endswith("q_norm.weight") for k in original) == (name != "no_qk_norm")
    assert any(k.endswith("q_proj.bias") for k in original) == (name != "no_qk_norm")
    for result in results:
        exported = result["export"][name, tp, pp, ep]
        names = [n for n, _ in exported]
        assert len(names) == len(set(names))
        exported = dict(exported)
        assert set(exported) == set(original), set(exported) ^ set(original)
        for tensor_name, tensor in original.items():
            assert torch.equal(exported[tensor_name], tensor), f"{tensor_name} differs at TP={tp} PP={pp} EP={ep}"


def test_planner_counts_equal_transformers_and_the_checkpoint(setup):
    """The planner needs nothing new for GLM-4.5: q/k/v biases, q/k norms and the router bias (a buffer, a tensor
    of the checkpoint) are counted as for Qwen2/Qwen3 and DeepSeek-V3; RoPE has no parameter."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.plan import memory

    dirs, _ = setup
    for name in ("qk_norm", "no_qk_norm"):
        model = AutoModelForCausalLM.from_pretrained(dirs[name])
        params = sum(p.numel() for p in model.parameters())
        bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        stored = sum(t.numel() for t in load_file(f"{dirs[name]}/model.safetensors").values())
        hf = load_hf_config(dirs[name])
        assert memory.numel(hf) == params + bias == stored, name
        assert memory.total_params(hf) == sum(p.numel() for p in model.parameters() if p.dim() >= 2), name
