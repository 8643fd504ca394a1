import logging

import numpy as np
import pytest
import torch
from reward_batches import response_batch, reward_config

from megatron_rl.protocol import DataProto
from megatron_rl.reward import RewardManager, place_scores, register_scorer


def test_scores_land_on_the_last_valid_token_of_ragged_responses():
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0],  # zero-length response
            [1, 1, 0, 1, 0],
        ]
    )  # multi-turn: a masked tool observation in the middle
    scores = torch.tensor([0.5, -1.0, 2.0, 0.25, 3.0])
    placed = place_scores(scores, mask)
    expected = torch.zeros(5, 5)
    expected[0, 2], expected[1, 0], expected[2, 4], expected[3, 0], expected[4, 3] = 0.5, -1.0, 2.0, 0.25, 3.0
    assert placed.dtype == torch.float32 and torch.equal(placed, expected)
    assert torch.equal(placed.sum(-1), scores)  # every score survives, the empty row's included


def test_place_scores_checks_shapes():
    with pytest.raises(ValueError, match=r"scores \(3,\) must be \[B\] for response_mask \(2, 4\)"):
        place_scores(torch.zeros(3), torch.ones(2, 4))
    assert place_scores(torch.ones(2), torch.ones(2, 0)).shape == (2, 0)


def test_manager_scores_decodes_and_places(tokenizer):
    batch = response_batch(tokenizer, ["38145", "3814", "", "999"], ["38145", "38145", "12", "999"])
    with RewardManager(tokenizer, reward_config()) as manager:
        assert manager.decode(batch.batch["responses"], batch.batch["response_mask"]) == [
            "38145",
            "3814",
            "",
            "999",
        ]
        out = manager(batch)
    scores = out.batch["token_level_scores"]
    assert scores.shape == (4, 8) and scores.dtype == torch.float32
    assert scores[0, 5] == 1.0 and scores[1, 4] == pytest.approx(0.8) and scores[3, 3] == 1.0
    assert scores[2].sum() == 0.0  # the empty answer scores 0 on its eos token
    assert torch.count_nonzero(scores) == 3
    assert list(out.non_tensor_batch["score"]) == pytest.approx([1.0, 0.8, 0.0, 1.0])
    assert list(out.non_tensor_batch["acc"]) == [1.0, 0.0, 0.0, 1.0]
    metrics = out.meta_info["reward_metrics"]
    assert metrics["reward/score/mean"] == pytest.approx(0.7) and metrics["reward/acc/mean"] == 0.5
    assert metrics["reward/errors"] == 0 and metrics["reward/empty_responses"] == 0
    assert len(batch.union(out)) == 4  # unions into the batch, as the trainer does


def test_zero_length_response_is_scored_and_counted(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["12", "12"], ["12", ""])
    batch.batch["response_mask"][1] = 0
    out = RewardManager(tokenizer, reward_config(path=custom_file))(batch)
    assert out.meta_info["reward_metrics"]["reward/empty_responses"] == 1
    assert out.non_tensor_batch["score"][1] == 1.0  # scored as the empty string (which is right here)
    assert (
        out.batch["token_level_scores"][1].tolist() == [1.0] + [0.0] * 7
    )  # on a masked slot: no loss sees it


def test_failing_scorers_score_zero_and_are_counted(tokenizer, custom_file, caplog):
    batch = response_batch(tokenizer, ["12", "raise", "text", "3"], ["12", "1", "1", "3"])
    manager = RewardManager(tokenizer, reward_config(path=custom_file))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.reward.manager"):
        out = manager(batch)
    assert list(out.non_tensor_batch["score"]) == [1.0, 0.0, 0.0, 1.0]
    assert out.meta_info["reward_metrics"]["reward/errors"] == 2
    assert "2 of 4 samples scored 0" in caplog.text
    assert "first: sample 1 (data_source 'synthetic/copy'): RuntimeError: scorer exploded" in caplog.text
    # a NaN score is not a failed sample but a scorer bug: it stops the step (tests/trainer/test_input_integrity.py)
    # extras: what the scorer returned where it returned them, None elsewhere
    assert list(out.non_tensor_batch["length"]) == [2, None, None, 1]
    assert out.meta_info["reward_metrics"]["reward/length/mean"] == 1.5


def test_custom_batch_scorer_gets_whole_lists(tokenizer, custom_file):
    batch = response_batch(tokenizer, ["12", "13", "3"], ["12", "12", "3"])
    out = RewardManager(tokenizer, reward_config(path=custom_file, name="batch_score", manager="batch"))(
        batch
    )
    assert list(out.non_tensor_batch["score"]) == [0.5, 0.0, 0.5]
    bad = RewardManager(tokenizer, reward_config(path=custom_file, name="wrong_length", manager="batch"))(
        batch
    )
    assert bad.meta_info["reward_metrics"]["reward/errors"] == 3


def test_missing_ground_truth_is_a_counted_error(tokenizer):
    batch = response_batch(tokenizer, ["12", "12"], ["12", "12"])
    batch.non_tensor_batch["reward_model"][1] = {"style": "rule"}
    out = RewardManager(tokenizer, reward_config())(batch)
    assert list(out.non_tensor_batch["score"]) == [1.0, 0.0]
    assert out.meta_info["reward_metrics"]["reward/errors"] == 1


def test_unknown_data_source_fails_before_scoring(tokenizer):
    batch = response_batch(tokenizer, ["1"], ["1"], data_source="my/new_set")
    with pytest.raises(ValueError, match="no scorer registered for data_source 'my/new_set'"):
        RewardManager(tokenizer, reward_config())(batch)


def test_missing_fields_and_bad_shapes_are_named(tokenizer):
    manager = RewardManager(tokenizer, reward_config())
    with pytest.raises(ValueError, match=r"missing \['response_mask'\] for RewardManager"):
        manager(
            DataProto.from_dict(
                {"responses": torch.zeros(1, 2, dtype=torch.long)},
                {"data_source": ["x"], "reward_model": [{}]},
            )
        )
    batch = response_batch(tokenizer, ["1"], ["1"])
    batch.batch["response_mask"] = batch.batch["response_mask"][:, :4]
    with pytest.raises(
        ValueError, match=r"responses \(1, 8\) and response_mask \(1, 4\) must both be \[B, R\]"
    ):
        manager(batch)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"manager": "gdpo"}, ValueError, "reward.reward_manager='gdpo' is unknown"),
        ({"manager": "batch"}, ValueError, "reward_manager=batch needs reward.custom_reward_function.path"),
        ({"num_workers": -1}, ValueError, "reward.num_workers must be an integer >= 0"),
        ({"timeout_s": 0}, ValueError, "reward.timeout_s must be > 0"),
        (
            {"path": "/nonexistent/reward.py"},
            FileNotFoundError,
            "custom_reward_function.path='/nonexistent/reward.py'",
        ),
    ],
)
def test_bad_config_names_the_key(tokenizer, kwargs, error, message):
    with pytest.raises(error, match=message):
        RewardManager(tokenizer, reward_config(**kwargs))


def test_custom_function_name_must_exist(tokenizer, custom_file):
    with pytest.raises(
        AttributeError,
        match=r"name='score_it' is not a function .* defines: \['batch_score', "
        r"'compute_score', 'wrong_length'\]",
    ):
        RewardManager(tokenizer, reward_config(path=custom_file, name="score_it"))


def test_scorer_defined_in_main_is_refused_for_worker_processes(tokenizer):
    def scorer(data_source, solution_str, ground_truth, extra_info):
        return 1.0

    scorer.__module__, scorer.__qualname__ = "__main__", "scorer"
    register_scorer("test/main_defined")(scorer)
    batch = response_batch(tokenizer, ["1"], ["1"], data_source="test/main_defined")
    with RewardManager(tokenizer, reward_config(num_workers=1)) as manager:
        with pytest.raises(ValueError, match="defined in __main__.*reward.num_workers=0"):
            manager(batch)
    inline = RewardManager(tokenizer, reward_config(num_workers=0))(batch)  # in-process it is fine
    assert np.array_equal(inline.non_tensor_batch["score"], [1.0])


def test_registered_batched_scorer_is_called_once_per_batch(tokenizer):
    calls = []

    def lengths(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(list(solution_strs))
        return [{"score": len(s) / 10, "chars": len(s)} for s in solution_strs]

    register_scorer("test/batched", batched=True)(lengths)
    batch = response_batch(tokenizer, ["1", "123", "12345"], ["", "", ""], data_source="test/batched")
    out = RewardManager(tokenizer, reward_config())(batch)
    assert calls == [["1", "123", "12345"]]
    assert list(out.non_tensor_batch["score"]) == pytest.approx([0.1, 0.3, 0.5])
    assert list(out.non_tensor_batch["chars"]) == [1, 3, 5]


def test_inline_scoring_stops_a_hung_scorer_at_reward_timeout_s(tokenizer, custom_file):
    """reward.num_workers=0 (the tiny preset's inline scoring) with a scorer that hangs: a clear error naming the
    row, data source, time limit and the key to change, within reward.timeout_s, not a silent stall (issue 56)."""
    import threading

    batch = response_batch(tokenizer, ["12", "hang"], ["12", "12"])
    manager = RewardManager(tokenizer, reward_config(path=custom_file, num_workers=0, timeout_s=0.5))
    raised: list[BaseException] = []

    def score() -> None:
        try:
            manager(batch)
        except BaseException as err:  # noqa: BLE001 - handed to the assertions below
            raised.append(err)

    caller = threading.Thread(target=score, daemon=True)  # daemon: a hang here must not hold the test run
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "inline scoring of a hung scorer did not return within 60 s"
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    message = str(raised[0])
    for part in ("row 1", "'synthetic/copy'", "reward.timeout_s=0.5", "reward.num_workers", "compute_score"):
        assert part in message, (part, message)


def test_an_agent_programs_reward_replaces_the_scorers(tokenizer):
    """agent/program.py: a program that returns a number gives its sample that score (None: the scorer's)."""
    batch = response_batch(tokenizer, ["12", "12", "7"], ["12", "12", "12"])
    batch.non_tensor_batch["agent_reward"] = np.array([None, 0.25, 1.0], dtype=object)
    batch.non_tensor_batch["reward_model"][2] = {"style": "rule"}  # a program's reward needs no ground truth
    out = RewardManager(tokenizer, reward_config())(batch)
    assert list(out.non_tensor_batch["score"]) == [1.0, 0.25, 1.0]
    assert out.meta_info["reward_metrics"]["reward/errors"] == 0
    assert out.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.25, 1.0]
