"""GRPO under Ray with the actor at CP=2 (TP=1) against the same run at TP=2: two ranks, packed sequences,
the same colocated HF rollout engines (rollout TP=1 on each rank), the same seed. CP only changes how the
actor splits each sequence, so the first step's metrics are the TP=2 run's and the engine keeps serving
the trainer's weights (rollout_probs_diff at the TP=2 run's level)."""
from __future__ import annotations

import pytest

from e2e_support import assert_finite, comparable, tiny_config, train_steps
from megatron_rl.train import run

pytestmark = pytest.mark.distributed

COMMON = ("actor_rollout_ref.actor.megatron.packed_sequences=true",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
CP2 = ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
       "actor_rollout_ref.actor.megatron.context_parallel_size=2")


def test_grpo_at_cp2_equals_tp2(tiny_assets, tmp_path, capfd):
    tp2 = train_steps(run(tiny_config(tiny_assets, tmp_path / "tp2", *COMMON)).metrics_path)
    capfd.readouterr()
    cp2 = train_steps(run(tiny_config(tiny_assets, tmp_path / "cp2", *COMMON, *CP2)).metrics_path)
    # one data-parallel rank: both ranks hold the same rows, each its half of every sequence (the workers
    # refuse to start when Megatron's parallel state is not the config's CP)
    assert "actor: TP*PP*CP=2, DP=1" in capfd.readouterr().out
    assert sorted(cp2) == sorted(tp2) == [1, 2]
    for record in cp2.values():
        assert_finite(record)
    want, have = comparable(tp2[1]), comparable(cp2[1])
    assert want.keys() == have.keys()
    diffs = {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > 1e-4 * max(1.0, abs(want[k]))}
    assert not diffs, f"CP=2's first step differs from TP=2's: {diffs}"
    for step in (1, 2):  # the engine serves exactly the trainer's weights after every sync
        for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean"):
            assert cp2[step][key] <= 2 * tp2[step][key] + 1e-6, (step, key, cp2[step][key], tp2[step][key])
        assert cp2[step]["rollout/logprob_diff_max"] < 1e-4
