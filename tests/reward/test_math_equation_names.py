"""The MATH scorer compares equations with their variables (issue 56): ``y=5`` is not the answer ``x=5``.

Before: ``normalize_answer`` drops a leading ``name=`` from both sides, so the string hot path of ``is_equiv``
saw ``5`` = ``5`` and never reached ``structured_equal``, which compares the names."""

from __future__ import annotations

import pytest

from megatron_rl.reward.scorers.math import compute_score, is_equiv


@pytest.mark.parametrize("prediction, truth", [
    ("y=5", "x=5"), ("y = 5", "x=5"), ("b=\\frac{1}{2}", "a=0.5"), ("y=2x+1", "x=2x+1"), ("y=1, x=2", "x=1, y=2"),
])
def test_an_equation_in_another_variable_is_not_the_answer(prediction, truth):
    assert not is_equiv(prediction, truth)
    assert compute_score("lighteval/MATH", f"so \\boxed{{{prediction}}}", truth)["score"] == 0.0


@pytest.mark.parametrize("prediction, truth", [
    ("x = 5", "x=5"), ("x=\\frac{1}{2}", "x=0.5"), ("x=1, y=2", "y=2, x=1"),
    # a bare value against a named one (either side) counts as the value: the model answered the question
    ("5", "x=5"), ("x=5", "5"),
])
def test_the_same_variable_or_a_bare_value_still_matches(prediction, truth):
    assert is_equiv(prediction, truth)
