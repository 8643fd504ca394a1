"""Scorer of ``synthetic/shapes`` and ``synthetic/shape_colour`` (megatron_rl.data.tasks.shapes): 1 for the right
answer (the count, the colour's number), 0 otherwise.

The answer is the content of the last ``\\boxed{...}`` when the response has one (geo3k's format), else the
whole response with surrounding whitespace stripped; either must equal the ground truth exactly.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_rl.reward.registry import register_scorer

__all__ = ["compute_score", "extract_answer"]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(solution_str: str) -> str:
    boxed = _BOXED.findall(solution_str)
    return (boxed[-1] if boxed else solution_str).strip()


@register_scorer("synthetic/shapes", "synthetic/shape_colour")
def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> dict[str, Any]:
    pred = extract_answer(solution_str)
    correct = pred == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "pred": pred}
