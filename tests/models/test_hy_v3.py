"""Hy3 (HYV3ForCausalLM: Qwen3's attention with q/k norms, DeepSeek-V3's sigmoid routing with the correction bias
and no expert groups, ungated shared experts, dense and sparse layers by mlp_layer_types) built on Megatron-Core
against transformers' HYV3ForCausalLM: config mapping, the checkpoint's own names (mlp.router.gate,
mlp.expert_bias, mlp.shared_mlp), logits (fp32, within 1e-5) and the exact export round trip at TP 1/2, EP 1/2,
PP 2 on 2 gloo ranks, with sequence parallelism and THD packing; its MTP layer skipped on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint, padded_batch as batch, tiny_hf_config
from deepseek_v3_jobs import assert_logits_match, hf_logits, layout_checks

TOLERANCE = 1e-5
MODELS = {
    "three_layers": {},
    "four_layers": dict(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),  # PP=2
}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]


def _cases() -> list[tuple[str, int, int, int]]:
    return [(name, tp, pp, ep) for tp, pp, ep in LAYOUTS for name in MODELS if pp == 1 or name == "four_layers"]


def _config(**overrides) -> dict:
    config = tiny_hf_config("hy_v3", vocab_size=300).to_dict()
    config.update(overrides)
    return config


def test_config_maps_to_qwen3_attention_and_sigmoid_routing():
    from megatron_rl.models.moe import moe_transformer_kwargs

    hf = parse_hf_config(_config())
    assert (hf.architecture, hf.model_type, hf.qk_norm, hf.qkv_bias, hf.mla) == ("HYV3ForCausalLM", "hy_v3", True,
                                                                               False, None)
    moe = hf.moe
    assert moe.layer_pattern == (False, True, True) and moe.dense_ffn_hidden_size == 96
    assert moe.shared_expert_size == 32 and not moe.shared_expert_gate
    assert moe.router_name(1) == "model.layers.1.mlp.router.gate.weight"
    assert moe.router_bias_name(1) == "model.layers.1.mlp.expert_bias"
    assert moe.shared_expert_name(1, "down") == "model.layers.1.mlp.shared_mlp.down_proj.weight"
    kwargs = moe_transformer_kwargs(moe, ep=1, etp=1)
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_router_enable_expert_bias"]
    assert kwargs["moe_router_num_groups"] is None and kwargs["moe_router_topk_scaling_factor"] == 2.5


@pytest.mark.parametrize("fields, message", [
    ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types=\['dense', 'sparse'\] must name"),
    ({"mlp_layer_types": ["dense", "dense", "dense"]}, r"at least one sparse"),
    ({"attention_bias": True}, r"attention_bias=true"),
])
def test_unsupported_hy_v3_fields_are_refused_by_name(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(_config(**fields), source="x/config.json")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hy_v3")
    dirs = {name: str(make_tiny_hf_checkpoint(root / name, "hy_v3", with_tokenizer=False, seed=i, vocab_size=300,
                                              **kwargs))
            for i, (name, kwargs) in enumerate(MODELS.items())}
    layouts = [(tp, pp, ep, 1 if tp > 1 and ep > 1 else None) for tp, pp, ep in LAYOUTS]
    with_mtp = _with_mtp_layer(Path(dirs["three_layers"]), root / "three_layers_mtp")
    results = run_multiprocess(_checks, 2, dirs, layouts, str(with_mtp), timeout_s=900)
    return dirs, results


def _checks(dirs, layouts, with_mtp):
    """``layout_checks``, and at the first layout the logits of the checkpoint with a stored MTP layer."""
    from megatron_rl.models import build_from_hf, compute_full_logits

    def first_layout(name, chunks, out):
        if name == "three_layers":
            out["mtp_skipped"] = compute_full_logits(build_from_hf(with_mtp), *batch())

    return layout_checks(dirs, layouts, first_layout)


def _with_mtp_layer(src: Path, dst: Path) -> Path:
    """``src`` with an MTP layer stored as Hy3 stores it (layer num_hidden_layers; num_nextn_predict_layers=1)."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    tensors[f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"] = torch.randn(64, 128)
    config["num_nextn_predict_layers"] = 1
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.distributed
@pytest.mark.parametrize("name, tp, pp, ep", _cases())
def test_logits_match_transformers(setup, name, tp, pp, ep):
    assert_logits_match(*setup, name, tp, pp, ep, TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_export_round_trip_is_exact(setup, name):
    dirs, results = setup
    stored = load_file(Path(dirs[name]) / "model.safetensors")
    for key, exported in results[0]["export"].items():
        if key[0] != name:
            continue
        assert set(n for n, _ in exported) == set(stored), key
        for tensor_name, tensor in exported:
            assert torch.equal(tensor, stored[tensor_name]), (key, tensor_name)


@pytest.mark.distributed
def test_stored_mtp_layer_is_skipped_and_the_router_bias_matters(setup):
    """The stored MTP layer changes nothing; zeroing the router bias moves transformers' logits beyond the tolerance
    (so the comparison above sees the bias)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    dirs, results = setup
    expected = hf_logits(dirs["three_layers"])
    valid = batch()[1].bool()
    assert (results[0]["mtp_skipped"] - expected)[valid].abs().max() <= TOLERANCE
    model = AutoModelForCausalLM.from_pretrained(dirs["three_layers"], dtype=torch.float32).eval()
    for layer in model.model.layers[1:]:
        layer.mlp.e_score_correction_bias.zero_()
    input_ids, attention_mask = batch()
    with torch.no_grad():
        zeroed = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask)).logits
    assert (zeroed - expected)[valid].abs().max() > 1e-3
