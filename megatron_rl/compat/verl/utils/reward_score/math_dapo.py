"""verl.utils.reward_score.math_dapo on megatron_rl.reward.scorers.verl_sources ({"score": +-1, "acc", "pred"})."""

from megatron_rl.reward.scorers import verl_sources as _ours


def compute_score(solution_str, ground_truth, strict_box_verify=False, pause_tokens_index=None) -> dict:
    if pause_tokens_index is not None:
        solution_str = solution_str[pause_tokens_index[-1] - 100:]
    return _ours.compute_score_dapo("math_dapo", solution_str, ground_truth, None, strict_box_verify)
