"""What only the launching environment can tell is refused before Ray or any worker starts (issue 14):
a distributed optimizer asked for where Transformer Engine / Apex do not import."""
from __future__ import annotations

import pytest

from e2e_support import run_module, tiny_overrides
from megatron_rl.models.capabilities import distributed_optimizer_blocker

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(distributed_optimizer_blocker() is None, reason="TE or Apex is installed here")
def test_unavailable_distributed_optimizer_is_refused_before_ray_starts(tiny_assets, tmp_path):
    overrides = tiny_overrides(tiny_assets, tmp_path, "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true")
    proc = run_module(["megatron_rl.train", *overrides], timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true needs Transformer Engine" in proc.stderr
    assert "without it the plan is" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_offload_run_matches_the_plain_run(tiny_assets, tmp_path):
    """megatron.param_offload + optimizer_offload through the hybrid worker (state away for generation and
    before the engine starts, back for log-probs, export and update): the same metrics as without."""
    from e2e_support import comparable, tiny_config, train_steps

    from megatron_rl.train import run

    flags = ["actor_rollout_ref.actor.megatron.param_offload=true",
             "actor_rollout_ref.actor.megatron.optimizer_offload=true",
             "actor_rollout_ref.ref.megatron.param_offload=true", "actor_rollout_ref.actor.use_kl_loss=true"]
    plain = train_steps(run(tiny_config(tiny_assets, tmp_path / "plain", flags[-1])).metrics_path)
    moved = train_steps(run(tiny_config(tiny_assets, tmp_path / "offload", *flags)).metrics_path)
    assert sorted(moved) == sorted(plain)
    for step in plain:
        a, b = comparable(plain[step]), comparable(moved[step])
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (step, key)
