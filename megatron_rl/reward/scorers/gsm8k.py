"""GSM8K scorer: the answer follows ``####`` (strict) or is the last number in the text (flexible).

Like verl's gsm8k scorer: ``score`` for a right answer, ``format_score`` for a wrong one that was found,
0 when none was found. Unlike verl, "42.0", "42" and "$1,000" vs "1000" compare as the same number.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from megatron_rl.reward.registry import register_scorer

__all__ = ["compute_score", "extract_answer", "same_number"]

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The last ``#### <number>`` (strict) or the last number anywhere (flexible); None when absent."""
    if method == "strict":
        matches = _STRICT.findall(solution_str)
    elif method == "flexible":
        matches = _NUMBER.findall(solution_str)
    else:
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    return matches[-1].replace(",", "") if matches else None


def same_number(a: str, b: str) -> bool:
    """Numeric equality when both parse as numbers (ignoring commas, "$", a final "."), else text equality."""

    def clean(text: str) -> str:
        return text.strip().replace(",", "").replace("$", "").rstrip(".")

    try:
        return Decimal(clean(a)) == Decimal(clean(b))
    except InvalidOperation:
        return clean(a) == clean(b)


@register_scorer("openai/gsm8k", "gsm8k", "synthetic/arith")
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Any]:
    pred = extract_answer(solution_str, method)
    correct = pred is not None and same_number(pred, str(ground_truth))
    value = score if correct else (format_score if pred is not None else 0.0)
    return {"score": value, "acc": float(correct), "pred": pred or ""}
