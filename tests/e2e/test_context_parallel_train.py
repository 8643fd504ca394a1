"""GRPO with the actor at CP=2 (TP=1) against the same run at TP=2: two ranks, packed sequences, the same
colocated HF rollout engines (rollout TP=1 on each rank), the same seed. CP only changes how the actor splits
each sequence, so the first step's metrics are the TP=2 run's and the engine keeps serving the trainer's
weights (rollout_probs_diff at the TP=2 run's level). Under Ray, and under torchrun (launch/torchrun.sh)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from e2e_support import REPO, assert_finite, comparable, tiny_config, tiny_overrides, train_steps
from megatron_rl.distributed import free_port
from megatron_rl.train import run

pytestmark = pytest.mark.distributed

COMMON = ("actor_rollout_ref.actor.megatron.packed_sequences=true",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
CP2 = ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
       "actor_rollout_ref.actor.megatron.context_parallel_size=2")


def _differences(want: dict, have: dict, rel: float) -> dict:
    want, have = comparable(want), comparable(have)
    assert want.keys() == have.keys()
    return {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > rel * max(1.0, abs(want[k]))}


@pytest.fixture(scope="module")
def cp2_ray(tiny_assets, tmp_path_factory, _shared_ray_manager):
    _shared_ray_manager.start()  # the module's first run; test_grpo_at_cp2_equals_tp2 keeps using that Ray
    out = tmp_path_factory.mktemp("cp2_ray")
    return train_steps(run(tiny_config(tiny_assets, out, *COMMON, *CP2)).metrics_path)


def test_grpo_at_cp2_equals_tp2(tiny_assets, tmp_path, shared_ray, cp2_ray, capfd):
    tp2 = train_steps(run(tiny_config(tiny_assets, tmp_path / "tp2", *COMMON)).metrics_path)
    capfd.readouterr()
    # the plan the driver prints: one data-parallel rank, both ranks holding the same rows, each its half of
    # every sequence (the workers refuse to start when Megatron's parallel state is not the config's CP)
    run(tiny_config(tiny_assets, tmp_path / "cp2", *COMMON, *CP2, "trainer.total_training_steps=1"))
    assert "actor: TP*PP*CP=2, DP=1" in capfd.readouterr().out
    assert sorted(cp2_ray) == sorted(tp2) == [1, 2]
    for record in cp2_ray.values():
        assert_finite(record)
    diffs = _differences(tp2[1], cp2_ray[1], 1e-4)
    assert not diffs, f"CP=2's first step differs from TP=2's: {diffs}"
    for step in (1, 2):  # the engine serves exactly the trainer's weights after every sync
        for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean"):
            assert cp2_ray[step][key] <= 2 * tp2[step][key] + 1e-6, (step, key, cp2_ray[step][key], tp2[step][key])
        assert cp2_ray[step]["rollout/logprob_diff_max"] < 1e-4


def test_torchrun_at_cp2_reproduces_ray(tiny_assets, tmp_path, cp2_ray):
    env = {**os.environ, "GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2", "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", "launch/torchrun.sh", *tiny_overrides(tiny_assets, tmp_path, *COMMON, *CP2)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    torchrun = train_steps(tmp_path / "metrics.jsonl")
    assert sorted(torchrun) == [1, 2]
    for step in (1, 2):
        diffs = _differences(cp2_ray[step], torchrun[step], 1e-5)
        assert not diffs, f"step {step}: torchrun at CP=2 differs from Ray: {diffs}"
