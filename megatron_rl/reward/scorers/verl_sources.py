"""The rest of verl's ``default_compute_score`` dispatch table, with verl's score conventions.

- ``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``: DAPO's Minerva format, the last
  ``Answer: ...`` line (else the last ``\\boxed{}``) of the response's last 300 characters; score
  +1 right / -1 wrong, ``acc``, ``pred``. The comparison is the MATH scorer's ``is_equiv`` (verl compares
  normalised strings only, so "0.5" vs "1/2" was wrong there: differs on purpose, docs/algorithms.md).
- ``numina_*`` (verl: prime_math): last ``\\boxed{}`` compared with ``is_equiv``, score 1.0 / 0.0.
- ``hiyouga/geometry3k`` (verl: geo3k): 0.9 * accuracy + 0.1 * format (``<think>...</think>`` then a box).
- ``searchR1_*`` (verl: search_r1_like_qa_em): exact match of ``<answer>...</answer>`` against any of
  ``ground_truth["target"]`` after SQuAD normalisation, 1.0 / 0.0 (the search tool is the rollout's
  business; scoring needs no service).

The code sources (``codecontests``, ``apps``, ``codeforces``, ``taco``) run their unit tests in the sandbox:
``megatron_rl/reward/code_execution.py``.
"""

from __future__ import annotations

import re
import string
from typing import Any

from megatron_rl.reward.registry import register_scorer
from megatron_rl.reward.scorers.math import MAX_ANSWER_CHARS, is_equiv, last_boxed

__all__ = ["compute_score_dapo", "compute_score_geo3k", "compute_score_numina", "compute_score_search_em"]

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
DAPO_TAIL_CHARS = 300  # verl: "The longest answer in MATH-500 has 159 characters"


def _truth(ground_truth: Any) -> str:
    truth = str(ground_truth)[: MAX_ANSWER_CHARS + 1]
    return last_boxed(truth) or truth


@register_scorer("math_dapo", "math", "math_dapo_reasoning", prefixes=("aime",))
def compute_score_dapo(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, strict_box_verify: bool = False
) -> dict[str, Any]:
    tail = solution_str[-DAPO_TAIL_CHARS:]
    pred = None
    if not strict_box_verify:
        found = _ANSWER.findall(tail)
        pred = found[-1].strip().rstrip(".") if found else None
    if pred is None:
        pred = last_boxed(tail[-100:] if strict_box_verify else tail)
    correct = pred is not None and is_equiv(pred, _truth(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred if pred is not None else "[INVALID]"}


_NUMINA = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
           "numina_cn_k12", "numina_olympiads")


@register_scorer(*_NUMINA)
def compute_score_numina(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    pred = last_boxed(solution_str)
    if pred is None:
        found = re.findall(r"(?i)answer is[:\s]*\$?([^\n$]+)", solution_str[-DAPO_TAIL_CHARS:])
        pred = found[-1].strip().rstrip(".") if found else None
    return float(pred is not None and is_equiv(pred, _truth(ground_truth)))


_THINK_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


@register_scorer("hiyouga/geometry3k")
def compute_score_geo3k(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, format_score: float = 0.1
) -> float:
    text = solution_str[-4 * MAX_ANSWER_CHARS:]
    pred = last_boxed(text)
    acc = float(pred is not None and is_equiv(pred, _truth(ground_truth)))
    fmt = float(bool(_THINK_FORMAT.fullmatch(text.strip())))
    return (1.0 - format_score) * acc + format_score * fmt


def _squad_normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_SEARCH = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
           "searchR1_musique", "searchR1_bamboogle")


@register_scorer(*_SEARCH)
def compute_score_search_em(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, score: float = 1.0
) -> float:
    answers = re.findall(r"<answer>(.*?)</answer>", solution_str[-4 * MAX_ANSWER_CHARS:], re.DOTALL)
    if not answers:
        return 0.0
    targets = ground_truth.get("target", ground_truth) if isinstance(ground_truth, dict) else ground_truth
    if isinstance(targets, str) or not hasattr(targets, "__iter__"):
        targets = [targets]
    pred = _squad_normalize(answers[-1])
    return score if any(pred == _squad_normalize(str(t)) for t in targets) else 0.0
