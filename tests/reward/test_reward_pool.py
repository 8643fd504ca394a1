"""Scoring in worker processes: time limits that hold, workers that die, results in order."""

import threading

import pytest
from reward_batches import response_batch, reward_config

from megatron_rl.reward import RewardManager
from megatron_rl.reward.custom import load_custom_scorer
from megatron_rl.reward.pool import ScoringPool
from megatron_rl.reward.scorers import digits

DEADLINE_S = 120  # a broken time limit fails the test instead of hanging the suite


def run_bounded(fn):
    """Run ``fn`` in a thread; fail if it does not return within DEADLINE_S."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), (
        f"scoring did not return within {DEADLINE_S} s: the time limit was not enforced"
    )
    return result["value"]


def test_a_hanging_scorer_is_cut_off_and_the_rest_are_scored(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["12", "hang", "3", "45"], ["12", "1", "3", "45"])
    # 5 s: a replaced worker's first call also unpickles the scorer (imports) on a loaded machine; "hang"
    # sleeps 3600 s, so it is still cut off only by the limit
    with RewardManager(tokenizer, reward_config(num_workers=2, timeout_s=5.0, path=custom_file)) as manager:
        out = run_bounded(lambda: manager(batch))
        assert list(out.non_tensor_batch["score"]) == [1.0, 0.0, 1.0, 1.0]
        metrics = out.meta_info["reward_metrics"]
        assert metrics["reward/timeouts"] == 1 and metrics["reward/errors"] == 1
        # the killed worker was replaced: the pool keeps working
        again = run_bounded(lambda: manager(response_batch(tokenizer, ["7"], ["7"])))
        assert list(again.non_tensor_batch["score"]) == [1.0]


def test_a_worker_that_dies_fails_only_its_sample(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["die", "12", "die", "3"], ["1", "12", "1", "3"])
    with RewardManager(tokenizer, reward_config(num_workers=2, path=custom_file)) as manager:
        out = run_bounded(lambda: manager(batch))
    assert list(out.non_tensor_batch["score"]) == [0.0, 1.0, 0.0, 1.0]
    assert out.meta_info["reward_metrics"]["reward/errors"] == 2


def test_pool_returns_outcomes_in_call_order():
    calls = [
        (digits.compute_score, {"data_source": "synthetic/copy", "solution_str": str(i), "ground_truth": "5"})
        for i in range(10)
    ]
    with ScoringPool(num_workers=3, timeout_s=30) as pool:
        outcomes = run_bounded(lambda: pool.run(calls))
    assert [o.value["acc"] for o in outcomes] == [float(i == 5) for i in range(10)]
    assert all(o.ok and not o.timed_out for o in outcomes)


def test_pool_reports_errors_and_timeouts(custom_file):
    fn = load_custom_scorer(str(custom_file))
    calls = [
        (fn, {"data_source": "x", "solution_str": text, "ground_truth": "1"})
        for text in ("hang", "raise", "1")
    ]
    # 5 s: "raise" and "1" run in the replaced worker, whose first call unpickles the scorer (imports) on a
    # loaded machine; "hang" sleeps 3600 s, so it is still cut off only by the limit
    with ScoringPool(num_workers=1, timeout_s=5.0) as pool:
        hang, boom, ok = run_bounded(lambda: pool.run(calls))
        assert pool.workers_replaced == 1
    assert hang.timed_out and hang.error == "timed out after 5 s (reward.timeout_s)"
    assert boom.error == "RuntimeError: scorer exploded" and not boom.timed_out
    assert ok.ok and ok.value["score"] == 1.0


def test_pool_settings_are_checked():
    with pytest.raises(ValueError, match="num_workers >= 1"):
        ScoringPool(num_workers=0, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ScoringPool(num_workers=1, timeout_s=0)
