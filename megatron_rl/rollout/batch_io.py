"""The rollout's DataProto contract, shared by every engine.

Input: ``input_ids``, ``attention_mask``, ``position_ids`` [B, P], prompts LEFT-padded.
Output (verl's layout, so batches from different calls concatenate): ``prompts`` [B, P], ``responses``
[B, R] right-padded with the pad id, ``response_mask`` [B, R] (1 up to and including the finishing
token), ``input_ids`` / ``attention_mask`` = prompt ++ response, ``position_ids`` continuing the prompt's,
``rollout_log_probs`` [B, R] fp32 (0 at pads), where R is always the call's max response length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.protocol import DataProto

__all__ = [
    "cut_at_finish",
    "PROMPT_KEYS", "build_rollout_batch", "check_prompt_batch", "prompt_token_lists", "repeated_prompt_rows",
]

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def check_prompt_batch(data: DataProto) -> None:
    """Fail early, naming the field, when the prompts are not the [B, P] left-padded layout."""
    data.require(*PROMPT_KEYS, where="rollout generate_sequences")
    ids, mask, pos = (data.batch[k] for k in PROMPT_KEYS)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, prompt_len], got shape {tuple(ids.shape)}")
    for key, t in (("attention_mask", mask), ("position_ids", pos)):
        if t.shape != ids.shape:
            raise ValueError(f"{key} has shape {tuple(t.shape)}, input_ids has {tuple(ids.shape)}")
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        row = int((lengths == 0).nonzero()[0])
        raise ValueError(f"prompt row {row} is empty (attention_mask all zero)")
    # Left padding: once a row's mask turns 1 it stays 1 up to the last column.
    if bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        row = int((mask[:, 1:].long() < mask[:, :-1].long()).any(-1).nonzero()[0])
        raise ValueError(
            f"prompts must be LEFT-padded (verl's convention); row {row} has attention_mask "
            f"{mask[row].tolist()} with padding after a real token"
        )


def prompt_token_lists(data: DataProto) -> list[list[int]]:
    """The prompts without their left padding."""
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def repeated_prompt_rows(
    ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """GRPO's ``rollout.n`` samples of a prompt arrive as identical consecutive rows, so an engine can
    prefill each prompt once. Returns (the first row of every run of identical rows, each row's run
    index), or None when no two consecutive rows are equal."""
    same = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1]) & (pos[1:] == pos[:-1])).all(-1)
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=ids.device), ~same])
    return starts.nonzero().squeeze(-1), starts.cumsum(0) - 1


def cut_at_finish(tokens: list[int], log_probs: list[float], finish_token_ids: Sequence[int], max_tokens: int,
                  where: str) -> tuple[list[int], list[float]]:
    """An engine's response up to and including its first finishing token; one longer than ``max_tokens`` is an
    error naming ``where`` (the engine and row)."""
    finish = set(finish_token_ids)
    for i, token in enumerate(tokens):
        if token in finish:
            tokens, log_probs = tokens[: i + 1], log_probs[: i + 1]
            break
    if len(tokens) > max_tokens:
        raise RuntimeError(f"{where} has {len(tokens)} tokens, more than the {max_tokens} asked for")
    return tokens, log_probs


def build_rollout_batch(
    prompts: DataProto,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    *,
    response_length: int,
    pad_token_id: int,
    weight_version: int,
    seconds: float,
) -> DataProto:
    """Assemble the output DataProto from per-sample response tokens (already cut after the finishing
    token) and the sampler's log-probs of those tokens. The input's non-tensor fields and meta_info pass
    through; meta_info gains the ``weight_version`` that generated every sample and the ``timing``."""
    batch_size = len(prompts)
    if len(responses) != batch_size or len(log_probs) != batch_size:
        raise ValueError(
            f"{len(responses)} responses / {len(log_probs)} log-prob rows for {batch_size} prompts"
        )
    lengths = [len(tokens) for tokens in responses]
    for i, (n, lps) in enumerate(zip(lengths, log_probs)):
        if n > response_length or len(lps) != n:
            raise ValueError(
                f"sample {i}: {n} response tokens and {len(lps)} log-probs for max length {response_length}"
            )
    prompt_ids = prompts.batch["input_ids"]
    device = prompt_ids.device
    # One scatter of all rows' tokens (row-major, as the mask's True cells are visited), not a copy per row:
    # a per-row loop cost ~20-60 ms per call at 256 samples.
    out_mask = torch.arange(response_length) < torch.tensor(lengths, dtype=torch.long).unsqueeze(-1)
    out_ids = torch.full((batch_size, response_length), pad_token_id, dtype=prompt_ids.dtype)
    out_ids[out_mask] = torch.tensor([t for row in responses for t in row], dtype=prompt_ids.dtype)
    out_lp = torch.zeros((batch_size, response_length), dtype=torch.float32)
    out_lp[out_mask] = torch.tensor([lp for row in log_probs for lp in row], dtype=torch.float32)
    out_mask = out_mask.to(prompts.batch["attention_mask"].dtype)
    out_ids, out_mask, out_lp = out_ids.to(device), out_mask.to(device), out_lp.to(device)

    prompt_pos = prompts.batch["position_ids"]
    steps = torch.arange(1, response_length + 1, device=device, dtype=prompt_pos.dtype)
    response_pos = prompt_pos[:, -1:] + steps.unsqueeze(0)
    batch = {
        "prompts": prompt_ids,
        "responses": out_ids,
        "response_mask": out_mask,
        "input_ids": torch.cat([prompt_ids, out_ids], dim=-1),
        "attention_mask": torch.cat([prompts.batch["attention_mask"], out_mask], dim=-1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=-1),
        "rollout_log_probs": out_lp,
    }
    meta = {**prompts.meta_info, "weight_version": weight_version, "timing": {"generate_sequences": seconds}}
    return DataProto(batch, dict(prompts.non_tensor_batch), meta)
