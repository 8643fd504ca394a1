"""``agg_loss``: reduce a [B, T] per-token loss to the scalar that is back-propagated.

Split invariance: a micro-batch's loss is its share of the mini-batch loss. Pass the mini-batch's
global normaliser (valid tokens for token-mean, non-empty sequences for the seq-mean modes, counted
over every micro-batch and every data-parallel rank) and the losses of all parts add up to the loss
of the whole mini-batch, so the accumulated gradient does not depend on how it was split.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algos._checks import check_token_tensors

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
Count = float | int | torch.Tensor


@dataclass(frozen=True)
class GlobalBatchInfo:
    """The mini-batch-wide normalisers ``agg_loss`` takes, computed once per mini-batch.

    global_num_tokens: valid tokens over all micro-batches and DP ranks (token-mean).
    global_batch_size: sequences with at least one valid token, likewise (seq-mean-* modes).
    dp_size: multiplier undoing a data-parallel gradient *average* (Megatron DDP's default and
        verl's convention): set it to the DP world size when gradients are averaged, keep 1 when summed.
    loss_scale_factor: divisor of seq-mean-token-sum-norm; None = the micro-batch's padded width.
        Set a constant (e.g. max_response_length) when micro-batches are padded to different widths.
    """

    global_num_tokens: Optional[Count] = None
    global_batch_size: Optional[Count] = None
    dp_size: int = 1
    loss_scale_factor: Optional[float] = None

    @classmethod
    def from_masks(
        cls,
        micro_batch_masks: Sequence[torch.Tensor],
        *,
        dp_group: Optional[dist.ProcessGroup] = None,
        dp_size: int = 1,
        loss_scale_factor: Optional[float] = None,
    ) -> "GlobalBatchInfo":
        """Count this rank's micro-batch response masks and, given ``dp_group``, sum the counts over it."""
        if not micro_batch_masks:
            raise ValueError("GlobalBatchInfo.from_masks needs at least one micro-batch mask")
        counts = torch.zeros(2, dtype=torch.float64, device=micro_batch_masks[0].device)
        for mask in micro_batch_masks:
            check_token_tensors(response_mask=mask)
            per_sequence = mask.sum(dim=-1, dtype=torch.float64)
            counts[0] += per_sequence.sum()
            counts[1] += (per_sequence > 0).sum()
        if dp_group is not None:
            dist.all_reduce(counts, group=dp_group)
        return cls(float(counts[0]), float(counts[1]), dp_size, loss_scale_factor)

    def agg_kwargs(self) -> dict:
        """The keyword arguments of ``agg_loss`` (no deep copy: counts may be tensors)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


LOCAL_BATCH = GlobalBatchInfo()  # normalise each call by its own counts (one micro-batch = the whole batch)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(values * mask); values outside the mask (NaN included) contribute neither value nor gradient."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (kept * mask).sum() if dim is None else (kept * mask).sum(dim=dim)


def _safe_divisor(count: Count) -> Count:
    # verl divides by the count as is, so an all-masked (micro-)batch gives NaN; its sum is 0, so 0 is right.
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Optional[Count] = None,
    global_batch_size: Optional[Count] = None,
    loss_scale_factor: Optional[float] = None,
    *,
    global_num_tokens: Optional[Count] = None,
) -> torch.Tensor:
    """Scalar loss from ``loss_mat`` [B, T] over ``loss_mask`` [B, T] (verl's ``agg_loss``, with
    verl's positional order: dp_size, batch_num_tokens, global_batch_size, loss_scale_factor).

    token-mean:              sum(loss * mask) / N_tokens
    token-sum:               sum(loss * mask)
    seq-mean-token-sum:      sum_i (sum_t loss_it * m_it) / N_seqs
    seq-mean-token-mean:     sum_i (sum_t loss_it * m_it / (sum_t m_it + 1e-8)) / N_seqs
    seq-mean-token-sum-norm: seq-mean-token-sum / loss_scale_factor (default: T, the padded width)

    N_tokens is ``batch_num_tokens`` (verl's name; ``global_num_tokens=`` is the same, keyword only)
    and N_seqs ``global_batch_size`` when given (the whole mini-batch across micro-batches and DP
    ranks: then the parts' losses sum to the full-batch loss), else this call's own counts (valid
    tokens; sequences with a valid token). The result is multiplied by ``dp_size`` (see
    ``GlobalBatchInfo``); dp_size > 1 without the global count is an error, as in verl. A zero count
    gives 0, not NaN.
    """
    check_token_tensors(loss_mat=loss_mat, loss_mask=loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")
    if batch_num_tokens is not None and global_num_tokens is not None:
        raise ValueError("agg_loss: pass batch_num_tokens or global_num_tokens (the same count), not both")
    if global_num_tokens is None:
        global_num_tokens = batch_num_tokens
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        _require_global(dp_size, global_num_tokens, "global_num_tokens (verl: batch_num_tokens)", loss_agg_mode)
        count = mask.sum() if global_num_tokens is None else global_num_tokens
        return masked_sum(loss_mat, mask) / _safe_divisor(count) * dp_size
    if loss_agg_mode == "token-sum":
        _check_dp_size(dp_size)
        return masked_sum(loss_mat, mask) * dp_size

    _require_global(dp_size, global_batch_size, "global_batch_size", loss_agg_mode)
    tokens_per_seq = mask.sum(dim=-1)
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (tokens_per_seq + 1e-8)
    non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)  # fully masked sequences do not count
    count = non_empty.sum() if global_batch_size is None else global_batch_size
    loss = (seq_losses * non_empty).sum() / _safe_divisor(count) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else max(loss_mask.shape[-1], 1))
    return loss


def _check_dp_size(dp_size: Any) -> None:
    # A count passed where dp_size sits (our pre-verl positional order) must not scale the loss.
    if isinstance(dp_size, bool) or not isinstance(dp_size, numbers.Integral) or dp_size < 1:
        raise ValueError(
            f"dp_size must be a positive int, got {dp_size!r} (agg_loss takes verl's positional order: "
            "loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)"
        )


def _require_global(dp_size: int, value: Optional[Count], name: str, mode: str) -> None:
    _check_dp_size(dp_size)
    if dp_size > 1 and value is None:
        raise ValueError(
            f"agg_loss(loss_agg_mode={mode!r}, dp_size={dp_size}) needs {name}: a local count would "
            "weight each data-parallel rank by its own token/sequence count"
        )
