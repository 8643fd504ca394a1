"""Synthetic RL batches in verl's layout (left-padded prompts, right-padded responses) for the role tests."""

from __future__ import annotations

import torch

from megatron_rl.protocol import DataProto

VOCAB = 300  # make_tiny_hf_checkpoint's default vocabulary


def make_rl_batch(
    size: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0, temperature: float = 1.0,
    group: int = 1,
) -> DataProto:
    """``size`` rows with prompt lengths in [1, prompt_len] and response lengths in [1, response_len];
    old_log_probs are 0 (filled by the caller), advantages random, values/returns random. ``group``
    consecutive rows share one prompt (GRPO's n responses per prompt)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt_len + 1, (size,), generator=gen)
    response_lens = torch.randint(1, response_len + 1, (size,), generator=gen)
    prompt_lens[0], response_lens[0] = prompt_len, response_len  # one full row: the widest case
    cols = torch.arange(prompt_len)
    prompts = torch.randint(0, VOCAB, (size, prompt_len), generator=gen)
    if group > 1:  # every row takes its group's first row's prompt
        first = torch.arange(size) // group * group
        prompt_lens, prompts = prompt_lens[first], prompts[first]
    prompt_mask = cols[None, :] >= (prompt_len - prompt_lens)[:, None]
    response_mask = torch.arange(response_len)[None, :] < response_lens[:, None]
    prompts = prompts * prompt_mask
    responses = torch.randint(0, VOCAB, (size, response_len), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    tensors = {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.long(),
        "old_log_probs": torch.zeros(size, response_len),
        "advantages": torch.randn(size, response_len, generator=gen) * response_mask,
        "values": torch.randn(size, response_len, generator=gen) * response_mask,
        "returns": torch.randn(size, response_len, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors, meta_info={"temperature": temperature})
