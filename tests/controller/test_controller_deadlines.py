"""Deadlines per call kind (issue 14 item 7): init/load, generate, update and save each have a config key,
and a call past its deadline names that key, not the catch-all ray_init.timeout_s."""
from __future__ import annotations

import pytest

from controller_workers import FaultyWorker
from megatron_rl.config import load_config
from megatron_rl.controller import RayResourcePool, RayWorkerGroup, WorkerTimeoutError
from megatron_rl.controller.deadlines import NO_DEADLINE_S, call_deadlines


def test_each_call_kind_has_its_key_and_null_falls_back_to_timeout_s():
    cfg = load_config(overrides=["ray_init.timeout_s=100", "ray_init.generate_timeout_s=250",
                                 "ray_init.update_timeout_s=null"])
    deadlines = call_deadlines(cfg)
    assert deadlines["init_model"] == deadlines["load_checkpoint"] == (3600.0, "ray_init.init_timeout_s")
    assert deadlines["generate_sequences"] == (250.0, "ray_init.generate_timeout_s")
    # null with nothing to derive from (no model here): no deadline in practice, the key still named (issue 32)
    seconds, key = deadlines["update_actor"]
    assert deadlines["update_critic"] == (seconds, key) and seconds == NO_DEADLINE_S
    assert key.startswith("ray_init.update_timeout_s (null: ")
    assert deadlines["save_checkpoint"] == deadlines["save_hf"] == (1800.0, "ray_init.save_timeout_s")
    assert deadlines["compute_log_prob"] == (100.0, "ray_init.timeout_s")  # nothing derived: timeout_s
    with pytest.raises(ValueError, match="ray_init.save_timeout_s must be > 0"):
        call_deadlines(load_config(overrides=["ray_init.save_timeout_s=0"]))


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


# ---------------------------------------------------------------------------- issue 32, item 9
def test_the_presets_deadlines_fit_their_work():
    """600 s bounded generate / log-prob / update / sync of every preset: long-CoT rollouts and a 70B step
    failed. Null keys now take bounds derived from the response length, the batch and the model's size."""
    cfg = load_config(overrides=["+experiment=grpo_70b"])
    deadlines = call_deadlines(cfg)
    # a 70B step: 2048 x 3072 tokens on 64 GPUs; even at 5% of an H100's bf16 peak (50 TFLOP/s) the update's
    # 6 x 70.6e9 x 2048 x 3072 FLOPs take 832 s, a forward 277 s, the sync of 141 GB at 1 GB/s 141 s
    flops = 2 * 70.55e9 * 2048 * 3072
    assert deadlines["update_actor"][0] >= 3 * flops / (64 * 50e12) + 600
    assert deadlines["compute_log_prob"][0] >= flops / (64 * 50e12) + 600
    assert deadlines["compute_ref_log_prob"] == deadlines["compute_log_prob"]
    assert deadlines["sync_weights"][0] >= 600 + 141
    # each names the key that raises it, and how its default was derived
    assert deadlines["update_actor"][1].startswith("ray_init.update_timeout_s (null: 600 s + 1 epoch(s)")
    assert "70.6 B active params" in deadlines["update_actor"][1]
    assert deadlines["compute_log_prob"][1].startswith("ray_init.timeout_s (at least 600 s + a forward")

    # long CoT: 32k response tokens at a slow 0.1 s per decode step of the batch
    long_cot = call_deadlines(load_config(overrides=["+experiment=grpo_70b", "data.max_response_length=32768"]))
    assert long_cot["generate_sequences"][0] >= 32768 * 0.1
    assert "32768 response tokens" in long_cot["generate_sequences"][1]
    for preset in ("grpo_7b", "grpo_32b", "grpo_qwen3_30b_a3b"):
        small = call_deadlines(load_config(overrides=[f"+experiment={preset}"]))
        response = load_config(overrides=[f"+experiment={preset}"]).data.max_response_length
        assert small["generate_sequences"][0] >= 600 + response * 0.1, preset
        assert small["update_actor"][0] > 600 and small["compute_log_prob"][0] > 600, preset


def test_a_set_key_wins_and_a_larger_timeout_s_raises_the_derived_floor():
    cfg = load_config(overrides=["+experiment=grpo_70b", "ray_init.generate_timeout_s=90",
                                 "ray_init.update_timeout_s=120", "ray_init.timeout_s=86400"])
    deadlines = call_deadlines(cfg)
    assert deadlines["generate_sequences"] == (90.0, "ray_init.generate_timeout_s")
    assert deadlines["update_actor"] == (120.0, "ray_init.update_timeout_s")
    assert deadlines["compute_log_prob"] == deadlines["sync_weights"] == (86400.0, "ray_init.timeout_s")


def test_server_requests_wait_by_default_and_a_set_deadline_names_its_key():
    import socket
    import threading

    from megatron_rl.rollout.sglang.server_transport import ServerHTTP
    from megatron_rl.rollout.sglang import SGLangServerError

    assert load_config(overrides=["+experiment=grpo_70b"]).actor_rollout_ref.rollout.sglang.request_timeout_s is None
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()  # accepts, never answers
    try:
        with pytest.raises(SGLangServerError, match=r"gave no answer within 0.5 s: raise "
                                                    r"actor_rollout_ref.rollout.sglang.request_timeout_s"):
            ServerHTTP(f"http://127.0.0.1:{listener.getsockname()[1]}", 0.5).request("/server_info", method="GET")
    finally:
        listener.close()
        for conn, _ in held:
            conn.close()
