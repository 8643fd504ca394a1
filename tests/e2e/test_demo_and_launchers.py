"""The demo learns; torchrun mode reproduces the Ray run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rl.demo import REQUIRED_RISE, learning_summary, main as demo_main
from megatron_rl.distributed import free_port
from megatron_rl.train import run
from e2e_support import REPO, comparable, tiny_config, tiny_overrides, train_steps

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_demo_learns(tmp_path):
    assert demo_main(["--out", str(tmp_path), "trainer.test_freq=-1"]) == 0
    first, last = learning_summary(tmp_path / "run" / "metrics.jsonl")
    assert last - first >= REQUIRED_RISE


def test_torchrun_mode_matches_ray_mode(tiny_assets, tmp_path):
    ray_result = run(tiny_config(tiny_assets, tmp_path / "ray"))
    # through the launcher script users run (launch/torchrun.sh), on CPU: 2 processes, no GPUs
    env = {**os.environ, "GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2", "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", "launch/torchrun.sh", *tiny_overrides(tiny_assets, tmp_path / "torchrun")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ray_steps = train_steps(ray_result.metrics_path)
    torchrun_steps = train_steps(tmp_path / "torchrun" / "metrics.jsonl")
    assert sorted(torchrun_steps) == sorted(ray_steps) == [1, 2]
    for step in ray_steps:
        want, have = comparable(ray_steps[step]), comparable(torchrun_steps[step])
        assert want.keys() == have.keys()
        diffs = {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not diffs, f"step {step}: torchrun differs from Ray: {diffs}"
