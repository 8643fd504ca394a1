"""Rank jobs of test_qwen2_5_vl.py (importable by spawned ranks): a tiny Qwen2.5-VL's logits, export and gradients at
several (TP, PP, sequence-parallel) layouts; and transformers' reference outputs for the same image+video+text batch."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_testing.vl_models import mm_token_types, visual_text_batch

GRAD_PARAMS = ("visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight", "visual.blocks.1.mlp.up_proj.bias",
               "visual.merger.mlp.0.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight")


def loss_of(logits: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean negative log-softmax of fixed random targets over the batch's real tokens (``attention_mask``)."""
    targets = torch.randint(0, vocab_size, attention_mask.shape, generator=torch.Generator().manual_seed(7))
    picked = torch.log_softmax(logits[..., :vocab_size].float(), -1).gather(-1, targets[..., None])[..., 0]
    valid = attention_mask.to(picked.dtype)
    return -(picked * valid).sum() / valid.sum()


def backward_summed(model, batch: Callable[[], tuple]) -> None:
    """One backward of ``loss_of`` on ``batch()`` through a PP=1 model, the gradients then summed over TP as Megatron's
    finalize_model_grads sums the sequence-parallel ones."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from megatron_rl.models import causal_padding_mask
    from megatron_rl.models.vision_inputs import model_inputs

    input_ids, attention_mask, images = batch()
    model.train()
    positions, extra = model_inputs(model.hf_config, input_ids, attention_mask, images)
    logits = model(input_ids, positions, causal_padding_mask(attention_mask), runtime_gather_output=True, **extra)
    loss_of(logits, attention_mask, model.hf_config.vocab_size).backward()
    model.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([model], model.config)


def _grads(model) -> dict[str, torch.Tensor]:
    """Gradients of GRAD_PARAMS after ``backward_summed``."""
    backward_summed(model, visual_text_batch)
    params = {"visual." + n: p for n, p in model.vision.named_parameters()}
    params["model.layers.0.input_layernorm.weight"] = model.decoder.layers[0].input_layernorm.weight
    params["model.norm.weight"] = model.decoder.final_layernorm.weight
    return {name: params[name].grad.clone() for name in GRAD_PARAMS}


def layout_checks(directory: str, layouts: list[tuple[int, int, bool]],
                  batch: Callable[[], tuple] = visual_text_batch,
                  grads: Callable[[Any], dict[str, torch.Tensor]] = _grads) -> dict[str, Any]:
    """For each (TP, PP, SP): the gathered logits of ``batch()`` (last stage), at SP off every exported tensor, at PP 1
    ``grads(model)`` (default: of GRAD_PARAMS)."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask, images = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}, "grads": {}}
    for tp, pp, sp in layouts:
        init_model_parallel(tp=tp, pp=pp)
        chunks = build_from_hf(directory, sequence_parallel=sp)
        logits = compute_full_logits(chunks, input_ids, attention_mask, micro_batch_size=1, images=images)
        if logits is not None:
            out["logits"][tp, pp, sp] = logits
        if not sp:
            out["export"][tp, pp] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
        if pp == 1:
            out["grads"][tp, sp] = grads(chunks[0])
    return out


def hf_reference(directory: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' fp32 logits of the batch (positions from the processor's mm_token_type_ids, as a real call has
    them) and the gradients of GRAD_PARAMS under ``loss_of``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_rl.models.vision_inputs import collate_visual_inputs

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)
    input_ids, attention_mask, images = visual_text_batch()
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=mm_token_types(input_ids),
                  **collate_visual_inputs(images))
    logits = model(**kwargs).logits
    loss_of(logits, attention_mask, model.config.text_config.vocab_size).backward()
    names = {"visual.": "model.visual.", "model.": "model.language_model."}
    params = dict(model.named_parameters())
    grads = {}
    for name in GRAD_PARAMS:
        prefix = next(p for p in names if name.startswith(p))
        grads[name] = params[names[prefix] + name.removeprefix(prefix)].grad
    return logits.detach(), grads


# ---------------------------------------------------------------- the comparisons both families' tests make

def assert_logits_match(results: list[dict[str, Any]], expected: torch.Tensor, valid: torch.Tensor,
                        layout: tuple[int, int, bool], tolerance: float) -> None:
    """Every last-stage rank's logits at ``layout`` (TP, PP, SP) equal transformers' over the ``valid`` tokens."""
    tp, pp, sp = layout
    last_stage = [r["logits"][layout] for r in results if layout in r["logits"]]
    assert len(last_stage) == 2 // pp
    for logits in last_stage:
        diff = (logits - expected)[valid].abs().max().item()
        print(f"TP={tp} PP={pp} SP={sp}: max |logit diff| {diff:.2e}")
        assert diff <= tolerance


def assert_grads_match(results: list[dict[str, Any]], expected: dict[str, torch.Tensor], layout: Any) -> None:
    """Every rank's gradients at ``layout`` equal transformers' (each of which is non-zero)."""
    for rank, result in enumerate(results):
        for name, reference in expected.items():
            assert reference.abs().max() > 0, name
            torch.testing.assert_close(result["grads"][layout][name], reference, rtol=1e-4, atol=1e-6,
                                       msg=f"rank {rank} {layout} {name}")


def assert_export_exact(stored: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> None:
    """The exported tensors are the checkpoint's, by name and bit for bit."""
    assert set(exported) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name
