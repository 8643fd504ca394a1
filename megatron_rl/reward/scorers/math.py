"""MATH scorer: compare the last ``\\boxed{...}`` of a response with the ground truth after normalisation.

Normalisation (in the spirit of the Hendrycks MATH ``strip_string``): drop spacing commands and spaces,
``\\left``/``\\right``, ``$``, ``%``, degree marks and ``\\text{}``-style wrappers; ``\\dfrac``/``\\tfrac`` ->
``\\frac``; add braces to ``\\frac12`` and ``\\sqrt2``; drop a leading ``x=``; ``.5`` -> ``0.5``. Then
plain numbers, ``a/b`` and ``\\frac{a}{b}`` compare by value, so ``0.5``, ``1/2`` and ``\\dfrac{1}{2}`` agree.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from megatron_rl.reward.registry import register_scorer

__all__ = ["compute_score", "is_equiv", "last_boxed", "normalize_answer"]

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SLASH = re.compile(r"(-?\d+)/(-?\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (braces balanced) or ``\\boxed x``; else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):  # "\boxed 5": up to the end of the math
        return rest.strip().split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


def normalize_answer(answer: str) -> str:
    s = answer.strip().replace("\n", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("\\left", "").replace("\\right", "")
    while _WRAPPER.search(s):
        s = _WRAPPER.sub(r"\1", s)
    s = _SPACING.sub("", s)
    for token in ("^{\\circ}", "^\\circ", "\\$", "$", "\\%", "%", " "):
        s = s.replace(token, "")
    s = re.sub(r"^[a-zA-Z]\w*=(?!=)", "", s)  # "x=5" -> "5"
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    return s.replace("-.", "-0.")


def _as_fraction(s: str) -> Fraction | None:
    try:
        if _NUMBER.fullmatch(s):
            return Fraction(s)
        if match := _FRAC.fullmatch(s):
            value = Fraction(int(match[2]), int(match[3]))
            return -value if match[1] else value
        if match := _SLASH.fullmatch(s):
            return Fraction(int(match[1]), int(match[2]))
    except ZeroDivisionError:
        return None
    return None


def is_equiv(prediction: str, ground_truth: str) -> bool:
    a, b = normalize_answer(prediction), normalize_answer(ground_truth)
    if a == b:
        return True
    value_a, value_b = _as_fraction(a), _as_fraction(b)
    return value_a is not None and value_a == value_b


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> dict[str, Any]:
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth  # some datasets keep the whole boxed solution as ground truth
    pred = last_boxed(solution_str)
    correct = pred is not None and is_equiv(pred, truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
