"""DeepSeek-V3 (multi-latent attention + sigmoid-routed MoE with expert bias and groups) built on Megatron-Core
against transformers' DeepseekV3ForCausalLM: config mapping, refusals, logits (fp32, within 1e-5) and the exact
export round trip at TP 1/2, EP 1/2, PP 2, with sequence parallelism and THD packing; q_lora_rank null; no YaRN;
the router bias a buffer without gradient; stored multi-token-prediction layers skipped.

One spawned group (2 gloo ranks) runs every Megatron-side check; the transformers references and assertions run
here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl_testing.tiny_models import TINY_DEEPSEEK_V3, make_tiny_hf_checkpoint, padded_batch as batch, \
    tiny_hf_config

from deepseek_v3_jobs import assert_logits_match, deepseek_checks, hf_logits

TOLERANCE = 1e-5
# the tiny checkpoints: q compression (DeepSeek-V3 / Kimi-K2), none (Moonlight / V2-Lite), and no YaRN
MODELS = {
    "q_lora": {},
    "no_q_lora": dict(q_lora_rank=None),
    "plain_rope": dict(rope_scaling=None, n_group=1, topk_group=1),
    "four_layers": dict(num_hidden_layers=4),  # for PP=2: a dense and an MoE layer on the first stage
}


def _config(**overrides) -> dict:
    config = tiny_hf_config("deepseek_v3", vocab_size=300).to_dict()
    config.update(overrides)
    return config


# ---------------------------------------------------------------- config mapping (no Megatron)


def test_config_maps_to_mla_and_deepseek_routing():
    from megatron_rl.models.mla import mla_transformer_kwargs
    from megatron_rl.models.moe import moe_transformer_kwargs

    hf = parse_hf_config(_config())
    assert (hf.architecture, hf.model_type) == ("DeepseekV3ForCausalLM", "deepseek_v3")
    mla, moe = hf.mla, hf.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        32, 16, 16, 8, 16)
    assert (mla.yarn.factor, mla.yarn.original_max_position_embeddings, mla.yarn.mscale_all_dim) == (4.0, 64, 1.0)
    assert hf.rope_scaling is None  # YaRN lives in the MLA spec, not in the GPT RoPE
    assert moe.layer_pattern == (False, True, True) and moe.dense_ffn_hidden_size == 96
    assert moe.shared_expert_size == 32 and not moe.shared_expert_gate
    assert moe.shared_expert_name(1, "up") == "model.layers.1.mlp.shared_experts.up_proj.weight"
    assert moe.router_bias_name(2) == "model.layers.2.mlp.gate.e_score_correction_bias"
    kwargs = moe_transformer_kwargs(moe, ep=1, etp=1)
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_router_enable_expert_bias"]
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (2, 1)
    assert kwargs["moe_router_topk_scaling_factor"] == 2.5 and kwargs["moe_router_bias_update_rate"] == 0.0
    attn = mla_transformer_kwargs(mla, hf.rope_theta)
    assert (attn["qk_head_dim"], attn["qk_pos_emb_head_dim"], attn["rope_type"]) == (16, 8, "yarn")
    assert parse_hf_config(_config(q_lora_rank=None)).mla.q_lora_rank is None
    plain = parse_hf_config(_config(rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    assert plain.mla.yarn is None and plain.rope_theta == 5e4
    assert parse_hf_config(_config(n_group=1, topk_group=1)).moe.num_groups is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rope_interleave": False}, "rope_interleave=false"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"n_group": 2, "topk_group": 2}, "num_experts_per_tok=2 / topk_group=2 must be 2"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"architectures": ["DeepseekV32ForCausalLM"]}, "DeepSeek sparse attention"),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "DeepseekV2ForCausalLM is not supported"),
    ],
)
def test_unsupported_deepseek_fields_are_refused_by_name(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**fields), source="x/config.json")


def test_latent_widths_need_not_split_over_tensor_parallel():
    """The down projections are whole on every TP rank (models/mla_layers.py): any latent width fits; the heads
    split over TP."""
    from megatron_rl.models.sizes import check_parallel_fit

    check_parallel_fit(parse_hf_config(_config(kv_lora_rank=15), source="x/config.json"), 2, 1, None)
    check_parallel_fit(parse_hf_config(_config()), 2, 1, None, ep=2)


def test_tiny_config_is_the_documented_one():
    config = tiny_hf_config("deepseek_v3")
    assert config.first_k_dense_replace == TINY_DEEPSEEK_V3["first_k_dense_replace"] == 1
    assert config.rope_parameters["rope_type"] == "yarn"


# ---------------------------------------------------------------- Megatron vs transformers (2 gloo ranks)

# (TP, PP, EP) on 2 gloo ranks; TP=2 with EP=2 splits no expert (ETP=1), the attention and shared expert over TP
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]


def _cases() -> list[tuple[str, int, int, int]]:
    """(checkpoint, TP, PP, EP): PP=2 only for the four-layer checkpoint."""
    return [(name, tp, pp, ep) for tp, pp, ep in LAYOUTS for name in MODELS if pp == 1 or name == "four_layers"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    dirs = {
        name: str(make_tiny_hf_checkpoint(root / name, "deepseek_v3", with_tokenizer=False, seed=i, **kwargs))
        for i, (name, kwargs) in enumerate(MODELS.items())
    }
    layouts = [(tp, pp, ep, 1 if tp > 1 and ep > 1 else None) for tp, pp, ep in LAYOUTS]
    with_mtp = _with_multi_token_prediction_layer(Path(dirs["q_lora"]), root / "q_lora_mtp")
    return dirs, run_multiprocess(deepseek_checks, 2, dirs, layouts, str(with_mtp), timeout_s=900)


def _with_multi_token_prediction_layer(src: Path, dst: Path) -> Path:
    """``src`` plus DeepSeek-V3's multi-token-prediction tensors as its checkpoints store them (layer
    num_hidden_layers; num_nextn_predict_layers=1 in the config)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    assert json.loads((dst / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{layers}.enorm.weight"] = torch.ones(64)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.distributed
@pytest.mark.parametrize("name, tp, pp, ep", _cases())
def test_logits_match_transformers(setup, name, tp, pp, ep):
    assert_logits_match(*setup, name, tp, pp, ep, TOLERANCE)


def test_router_bias_and_yarn_move_the_reference_logits(setup):
    """The tiny checkpoints exercise what the logits test checks: zeroing the router bias or dropping the
    YaRN softmax scale changes transformers' logits well beyond the tolerance."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    dirs, _ = setup
    input_ids, attention_mask = batch()
    expected = hf_logits(dirs["q_lora"])
    model = AutoModelForCausalLM.from_pretrained(dirs["q_lora"], dtype=torch.float32).eval()

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids_from_mask(attention_mask)).logits

    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert (logits() - expected).abs().max().item() > 1e-3
    model = AutoModelForCausalLM.from_pretrained(dirs["q_lora"], dtype=torch.float32).eval()
    for layer in model.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5
    assert (logits() - expected).abs().max().item() > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_sequence_parallel_logits_match_transformers(setup, name):
    dirs, results = setup
    expected = hf_logits(dirs[name])
    valid = batch()[1].bool()
    for result in results:
        diff = (result["logits"][name, 2, 1, 1, "sp"] - expected)[valid].abs().max().item()
        print(f"{name} TP=2 SP: max |logit diff| {diff:.2e}")
        assert diff <= TOLERANCE, f"{name} TP=2 sequence parallel: max |logit diff| {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_sequences_match_transformers(setup, name):
    """THD packs (packed_sequences): MLA's RoPE restarts at each sequence, SDPAttention's packed path takes
    q/k heads wider than v heads."""
    dirs, results = setup
    expected = hf_logits(dirs[name])[batch()[1].bool()]
    for result in results:
        diff = (result["packed"][name] - expected).abs().max().item()
        print(f"{name} THD: max |logit diff| {diff:.2e}")
        assert diff <= TOLERANCE, f"{name} packed: max |logit diff| {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("name, tp, pp, ep", _cases())
def test_export_round_trip_is_exact(setup, name, tp, pp, ep):
    dirs, results = setup
    original = {}
    for file in Path(dirs[name]).glob("*.safetensors"):
        original.update(load_file(file))
    assert any(k.endswith("e_score_correction_bias") for k in original)
    for result in results:
        exported = result["export"][name, tp, pp, ep]
        names = [n for n, _ in exported]
        assert len(names) == len(set(names))
        exported = dict(exported)
        assert set(exported) == set(original), set(exported) ^ set(original)
        for tensor_name, tensor in original.items():
            assert torch.equal(exported[tensor_name], tensor), f"{tensor_name} differs at TP={tp} PP={pp} EP={ep}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_router_bias_is_a_buffer_without_gradient(setup, name):
    _, results = setup
    for result in results:
        held = result["router_bias"][name]
        assert not held["is_parameter"] and not held["requires_grad"] and held["grad"] is None
        assert held["router_weight_grad_nonzero"]  # the router itself is trained


@pytest.mark.distributed
def test_rope_at_positions_serves_mla(setup):
    """Shared prompts' RoPE at given positions reaches every MLASelfAttention layer's own (YaRN) table (the layouts'
    equality: tests/workers/test_shared_prompts_mla.py); before, MLA was refused here."""
    _, results = setup
    for result in results:
        assert "q_lora" not in result.get("rope_positions", {}), result.get("rope_positions")


@pytest.mark.distributed
def test_multi_token_prediction_layers_are_skipped_on_load(setup):
    _, results = setup
    for result in results:
        assert torch.equal(result["logits"]["q_lora_mtp"], result["logits"]["q_lora", 1, 1, 1])


def test_expert_bias_counts_leave_pads_out():
    """Megatron-Core 0.16.1 masked the expert bias's token counts ([tokens, experts]) with the flattened [tokens] pad
    mask: a shape error on every training micro-batch with pads (tests/e2e/test_deepseek_v3_train.py failed with
    "size of tensor a (4) must match the size of tensor b (168)"). The rebound count leaves the pads out."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models.moe_compat import count_expert_bias_tokens_without_pads

    count_expert_bias_tokens_without_pads()
    router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(3))
    routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    pads = torch.tensor([[False, False], [False, True]])  # [seq, batch]: the last token is a pad
    TopKRouter._apply_expert_bias(router, routing_map, pads.reshape(-1))
    assert router.local_tokens_per_expert.tolist() == [2.0, 2.0, 2.0]
    with torch.no_grad():  # evaluation and recomputation do not count (Megatron's rule, kept)
        TopKRouter._apply_expert_bias(router, routing_map, None)
    assert router.local_tokens_per_expert.tolist() == [2.0, 2.0, 2.0]
