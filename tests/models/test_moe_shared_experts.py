"""Qwen2-MoE (gated shared expert, decoder_sparse_step, mlp_only_layers) and Qwen3-MoE with dense layers
(mlp_only_layers) in Megatron-Core against transformers (issue 38, part 2).

Config mapping and refusals (no processes); logits within 1e-4 of transformers' and the export bit-exact at
TP1/EP1, TP2 x EP2 (ETP 1) and PP2 (two gloo ranks); the converter CLI round trip; the weight sync into the HF
rollout engine; the planner's parameter counts against the HF model's numel, tiny and at the published
Qwen1.5-MoE-A2.7B / Qwen2-57B-A14B sizes.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.moe import moe_transformer_kwargs
from megatron_rl.models.sizes import check_parallel_fit
from shared_expert_jobs import LAYOUTS, MODELS, batch, checks, make_checkpoint, tiny_config

TOLERANCE = 1e-4


def _config(family: str, **overrides) -> dict:
    return tiny_config(family, **overrides).to_dict()


# ---------------------------------------------------------------- config (no processes)


def test_qwen2_moe_maps_to_shared_experts_and_a_layer_pattern():
    hf = parse_hf_config(_config("qwen2_moe"))
    moe = hf.moe
    assert hf.model_type == "qwen2_moe" and hf.qkv_bias and not hf.qk_norm
    # decoder_sparse_step=2: layers 1, 3, 5 are MoE; mlp_only_layers=[3] makes 3 dense
    assert moe.layer_pattern == (False, True, False, False, False, True)
    assert (moe.shared_expert_size, moe.shared_expert_gate, moe.dense_ffn_hidden_size) == (48, True, 64)
    assert moe.shared_expert_name(5, "up") == "model.layers.5.mlp.shared_expert.up_proj.weight"
    assert moe.shared_expert_name(5, "gate_score") == "model.layers.5.mlp.shared_expert_gate.weight"
    kwargs = moe_transformer_kwargs(moe, 1, 1)
    assert kwargs["moe_layer_freq"] == [0, 1, 0, 0, 0, 1]
    assert kwargs["moe_shared_expert_intermediate_size"] == 48 and kwargs["moe_shared_expert_gate"] is True
    assert kwargs["moe_router_pre_softmax"] is True  # norm_topk_prob=False: top-k of the full softmax
    assert not parse_hf_config(_config("qwen2_moe", qkv_bias=False)).qkv_bias


def test_qwen3_moe_dense_layers_and_all_moe_default():
    dense_first = parse_hf_config(_config("qwen3_moe"))
    assert dense_first.moe.layer_pattern == (False, True) and dense_first.moe.shared_expert_size is None
    assert moe_transformer_kwargs(dense_first.moe, 1, 1)["moe_layer_freq"] == [0, 1]
    every = parse_hf_config(_config("qwen3_moe", mlp_only_layers=[]))
    assert every.moe.layer_pattern == () and every.moe.dense_ffn_hidden_size is None
    kwargs = moe_transformer_kwargs(every.moe, 1, 1)
    assert kwargs["moe_layer_freq"] == 1 and kwargs["moe_shared_expert_intermediate_size"] is None


@pytest.mark.parametrize(
    "family, fields, message",
    [
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0 must be positive"),
        ("qwen2_moe", dict(mlp_only_layers=[6]), "mlp_only_layers=[6]: [6] outside 0..5 (num_hidden_layers=6)"),
        ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be a positive integer"),
        ("qwen2_moe", dict(mlp_only_layers=[1, 3, 5]), "leave no MoE layer among num_hidden_layers=6"),
        ("qwen3_moe", dict(mlp_only_layers=["0"]), "mlp_only_layers=['0'] must be a list of layer indices"),
    ],
)
def test_bad_layer_placement_and_shared_expert_fields_are_refused_by_name(family, fields, message):
    raw = _config(family)
    raw.update(fields)  # as config.json / override_config would hold them (the HF config class checks some itself)
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        parse_hf_config(raw, source="/ckpt/config.json")


@pytest.mark.parametrize(
    "arch, reason",
    [("DeepseekV2ForCausalLM", "softmax routing"), ("DeepseekV32ForCausalLM", "DeepSeek sparse attention \\(DSA")],
)
def test_deepseek_v2_and_v32_are_refused_by_name_with_the_reason(arch, reason):
    # DeepseekV3ForCausalLM is built (tests/models/test_deepseek_v3.py)
    raw = {**_config("qwen2_moe"), "architectures": [arch], "first_k_dense_replace": 1}
    with pytest.raises(UnsupportedModelError, match=f"architecture {arch} is not supported: .*{reason}"):
        parse_hf_config(raw, source="/ckpt/config.json")


def test_tensor_parallel_must_split_the_shared_expert_and_the_dense_layers():
    check_parallel_fit(parse_hf_config(_config("qwen2_moe")), 4, 1, None, ep=2, etp=1)
    with pytest.raises(ValueError, match=re.escape("shared_expert_intermediate_size=50 is not divisible by TP=4")):
        check_parallel_fit(parse_hf_config(_config("qwen2_moe", shared_expert_intermediate_size=50)), 4, 1, None)
    with pytest.raises(ValueError, match=re.escape("intermediate_size=66 (the dense layers) is not divisible by TP=4")):
        check_parallel_fit(parse_hf_config(_config("qwen3_moe", intermediate_size=66)), 4, 1, None)


# ---------------------------------------------------------------- Megatron vs transformers (two gloo ranks)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_experts")
    dirs = {family: str(make_checkpoint(root / family, family)) for family in MODELS}
    return dirs, run_multiprocess(checks, 2, dirs, LAYOUTS, timeout_s=900)


@functools.cache
def hf_logits(directory: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    input_ids, attention_mask = batch()
    with torch.no_grad():
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
        ).logits


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "TP{}_PP{}_EP{}_ETP{}".format(*layout))
@pytest.mark.parametrize("family", list(MODELS))
def test_logits_equal_transformers(two_ranks, family, layout):
    dirs, results = two_ranks
    valid = batch()[1].bool()
    expected = hf_logits(dirs[family])
    got = [r["logits"][family, layout] for r in results if (family, layout) in r["logits"]]
    assert len(got) == 2 // layout[1]  # every rank of the last stage
    for logits in got:
        diff = (logits - expected)[valid].abs().max().item()
        assert diff <= TOLERANCE, f"{family} (TP, PP, EP, ETP)={layout}: max |logit diff| {diff:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "TP{}_PP{}_EP{}_ETP{}".format(*layout))
@pytest.mark.parametrize("family", list(MODELS))
def test_export_gives_back_every_hf_tensor_bit_for_bit(two_ranks, family, layout):
    dirs, results = two_ranks
    original = load_file(f"{dirs[family]}/model.safetensors")
    if family == "qwen2_moe":
        assert "model.layers.5.mlp.shared_expert_gate.weight" in original
        assert "model.layers.3.mlp.gate_proj.weight" in original  # mlp_only layer: dense
    for result in results:
        exported = dict(result["export"][family, layout])
        assert len(exported) == len(result["export"][family, layout])  # each name once
        assert exported.keys() == original.keys(), sorted(exported.keys() ^ original.keys())
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), f"{family} {layout}: {name}"


# ---------------------------------------------------------------- converter, weight sync


@pytest.mark.distributed
@pytest.mark.slow  # two CLI runs, each starting two ranks
def test_convert_cli_round_trip_is_exact(tmp_path, capsys):
    from megatron_rl.weights.convert_cli import main

    hf_dir = make_checkpoint(tmp_path / "hf", "qwen2_moe")
    mcore_dir, back_dir = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(mcore_dir), "--tp", "2", "--verify"]) == 0
    diff = float(re.search(r"max \|logit diff\| = (\S+) \(ok", capsys.readouterr().out).group(1))
    assert diff <= TOLERANCE
    assert main(["mcore-to-hf", "--mcore-dir", str(mcore_dir), "--out", str(back_dir), "--pp", "2"]) == 0
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())


@pytest.mark.distributed
def test_weight_sync_into_hf_engine_at_expert_parallel(tmp_path):
    """EP=2 export -> the HF rollout engine (transformers 5: fused routed experts, the shared expert and the
    dense layers by their own names) started from random weights: its log-probs equal the trainer's."""
    from moe_jobs import moe_sync_job

    model = make_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", seed=3)
    for rank, metrics in enumerate(run_multiprocess(moe_sync_job, 2, str(model), timeout_s=600)):
        assert metrics["rollout/logprob_diff_max"] < 1e-5, (rank, metrics)


@pytest.mark.distributed
def test_actor_updates_log_router_metrics_of_the_moe_layers_only(tmp_path):
    """Two PPO updates at EP=2 with the router losses on, then one with freeze_router: the losses and expert
    loads are those of MoE layers 1 and 5 (before, dense layers added zeros and diluted the means), routers stay,
    the shared-expert gates train."""
    from moe_jobs import moe_actor_job

    model = make_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe")
    per_rank = run_multiprocess(moe_actor_job, 2, str(model), 2, timeout_s=900)
    for metrics in per_rank[0]["metrics"]:
        layers = {k.rsplit("_", 1)[1] for k in metrics if "/layer_" in k}
        assert layers == {"1", "5"}, sorted(metrics)
        aux = [metrics["actor/moe_aux_loss/layer_1"], metrics["actor/moe_aux_loss/layer_5"]]
        assert metrics["actor/moe_aux_loss"] == pytest.approx(sum(aux) / 2)
        assert 0.9 < metrics["actor/moe_aux_loss"] < 2.0, metrics  # 1 = uniform routing, E / topk = 2 at most
        assert 1.0 <= metrics["actor/moe_expert_load"] <= 2.0, metrics
    change = per_rank[0]["frozen_change"]
    for layer in (1, 5):
        assert change[f"model.layers.{layer}.mlp.gate.weight"] == 0
        assert change[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] > 0
        assert change[f"model.layers.{layer}.mlp.shared_expert.down_proj.weight"] > 0
    assert change["model.layers.3.mlp.down_proj.weight"] > 0  # the mlp_only layer trains as a dense MLP


# ---------------------------------------------------------------- planner


def _hf_numel(raw: dict, device: str = "cpu") -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# Written by hand from the published config.json files (Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen2-57B-A14B), the fields
# that size the model; not downloaded.
QWEN15_MOE_A27B = dict(
    architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
    moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
    decoder_sparse_step=1, norm_topk_prob=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
    max_position_embeddings=8192, rope_theta=1000000.0, use_sliding_window=False,
)
QWEN2_57B_A14B = dict(
    architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    moe_intermediate_size=2560, shared_expert_intermediate_size=20480, num_experts=64, num_experts_per_tok=8,
    decoder_sparse_step=1, norm_topk_prob=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
    max_position_embeddings=32768, rope_theta=1000000.0, use_sliding_window=False,
)


@pytest.mark.parametrize("family", list(MODELS))
def test_planner_counts_the_tiny_models_numel(family):
    from megatron_rl.plan import memory

    raw = _config(family)
    model = parse_hf_config(raw)
    assert memory.numel(model) == _hf_numel(raw)
    # PP=2 at TP=1: the two stages hold every weight matrix (untied: embedding first, lm_head last)
    layout = memory.Layout(tp=1, pp=2, cp=1, dp=1)
    padded = memory.padded_vocab_size(model.vocab_size, 1) - model.vocab_size
    both = memory.stage_params(model, layout, "first") + memory.stage_params(model, layout, "last")
    assert both == memory.total_params(model) + 2 * padded * model.hidden_size


@pytest.mark.parametrize(
    "raw, total_b, active_b",
    [(QWEN15_MOE_A27B, 14.32, 2.69), (QWEN2_57B_A14B, 57.41, 14.25)],  # model cards: 14.3 B / 2.7 B, 57 B / 14 B
    ids=["Qwen1.5-MoE-A2.7B", "Qwen2-57B-A14B"],
)
def test_planner_counts_published_qwen2_moe_models(raw, total_b, active_b):
    from megatron_rl.plan import memory

    model = parse_hf_config(raw)
    assert memory.numel(model) == _hf_numel(raw, device="meta")  # no memory: shapes only
    assert round(memory.numel(model) / 1e9, 2) == total_b
    assert round(memory.active_params(model) / 1e9, 2) == active_b


def test_planner_puts_dense_first_layers_experts_on_their_stage():
    from megatron_rl.plan import memory

    # 4 layers, the first two dense (mlp_only_layers): at PP=2 the first stage has no experts
    model = parse_hf_config({**QWEN2_57B_A14B, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]})
    layout = memory.Layout(tp=2, pp=2, cp=1, dp=4, ep=4, etp=1)
    experts = 64 * 3 * 3584 * 2560
    assert memory.stage_expert_params(model, layout, "first") == 0
    assert memory.stage_expert_params(model, layout, "last") == 2 * experts // 4
    dense, shared = 3 * 3584 * 18944, 3 * 3584 * 20480 + 3584
    first, last = memory.stage_params(model, layout, "first"), memory.stage_params(model, layout, "last")
    # both stages: embedding / lm_head shard of the same size; attention alike
    assert last - first == 2 * (experts // 4 + (shared + 64 * 3584) // 2) - 2 * (dense // 2)
