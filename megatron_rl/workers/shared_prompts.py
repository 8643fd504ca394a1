"""Micro-batches that compute each prompt once for all of its responses (``megatron.share_prompts``).

GRPO, RLOO and the other group estimators sample n responses per prompt, so a padded micro-batch holds
every prompt n times and the model computes (and back-propagates through) the same prompt tokens n
times. Here the rows of a micro-batch whose prompts are token for token the same become one sequence:

    [prompt | response 1 | response 2 | ... | response n]

with RoPE positions prompt 0..p-1 and, for every response, p..p+r-1 (each response continues the
prompt), and a tree attention mask: a response token sees the prompt and the earlier tokens of its own
response only. Every response token therefore gets exactly the output it gets in its own padded row,
and the prompt's gradient is the sum of what its n copies would have received. The model computes
p + sum(r) positions per group instead of n * (p + r); for 15-token prompts and 32-token responses at
n = 8 that is 28 % fewer, in the forward and in the backward.

The first token of every response is predicted by the prompt's last position, which all n responses
share; ``predictor_rows``/``predictor_cols`` select it once per response token (``select_predictors``),
so the loss and its gradients are those of the unshared layout.
"""

from __future__ import annotations

import torch

from megatron_rl.models.attention import PAD_SEGMENT, PROMPT_SEGMENT
from megatron_rl.workers.packing import PackedMicroBatch


def _prompt_groups(
    prompt_ids: torch.Tensor, prompt_real: torch.Tensor, prompt_tokens: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(each row's prompt group, the number of groups): rows with the same real prompt tokens share one
    sequence; a row without a prompt token is refused."""
    if bool((prompt_tokens == 0).any()):
        empty = (prompt_tokens == 0).nonzero().flatten().tolist()
        raise ValueError(f"share_prompts: rows {rows[empty].tolist()} have no prompt token in attention_mask")
    # pads set to -1 so padding cannot differ
    prompt_key = prompt_ids.masked_fill(~prompt_real, -1)
    keys, group = torch.unique(prompt_key, dim=0, return_inverse=True)
    return group, keys.shape[0]


def _response_starts(
    group: torch.Tensor, num_groups: int, prompt_tokens: torch.Tensor, response_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each group's prompt length, where each row's response starts in its group's sequence): after the
    prompt and the responses of the group's earlier rows (rows keep their order within a group)."""
    device = group.device
    group_prompt = torch.zeros(num_groups, dtype=torch.long, device=device)
    group_prompt[group] = prompt_tokens
    order = torch.sort(group, stable=True).indices
    before = torch.cumsum(response_tokens[order], 0) - response_tokens[order]
    group_start = torch.zeros(num_groups, dtype=torch.long, device=device)
    group_start.scatter_reduce_(0, group[order], before, reduce="amin", include_self=False)
    start = torch.empty_like(before)
    start[order] = group_prompt[group[order]] + before - group_start[group[order]]
    return group_prompt, start


def pack_shared_prompts(
    batch: dict[str, torch.Tensor],
    rows: torch.Tensor,
    field_keys: tuple[str, ...] = (),
    shape: tuple[int, int] | None = None,
    multiple: int = 1,
) -> PackedMicroBatch:
    """Pack ``rows`` of ``batch`` (input_ids, attention_mask, responses; see batch_checks.py) with one
    sequence per distinct prompt. ``shape`` = (sequences, width) fixes the rectangle (the interleaved
    pipeline schedule needs one shape); ``multiple`` rounds the width up (sequence parallelism)."""
    ids = batch["input_ids"][rows]
    real = batch["attention_mask"][rows].bool()
    responses = batch["responses"][rows]
    response_len = responses.shape[1]
    prompt_len = ids.shape[1] - response_len
    device = ids.device

    prompt_real = real[:, :prompt_len]
    prompt_tokens = prompt_real.sum(dim=1)
    group, num_groups = _prompt_groups(ids[:, :prompt_len], prompt_real, prompt_tokens, rows)
    response_real = real[:, prompt_len:]
    response_tokens = response_real.sum(dim=1)
    group_prompt, start = _response_starts(group, num_groups, prompt_tokens, response_tokens)

    lengths = group_prompt.clone().index_add_(0, group, response_tokens)
    longest = -(-max(int(lengths.max()), 1) // multiple) * multiple
    num_seqs, width = shape if shape is not None else (num_groups, longest)
    if width < longest or num_seqs < num_groups:
        raise ValueError(f"share_prompts: shape {shape} cannot hold {num_groups} prompt groups of up to "
                         f"{longest} tokens")

    packed_ids = torch.zeros(num_seqs, width, dtype=ids.dtype, device=device)
    positions = torch.zeros(num_seqs, width, dtype=torch.long, device=device)
    segment = torch.full((num_seqs, width), PAD_SEGMENT, dtype=torch.long, device=device)
    # the prompts: real tokens in order (left padding dropped), from each group's first row
    first_row = torch.zeros(num_groups, dtype=torch.long, device=device)
    first_row.scatter_reduce_(0, group, torch.arange(len(rows), device=device), reduce="amin", include_self=False)
    prompt_rank = prompt_real.long().cumsum(dim=1) - 1
    p_rows, p_cols = prompt_real[first_row].nonzero(as_tuple=True)
    p_rank = prompt_rank[first_row][p_rows, p_cols]
    packed_ids[p_rows, p_rank] = ids[first_row[p_rows], p_cols]
    positions[p_rows, p_rank] = p_rank
    segment[p_rows, p_rank] = PROMPT_SEGMENT
    # the responses: token t (t-th real one) of row i at start_i + t, position p + t
    token_rows, token_cols = response_real.nonzero(as_tuple=True)
    rank = (response_real.long().cumsum(dim=1) - 1)[token_rows, token_cols]
    seq = group[token_rows]
    col = start[token_rows] + rank
    packed_ids[seq, col] = responses[token_rows, token_cols]
    positions[seq, col] = group_prompt[seq] + rank
    segment[seq, col] = token_rows
    # token t is predicted by token t-1 of its response, the first one by the prompt's last token
    predictor_cols = torch.where(rank > 0, col - 1, group_prompt[seq] - 1)

    return PackedMicroBatch(
        rows=rows,
        input_ids=packed_ids,
        attention_mask=segment != PAD_SEGMENT,
        token_rows=token_rows,
        token_cols=token_cols,
        predictor_cols=predictor_cols,
        labels=responses[token_rows, token_cols],
        response_len=response_len,
        fields={key: batch[key][rows] for key in field_keys},
        predictor_rows=seq,
        shared_positions=positions,
        shared_segments=segment,
    )

