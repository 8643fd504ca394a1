"""End to end: GRPO for 2 steps where the rollouts are made by an agent program written with the ``openai`` client
(examples/agents/openai_tool_agent.py) talking to the run's engine through the agent proxy: the tool_multiply task,
hybrid workers under Ray, Megatron actor at TP=2. The random model's turns end at stop tokens; the program nudges
it with a user message when it neither calls the tool nor answers, so samples span several turns. Every step:
finite metrics, verl's num_turns/*, the trainer's log-probs equal to the engine's on every model token of the
programs' samples (training/rollout_probs_diff_max)."""
from __future__ import annotations

from pathlib import Path

import pytest
from e2e_support import TWO_RANKS, assert_finite, train_steps

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]

PROGRAM = Path(__file__).resolve().parents[2] / "examples" / "agents" / "openai_tool_agent.py"


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("agent_program_assets"), task="tool_multiply",
                                       n_train=32, n_val=8, tokenizer_kwargs={"vocab_size": 200}, max_positions=512)
    return {"train": train, "val": val, "model": model}


def test_grpo_two_steps_on_an_openai_client_agent(tool_assets, tmp_path):
    stops = list(range(40, 52))  # 12 of 200 tokens: random weights end a turn after ~15 tokens
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu",
        *TWO_RANKS,
        f"data.train_files=[{tool_assets['train']}]",
        f"data.val_files=[{tool_assets['val']}]",
        f"actor_rollout_ref.model.path={tool_assets['model']}",
        f"trainer.default_local_dir={tmp_path}",
        "data.max_prompt_length=192",
        "data.max_response_length=96",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.stop_token_ids={stops}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.agent_program={PROGRAM}:run",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
    ])
    result = run(cfg)
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        for key in ("num_turns/mean", "num_turns/max", "critic/score/mean", "actor/pg_loss"):
            assert key in record, key
        assert record["num_turns/max"] >= 4  # prompt + 2 model turns + the nudge between them
        assert record["training/rollout_probs_diff_max"] < 1e-5
