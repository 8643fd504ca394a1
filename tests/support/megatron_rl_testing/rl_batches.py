"""Synthetic RL batches in verl's layout for benchmarks: n responses per prompt, responses right-padded."""

from __future__ import annotations

import torch


def grouped_rl_batch(prompts: int, n: int, prompt_len: int, response_lens: torch.Tensor, response_len: int,
                     generator: torch.Generator, vocab: int = 500):
    """``prompts`` x ``n`` rows (each prompt repeated n times) with the given response lengths, random tokens and
    advantages; old log-probs are left to the caller."""
    from megatron_rl.protocol import DataProto

    mask = (torch.arange(response_len)[None, :] < response_lens[:, None]).long()
    prompt_ids = torch.randint(1, vocab, (prompts, prompt_len), generator=generator).repeat_interleave(n, dim=0)
    responses = torch.randint(1, vocab, (prompts * n, response_len), generator=generator) * mask
    attention = torch.cat([torch.ones_like(prompt_ids), mask], dim=1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompt_ids, responses], 1), "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "responses": responses, "response_mask": mask,
        "advantages": torch.randn(mask.shape, generator=generator) * mask,
    }, meta_info={"temperature": 1.0})
