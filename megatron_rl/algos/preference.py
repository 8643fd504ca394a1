"""Preference-pair losses: DPO (sigmoid), IPO and the length-normalised SimPO, from sequence log-probs.

Each pair i has a chosen and a rejected response; the losses take the policy's (and, except SimPO, the
reference's) log-probs of each whole response, [P] tensors. With
    h_i = (pi_c - pi_r) - (ref_c - ref_r)                 (the implicit reward margin over beta)
  sigmoid (DPO, https://arxiv.org/abs/2305.18290): -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
      (eps = label_smoothing: conservative DPO; 0 is plain DPO)
  ipo (https://arxiv.org/abs/2310.12036): (h - 1 / (2 beta))^2; TRL feeds it length-averaged log-probs
      (``sequence_log_probs(..., average=True)``)
  simpo (https://arxiv.org/abs/2405.14734): reference-free on length-averaged log-probs,
      -(1 - eps) log sigma(beta (pi_c - pi_r) - gamma) - eps log sigma(-(beta (pi_c - pi_r) - gamma))
and the loss is the mean over pairs. Metrics use TRL's names: rewards/chosen, rewards/rejected (mean
beta * (pi - ref), or beta * pi for simpo), rewards/margins, rewards/accuracies (chosen reward above
rejected). ``preference_pair_loss`` pairs a batch's rows and gives each row's loss derivative: the DPO trainer's
(workers/preference.py, docs/dpo.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_rl.algos._checks import check_token_tensors

PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "simpo")
_REFERENCE_FREE = ("simpo",)


def sequence_log_probs(
    token_log_probs: torch.Tensor, response_mask: torch.Tensor, average: bool = False
) -> torch.Tensor:
    """[B] log-prob of each response: the sum of its tokens' log-probs [B, T] over response_mask, or with
    ``average`` their mean (an empty response gives 0)."""
    check_token_tensors(token_log_probs=token_log_probs, response_mask=response_mask)
    mask = response_mask.to(token_log_probs.dtype)
    kept = torch.where(response_mask.bool(), token_log_probs, torch.zeros_like(token_log_probs))
    total = (kept * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp_min(1) if average else total


def _check_pairs(**tensors: Optional[torch.Tensor]) -> int:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if any(len(shape) != 1 for shape in shapes.values()) or len(set(shapes.values())) > 1:
        detail = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"preference log-probs must all be [num_pairs] of one shape, got {detail}")
    pairs = next(iter(shapes.values()))[0]
    if pairs == 0:
        raise ValueError("preference log-probs hold no pairs (shape (0,)): the mean loss is undefined")
    return pairs


def compute_preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: Optional[torch.Tensor] = None,
    reference_rejected_logps: Optional[torch.Tensor] = None,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean preference loss over the pairs and TRL's reward metrics (module docstring for the formulas).

    The reference log-probs are required except for simpo (which ignores them); they carry no gradient.
    """
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"unknown preference loss_type {loss_type!r}; known: {list(PREFERENCE_LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    reference_free = loss_type in _REFERENCE_FREE
    if not reference_free and (reference_chosen_logps is None or reference_rejected_logps is None):
        raise ValueError(f"loss_type={loss_type!r} needs reference_chosen_logps and reference_rejected_logps")
    _check_pairs(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                 reference_chosen_logps=None if reference_free else reference_chosen_logps,
                 reference_rejected_logps=None if reference_free else reference_rejected_logps)
    if reference_free:
        chosen_ratio, rejected_ratio = policy_chosen_logps, policy_rejected_logps
    else:
        chosen_ratio = policy_chosen_logps - reference_chosen_logps.detach()
        rejected_ratio = policy_rejected_logps - reference_rejected_logps.detach()
    margin = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        logits = beta * margin - (simpo_gamma if loss_type == "simpo" else 0.0)
        losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    chosen_rewards = (beta * chosen_ratio).detach().float()
    rejected_rewards = (beta * rejected_ratio).detach().float()
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
    }
    return losses.mean(), metrics


def _pair_order(pair_index: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The rows ordered pair by pair, chosen first: ``order[0::2]`` the chosen sides, ``order[1::2]`` the rejected;
    ValueError unless every pair has exactly one of each."""
    key = pair_index.long() * 2 + (1 - chosen.long())
    order = torch.argsort(key, stable=True)
    ordered = key[order]
    if len(key) % 2 or ordered[0::2].remainder(2).any() or not torch.equal(ordered[0::2] + 1, ordered[1::2]):
        raise ValueError("a preference batch needs each pair_index exactly twice, once with chosen=1 and once with "
                         "chosen=0")
    return order


def preference_pair_loss(
    policy_logps: torch.Tensor,
    reference_logps: Optional[torch.Tensor],
    pair_index: torch.Tensor,
    chosen: torch.Tensor,
    **loss_kwargs,
) -> tuple[float, dict[str, float], torch.Tensor]:
    """``compute_preference_loss`` on [N] sequence log-probs of rows in any order (the pairs found by ``pair_index``
    and ``chosen``: 1 on the chosen side): (the mean loss, its metrics with TRL's logps/chosen and logps/rejected,
    dL / d policy_logps[r] for every row r, from autograd in float64)."""
    order = _pair_order(pair_index, chosen)
    logps = policy_logps.detach().double().clone().requires_grad_(True)
    ordered = logps[order]
    ref = None if reference_logps is None else reference_logps.detach().double()[order]
    loss, metrics = compute_preference_loss(
        ordered[0::2], ordered[1::2], None if ref is None else ref[0::2], None if ref is None else ref[1::2],
        **loss_kwargs)
    (derivative,) = torch.autograd.grad(loss, logps)
    values = ordered.detach()
    metrics |= {"logps/chosen": float(values[0::2].mean()), "logps/rejected": float(values[1::2].mean())}
    return float(loss.detach()), metrics, derivative.float()


__all__ = ["PREFERENCE_LOSS_TYPES", "compute_preference_loss", "preference_pair_loss", "sequence_log_probs"]
