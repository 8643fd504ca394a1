"""End to end: GRPO for 3 steps on the tiny model with multi-turn, tool-using rollouts (the tool_multiply
task, calculator tool, agent loop in the hybrid workers under Ray, Megatron actor at TP=2). The random
model's turns end at stop tokens; turns without a tool call or a '####' answer are nudged, so samples span
several turns. Every step: finite metrics, verl's num_turns/* and tool_call_counts/*, the trainer's
log-probs equal to the engine's on every model token (training/rollout_probs_diff_max), verified sync."""
from __future__ import annotations

import pytest
from e2e_support import TWO_RANKS, assert_finite, train_steps

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("shared_ray")]


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("tool_assets"), task="tool_multiply", n_train=64,
                                       n_val=8, tokenizer_kwargs={"vocab_size": 200}, max_positions=512)
    return {"train": train, "val": val, "model": model}


def test_grpo_three_steps_on_multi_turn_tool_rollouts(tool_assets, tmp_path):
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
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
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
        for key in ("num_turns/mean", "num_turns/max", "num_turns/min", "tool_call_counts/mean",
                    "tool_call_counts/max", "tool_call_counts/min", "critic/score/mean", "actor/pg_loss"):
            assert key in record, key
        assert record["num_turns/max"] >= 5  # prompt + >= 2 model turns + an observation between them
        assert record["num_turns/mean"] > 3
        # Megatron's log-probs of the multi-turn samples = the engine's, on every model token
        assert record["training/rollout_probs_diff_max"] < 1e-5  # measured ~5e-9
        assert record["rollout/logprob_diff_max"] < 1e-4
