"""LoRA on an MoE model (issue 51): adapters on the attention and on every routed expert's fc1 / fc2, at CP 2 x EP 2
and at TP 2 x ETP 2 (sequence parallel) on two gloo ranks, equal to one rank (fp32, Qwen3-MoE, load-balancing loss
on, B drawn non-zero so every adapter moves the output and every factor gets a gradient): log-probs, the update's
metrics, every adapter's gradient (each expert's on the rank that holds it, named by its global index), the step,
the merged weights the engines get (against a merge done here from the base checkpoint), and the PEFT adapter
written at EP 2 (per-expert modules, as the checkpoint names the experts) loading at EP 1 to the same log-probs.

Before this change LoRA on an MoE model was refused (``check_lora_model``: "LoRA on MoE experts ... is not built",
and ``attach_lora`` raised on an MoELayer). Without the ETP sum of the replicated factor's gradient
(models/lora.py ``_SumGradOver``) the TP 2 x ETP 2 run's A (fc1) and B (fc2) gradients are one rank's part. Under
Megatron's full recompute (verl's LoRA script sets it) every adapter's gradient was zero, dense models' too: the
recomputed chunk's backward runs only if an input requires grad, and the frozen embedding's output did not
(``_input_requires_grad``); the ``recompute`` layout checks that one rank with it equals one rank without."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from lora_moe_jobs import lora_moe_job, peft_load_job, resume_job
from safetensors import safe_open

from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed
ATOL = 1e-5
SCALE = 8.0 / 4  # lora_jobs.lora_config: alpha 8, rank 4
EXPERTS, LAYERS = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("lora_moe") / "m", "qwen3_moe", num_layers=LAYERS,
                                       with_tokenizer=False))


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("lora_moe_out")
    peft_dir, ckpt_dir = str(work / "adapter"), str(work / "ckpt")
    reference = run_multiprocess(lora_moe_job, 1, model_dir, timeout_s=600)[0]
    cp_ep = run_multiprocess(lora_moe_job, 2, model_dir, 2, 2, 1, None, peft_dir, ckpt_dir, timeout_s=600)
    tp_etp = run_multiprocess(lora_moe_job, 2, model_dir, 1, 1, 2, 2, timeout_s=600)
    loaded = run_multiprocess(peft_load_job, 1, model_dir, peft_dir, timeout_s=600)[0]
    resumed = run_multiprocess(resume_job, 1, model_dir, ckpt_dir, timeout_s=600)[0]
    recomputed = run_multiprocess(lora_moe_job, 1, model_dir, 1, 1, 1, None, None, None, True, timeout_s=600)
    return {"reference": reference, "cp2_ep2": cp_ep, "tp2_etp2": tp_etp, "peft_dir": Path(peft_dir),
            "loaded": loaded, "resumed": resumed, "recompute": recomputed}


def test_adapters_sit_on_every_expert_and_the_attention(runs):
    reference = runs["reference"]
    names = set(reference["grads"])
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            assert {f"{layer}.expert{expert}.linear_fc1.A_gate", f"{layer}.expert{expert}.linear_fc2.B"} <= names
        assert {f"{layer}.linear_qkv.A_q", f"{layer}.linear_proj.B"} <= names
    # the experts' adapters reduce over expert-DP (DDP's expert buffer), the attention's over DP
    assert reference["expert_dp_params"] and all(".experts." in n for n in reference["expert_dp_params"])
    assert len(reference["expert_dp_params"]) == LAYERS * EXPERTS * 6
    # the adapters change the policy (B non-zero): off, the model is its base
    assert (reference["log_probs"] - reference["log_probs_adapters_off"]).abs().max() > 0.1


@pytest.mark.parametrize("layout", ["cp2_ep2", "tp2_etp2", "recompute"])
def test_log_probs_metrics_gradients_and_step_equal_one_rank(runs, layout):
    reference, seen = runs["reference"], set()
    for rank in runs[layout]:
        torch.testing.assert_close(rank["log_probs"], reference["log_probs"], atol=ATOL, rtol=ATOL)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/moe_aux_loss"):
            assert rank["metrics"][key] == pytest.approx(reference["metrics"][key], rel=ATOL, abs=ATOL), key
        for name, grad in rank["grads"].items():
            expected = reference["grads"][name]
            assert expected.abs().max() > 0, name
            torch.testing.assert_close(grad, expected, atol=ATOL, rtol=ATOL, msg=lambda m: f"{name}: {m}")
            step = rank["adapters_after"][name] - rank["adapters_before"][name]
            expected_step = reference["adapters_after"][name] - reference["adapters_before"][name]
            torch.testing.assert_close(step, expected_step, atol=1e-4, rtol=0, msg=lambda m: f"{name}: {m}")
            seen.add(name)
        torch.testing.assert_close(rank["log_probs_after"], reference["log_probs_after"], atol=1e-4, rtol=0)
    assert seen == set(reference["grads"])  # every expert's adapter was compared on the rank that holds it


def _base(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_engines_get_each_expert_merged(runs, model_dir):
    """W + alpha / r B A per expert and attention part, merged here from the base checkpoint and the trained
    adapters, equals what every layout exports."""
    base, adapters = _base(model_dir), runs["reference"]["adapters_after"]
    hf_parts = {("linear_fc1", "gate"): "gate_proj", ("linear_fc1", "up"): "up_proj", ("linear_fc2", ""): "down_proj"}
    checked = 0
    for name, a in adapters.items():
        match = re.fullmatch(r"(\d+)\.expert(\d+)\.(linear_fc[12])\.A_?(\w*)", name)
        if match is None:
            continue
        layer, expert, target, part = match.groups()
        b = adapters[name.replace(".A", ".B")]
        key = f"model.layers.{layer}.mlp.experts.{expert}.{hf_parts[target, part]}.weight"
        merged = base[key] + SCALE * b @ a
        for run in [runs["reference"], *runs["cp2_ep2"], *runs["tp2_etp2"]]:
            torch.testing.assert_close(run["exported"][key], merged, atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")
        checked += 1
    assert checked == LAYERS * EXPERTS * 3
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.allclose(runs["reference"]["exported"][q], base[q])  # the attention's adapters merged too


def test_peft_adapter_names_every_expert_and_loads_at_another_layout(runs):
    directory, reference = runs["peft_dir"], runs["reference"]
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for layer in range(LAYERS):
        for expert in range(EXPERTS):  # written at EP 2: both ranks' experts
            prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}"
            torch.testing.assert_close(tensors[f"{prefix}.gate_proj.lora_A.weight"],
                                       reference["adapters_after"][f"{layer}.expert{expert}.linear_fc1.A_gate"],
                                       atol=1e-4, rtol=0)
            torch.testing.assert_close(tensors[f"{prefix}.down_proj.lora_B.weight"],
                                       reference["adapters_after"][f"{layer}.expert{expert}.linear_fc2.B"],
                                       atol=1e-4, rtol=0)
    assert len(tensors) == LAYERS * (EXPERTS * 3 + 4) * 2  # per layer: 3 per expert, q/k/v/o; A and B each
    torch.testing.assert_close(runs["loaded"]["log_probs"], runs["cp2_ep2"][0]["log_probs_after"], atol=ATOL, rtol=0)


def test_a_checkpoint_saved_at_ep2_resumes_at_one_rank_with_each_experts_adam_state(runs):
    """The LoRA checkpoint (adapters only; each expert's under Megatron's expert axis, replicated over expert-DP)
    saved at CP 2 x EP 2 loads at one rank: every adapter equal, and the next update (Adam's step 2, from the loaded
    moments) moves every adapter as the saving run's own second update did: within lr / 10 (Adam divides each
    gradient by its own running scale, so the float noise of a near-zero gradient moves a weight by up to ~lr; a
    resume without the moments would take a first Adam step, lr x sign(g), off by ~lr nearly everywhere)."""
    resumed, saved = runs["resumed"], {k: v for rank in runs["cp2_ep2"] for k, v in rank["adapters_after"].items()}
    after_next = {k: v for rank in runs["cp2_ep2"] for k, v in rank["adapters_next"].items()}
    assert set(resumed["adapters"]) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(resumed["adapters"][name], tensor, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(resumed["adapters_next"][name], after_next[name], atol=1e-3, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
