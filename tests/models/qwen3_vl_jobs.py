"""Rank jobs of test_qwen3_vl.py (importable by spawned ranks): a tiny Qwen3-VL's logits, export and gradients at
several (TP, PP, sequence-parallel) layouts, one with full activation recompute; a PP layout that leaves DeepStack's
layers off the first stage refused; and transformers' reference outputs for the same image+text batch."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl_testing.vl_models import QWEN3_VL_PATCH, mm_token_types, visual_text_batch
from vision_jobs import backward_summed, loss_of
from vision_jobs import layout_checks as shared_layout_checks

# checkpoint names (transformers' parameter names too): the tower's first and last blocks, both DeepStack mergers,
# the final merger, the learned position grid; a language layer's norms before and after DeepStack, the final norm
GRAD_PARAMS = ("model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
               "model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.2.mlp.linear_fc1.bias",
               "model.visual.deepstack_merger_list.0.linear_fc1.weight",
               "model.visual.deepstack_merger_list.1.norm.bias",
               "model.visual.merger.linear_fc2.weight", "model.language_model.layers.0.input_layernorm.weight",
               "model.language_model.layers.2.self_attn.q_norm.weight", "model.language_model.norm.weight")
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def batch():
    return visual_text_batch(QWEN3_VL_PATCH, frames_apart=True)


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients of GRAD_PARAMS after ``backward_summed``."""
    backward_summed(model, batch)
    params = {"model.visual." + n: p for n, p in model.vision.named_parameters()}
    layers = model.decoder.layers
    params["model.language_model.layers.0.input_layernorm.weight"] = layers[0].input_layernorm.weight
    params["model.language_model.layers.2.self_attn.q_norm.weight"] = layers[2].self_attention.q_layernorm.weight
    params["model.language_model.norm.weight"] = model.decoder.final_layernorm.weight
    # (none reached a parameter: zero, so that a missing path shows as a gradient mismatch)
    return {name: torch.zeros_like(params[name]) if params[name].grad is None else params[name].grad.clone()
            for name in GRAD_PARAMS}


def layout_checks(directory: str, layouts: list[tuple[int, int, bool]], refused_directory: str) -> dict[str, Any]:
    """vision_jobs.layout_checks on this batch with these gradients; at TP 1 the gradients again under full
    activation recompute; the error building ``refused_directory`` (DeepStack into 3 layers) at PP 2 (2 layers a
    stage)."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, build_gpt_model, load_hf_config

    out = shared_layout_checks(directory, layouts, batch, _grads)
    init_model_parallel(tp=1, pp=1)
    out["grads"]["recompute"] = _grads(build_from_hf(directory, **RECOMPUTE)[0])
    init_model_parallel(tp=1, pp=2)
    try:  # built, not loaded: loading is collective over the stages, and only the first stage refuses
        build_gpt_model(load_hf_config(refused_directory), init_weights=False)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    return out


def hf_reference(directory: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' fp32 logits of the batch (positions from mm_token_type_ids, as the processor gives them) and the
    gradients of GRAD_PARAMS under ``loss_of``."""
    from transformers import Qwen3VLForConditionalGeneration

    from megatron_rl.models.vision_inputs import collate_visual_inputs

    model = Qwen3VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    input_ids, attention_mask, images = batch()
    logits = model(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=mm_token_types(input_ids),
                   **collate_visual_inputs(images)).logits
    loss_of(logits, attention_mask, model.config.text_config.vocab_size).backward()
    params = dict(model.named_parameters())
    return logits.detach(), {name: params[name].grad for name in GRAD_PARAMS}
