"""End to end: GRPO for 3 steps on the tiny model with multi-turn, tool-using rollouts (the tool_multiply
task, calculator tool, agent loop in the hybrid workers under Ray, Megatron actor at TP=2). The random
model's turns end at stop tokens; turns without a tool call or a '####' answer are nudged, so samples span
several turns. Every step: finite metrics, verl's num_turns/* and tool_call_counts/*, the trainer's
log-probs equal to the engine's on every model token (training/rollout_probs_diff_max), verified sync."""
from __future__ import annotations

import pytest
from e2e_support import assert_finite, multi_turn_overrides, tool_multiply_assets, train_steps

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    return tool_multiply_assets(tmp_path_factory.mktemp("tool_assets"), n_train=64)


def test_grpo_three_steps_on_multi_turn_tool_rollouts(tool_assets, tmp_path):
    cfg = load_config(overrides=multi_turn_overrides(
        tool_assets, tmp_path,
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        steps=3, response_length=96, micro_batch=16, n=4,
    ))
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        for key in ("num_turns/mean", "num_turns/max", "num_turns/min", "tool_call_counts/mean",
                    "tool_call_counts/max", "tool_call_counts/min", "critic/score/mean", "actor/pg_loss"):
            assert key in record, key
        assert record["num_turns/max"] >= 5  # prompt + >= 2 model turns + an observation between them
        assert record["num_turns/mean"] > 3
        # Megatron's log-probs of the multi-turn samples = the engine's, on every model token
        assert record["training/rollout_probs_diff_max"] < 1e-5  # measured ~5e-9
        assert record["rollout/logprob_diff_max"] < 1e-4
