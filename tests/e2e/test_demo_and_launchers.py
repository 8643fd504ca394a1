"""The demo learns; torchrun mode reproduces the Ray run."""
from __future__ import annotations

import pytest

from megatron_rl.demo import REQUIRED_RISE, learning_summary, main as demo_main
from megatron_rl.distributed import free_port
from megatron_rl.train import run
from e2e_support import comparable, run_module, tiny_config, tiny_overrides, train_steps

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_demo_learns(tmp_path):
    assert demo_main(["--out", str(tmp_path), "trainer.test_freq=-1"]) == 0
    first, last = learning_summary(tmp_path / "run" / "metrics.jsonl")
    assert last - first >= REQUIRED_RISE


def test_torchrun_mode_matches_ray_mode(tiny_assets, tmp_path):
    ray_result = run(tiny_config(tiny_assets, tmp_path / "ray"))
    proc = run_module(
        ["torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", f"--master-port={free_port()}",
         "-m", "megatron_rl.train", *tiny_overrides(tiny_assets, tmp_path / "torchrun", "trainer.launcher=torchrun")],
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ray_steps = train_steps(ray_result.metrics_path)
    torchrun_steps = train_steps(tmp_path / "torchrun" / "metrics.jsonl")
    assert sorted(torchrun_steps) == sorted(ray_steps) == [1, 2]
    for step in ray_steps:
        want, have = comparable(ray_steps[step]), comparable(torchrun_steps[step])
        assert want.keys() == have.keys()
        diffs = {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not diffs, f"step {step}: torchrun differs from Ray: {diffs}"
