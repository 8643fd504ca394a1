"""Conveniences on top of the builder: build+load in one call, and full logits through the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.models.attention import causal_padding_mask
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.models.layout import unwrap
from megatron_rl.models.loading import load_hf_weights
from megatron_rl.models.mtp import with_mtp
from megatron_rl.models.vision_inputs import model_inputs, position_ids_from_mask


def build_from_hf(
    model_dir: str | Path, progress: bool = False, mtp: bool = False, **build_kwargs: Any
) -> list[torch.nn.Module]:
    """``build_gpt_model`` for ``model_dir``'s config (with its multi-token-prediction layers if ``mtp``), then
    ``load_hf_weights`` from it."""
    chunks = build_gpt_model(with_mtp(load_hf_config(model_dir), mtp), init_weights=False, **build_kwargs)
    load_hf_weights(chunks, model_dir, progress=progress)
    return chunks


def compute_full_logits(
    model_chunks: list[torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int | None = None,
    images: list | None = None,
) -> torch.Tensor | None:
    """Forward-only pass through the pipeline; [B, T, vocab] fp32 logits, TP-gathered with the
    vocabulary padding removed, on the last pipeline stage (None on the other stages).

    For verification and small evaluations — training code keeps logits vocab-parallel. ``images``: each row's
    processor outputs (``multi_modal_inputs``, or None) for a vision-language model.
    """
    chunks = [unwrap(c) for c in model_chunks]
    vocab = chunks[0].hf_config.vocab_size
    micro = micro_batch_size or input_ids.shape[0]
    rows = images if images is not None else [None] * input_ids.shape[0]
    batches = [
        (input_ids[i : i + micro], attention_mask[i : i + micro], rows[i : i + micro])
        for i in range(0, input_ids.shape[0], micro)
    ]
    hf = chunks[0].hf_config

    def forward_step(data_iterator, model):
        ids, mask, row_images = next(data_iterator)
        positions, extra = model_inputs(hf, ids, mask, row_images)
        output = model(ids, positions, causal_padding_mask(mask), runtime_gather_output=True, **extra)
        return output, lambda out: (out.sum() * 0.0, {"logits": out[..., :vocab].float()})

    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=input_ids.shape[1],
            micro_batch_size=micro,
            forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat([out["logits"] for out in outputs])
