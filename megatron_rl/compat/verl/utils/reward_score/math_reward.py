"""verl.utils.reward_score.math_reward on megatron_rl.reward.scorers.math (1.0 / 0.0, as verl)."""

from megatron_rl.reward.scorers import math as _ours

is_equiv = _ours.is_equiv
last_boxed_only_string = _ours.last_boxed


def compute_score(solution_str, ground_truth) -> float:
    return _ours.compute_score("lighteval/MATH", solution_str, ground_truth)["score"]
