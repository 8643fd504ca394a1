"""Scorer of ``synthetic/tool_multiply`` (megatron_rl.data.tasks.tool_multiply): the exact product after ``####``.

The decoded response holds every turn, tool results included; only a ``####`` answer counts (the tool's
output never contains one), so copying the tool result without answering scores 0.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.reward.registry import register_scorer
from megatron_rl.reward.scorers.gsm8k import extract_answer, same_number

__all__ = ["compute_score"]


@register_scorer("synthetic/tool_multiply")
def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, Any]:
    pred = extract_answer(solution_str, "strict")
    correct = pred is not None and same_number(pred, str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "pred": pred or ""}
