"""Disaggregated, one-step off-policy training on the real stack (CPU, embedded Ray): the Megatron actor at
TP=2 on two ranks, one HF-engine rollout server in its own process (servers/hf_server.py) synced over a gloo
update group and verified every step, the next step's rollouts generated while the actor updates."""
from __future__ import annotations

import pytest

from e2e_support import assert_finite, tiny_config, train_steps
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


def test_one_step_off_on_an_hf_rollout_server(tiny_assets, tmp_path):
    result = run(tiny_config(
        tiny_assets, tmp_path, "trainer.total_training_steps=3",
        "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1",
        "async_training.mode=one_step_off",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
    ))
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4  # the server serves exactly the synced weights
    assert [steps[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [steps[s]["async/weight_version_min"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    # one version behind: the behaviour log-probs differ from the proximal policy's, the IS weights say so
    assert steps[1]["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert steps[3]["rollout_corr/rollout_is_mean"] != pytest.approx(1.0, abs=1e-5)
    assert "servers" in result.rollout_engines


def test_fully_async_with_partial_rollouts_and_decoupled_ppo(tiny_assets, tmp_path):
    """The rollouter generates ahead (2 batches), each sync pauses the server mid-response (1-token chunks),
    decoupled PPO weights behaviour->proximal; staleness stays within the bound; every sync is verified once the
    server generates again (a probe inside the paused window would wait for the continue: a deadlock)."""
    result = run(tiny_config(
        tiny_assets, tmp_path, "trainer.total_training_steps=3",
        "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=1",
        "actor_rollout_ref.rollout.server_chunk_tokens=1", "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        "async_training.mode=fully_async", "async_training.max_staleness=2", "async_training.buffer_batches=2",
        "actor_rollout_ref.actor.policy_loss=decoupled_ppo", "actor_rollout_ref.actor.behav_imp_weight_cap=5.0",
    ))
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        assert record["async/staleness_max"] <= 2
        assert "actor/behav_imp_weight_mean" in record
        assert record["rollout/logprob_diff_max"] < 1e-4, record  # the server serves the trainer's weights
    assert steps[1]["async/staleness_max"] == 0.0
    # the first batch is generated before any update: its behaviour and proximal policies are the same weights
    assert steps[1]["actor/behav_kl"] == pytest.approx(0.0, abs=1e-4)
    assert max(steps[s]["async/staleness_max"] for s in (2, 3)) >= 1.0
