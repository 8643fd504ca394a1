"""Plain-torch truth for every op in megatron_rl.ops.

These functions define the semantics (verl 0.9.x, see docs/kernels.md) and are the fallback when the
compiled extension is missing. They favour obviousness over speed: the log-prob reference materialises
the full-vocabulary softmax, GAE is verl's per-timestep loop and group normalisation loops over groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.ops import _checks

WHITEN_EPS = 1e-8  # verl's masked_mean / rsqrt epsilon


class _GatherVocabShards(torch.autograd.Function):
    """All-gather [N, V/tp] shards into [N, V]; backward keeps this rank's slice.

    The loss computed from the gathered logits is replicated on every TP rank, so each rank's gradient
    is just its own columns of the full gradient (no reduction, as in Megatron's cross-entropy).
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        world = dist.get_world_size(group)
        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        start = ctx.rank * ctx.width
        return grad_full[..., start : start + ctx.width], None


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    check_labels: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature)[label] (and the softmax entropy), shaped like labels.

    fp32 results (fp64 for fp64 logits).

    logits [..., V_local] is this rank's vocabulary shard when tp_group is given (shard r holds global
    ids [r*V_local, (r+1)*V_local)); labels hold global ids. Columns >= vocab_size (padding) are
    excluded. Rows whose label is ignore_index give 0 for both outputs and receive no gradient.
    """
    tp_world = dist.get_world_size(tp_group) if tp_group is not None else 1
    _checks.check_log_prob_args(
        logits, labels, temperature, vocab_size, logits.shape[-1] * tp_world, ignore_index,
        check_values=check_labels,
    )
    x = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    if tp_group is not None and tp_world > 1:
        x = _GatherVocabShards.apply(x, tp_group)
    if vocab_size is not None:
        x = x[..., :vocab_size]
    ignored = labels == ignore_index
    log_softmax = torch.log_softmax(x, dim=-1)
    target = log_softmax.gather(-1, labels.masked_fill(ignored, 0).long().unsqueeze(-1)).squeeze(-1)
    log_probs = target.masked_fill(ignored, 0.0)
    if not with_entropy:
        return log_probs
    # -sum p*log p, with p*log p := 0 where p == 0 (a -inf logit) so neither value nor gradient is NaN.
    finite_log_softmax = log_softmax.masked_fill(torch.isneginf(log_softmax), 0.0)
    entropy = -(log_softmax.exp() * finite_log_softmax).sum(dim=-1)
    return log_probs, entropy.masked_fill(ignored, 0.0)


def masked_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GAE, not whitened: returns (advantages, returns = advantages + values), fp32 [B, T].

    Masked tokens (mask 0) carry both the next value and the running advantage through unchanged.
    """
    _checks.check_gae_args(token_level_rewards, values, response_mask, gamma, lam)
    rewards, vals, mask = token_level_rewards.float(), values.float(), response_mask.float()
    next_value = torch.zeros_like(vals[:, 0]) if vals.shape[1] else vals.new_zeros(vals.shape[0])
    last_gae = torch.zeros_like(next_value)
    advantages = torch.empty_like(vals)
    for t in reversed(range(vals.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        m = mask[:, t]
        next_value = vals[:, t] * m + (1 - m) * next_value
        last_gae = (delta + gamma * lam * last_gae) * m + (1 - m) * last_gae
        advantages[:, t] = last_gae
    return advantages, advantages + vals


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / (sum(mask) + 1e-8); NaNs outside the mask do not leak in (as verl)."""
    _checks.check_masked_args(x, mask)
    total = (torch.where(mask.bool(), x, 0.0) * mask).sum(dim=dim)
    return total / (mask.sum(dim=dim) + WHITEN_EPS)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8) over the masked elements, unbiased variance (verl).

    Masked-out slots are transformed too (not zeroed). Raises when the mask selects fewer than two
    elements, as verl does.
    """
    _checks.check_masked_args(x, mask)
    _checks.check_whiten_count(float(mask.sum()), mask)
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * (count / (count - 1))
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def group_normalize(
    scores: torch.Tensor, group_index: torch.Tensor, *, mode: str, epsilon: float = 1e-6
) -> torch.Tensor:
    """Per-response advantage from the scores of its group (all responses to one prompt), fp32 [B].

    grpo:      (s - mean) / (std_unbiased + epsilon); a singleton group uses mean 0, std 1.
    grpo_mean: s - mean (Dr.GRPO); a singleton keeps s.
    rloo:      s * n/(n-1) - mean * n/(n-1) (leave-one-out baseline); a singleton keeps s.
    """
    _checks.check_group_args(scores, group_index, mode, epsilon)
    s = scores.float()
    out = torch.empty_like(s)
    for g in torch.unique(group_index).tolist():
        members = group_index == g
        group = s[members]
        n = group.numel()
        if n == 1:
            out[members] = group / (1.0 + epsilon) if mode == "grpo" else group
            continue
        mean = group.mean()
        if mode == "grpo":
            out[members] = (group - mean) / (group.std() + epsilon)
        elif mode == "grpo_mean":
            out[members] = group - mean
        else:
            out[members] = group * n / (n - 1) - mean * n / (n - 1)
    return out
