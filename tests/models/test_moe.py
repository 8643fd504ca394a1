"""MoE models (Qwen3-MoE, Mixtral) in Megatron-Core against transformers, with expert parallelism (gloo).

One spawned group of 2 ranks covers EP=1, EP=2, TP=2, TP=2 x EP=2 (ETP=1) and PP=2; a slow group of 4 ranks
covers EP=2 x TP=2 (ETP=2) and PP=2 x EP=2. Each checks logits (1e-4 of transformers'), the export round trip
(bit-exact, every rank and rank 0 only), that loading reads only the experts a rank owns, that the export's
counted traffic equals plan/traffic.py's model byte for byte, and (at TP=PP=1) that gradients do not depend on EP.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.sizes import check_parallel_fit
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint, tiny_hf_config
from moe_jobs import GPUS_PER_NODE, LAYOUTS_2, LAYOUTS_4, batch, moe_checks

TOLERANCE = 1e-4
FAMILIES = ("qwen3_moe", "mixtral")
# qwen3_moe without renormalised top-k exercises moe_router_pre_softmax=True; Mixtral always renormalises.
MODELS = {"qwen3_moe": dict(norm_topk_prob=False), "mixtral": dict(sliding_window=None)}


def _config(family: str, **overrides) -> dict:
    return tiny_hf_config(family, **overrides).to_dict()


# ---------------------------------------------------------------- config (no processes)


def test_moe_configs_map_to_megatron_routing():
    from megatron_rl.models.moe import moe_transformer_kwargs

    qwen = parse_hf_config(_config("qwen3_moe", norm_topk_prob=True))
    assert (qwen.moe.num_experts, qwen.moe.topk, qwen.moe.ffn_hidden_size, qwen.qk_norm) == (4, 2, 16, True)
    assert moe_transformer_kwargs(qwen.moe, 1, 1)["moe_router_pre_softmax"] is False  # softmax over top-k
    raw = parse_hf_config(_config("qwen3_moe", norm_topk_prob=False))
    assert moe_transformer_kwargs(raw.moe, 1, 1)["moe_router_pre_softmax"] is True  # top-k of the softmax
    mixtral = parse_hf_config(_config("mixtral"))
    assert (mixtral.moe.num_experts, mixtral.moe.ffn_hidden_size, mixtral.moe.norm_topk_prob) == (4, 64, True)
    assert mixtral.moe.expert_name(1, 3, "up") == "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert parse_hf_config(_config("qwen3")).moe is None


@pytest.mark.parametrize(
    "family, fields, message",
    [
        # dense layers are supported (tests/models/test_moe_shared_experts.py); bad placements are refused
        ("qwen3_moe", dict(mlp_only_layers=[2]), "mlp_only_layers=[2]: [2] outside 0..1"),
        ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be a positive integer"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    ],
)
def test_unsupported_moe_fields_are_refused_by_name(family, fields, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        parse_hf_config(_config(family, **fields))


def test_expert_parallel_sizes_are_checked():
    moe = parse_hf_config(_config("qwen3_moe"))
    check_parallel_fit(moe, 2, 1, None, ep=4, etp=1)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by EP=3"):
        check_parallel_fit(moe, 1, 1, None, ep=3)
    with pytest.raises(ValueError, match="moe_intermediate_size .*=16 is not divisible by ETP=3"):
        check_parallel_fit(moe, 1, 1, None, ep=1, etp=3)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2 must be 1 or the TP size"):
        check_parallel_fit(moe, 4, 1, None, ep=1, etp=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 needs an MoE model"):
        check_parallel_fit(parse_hf_config(_config("qwen3")), 1, 1, None, ep=2)


# ---------------------------------------------------------------- Megatron vs transformers


def _run(root, world, layouts):
    dirs = {f: str(make_tiny_hf_checkpoint(root / f, f, **MODELS[f])) for f in FAMILIES}
    return dirs, run_multiprocess(moe_checks, world, dirs, layouts, timeout_s=900)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("moe2"), 2, LAYOUTS_2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("moe4"), 4, LAYOUTS_4)


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


def _check_logits(dirs, results, layout):
    valid = batch()[1].bool()
    for name in FAMILIES:
        expected = hf_logits(dirs[name])
        got = [r["logits"][name, layout] for r in results if (name, layout) in r["logits"]]
        assert len(got) == len(results) // layout[1]  # every rank of the last stage
        for logits in got:
            diff = (logits - expected)[valid].abs().max().item()
            assert diff <= TOLERANCE, f"{name} (TP, PP, EP, ETP)={layout}: max |logit diff| {diff:.2e}"


def _check_export(dirs, results, layout):
    for name in FAMILIES:
        original = load_file(f"{dirs[name]}/model.safetensors")
        for result in results:
            for kind in ("export", "export_rank0"):
                items = result[kind][name, layout]
                if kind == "export_rank0" and result["rank"] != 0:
                    assert items == []  # non-consumers take part in the collectives, yield nothing
                    continue
                exported = dict(items)
                assert len(exported) == len(items) and exported.keys() == original.keys()
                for tensor_name, tensor in original.items():
                    assert torch.equal(exported[tensor_name], tensor), f"{tensor_name} {kind} {layout}"


def _check_reads(results, layout):
    for name in FAMILIES:
        for result in results:
            owned, read = result["reads"][name, layout]
            experts = {int(m.group(1)) for n in read if (m := re.search(r"\.experts\.(\d+)\.", n))}
            assert experts == set(owned), f"{name} {layout}: read experts {sorted(experts)}, owns {owned}"


def _check_traffic(dirs, results, layout):
    """Counted bytes per link class and collectives of one export = plan/traffic.py's model, rank by rank."""
    import json

    from megatron_rl_testing.traffic_counter import KEYS
    from megatron_rl.plan.traffic import model_sync_traffic

    tp, pp, ep, etp = layout
    for name in FAMILIES:
        with open(f"{dirs[name]}/config.json") as f:
            hf = parse_hf_config(json.load(f))
        model = model_sync_traffic(hf, tp, pp, len(results) // (tp * pp), GPUS_PER_NODE, path="shard_first",
                                   dtype_bytes=4, bucket_bytes=20_000, ep=ep, etp=etp)
        for result in results:
            expected = {k: model.per_rank[result["rank"]][k] for k in KEYS}
            assert result["traffic"][name, layout] == expected, (name, layout, result["rank"])
            if layout != (1, 1, 1, None):  # every other layout moves bytes (at TP=PP=1: the EP step alone)
                assert expected["intra_recv"] + expected["inter_recv"] > 0, (name, layout, expected)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS_2)
def test_two_ranks_logits_export_and_owned_reads(two_ranks, layout):
    dirs, results = two_ranks
    _check_logits(dirs, results, layout)
    _check_export(dirs, results, layout)
    _check_reads(results, layout)
    _check_traffic(dirs, results, layout)


@pytest.mark.distributed
def test_gradients_do_not_depend_on_expert_parallelism(two_ranks):
    _, results = two_ranks
    for name in FAMILIES:
        for result in results:
            ep1, ep2 = result["grads"][name, (1, 1, 1, None)], result["grads"][name, (1, 1, 2, None)]
            assert any(".experts." in key for key in ep2)
            for key, grad in ep2.items():  # EP=2 holds half the experts; each must match EP=1's
                assert grad.abs().sum() > 0, key
                # fp32 sums in another order: measured <= 3e-7 of the tensor's largest entry
                scale = ep1[key].abs().max().item()
                torch.testing.assert_close(grad, ep1[key], rtol=0, atol=2e-6 * scale, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS_4)
def test_four_ranks_expert_and_tensor_parallel(four_ranks, layout):
    dirs, results = four_ranks
    _check_logits(dirs, results, layout)
    _check_export(dirs, results, layout)
    _check_reads(results, layout)
    _check_traffic(dirs, results, layout)


@pytest.mark.distributed
def test_actor_updates_at_expert_parallel_log_router_losses(tmp_path):
    from moe_jobs import moe_actor_job

    model = make_tiny_hf_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    per_rank = run_multiprocess(moe_actor_job, 2, str(model), 3, timeout_s=900)
    assert per_rank[0]["metrics"] == per_rank[1]["metrics"]  # metrics are reduced: identical on every rank
    for metrics in per_rank[0]["metrics"]:
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        # Megatron's switch loss, E / topk * sum_i(f_i * p_i): 1 for uniform routing, E / topk = 2 at most
        assert 0.9 < metrics["actor/moe_aux_loss"] < 2.0, metrics
        assert {"actor/moe_aux_loss/layer_0", "actor/moe_aux_loss/layer_1"} <= metrics.keys()
        assert metrics["actor/moe_z_loss"] > 0
        # busiest expert's tokens / the mean: 1 balanced, E / topk = 2 at most
        for layer in (0, 1):
            assert 1.0 <= metrics[f"actor/moe_expert_load/layer_{layer}"] <= 2.0, metrics
    # megatron.freeze_router: one update leaves every router as it was and moves every expert
    change = per_rank[0]["frozen_change"]
    routers = [name for name in change if name.endswith("mlp.gate.weight")]
    experts = [name for name in change if ".experts." in name]
    assert len(routers) == 2 and len(experts) == 2 * 4 * 3, sorted(change)
    assert all(change[name] == 0 for name in routers), {name: change[name] for name in routers}
    assert all(change[name] > 0 for name in experts), {name: change[name] for name in experts}
    assert change["model.embed_tokens.weight"] > 0


def test_freeze_router_on_a_dense_model_is_refused_by_name():
    from megatron_rl.models.moe_training import freeze_routers

    with pytest.raises(ValueError, match=re.escape("actor.megatron.freeze_router=true needs an MoE model")):
        freeze_routers([torch.nn.Linear(2, 2)], "actor.megatron.freeze_router")


@pytest.mark.distributed
@pytest.mark.slow  # two CLI runs, each starting two ranks
def test_convert_cli_round_trip_is_exact(tmp_path, capsys):
    from megatron_rl.weights.convert_cli import main

    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", "mixtral")
    mcore_dir, back_dir = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(mcore_dir), "--tp", "2", "--verify"]) == 0
    diff = float(re.search(r"max \|logit diff\| = (\S+) \(ok", capsys.readouterr().out).group(1))
    assert diff <= TOLERANCE
    assert main(["mcore-to-hf", "--mcore-dir", str(mcore_dir), "--out", str(back_dir), "--pp", "2"]) == 0
    original, converted = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[name], tensor) for name, tensor in original.items())


def test_planner_counts_total_and_active_params_and_shards_experts_over_ep():
    from megatron_rl.plan import memory

    qwen3_30b_a3b = dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    )
    model = parse_hf_config(qwen3_30b_a3b)
    assert round(memory.total_params(model) / 1e9, 2) == 30.53  # Qwen's model card: 30.5 B total
    assert round(memory.active_params(model) / 1e9, 2) == 3.35  # ... 3.3 B activated
    ep1 = memory.Layout(tp=2, pp=1, cp=1, dp=8)
    ep8 = memory.Layout(tp=2, pp=1, cp=1, dp=8, ep=8, etp=1)
    experts = 48 * 128 * 3 * 2048 * 768
    assert memory.stage_expert_params(model, ep8) == experts // 8
    assert memory.stage_params(model, ep1, "first") - memory.stage_params(model, ep8, "first") == experts // 2 - experts // 8
    assert memory.expert_data_parallel(ep8) == 2  # 16 ranks / (EP 8 x ETP 1)


@pytest.mark.distributed
def test_weight_sync_into_hf_engine_at_expert_parallel(tmp_path):
    from moe_jobs import moe_sync_job

    model = make_tiny_hf_checkpoint(tmp_path / "mixtral", "mixtral", seed=3)
    for rank, metrics in enumerate(run_multiprocess(moe_sync_job, 2, str(model), timeout_s=600)):
        assert metrics["rollout/logprob_diff_max"] < 1e-5, (rank, metrics)
