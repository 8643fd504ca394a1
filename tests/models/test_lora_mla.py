"""LoRA on multi-latent attention (issue 52): adapters on DeepSeek-V3's q_a/q_b (or q) / kv_a / kv_b / o projections
(and the dense MLP, every routed expert and the shared expert), on the tiny checkpoints with q compression (V3 /
Kimi-K2) and without (Moonlight / V2-Lite), fp32, B drawn non-zero:

(a) the merged export is W + alpha/r B A of the adapters' own (gathered) factors, at TP 1 and TP 2;
(b) the logits with adapters equal transformers' DeepseekV3ForCausalLM with the same deltas merged into its weights
    (1e-5) at TP 1, TP 2 and TP 2 with sequence parallelism;
(c) every adapter's gradient at TP 2 (sequence parallel, as MoE training requires) equals TP 1's (1e-5): the
    duplicated down projections' adapters see each rank's slice of the sequence and are summed over TP by
    finalize_model_grads (``sequence_parallel``), as their base weights;
(d) a PEFT adapter saved at TP 2 (PEFT's keys: ``...self_attn.kv_a_proj_with_mqa.lora_A.weight``) loads at TP 1
    over adapters drawn from another seed exactly, to the same logits; PEFT itself loads one (attention only) into
    transformers' model to Megatron's logits;
(e) the planner's trainable-parameter count equals the built adapters' parameters.

Before this change ``_check_buildable`` refused LoRA with MLA ("LoRA on multi-latent attention ... is not built").
Two spawned groups (1 and 2 gloo ranks) run Megatron; transformers and the assertions run here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint, padded_batch

from lora_mla_jobs import ALPHA, RANK, TARGETS, lora_mla_job

pytestmark = pytest.mark.distributed
TOLERANCE = 1e-5
SCALE = ALPHA / RANK
MODELS = {"q_lora": {}, "no_q_lora": dict(q_lora_rank=None)}
LAYERS = 3  # the tiny checkpoints: a dense first layer, then MoE layers (8 experts, a shared one)
ATTENTION = {"q_lora": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
             "no_q_lora": ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_mla")
    dirs = {name: str(make_tiny_hf_checkpoint(root / name, "deepseek_v3", with_tokenizer=False, seed=0, **kwargs))
            for name, kwargs in MODELS.items()}
    peft_root = root / "peft"
    tp2 = run_multiprocess(lora_mla_job, 2, dirs, 2, True, str(peft_root), timeout_s=600)
    tp2_no_sp = run_multiprocess(lora_mla_job, 2, dirs, 2, False, timeout_s=600)
    attention_root = root / "peft_attention"
    tp1 = run_multiprocess(lora_mla_job, 1, dirs, 1, False, None, str(peft_root), str(attention_root),
                           timeout_s=600)[0]
    return {"dirs": dirs, "peft_root": peft_root, "attention_root": attention_root, "tp1": tp1, "tp2_sp": tp2,
            "tp2": tp2_no_sp}


def _checkpoint(directory: str) -> dict[str, torch.Tensor]:
    from pathlib import Path

    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    return tensors


def _deltas(factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{HF weight name: alpha/r B A} of PEFT-keyed full factors."""
    out = {}
    for key, a in factors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = factors[key.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = SCALE * (b.double() @ a.double())
    return out


def test_adapters_sit_on_every_mla_linear(runs):
    for name in MODELS:
        factors = runs["tp1"][name]["factors"]
        for layer in range(LAYERS):
            for proj in ATTENTION[name]:
                for factor in "AB":
                    key = f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{factor}.weight"
                    assert key in factors, key
                    assert factors[key].abs().max() > 0, key
        assert f"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight" in factors
        assert f"base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_B.weight" in factors
        assert f"base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_B.weight" in factors
        # every TP layout starts from the same adapters
        for layout in ("tp2_sp", "tp2"):
            for rank in runs[layout]:
                assert rank[name]["factors"].keys() == factors.keys()
                for key, tensor in factors.items():
                    assert torch.equal(rank[name]["factors"][key], tensor), (layout, key)


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp", "tp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_merged_export_is_w_plus_scaled_ba(runs, name, layout):
    base = _checkpoint(runs["dirs"][name])
    ranks = [runs["tp1"]] if layout == "tp1" else runs[layout]
    worst = 0.0
    for rank in ranks:
        held = rank[name]
        deltas = _deltas(held["factors"])
        export = held["export"]
        assert set(deltas) <= set(export)
        for tensor_name, tensor in export.items():
            expected = base[tensor_name].double() + deltas.get(tensor_name, 0.0)
            diff = (tensor.double() - expected).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOLERANCE, f"{name} {layout} {tensor_name}: max |diff| {diff:.2e}"
        # the adapters do change the MLA weights
        for proj in ATTENTION[name]:
            tensor_name = f"model.layers.1.self_attn.{proj}.weight"
            assert (export[tensor_name] - base[tensor_name]).abs().max() > 1e-3, tensor_name
    print(f"{name} {layout}: merged export max |diff| {worst:.2e}")


def _merged_hf_logits(directory: str, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' fp32 logits of the test batch with ``deltas`` added to its weights (per-expert deltas into its
    fused expert tensors: [E, 2 ffn, h] gate|up, [E, h, ffn] down)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in deltas.items():
            delta = delta.float()
            if name in params:
                params[name].add_(delta)
                continue
            prefix, expert, proj, _ = name.rsplit(".", 3)  # model.layers.<i>.mlp.experts, <e>, gate_proj, weight
            expert = int(expert)
            if proj == "down_proj":
                params[f"{prefix}.down_proj"][expert].add_(delta)
            else:
                gate_up = params[f"{prefix}.gate_up_proj"][expert]
                half = gate_up.shape[0] // 2
                (gate_up[:half] if proj == "gate_proj" else gate_up[half:]).add_(delta)
        input_ids, attention_mask = padded_batch()
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids_from_mask(attention_mask)).logits


@pytest.fixture(scope="module")
def hf_logits(runs):
    return {name: _merged_hf_logits(runs["dirs"][name], _deltas(runs["tp1"][name]["factors"])) for name in MODELS}


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp", "tp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_equal_transformers_with_merged_deltas(runs, hf_logits, name, layout):
    expected = hf_logits[name]
    valid = padded_batch()[1].bool()
    ranks = [runs["tp1"]] if layout == "tp1" else runs[layout]
    for rank in ranks:
        logits = rank[name]["logits"]
        assert logits.shape == expected.shape
        diff = (logits - expected)[valid].abs().max().item()
        print(f"{name} {layout}: max |logit diff| vs transformers merged {diff:.2e}")
        assert diff <= TOLERANCE
    # the adapters matter: transformers without them is far off
    from deepseek_v3_jobs import hf_logits as base_logits

    assert (base_logits(runs["dirs"][name]) - expected)[valid].abs().max() > 1e-2


@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_gradients_at_tp2_equal_tp1(runs, name):
    reference = runs["tp1"][name]["grads"]
    worst, where = 0.0, ""
    for rank in runs["tp2_sp"]:
        grads = rank[name]["grads"]
        assert grads.keys() == reference.keys()
        for key, expected in reference.items():
            # a routed expert the batch does not reach has a zero gradient; everything else moves
            assert expected.abs().max() > 0 or ".mlp.experts." in key, f"{key}: zero gradient"
            diff = (grads[key] - expected).abs().max().item()
            if diff >= worst:
                worst, where = diff, key
    print(f"{name} TP=2 SP vs TP=1: {len(reference)} adapter gradients, max |diff| {worst:.2e} ({where})")
    assert worst <= TOLERANCE, where


@pytest.mark.parametrize("name", list(MODELS))
def test_peft_save_at_tp2_loads_at_tp1_exactly(runs, name):
    directory = runs["peft_root"] / name
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert set(ATTENTION[name]) <= set(config["target_modules"])
    held = runs["tp1"][name]
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert saved.keys() == held["factors"].keys()
    for key, tensor in saved.items():
        assert torch.equal(tensor, held["factors"][key]), key  # TP 2's gathered factors: TP 1's
        assert torch.equal(held["loaded"][key], tensor), key
    assert any(not torch.equal(held["before_load"][k], saved[k]) for k in saved)  # the load did something
    assert torch.equal(held["loaded_logits"], held["logits"])


@pytest.mark.parametrize("name", list(MODELS))
def test_peft_loads_the_saved_adapter_into_transformers(runs, name):
    """PEFT's own LoraModel on transformers' DeepseekV3ForCausalLM, from the adapter saved here (attention only:
    transformers 5 holds the experts fused, without per-expert linears), gives Megatron's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.api import position_ids_from_mask

    base = AutoModelForCausalLM.from_pretrained(runs["dirs"][name], dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(runs["attention_root"] / name)).eval()
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert len(adapted) == LAYERS * len(ATTENTION[name])
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask)).logits
    valid = attention_mask.bool()
    diff = (runs["tp1"][name]["attention_logits"] - logits)[valid].abs().max().item()
    print(f"{name}: PEFT on transformers vs Megatron TP=1 (attention adapters): max |logit diff| {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("name", list(MODELS))
def test_planner_counts_the_built_adapters(runs, name):
    from megatron_rl.config.schema import LoRAConfig
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.plan.lora import lora_trainable_params

    model = load_hf_config(runs["dirs"][name])
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=list(TARGETS))
    built = runs["tp1"][name]["local_adapter_params"]
    assert built == sum(t.numel() for t in runs["tp1"][name]["factors"].values())
    assert lora_trainable_params(model, lora) == built


def test_targets_on_mla():
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.lora import check_lora_model, hf_modules_to_megatron, lora_targets
    from megatron_rl.config.schema import LoRAConfig
    from megatron_rl.models.mla import MLASpec

    q_lora = MLASpec(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    no_q = MLASpec(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    default = LoRAConfig(rank=4, alpha=8.0)
    assert lora_targets(default, 0, q_lora) == ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                                "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora_targets(default, 0, no_q)[:3] == ["linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj"]
    some = LoRAConfig(rank=4, alpha=8.0, target_modules=["linear_kv_up_proj", "linear_proj"])
    assert lora_targets(some, 0, q_lora) == ["linear_kv_up_proj", "linear_proj"]
    assert lora_targets(some, 0) == ["linear_proj"]  # a GPT model has no linear_kv_up_proj
    excluded = LoRAConfig(rank=4, alpha=8.0, exclude_modules=["linear_qkv"])
    assert lora_targets(excluded, 0, q_lora) == ["linear_proj", "linear_fc1", "linear_fc2"]
    # verl's / PEFT's HF names of an MLA model
    assert hf_modules_to_megatron(["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], "k") == [
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    assert hf_modules_to_megatron(["q_proj", "kv_a_proj_with_mqa", "kv_b_proj"], "k") == [
        "linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj"]
    assert hf_modules_to_megatron(["q_proj", "k_proj", "v_proj"], "k") == ["linear_qkv"]
    assert hf_modules_to_megatron("all-linear", "k") == list(TARGETS)

    class Facts:
        source, hidden_size, head_dim, intermediate_size, moe, num_layers = "tiny", 64, 16, 96, None, 3
        mla = no_q

    with pytest.raises(ConfigError, match="linear_q_down_proj.*does not have.*linear_q_proj"):
        check_lora_model(Facts, "actor_rollout_ref.model",
                         LoRAConfig(rank=4, alpha=8.0, target_modules=["linear_q_down_proj"]))
    with pytest.raises(ConfigError, match="kv_lora_rank 16"):
        check_lora_model(Facts, "actor_rollout_ref.model", LoRAConfig(rank=32, alpha=8.0))
    Facts.mla = None
    with pytest.raises(ConfigError, match="linear_kv_up_proj: multi-latent attention's linears"):
        check_lora_model(Facts, "actor_rollout_ref.model",
                         LoRAConfig(rank=4, alpha=8.0, target_modules=["linear_kv_up_proj"]))
