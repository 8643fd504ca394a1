"""Scorer for the digit-string tasks (synthetic/copy, synthetic/reverse, synthetic/sort).

score = 1 - edit_distance(answer, target) / max(len(answer), len(target)), where answer is the response
with surrounding whitespace stripped. It is 1 exactly for the right answer, 0 for an empty one, and
every right digit in the right order earns credit even when the length is off — partial credit a
random model already collects, which is what lets GRPO learn these tasks from scratch (position-only
credit, where one inserted digit zeroes everything after it, learned several times slower in our runs).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.reward.registry import register_scorer

__all__ = ["compute_score", "edit_distance"]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute; each costs 1)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


@register_scorer("synthetic/copy", "synthetic/reverse", "synthetic/sort")
def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> dict[str, float]:
    target, answer = str(ground_truth), solution_str.strip()
    longest = max(len(answer), len(target))
    score = 1.0 - edit_distance(answer, target) / longest if longest else 1.0
    return {"score": score, "acc": float(answer == target)}
