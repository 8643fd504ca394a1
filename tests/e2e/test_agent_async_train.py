"""End to end: multi-turn, tool-using GRPO (the tool_multiply task, the agent loop with the calculator) under the
async trainers on one HF-engine rollout server in its own process: one-step-off, and fully async with partial
rollouts (1-token chunks, every sync pausing the server mid-turn). The agent loop runs on the driver over the
servers' client (agent/rollout.py MultiTurnClient). Every step: finite metrics, verl's num_turns/*, staleness within
the bound, and the server serving the trainer's weights (rollout/logprob_diff_max)."""
from __future__ import annotations

import pytest
from e2e_support import assert_finite, multi_turn_overrides, tool_multiply_assets, train_steps

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

MODES = {
    "one_step_off": ["async_training.mode=one_step_off", "algorithm.rollout_correction.rollout_is=token",
                     "algorithm.rollout_correction.rollout_is_threshold=2.0"],
    "fully_async": ["async_training.mode=fully_async", "async_training.max_staleness=2",
                    "async_training.buffer_batches=2", "actor_rollout_ref.rollout.server_chunk_tokens=1",
                    "actor_rollout_ref.actor.policy_loss=decoupled_ppo",
                    "actor_rollout_ref.actor.behav_imp_weight_cap=5.0"],
}


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    return tool_multiply_assets(tmp_path_factory.mktemp("agent_async_assets"), n_train=32)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_multi_turn_grpo_under_the_async_trainers(tool_assets, tmp_path, mode):
    cfg = load_config(overrides=multi_turn_overrides(
        tool_assets, tmp_path,
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.mode=server",
        "actor_rollout_ref.rollout.num_servers=1",
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        *MODES[mode],
        steps=3, response_length=64, micro_batch=8, n=2,
    ))
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        assert record["num_turns/max"] >= 4  # prompt + 2 model turns + the observation between them
        assert record["async/staleness_max"] <= 2
        assert record["rollout/logprob_diff_max"] < 1e-4, record  # the server serves the trainer's weights
    assert steps[1]["async/staleness_max"] == 0.0
    assert max(steps[s]["async/staleness_max"] for s in (2, 3)) >= 1.0
