"""MATH scorer: compare the boxed answer of a response with the ground truth.

The answer is the last ``\\boxed{...}``, joined with the boxes right before it when only "and", commas,
``\\quad`` or math delimiters separate them (``\\boxed{-2} and \\boxed{1}``); the same for a boxed
ground truth. Comparison, cheapest first:

1. normalised strings (in the spirit of Hendrycks' ``strip_string``): spacing commands and spaces,
   ``\\left``/``\\right``, ``$``, ``%``, degree marks, units after a number and ``\\text{}``-style wrappers
   dropped; ``\\dfrac``/``\\tfrac``/``\\cfrac`` -> ``\\frac``; ``\\frac12``/``\\sqrt2`` braced; a leading
   ``x=`` dropped (when both answers name a variable and the names differ, steps 1-2 are skipped and step 3
   compares the names: ``y=5`` is not ``x=5``; a bare ``5`` against ``x=5`` is the value); ``1,000`` ->
   ``1000`` (but ``32, 349`` is a list); unicode minus, ``½``, ``π``, ``√``, ``×``;
2. plain numbers, ``a/b`` and ``\\frac{a}{b}`` by value, exactly; a decimal of 10 or more significant digits
   within one unit of its last digit (``0.0833333333333333`` = ``\\frac{1}{12}``, ``0.333333`` is not
   ``\\frac{1}{3}``);
3. ``math_equiv.structured_equal``: lists order-free, tuples / intervals / matrices in order, relations up to
   a factor, named values by name, single values as sympy expressions (sympy only from here on);
4. only where 3 cannot read an answer and ``math_verify`` is installed (optional, main thread only: its
   timeout is signal-based): math-verify's symbolic check.

Bounded time: answers longer than ``MAX_ANSWER_CHARS`` are compared as normalised strings only, numbers
are parsed only up to ``MAX_NUMBER_DIGITS`` digits, sympy sees at most ``math_equiv.MAX_SYMPY_CHARS``
characters and no towers of powers; the scoring pool's per-call timeout (``reward.timeout_s``) bounds the
rest. Accuracy against outside-labelled pairs: tests/reward/test_math_scorer_accuracy.py.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

from megatron_rl.reward.registry import register_scorer
from megatron_rl.reward.scorers.math_equiv import numbers_close, structured_equal

__all__ = ["boxed_answer", "compute_score", "is_equiv", "last_boxed", "normalize_answer"]

_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SLASH = re.compile(r"(-?\d+)/(-?\d+)")
_LEADING_NAME = re.compile(r"^[\s$]*([A-Za-z]\w*)\s*=(?!=)")  # "x=5", "x = 5": the answer names its variable
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
MAX_ANSWER_CHARS = 1000
MAX_NUMBER_DIGITS = 400
_UNITS = (
    "cm", "mm", "km", "m", "kg", "g", "mg", "l", "ml", "s", "sec", "seconds", "second", "min", "minutes", "minute",
    "hours", "hour", "hrs", "days", "day", "weeks", "years", "year", "degrees", "degree", "deg", "units", "unit",
    "inches", "inch", "in", "feet", "foot", "ft", "yards", "yd", "miles", "mile", "mph", "meters", "meter",
    "centimeters", "dollars", "dollar", "cents", "cent", "percent", "sq", "squareunits", "squarefeet",
    "squaremeters", "cubicunits", "points", "people", "students", "pounds", "lbs", "oz", "ounces", "liters",
    "pct", "percentage", "yuan",
)
_UNIT_TAIL = re.compile(r"(?<=[\d}])(?:\\(?:text|mbox|mathrm)\{\s*([a-zA-Z ]+)\}|\s*([a-zA-Z]+)(?:\^[23])?)$")
_TEXT_TAIL = re.compile(r"(?<=[\d}])\s*\\(?:text|textnormal|mbox|mathrm)\{(?!\s*(?:and|or)\s*\})[^{}\d]*\}$")
_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00bd": "1/2", "\u2153": "1/3", "\u2154": "2/3", "\u00bc": "1/4",
    "\u00be": "3/4", "\u215b": "1/8", "\u03c0": "\\pi ", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u00b0": "^\\circ",
    "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ",
}
_SQRT_UNICODE = re.compile("\u221a\\s*(\\d+|[a-zA-Z]|\\{[^{}]*\\}|\\([^()]*\\))")


def _strip_unit(s: str) -> str:
    """Drop one trailing unit after a number ("5\\text{ cm}", "5cm", "12 dollars"); "2x" keeps its x."""
    match = _UNIT_TAIL.search(s)
    if match:
        word = (match[1] or match[2] or "").replace(" ", "").lower()
        if word in _UNITS:
            return s[: match.start()]
    return s


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


_BOX_GAP = re.compile(r"(?:\s|[,;.$]|\\[()\[\]]|\\q?quad|\\text\{\s*(?:and|or|,)?\s*\}|\band\b|\bor\b)*")


def boxed_answer(text: str) -> str | None:
    """The last box, joined with the boxes right before it when only "and", commas, ``\\quad`` or math
    delimiters separate them (``\\boxed{-2} and \\boxed{1}`` -> ``-2,1``); "first \\boxed{3}, finally
    \\boxed{4}" is 4. None when there is no complete box."""
    last = last_boxed(text)
    if last is None:
        return None
    parts, end = [last], _box_start(text, len(text))
    for _ in range(20):  # a bounded look back
        before = _box_start(text, end)
        if before < 0:
            break
        content = last_boxed(text[before:end].rstrip())
        gap = _gap_after(text, before, end)
        if content is None or gap is None or not _BOX_GAP.fullmatch(gap):
            break
        parts.append(content)
        end = before
    return ",".join(reversed(parts))


def _box_start(text: str, end: int) -> int:
    return max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))


def _gap_after(text: str, start: int, end: int) -> str | None:
    """The text between the box that starts at ``start`` and ``end``."""
    rest = text[start:end].removeprefix("\\boxed").removeprefix("\\fbox")
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[i + 1:]
    return None


def normalize_answer(answer: str) -> str:
    """Canonical spelling of one answer (see the module docstring); equal strings mean equal answers."""
    s = answer.strip().replace("\n", "")
    if "\\begin" not in s:  # "\\frac" from a doubly escaped string: not a line break outside matrices
        s = re.sub(r"(?<!\\)\\\\(?=[A-Za-z])", r"\\", s)
    s = re.sub(r",\\!\s*", ",", s)  # "11,\\! 111": a thousands separator
    spaced_list = bool(re.search(r",\s", s))  # "32, 349" is a list, "32,349" a number
    for char, repl in _UNICODE.items():
        s = s.replace(char, repl)
    s = _SQRT_UNICODE.sub(lambda m: "\\sqrt{" + m[1].strip("{}()") + "}", s)
    s = s.replace("{,}", ",").replace("\\!", "")
    s = _strip_unit(s.strip())
    s = _TEXT_TAIL.sub("", s)  # "17\\text{ any text}": words after a number label it
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = s.replace("\\left", "").replace("\\right", "")
    while _WRAPPER.search(s):
        s = _WRAPPER.sub(r"\1", s)
    s = _SPACING.sub("", s)
    for token in ("^{\\circ}", "^\\circ", "\\$", "$", "\\%", "%", " "):
        s = s.replace(token, "")
    s = _LEADING_NAME.sub("", s)  # "x=5" -> "5"
    s = _strip_unit(s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)  # 4210_{7} = 4210_7
    if _THOUSANDS.fullmatch(s) and not spaced_list:
        s = s.replace(",", "")
    s = s.rstrip(".").rstrip("\\")
    if s.startswith("."):
        s = "0" + s
    return s.replace("-.", "-0.")


def _leading_name(answer: str) -> str | None:
    """The variable of a leading ``x=`` (the one ``normalize_answer`` drops), else None."""
    match = _LEADING_NAME.match(answer)
    return match[1] if match else None


def _as_fraction(s: str) -> Fraction | None:
    if sum(c.isdigit() for c in s) > MAX_NUMBER_DIGITS:  # a 100k-digit "answer" is not worth a bignum parse
        return None
    try:
        if _NUMBER.fullmatch(s):
            return Fraction(s)
        if match := _FRAC.fullmatch(s):
            value = Fraction(int(match[2]), int(match[3]))
            return -value if match[1] else value
        if match := _SLASH.fullmatch(s):
            return Fraction(int(match[1]), int(match[2]))
    except (ZeroDivisionError, ValueError):
        return None
    return None


def is_equiv(prediction: str, ground_truth: str, use_math_verify: bool = True) -> bool:
    """Whether two answers (box contents) are the same; see the module docstring for the rules."""
    if len(prediction) > MAX_ANSWER_CHARS or len(ground_truth) > MAX_ANSWER_CHARS:
        return prediction.strip() == ground_truth.strip()
    a, b = normalize_answer(prediction), normalize_answer(ground_truth)
    # normalising drops a leading "x=": answers naming two different variables are left to structured_equal,
    # which compares the names (y=5 is not x=5); a bare value against a named one is the value
    names = _leading_name(prediction), _leading_name(ground_truth)
    if None in names or names[0] == names[1]:
        if a == b:  # the hot path: no sympy when the strings decide
            return True
        value_a, value_b = _as_fraction(a), _as_fraction(b)
        if value_a is not None and value_b is not None:
            return numbers_close(value_a, value_b, a, b)
    decided = structured_equal(prediction, ground_truth)
    if decided is not None:
        return decided
    return use_math_verify and _math_verify_equal(prediction, ground_truth)


def _math_verify_equal(prediction: str, ground_truth: str, timeout_s: int = 3) -> bool:
    """HF math-verify's symbolic check when installed and usable here (main thread), else False."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        import math_verify
    except ImportError:
        return False
    try:
        gold = math_verify.parse(f"${ground_truth}$", parsing_timeout=timeout_s)
        pred = math_verify.parse(f"${prediction}$", parsing_timeout=timeout_s)
        return bool(gold and pred and math_verify.verify(gold, pred, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a parser failure or timeout means "not shown equal"
        return False


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> dict[str, Any]:
    truth = str(ground_truth)
    truth = boxed_answer(truth) or truth  # some datasets keep the whole boxed solution as ground truth
    pred = boxed_answer(solution_str)
    correct = pred is not None and is_equiv(pred, truth)
    return {"score": float(correct), "acc": float(correct), "pred": pred or ""}
