"""DAPO's soft overlong punishment (``reward.reward_manager=dapo``, ``reward.reward_kwargs.overlong_buffer_cfg``).

A response of ``length`` tokens gets ``min(-(length - (max_resp_len - len)) / len * penalty_factor, 0)`` added to
its score: nothing up to ``max_resp_len - len`` tokens, then a penalty growing linearly to ``-penalty_factor`` at
``max_resp_len`` (verl's DAPORewardManager). ``length`` counts the response's real tokens as verl does: the
``attention_mask`` of the response part, tool output of multi-turn rollouts included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.config.schema import RewardConfig

__all__ = ["OverlongPenalty"]

_CFG = "reward.reward_kwargs.overlong_buffer_cfg"


@dataclass(frozen=True)
class OverlongPenalty:
    max_resp_len: int
    buffer_len: int
    penalty_factor: float
    log: bool

    @classmethod
    def from_config(cls, reward: RewardConfig, response_length: int | None) -> OverlongPenalty | None:
        """The penalty ``reward`` (the ``reward`` config section) asks for, or None when it asks for none.
        ``response_length``: the longest response the rollout generates, which ``max_resp_len: null`` means and
        an explicit one must equal. Raises ValueError naming the key for a setting verl would assert on or that
        would silently not do what it says."""
        kwargs = reward.reward_kwargs
        buffer = kwargs.overlong_buffer_cfg
        if not buffer.enable:
            return None
        if str(reward.reward_manager) != "dapo":
            # verl's other managers ignore it; a penalty that is configured but never applied is refused instead
            raise ValueError(
                f"{_CFG}.enable=true is applied by reward.reward_manager=dapo only, but reward.reward_manager="
                f"{str(reward.reward_manager)}: set reward.reward_manager=dapo, or {_CFG}.enable=false"
            )
        if not (isinstance(buffer.len, int) and buffer.len > 0):
            raise ValueError(
                f"{_CFG}.len must be a positive integer when {_CFG}.enable=true, got {buffer.len!r} (to disable the "
                f"penalty, set {_CFG}.enable=false)"
            )
        if not buffer.penalty_factor >= 0:
            raise ValueError(
                f"{_CFG}.penalty_factor must be >= 0 (a negative one rewards overlong responses), "
                f"got {buffer.penalty_factor!r}"
            )
        max_resp_len = kwargs.max_resp_len if kwargs.max_resp_len is not None else response_length
        if max_resp_len is None:
            raise ValueError(
                f"{_CFG}.enable=true needs reward.reward_kwargs.max_resp_len, or the response length "
                f"(data.max_response_length) to stand for it"
            )
        if response_length is not None and max_resp_len != response_length:
            # larger: the penalty never reaches -penalty_factor; smaller: it grows past it without bound
            raise ValueError(
                f"reward.reward_kwargs.max_resp_len={max_resp_len} differs from the response length {response_length} "
                f"(actor_rollout_ref.rollout.response_length, null: data.max_response_length): the penalty must end "
                f"at -penalty_factor where responses are cut; leave reward.reward_kwargs.max_resp_len null"
            )
        if buffer.len > max_resp_len:
            raise ValueError(
                f"{_CFG}.len={buffer.len} must be <= reward.reward_kwargs.max_resp_len={max_resp_len} (the buffer is "
                f"the last len tokens before it)"
            )
        return cls(int(max_resp_len), int(buffer.len), float(buffer.penalty_factor), bool(buffer.log))

    def __call__(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B] float32 penalties (<= 0) for [B] integer response lengths. float32 as verl computes it."""
        exceed = lengths.long() - (self.max_resp_len - self.buffer_len)
        return torch.clamp(-exceed / self.buffer_len * self.penalty_factor, max=0.0)
