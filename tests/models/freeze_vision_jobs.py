"""Rank job of test_freeze_vision_tower.py: a one-rank (gloo, CPU, TP 1) actor engine of the tiny Qwen2.5-VL built
with actor.freeze_vision_tower, one optimizer step on an image+text batch, and what moved."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl_testing.vl_models import visual_text_batch

PREFIX = "actor_rollout_ref.actor"


def freeze_job(model_dir: str, freeze: bool) -> dict[str, Any]:
    from megatron_rl.config.schema import MegatronParallelConfig, OptimConfig
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models import causal_padding_mask
    from megatron_rl.models.layout import unwrap
    from megatron_rl.models.vision_inputs import model_inputs
    from megatron_rl.workers import MegatronEngine

    from vision_jobs import loss_of

    init_model_parallel(tp=1)
    try:
        engine = MegatronEngine(model_dir, MegatronParallelConfig(), OptimConfig(lr=1e-2), name=PREFIX,
                                freeze_vision_tower=freeze)
        (ddp,) = engine.model
        model = unwrap(ddp)
        vision = dict(model.vision.named_parameters())
        language = {n: p for n, p in model.named_parameters() if not n.startswith("vision.")}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        input_ids, attention_mask, images = visual_text_batch()
        engine.zero_grad()
        positions, extra = model_inputs(model.hf_config, input_ids, attention_mask, images)
        logits = ddp(input_ids, positions, causal_padding_mask(attention_mask), runtime_gather_output=True, **extra)
        loss_of(logits, attention_mask, model.hf_config.vocab_size).backward()
        ddp.finish_grad_sync()
        grad_norm = engine.optimizer_step()
        moved = {n: not torch.equal(before[n], p.detach()) for n, p in model.named_parameters()}
        return {
            "grad_norm": grad_norm,
            "vision_requires_grad": {n: p.requires_grad for n, p in vision.items()},
            "language_requires_grad": {n: p.requires_grad for n, p in language.items()},
            "vision_moved": {n: moved["vision." + n] for n in vision},
            "language_moved": {n: moved[n] for n in language},
        }
    finally:
        destroy_model_parallel()
