"""verl's rollout-correction bypass mode on the real path: with the rollout engine serving the actor's weights
of the same step (exactly on-policy), using its log-probs as the old log-probs trains the same model as
recomputing them with the actor, and skips that pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.distributed import free_port
from e2e_support import REPO

pytestmark = pytest.mark.distributed
# What the update reads, per step: identical up to the engine-vs-trainer log-prob difference (~1e-6 here).
UPDATE_METRICS = ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "critic/score/mean")


def test_bypass_mode_trains_the_same_model_without_the_old_log_prob_pass(tiny_assets, tmp_path):
    # one process (the torchrun launcher's in-process workers on one rank) runs both trainings
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = Path(__file__).with_name("bypass_job.py")
    proc = subprocess.run([sys.executable, str(job), str(tmp_path), str(tiny_assets["train"]),
                           str(tiny_assets["model"])], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    recomputed, bypass = results["recomputed"], results["bypass"]

    assert [r["step"] for r in bypass["steps"]] == [r["step"] for r in recomputed["steps"]] == [1, 2]
    for want, have in zip(recomputed["steps"], bypass["steps"]):
        assert "timing_s/old_log_prob" in want and "timing_s/old_log_prob" not in have  # the pass is skipped
        # the engine's log-probs were the actor's: the recomputed path saw (almost) no difference
        assert want["training/rollout_probs_diff_max"] < 1e-4
        for key in UPDATE_METRICS:
            assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["step"], key)
    assert bypass["weights"].keys() == recomputed["weights"].keys()
    for name, values in recomputed["weights"].items():
        torch.testing.assert_close(torch.tensor(bypass["weights"][name]), torch.tensor(values),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
