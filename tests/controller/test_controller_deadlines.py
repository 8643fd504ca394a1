"""Deadlines per call kind (issue 14 item 7): init/load, generate, update and save each have a config key,
and a call past its deadline names that key, not the catch-all ray_init.timeout_s."""
from __future__ import annotations

import pytest

from controller_workers import FaultyWorker
from megatron_rl.config import load_config
from megatron_rl.controller import RayResourcePool, RayWorkerGroup, WorkerTimeoutError
from megatron_rl.controller.deadlines import call_deadlines


def test_each_call_kind_has_its_key_and_null_falls_back_to_timeout_s():
    cfg = load_config(overrides=["ray_init.timeout_s=100", "ray_init.generate_timeout_s=250",
                                 "ray_init.update_timeout_s=null"])
    deadlines = call_deadlines(cfg.ray_init)
    assert deadlines["init_model"] == deadlines["load_checkpoint"] == (3600.0, "ray_init.init_timeout_s")
    assert deadlines["generate_sequences"] == (250.0, "ray_init.generate_timeout_s")
    assert deadlines["update_actor"] == deadlines["update_critic"] == (100.0, "ray_init.timeout_s")
    assert deadlines["save_checkpoint"] == deadlines["save_hf"] == (1800.0, "ray_init.save_timeout_s")
    assert "compute_log_prob" not in deadlines  # the group's timeout_s
    with pytest.raises(ValueError, match="ray_init.save_timeout_s must be > 0"):
        call_deadlines(load_config(overrides=["ray_init.save_timeout_s=0"]).ray_init)


@pytest.mark.distributed
def test_a_call_past_its_own_deadline_names_its_key(ray_cluster):
    wg = RayWorkerGroup(RayResourcePool([1], cpus_per_process=0.5), FaultyWorker, name_prefix="actor",
                        timeout_s=120, method_timeouts={"hang": (2.0, "ray_init.generate_timeout_s")})
    try:
        with pytest.raises(WorkerTimeoutError, match=r"actor.hang\(\): ranks \[0\] gave no result within 2 s "
                                                     r".*raise ray_init.generate_timeout_s"):
            wg.hang()
        assert wg.group.deadline("ping") == (120, "ray_init.timeout_s")
    finally:
        wg.kill()
        wg.resource_pool.release()
