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


def test_offload_run_matches_the_plain_run(tiny_assets, tmp_path, shared_ray):
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


def test_refusals_that_came_after_start_up_come_before_it_with_exit_code_2(tiny_assets, tmp_path):
    """Issue 33 items 7 and 9, through the real entry point: CP > 1 on padded micro-batches (accepted by
    --dry-run and the real start before, refused by the model build after Ray started; issue 35 builds CP on
    packed sequences only) and an architecture the builders do not know (refused by
    --dry-run, but a real start failed in init_model) are refused by both before anything starts, rc 2."""
    import json
    import shutil

    other = tmp_path / "other_model"
    shutil.copytree(tiny_assets["model"], other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    cases = [
        ("actor_rollout_ref.actor.megatron.context_parallel_size=2 actor_rollout_ref.ref.megatron.context_parallel_size=2 "
         "trainer.n_gpus_per_node=4",
         "actor_rollout_ref.actor.megatron.context_parallel_size=2 needs actor_rollout_ref.actor.megatron.packed_sequences=true"),
        (f"actor_rollout_ref.model.path={other}", "FancyNewForCausalLM"),
    ]
    for override, message in cases:
        for dry_run in (["--dry-run"], []):
            out = tmp_path / f"run{len(dry_run)}"
            proc = run_module(["megatron_rl.train", *dry_run, *tiny_overrides(tiny_assets, out, *override.split())],
                              timeout=300)
            assert proc.returncode == 2, (override, dry_run, proc.stderr[-3000:])
            assert message in proc.stderr, (override, dry_run, proc.stderr[-3000:])
            assert "Started a local Ray instance" not in proc.stdout + proc.stderr
