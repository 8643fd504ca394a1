"""Rank jobs of test_vision_actor.py: an actor on a tiny Qwen2.5-VL computing log-probs of an RL batch whose prompts
hold images (verl's multi_modal_inputs column), and one update."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from workers_jobs import ROLLOUT_N, actor_config, update

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
from megatron_rl.models.layout import unwrap
from megatron_rl.workers import ActorRole, MegatronEngine
from megatron_rl.protocol import DataProto
from megatron_rl_testing.vl_models import IMAGE, VIDEO, visual_text_batch

RESPONSE_LENS = (4, 2, 5, 3)
TEMPERATURE = 0.7


def vision_rl_batch() -> DataProto:
    """Four rows in verl's layout (left-padded prompts | right-padded responses): the three visual_text_batch rows'
    real tokens as prompts (two with images, one of them with a video too, one text-only) plus the first again;
    random responses, one of which holds the image token and one the video token."""
    ids, mask, images = visual_text_batch()
    prompts = [ids[i][mask[i].bool()] for i in range(3)] + [ids[0][mask[0].bool()]]
    rows_images = [images[0], images[1], images[2], images[0]]
    width, response_len = max(len(p) for p in prompts), max(RESPONSE_LENS)
    gen = torch.Generator().manual_seed(3)
    size = len(prompts)
    input_ids = torch.zeros(size, width + response_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, length) in enumerate(zip(prompts, RESPONSE_LENS)):
        input_ids[i, width - len(prompt):width] = prompt
        input_ids[i, width:width + length] = torch.randint(0, IMAGE, (length,), generator=gen)
        attention_mask[i, width - len(prompt):width + length] = 1
    input_ids[1, width] = IMAGE  # a policy may sample <|image_pad|>: text in a response, not an image
    input_ids[2, width + 1] = VIDEO  # nor is <|video_pad|> a video
    responses = input_ids[:, width:]
    response_mask = attention_mask[:, width:]
    tensors = {
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask,
        "old_log_probs": -3.0 + 0.3 * torch.randn(size, response_len, generator=gen),
        "advantages": torch.randn(size, response_len, generator=gen) * response_mask,
    }
    column = np.empty(size, dtype=object)
    column[:] = rows_images
    return DataProto.from_dict(tensors, non_tensors={"multi_modal_inputs": column},
                               meta_info={"temperature": TEMPERATURE})


def actor_job(model_dir: str, tp: int, pp: int) -> dict[str, Any]:
    """Log-probs before and after one update, the vision tower's weights before and after (first stage)."""
    init_model_parallel(tp=tp, pp=pp)
    config = actor_config(tp=tp, pp=pp, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                          ppo_max_token_len_per_gpu=200, entropy_coeff=0.0)
    actor = ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)
    data = vision_rl_batch()
    out: dict[str, Any] = {"log_probs": actor.compute_log_prob(data).batch["old_log_probs"]}
    vision = unwrap(actor.engine.model[0]).vision
    before = {n: p.detach().clone() for n, p in vision.named_parameters()} if vision is not None else {}
    out["metrics"] = update(actor, data)
    out["vision_moved"] = {n: not torch.equal(before[n], p) for n, p in vision.named_parameters()} if before else {}
    out["log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    destroy_model_parallel()
    return out
