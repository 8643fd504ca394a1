"""verl.utils.reward_score.gsm8k on megatron_rl.reward.scorers.gsm8k (returns the float score, as verl)."""

from megatron_rl.reward.scorers import gsm8k as _ours

extract_solution = _ours.extract_answer


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0) -> float:
    return _ours.compute_score("openai/gsm8k", solution_str, ground_truth, None, method, format_score, score)["score"]
