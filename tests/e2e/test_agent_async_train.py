"""End to end: multi-turn, tool-using GRPO (the tool_multiply task, the agent loop with the calculator) under the
async trainers on one HF-engine rollout server in its own process: one-step-off, and fully async with partial
rollouts (1-token chunks, every sync pausing the server mid-turn). The agent loop runs on the driver over the
servers' client (agent/rollout.py MultiTurnClient). Every step: finite metrics, verl's num_turns/*, staleness within
the bound, and the server serving the trainer's weights (rollout/logprob_diff_max)."""
from __future__ import annotations

import pytest
from e2e_support import TWO_RANKS, assert_finite, train_steps

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
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("agent_async_assets"), task="tool_multiply",
                                       n_train=32, n_val=8, tokenizer_kwargs={"vocab_size": 200}, max_positions=512)
    return {"train": train, "val": val, "model": model}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_multi_turn_grpo_under_the_async_trainers(tool_assets, tmp_path, mode):
    stops = list(range(40, 52))  # 12 of 200 tokens: random weights end a turn after ~15 tokens
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu",
        *TWO_RANKS,
        f"data.train_files=[{tool_assets['train']}]",
        f"data.val_files=[{tool_assets['val']}]",
        f"actor_rollout_ref.model.path={tool_assets['model']}",
        f"trainer.default_local_dir={tmp_path}",
        "data.max_prompt_length=192",
        "data.max_response_length=64",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.rollout.stop_token_ids={stops}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.mode=server",
        "actor_rollout_ref.rollout.num_servers=1",
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        *MODES[mode],
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
    ])
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
