"""From the reward model's ``token_level_scores`` to the ``token_level_rewards`` the estimators read."""

from __future__ import annotations

import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_finite, check_token_tensors
from megatron_rl.algos.kl import KLController
from megatron_rl.algos.kl import kl_penalty as kl_estimate
from megatron_rl.protocol import DataProto


def apply_kl_penalty(
    data: DataProto, kl_ctrl: KLController, kl_penalty: str = "kl"
) -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * KL(old_log_probs || ref_log_prob) * response_mask.

    beta is ``kl_ctrl.value`` before this step's update; the controller is then updated with the
    batch's KL (per-sequence masked mean, averaged over sequences) and n_steps = batch size.
    Returns ``(data, metrics)`` with actor/reward_kl_penalty and actor/reward_kl_penalty_coeff.
    """
    data.require(
        "token_level_scores", "old_log_probs", "ref_log_prob", "response_mask", where="apply_kl_penalty"
    )
    batch = data.batch
    scores, mask = batch["token_level_scores"], batch["response_mask"]
    check_token_tensors(
        token_level_scores=scores,
        old_log_probs=batch["old_log_probs"],
        ref_log_prob=batch["ref_log_prob"],
        response_mask=mask,
    )
    check_finite("token_level_scores", scores)
    mask = mask.to(torch.float32)
    kld = kl_estimate(batch["old_log_probs"].float(), batch["ref_log_prob"].float(), kl_penalty) * mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = scores - beta * kld
    current_kl = ops.masked_mean(kld, mask, dim=-1).mean().item() if len(data) else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def rewards_from_scores(data: DataProto) -> DataProto:
    """No KL in the reward: token_level_rewards = token_level_scores (in place, returns ``data``)."""
    data.require("token_level_scores", where="rewards_from_scores")
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    return data
