"""DeepSeek-V3 gradients across layouts (issue 52): one training backward of a fixed scalar loss (the mean negative
log-softmax of fixed target tokens over the real tokens, ``gradient_loss``) through Megatron's DDP wrapper and
finalize_model_grads, on the tiny checkpoints (norms and biases perturbed, the router bias non-zero); every
gradient of one MoE layer -- MLA's q_a/q_b (or q) / kv_a / kv_b / o projections and latent norms, the layer norms,
the router, each expert's gate / up / down by its global index, the shared expert -- gathered to full checkpoint-
named tensors and compared with TP=1 (one rank) at TP=2 (sequence parallel), EP=2, TP=2 x EP=2 (ETP=1) and DP=2
within 1e-5, and TP=1's with transformers' DeepseekV3ForCausalLM. The router bias stays a buffer without gradient.

Two spawned groups (1 and 2 gloo ranks) compute the Megatron gradients; transformers and the assertions run here.
"""

from __future__ import annotations

import pytest

from megatron_rl.distributed import run_multiprocess
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

from deepseek_v3_jobs import (
    GRAD_LAYER,
    assert_gradients_close,
    assert_layout_gradients_equal,
    hf_layer_grads,
    layer_grads,
)

TOLERANCE = 1e-5
MODELS = {"q_lora": {}, "no_q_lora": dict(q_lora_rank=None)}  # q compressed (V3 / Kimi-K2) or not (V2-Lite)
# checkpoint seeds under which the batch reaches all 8 experts of the compared layer (an expert without tokens has a
# zero gradient, equal to anything's; test_reference_gradients_cover_the_whole_layer checks it)
SEEDS = {"q_lora": 0, "no_q_lora": 21}
# (TP, EP) on 2 gloo ranks: TP=2 with sequence parallelism; TP=2 x EP=2 splits no expert (ETP=1); (1, 1) is DP=2
LAYOUTS = [(2, 1), (1, 2), (2, 2), (1, 1)]
# Megatron-Core 0.16.1's local MLA spec split the down projections over TP and cut the shared RoPE key from a TP
# gather whose backward only splits: each TP rank kept its own heads' share of the key's gradient (kv_a's RoPE rows
# off by ~5e-3, everything below by up to ~4e-2). The local spec now keeps them whole (models/mla_layers.py), as
# TE's does.


def _layouts():
    return LAYOUTS

LAYER = f"model.layers.{GRAD_LAYER}."
ATTENTION = {"q_lora": ("q_a_proj", "q_a_layernorm", "q_b_proj"), "no_q_lora": ("q_proj",)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3_grads")
    dirs = {
        name: str(make_tiny_hf_checkpoint(root / name, "deepseek_v3", with_tokenizer=False, seed=SEEDS[name],
                                            **kwargs))
        for name, kwargs in MODELS.items()
    }
    reference = run_multiprocess(layer_grads, 1, dirs, [(1, 1, None)], timeout_s=600)[0]
    layouts = [(tp, ep, 1 if tp > 1 and ep > 1 else None) for tp, ep in LAYOUTS]
    return dirs, reference, run_multiprocess(layer_grads, 2, dirs, layouts, timeout_s=600)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_gradients_cover_the_whole_layer(setup, name):
    _, reference, _ = setup
    held = reference[name, 1, 1]
    assert held["uncovered"] == []  # every parameter of the layer is compared
    names = set(held["grads"])
    for proj in (*ATTENTION[name], "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        assert f"{LAYER}self_attn.{proj}.weight" in names, proj
    assert {f"{LAYER}mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")} <= names
    assert {f"{LAYER}mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")} <= names
    assert f"{LAYER}mlp.gate.weight" in names and f"{LAYER}mlp.gate.e_score_correction_bias" not in names
    for tensor_name, grad in held["grads"].items():
        assert grad.abs().max() > 0, f"{tensor_name}: zero gradient"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp, ep", _layouts())
def test_layer_gradients_equal_across_layouts(setup, name, tp, ep):
    _, reference, results = setup
    ranks = [result[name, tp, ep] for result in results]
    assert_layout_gradients_equal(reference[name, 1, 1], ranks, f"{name} TP={tp} EP={ep}", TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_gradients_match_transformers(setup, name):
    dirs, reference, _ = setup
    assert_gradients_close(hf_layer_grads(dirs[name]), [reference[name, 1, 1]], f"{name} TP=1 vs transformers",
                           TOLERANCE)
