"""``verl.utils.reward_score`` on megatron-rl's scorer registry (megatron_rl.reward).

``default_compute_score(data_source, solution_str, ground_truth, extra_info=None, ...)`` dispatches by
data_source like verl's (exact names, ``aime*`` by prefix) and returns what verl returns: the dict for
the math_dapo family ({"score": +-1, "acc", "pred"}), a float elsewhere.
A source with no scorer raises ``NotImplementedError`` (as verl) that is also a ``ValueError`` (as
megatron-rl), naming the known sources or the external service the source would need. The code sources
(``codecontests``, ``apps``, ``codeforces``, ``taco``) run their tests in this machine's sandbox, or on the
SandboxFusion service at ``sandbox_fusion_url`` (megatron_rl/reward/code_execution.py).
Scorers registered with ``megatron_rl.reward.register_scorer`` are dispatched here too.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.reward import get_scorer

__all__ = ["UnknownDataSource", "default_compute_score"]


class UnknownDataSource(NotImplementedError, ValueError):
    pass


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    try:
        scorer = get_scorer(data_source)
    except ValueError as err:
        raise UnknownDataSource(str(err)) from None
    if scorer.sandbox:  # as verl: only the code sources' scorer gets the sandbox settings
        res = scorer.fn(data_source, solution_str, ground_truth, extra_info, sandbox_fusion_url=sandbox_fusion_url,
                        memory_limit_mb=memory_limit_mb or 1024, concurrent_semaphore=concurrent_semaphore)
    elif scorer.batched:
        res = scorer.fn([data_source], [solution_str], [ground_truth], [extra_info])[0]
    else:
        res = scorer.fn(data_source, solution_str, ground_truth, extra_info)
    if isinstance(res, dict):
        # verl returns the dict only where its scorer does (math_dapo's family); elsewhere the score.
        dapo = data_source in ("math_dapo", "math", "math_dapo_reasoning") or data_source.startswith("aime")
        return res if dapo or "score" not in res else float(res["score"])
    if isinstance(res, (int, float, bool)):
        return float(res)
    return float(res[0])
