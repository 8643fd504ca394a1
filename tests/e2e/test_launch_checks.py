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
