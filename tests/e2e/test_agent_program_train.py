"""End to end: GRPO for 2 steps where the rollouts are made by an agent program written with the ``openai`` client
(examples/agents/openai_tool_agent.py) talking to the run's engine through the agent proxy: the tool_multiply task,
hybrid workers under Ray, Megatron actor at TP=2. The random model's turns end at stop tokens; the program nudges
it with a user message when it neither calls the tool nor answers, so samples span several turns. Every step:
finite metrics, verl's num_turns/*, the trainer's log-probs equal to the engine's on every model token of the
programs' samples (training/rollout_probs_diff_max)."""
from __future__ import annotations

from pathlib import Path

import pytest
from e2e_support import assert_finite, multi_turn_overrides, tool_multiply_assets, train_steps

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]

PROGRAM = Path(__file__).resolve().parents[2] / "examples" / "agents" / "openai_tool_agent.py"


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    return tool_multiply_assets(tmp_path_factory.mktemp("agent_program_assets"), n_train=32)


def test_grpo_two_steps_on_an_openai_client_agent(tool_assets, tmp_path):
    cfg = load_config(overrides=multi_turn_overrides(
        tool_assets, tmp_path,
        f"actor_rollout_ref.rollout.multi_turn.agent_program={PROGRAM}:run",
        steps=2, response_length=96, micro_batch=16, n=4,
    ))
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        for key in ("num_turns/mean", "num_turns/max", "critic/score/mean", "actor/pg_loss"):
            assert key in record, key
        assert record["num_turns/max"] >= 4  # prompt + 2 model turns + the nudge between them
        assert record["training/rollout_probs_diff_max"] < 1e-5
