import pytest

from megatron_rl.data.tasks import TASKS, make_rows
from megatron_rl.reward import get_scorer, register_scorer, registered_data_sources
from megatron_rl.reward.scorers import digits, gsm8k, math

# (response, ground truth, strict score, flexible score)
GSM8K_TABLE = [
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),  # right
    ("#### 8", "7", 0.0, 0.0),  # wrong
    ("so the answer is\n####   1,250", "1250", 1.0, 1.0),  # thousands separator, extra spaces
    ("#### $42.", "42", 1.0, 1.0),  # dollar sign, sentence dot
    ("#### 42.0", "42", 1.0, 1.0),  # same number, other spelling
    ("#### -3", "-3", 1.0, 1.0),  # negative
    ("#### 5 then #### 6", "6", 1.0, 1.0),  # the last answer counts
    ("#### 6 then #### 5", "6", 0.0, 0.0),
    ("The answer is 7.", "7", 0.0, 1.0),  # no ####: only flexible finds it
    ("I do not know", "7", 0.0, 0.0),  # missing
    ("", "7", 0.0, 0.0),
    ("####", "7", 0.0, 0.0),
    ("7 apples, #### seven", "7", 0.0, 1.0),
]


@pytest.mark.parametrize("response,truth,strict,flexible", GSM8K_TABLE)
def test_gsm8k_extraction(response, truth, strict, flexible):
    assert gsm8k.compute_score("openai/gsm8k", response, truth)["score"] == strict
    assert gsm8k.compute_score("openai/gsm8k", response, truth, method="flexible")["score"] == flexible


def test_gsm8k_format_score_rewards_a_wrong_but_well_formed_answer():
    assert gsm8k.compute_score("gsm8k", "#### 8", "7", format_score=0.1) == {
        "score": 0.1,
        "acc": 0.0,
        "pred": "8",
    }
    assert gsm8k.compute_score("gsm8k", "eight", "7", format_score=0.1)["score"] == 0.0
    assert gsm8k.compute_score("gsm8k", "#### 7", "7", format_score=0.1)["score"] == 1.0


# (response, ground truth, right?)
MATH_TABLE = [
    (r"so \boxed{5}", "5", True),
    (r"\boxed{6}", "5", False),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", True),  # dfrac, unbraced frac
    (r"\boxed{0.5}", r"\frac{1}{2}", True),  # decimal vs fraction
    (r"\boxed{1/2}", "0.5", True),
    (r"\boxed{-\frac{3}{4}}", "-0.75", True),
    (r"\boxed{ 2 \sqrt 3 }", r"2\sqrt{3}", True),  # spacing, unbraced sqrt
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", True),  # \left/\right and spaces
    (r"\boxed{x = 4}", "4", True),  # variable assignment
    (r"\boxed{90^\circ}", "90", True),
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{\text{(B)}}", "(B)", True),  # text wrapper
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{\frac{a}{b}}", r"\frac{b}{a}", False),
    (r"\boxed{\frac{1}{0}}", "0", False),  # no crash on a zero denominator
    (r"The answer is \boxed 7$.", "7", True),  # \boxed without braces
    (r"\boxed{\frac{1}{2}", "0.5", False),  # cut off inside the box
    ("The answer is 5", "5", False),  # no box: missing
    (r"first \boxed{3}, finally \fbox{4}", "4", True),  # the last box counts
    (r"\boxed{5}", r"The answer is $\boxed{5}$", True),  # boxed ground truth
]


@pytest.mark.parametrize("response,truth,right", MATH_TABLE)
def test_math_boxed_answers(response, truth, right):
    result = math.compute_score("lighteval/MATH", response, truth)
    assert result["score"] == result["acc"] == float(right)


def test_last_boxed_handles_nested_braces():
    assert math.last_boxed(r"\boxed{\frac{1}{\sqrt{2}}} end") == r"\frac{1}{\sqrt{2}}"
    assert math.last_boxed("no box") is None


# (response, target, score)
DIGITS_TABLE = [
    ("38145", "38145", 1.0),
    (" 38145\n", "38145", 1.0),  # surrounding whitespace is ignored
    ("3814", "38145", 0.8),  # one missing
    ("381450", "38145", 5 / 6),  # one extra
    ("38945", "38145", 0.8),  # one wrong
    ("83145", "38145", 0.6),  # swapped pair: two substitutions
    ("", "38145", 0.0),
    ("abcde", "38145", 0.0),
    ("3 8 1 4 5", "38145", 5 / 9),  # inner spaces count as wrong characters
]


@pytest.mark.parametrize("response,target,score", DIGITS_TABLE)
def test_digits_partial_credit(response, target, score):
    result = digits.compute_score("synthetic/copy", response, target)
    assert result["score"] == pytest.approx(score)
    assert result["acc"] == float(score == 1.0)


def test_edit_distance():
    assert digits.edit_distance("kitten", "sitting") == 3
    assert digits.edit_distance("", "abc") == 3 and digits.edit_distance("abc", "abc") == 0


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_synthetic_task_has_a_scorer_that_accepts_its_answer(task):
    for row in make_rows(task, 20, seed=0, split="val"):
        scorer = get_scorer(row["data_source"])
        truth = row["reward_model"]["ground_truth"]
        answer = row["extra_info"].get("answer", truth)  # arith: the worked solution ending in "#### n"
        kwargs = {"data_source": row["data_source"], "ground_truth": truth, "extra_info": row["extra_info"]}
        assert scorer.fn(solution_str=answer, **kwargs)["score"] == 1.0
        assert scorer.fn(solution_str="#### 100000", **kwargs)["score"] < 1.0


def test_registry_lookup_and_conflicts():
    assert {"openai/gsm8k", "lighteval/MATH", "synthetic/copy"} <= set(registered_data_sources())
    assert get_scorer("openai/gsm8k").fn is gsm8k.compute_score
    with pytest.raises(
        ValueError, match="no scorer registered for data_source 'nope'.*custom_reward_function"
    ):
        get_scorer("nope")
    with pytest.raises(
        ValueError, match="already has the scorer megatron_rl.reward.scorers.gsm8k.compute_score"
    ):
        register_scorer("openai/gsm8k")(lambda **kw: 1.0)
    register_scorer("openai/gsm8k")(gsm8k.compute_score)  # the same function again is fine
