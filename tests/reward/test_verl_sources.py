"""verl's default compute_score dispatch table and the math scorer's math-verify-style acceptance."""

from __future__ import annotations

import pytest

from megatron_rl.compat.verl.utils.reward_score import UnknownDataSource, default_compute_score
from megatron_rl.reward import get_scorer
from megatron_rl.reward.registry import missing_scorer_reason
from megatron_rl.reward.scorers.math import is_equiv


@pytest.mark.parametrize("source, solution, truth, want", [
    ("openai/gsm8k", "so #### 1,000", "1000", 1.0),
    ("openai/gsm8k", "so #### 999", "1000", 0.0),
    ("lighteval/MATH", "thus \\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "4", 0.0),
    ("HuggingFaceH4/MATH-500", "\\boxed{5\\text{ cm}}", "5", 1.0),
    ("numina_olympiads", "... \\boxed{-3}", "\u22123", 1.0),
    ("numina_cn_k12", "... \\boxed{2}", "3", 0.0),
    ("hiyouga/geometry3k", "<think>r</think> so \\boxed{7}", "7", 1.0),
    ("hiyouga/geometry3k", "so \\boxed{7}", "7", 0.9),
    ("searchR1_nq", "<answer>The Eiffel Tower</answer>", {"target": ["eiffel tower"]}, 1.0),
    ("searchR1_hotpotqa", "<answer>Paris</answer>", {"target": ["London"]}, 0.0),
])
def test_float_sources(source, solution, truth, want):
    assert default_compute_score(source, solution, truth) == pytest.approx(want)


@pytest.mark.parametrize("source", ["math_dapo", "math", "aime2024", "aime_2025"])
def test_dapo_family_scores_plus_minus_one(source):
    right = default_compute_score(source, "work...\nAnswer: 1{,}000", "1000")
    assert right == {"score": 1.0, "acc": True, "pred": "1{,}000"}
    wrong = default_compute_score(source, "work...\nAnswer: 999", "1000")
    assert wrong["score"] == -1.0 and wrong["acc"] is False
    boxed = default_compute_score(source, "so \\boxed{\\frac{1}{2}}", "0.5")
    assert boxed["score"] == 1.0
    assert default_compute_score(source, "no answer here", "3")["pred"] == "[INVALID]"


def test_code_sources_have_the_sandbox_scorer_and_unknown_sources_fail_by_name():
    for source in ("codecontests", "apps", "codeforces", "taco"):  # verl's code sources (reward/code_execution.py)
        assert get_scorer(source).sandbox and missing_scorer_reason(source) is None
    with pytest.raises(NotImplementedError, match="no scorer registered for data_source 'nope'"):
        default_compute_score("nope", "x", "y")
    with pytest.raises(UnknownDataSource):
        default_compute_score("nope", "x", "y", sandbox_fusion_url="http://127.0.0.1:9/run_code")
    assert missing_scorer_reason("aime24") is None


@pytest.mark.parametrize("pred, truth", [
    ("5\\text{ cm}", "5"), ("12 dollars", "12"), ("30^\\circ", "30"), ("1{,}000{,}000", "1000000"),
    ("\u22127", "-7"), ("\u00bd", "0.5"), ("\u00be", "\\frac{3}{4}"), ("2\u03c0", "2\\pi"), ("\u221a3", "\\sqrt{3}"),
])
def test_math_accepts_what_math_verify_accepts(pred, truth):
    assert is_equiv(pred, truth)


@pytest.mark.parametrize("pred, truth", [
    ("2x", "2"), ("5 cm", "6"), ("1{,}001", "1000"), ("\u22127", "7"), ("\u221a3", "\\sqrt{2}"), ("\u03c0", "2\\pi"),
])
def test_math_still_rejects_wrong_answers(pred, truth):
    assert not is_equiv(pred, truth)


def test_symbolic_equality_through_math_verify():
    pytest.importorskip("math_verify", reason="math-verify (optional) not installed; the own scorer is the fallback")
    assert is_equiv("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
    assert not is_equiv("\\frac{\\sqrt{3}}{2}", "\\frac{1}{\\sqrt{2}}")


@pytest.mark.timeout(120)  # verl's math_dapo took over 2 minutes on one such answer
def test_a_huge_answer_is_scored_and_rejected():
    huge = "9" * 100_000
    for source in ("math_dapo", "lighteval/MATH", "numina_olympiads"):
        result = default_compute_score(source, f"Answer: {huge}\n\\boxed{{{huge}}}", huge + "1")
        score = result["score"] if isinstance(result, dict) else result
        assert score in (0.0, -1.0)
