"""Placement of vLLM engines on a fake 8-GPU node (megatron_rl_testing.fake_gpu_node): every colocated engine runs
on exactly its replica's GPUs, two engines never share one, and the servers the run starts get the GPUs Ray
gave them and compute their settings where they run.

vLLM's rule the double keeps (vllm 0.32.0): TP worker i binds ``cuda:i`` of the environment the engine's
processes inherit (vllm/v1/worker/gpu_worker.py:498-501; vllm/platforms/interface.py:288-341 maps logical
device i to the i-th ``CUDA_VISIBLE_DEVICES`` entry). A leader that sees the whole node therefore puts every
engine on GPUs 0..k-1 unless the replica's GPUs are what its engine's processes see.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.device import DEVICE_INDEX_ENV
from megatron_rl_testing.fake_gpu_node import GiB, FakeGpuNode
from megatron_rl_testing.rollout_ranks import TOKEN_IDS, build_ranks, torchrun_envs
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()


def shut_down(leaders) -> None:
    """Each engine gives its GPUs back (this process holds every simulated leader's claim)."""
    for replica in leaders:
        replica.engine.shutdown()


@pytest.mark.parametrize("tp,ranks,cuda_visible", [
    (1, 8, None), (2, 8, None), (4, 8, None),
    (8, 8, None),  # one engine on the whole node: right before the fix too (the control)
    (2, 4, "4,5,6,7"),  # a job on the node's upper half: its masks name physical GPUs 4..7
])
def test_every_colocated_engine_runs_on_exactly_its_replicas_gpus(monkeypatch, tp, ranks, cuda_visible):
    node = FakeGpuNode(monkeypatch)
    replicas = build_ranks(node, monkeypatch, engine="vllm", tp=tp, envs=torchrun_envs(ranks, cuda_visible))

    leaders = [r for r in replicas if r.is_leader]
    assert len(node.engines) == len(leaders) == ranks // tp
    for replica in leaders:
        engine_gpus = node.engines[leaders.index(replica)].gpus
        assert engine_gpus == replica.replica.gpus, (
            f"engine {replica.replica.index} runs on GPUs {engine_gpus}, its replica is {replica.replica.gpus}")
    used = [g for e in node.engines for g in e.gpus]
    assert len(used) == len(set(used)) == ranks, f"engines share GPUs: {[e.gpus for e in node.engines]}"
    shut_down(leaders)


def test_under_ray_each_engine_follows_the_gpu_ray_gave_its_leader(monkeypatch):
    """Ray: every actor sees the whole node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES) and its GPU comes from
    ray.get_gpu_ids(), here in a shuffled order of ranks over GPUs."""
    node = FakeGpuNode(monkeypatch)
    gpu_of_rank = [2, 3, 0, 1, 6, 7, 4, 5]
    envs = [{**env, "MEGATRON_RL_GPU_ID": str(g), "MEGATRON_RL_NODE_ID": "n0"}
            for env, g in zip(torchrun_envs(8), gpu_of_rank)]
    replicas = build_ranks(node, monkeypatch, engine="vllm", tp=2, envs=envs)
    leaders = [r for r in replicas if r.is_leader]
    assert sorted(e.gpus for e in node.engines) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [e.gpus for e in node.engines] == [r.replica.gpus for r in leaders]
    shut_down(leaders)


# ---------------------------------------------------------------------------------------------- VLLMEngine's mask
def vllm_engine(**kwargs):
    from megatron_rl.rollout.vllm import VLLMEngine

    tp = len(kwargs.get("gpus") or (0,))
    return VLLMEngine(RolloutConfig(name="vllm", response_length=4, tensor_model_parallel_size=tp), "/unused",
                      max_model_len=16, device="cuda", **TOKEN_IDS, **kwargs)


def test_the_mask_spans_the_construction_only(monkeypatch):
    node = FakeGpuNode(monkeypatch)
    with node.process("leader", {"CUDA_VISIBLE_DEVICES": "1,2,3,4", DEVICE_INDEX_ENV: "2"}):
        torch.cuda.set_device(2)
        engine = vllm_engine(gpus=(3, 4), replica_index=1)
        assert node.engines[0].gpus == (3, 4)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2,3,4" and os.environ[DEVICE_INDEX_ENV] == "2"
        assert torch.cuda.device_count() == 4 and node.physical() == 3  # the leader's own view is unchanged
        engine.shutdown()
    with node.process("leader2"):  # no CUDA_VISIBLE_DEVICES: it stays unset after the engine is built
        vllm_engine(gpus=(5,), replica_index=0).shutdown()
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert node.engines[1].gpus == (5,)


def test_gpus_the_leader_cannot_see_are_refused_before_vllm_starts(monkeypatch):
    node = FakeGpuNode(monkeypatch)
    with node.process("leader", {"CUDA_VISIBLE_DEVICES": "0,1"}):
        with pytest.raises(ValueError, match=r"rollout replica 3: its GPUs \[1, 2\] .*GPU 2 .*DEVICES='0,1'"):
            vllm_engine(gpus=(1, 2), replica_index=3)
    assert node.engines == []


def test_a_second_engine_on_a_gpu_of_a_live_one_is_refused(monkeypatch):
    node = FakeGpuNode(monkeypatch)
    with node.process("leader"):
        first = vllm_engine(gpus=(0, 1), replica_index=0)
        with pytest.raises(ValueError, match=r"rollout replica 1: GPU 1 .*rollout replica 0 .*GPUs \[0, 1\]"):
            vllm_engine(gpus=(1, 2), replica_index=1)
        assert len(node.engines) == 1
        first.shutdown()  # its GPUs are free again
        vllm_engine(gpus=(1, 2), replica_index=1).shutdown()
    assert node.engines[1].gpus == (1, 2)


def test_gpus_must_match_the_engines_tp(monkeypatch):
    from megatron_rl.rollout.vllm import VLLMEngine

    FakeGpuNode(monkeypatch)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 .* 1 GPU"):
        VLLMEngine(RolloutConfig(name="vllm", response_length=4, tensor_model_parallel_size=2), "/unused",
                   max_model_len=16, device="cuda", gpus=(0,), replica_index=0, **TOKEN_IDS)


def test_a_failed_start_restores_the_environment_and_frees_the_gpus(monkeypatch):
    """vLLM's start-up check (vllm/v1/worker/utils.py:761) refuses: the leader's environment comes back and the
    GPUs are not left claimed."""
    node = FakeGpuNode(monkeypatch)
    with node.process("leader"):
        torch.cuda.set_device(0)
        node.hold_cache(60 * GiB)  # the trainer's cache, not emptied
        with pytest.raises(ValueError, match=r"Free memory on device cuda:0 \(20.00/80.00 GiB\) on startup is less "
                                             r"than desired GPU memory utilization \(0.5"):
            vllm_engine(gpus=(0,), replica_index=0)
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
        torch.cuda.empty_cache()
        vllm_engine(gpus=(0,), replica_index=0).shutdown()


def test_the_vllm_double_keeps_vllms_sleep_and_wake_rules(monkeypatch):
    """The harness itself (others' memory tests stand on it): level-2 sleep gives everything back, a wake naming a
    tag that is not asleep wakes nothing (vllm/v1/executor/abstract.py:398-404), and a wake into memory the
    trainer's cache still holds fails as cuMemCreate does, until that cache is emptied."""
    node = FakeGpuNode(monkeypatch)
    with node.process("leader"):
        torch.cuda.set_device(0)
        engine = vllm_engine(gpus=(0,), replica_index=0)
        llm, awake = engine.llm, node.free_bytes(0)
        assert awake == node.total_bytes - 40 * GiB  # gpu_memory_utilization 0.5 of 80 GiB: weights + KV cache
        llm.sleep(level=2)
        assert node.free_bytes(0) == node.total_bytes
        llm.wake_up(tags=["weights", "scheduling", "bogus"])
        assert node.free_bytes(0) == node.total_bytes
        llm.wake_up(tags=["weights"])
        assert node.free_bytes(0) == node.total_bytes - node.model_bytes
        node.hold_cache(60 * GiB)
        with pytest.raises(RuntimeError, match="out of memory: vLLM engine 0 wake_up\\(kv_cache\\) needs 36.00 GiB"):
            llm.wake_up(tags=["kv_cache"])
        torch.cuda.empty_cache()
        llm.wake_up(tags=["kv_cache"])
        assert node.free_bytes(0) == awake and not node.engines[0].asleep
        engine.shutdown()
        assert node.free_bytes(0) == node.total_bytes


# ---------------------------------------------------------------------------------------------- started servers
def driver_settings(tp: int):
    """The servers' settings as the driver computes them: on this CPU machine, fp32 and a CPU-sized KV cache."""
    from megatron_rl.servers.vllm_server import VLLMServerSettings

    settings = VLLMServerSettings.from_rollout(RolloutConfig(name="vllm", tensor_model_parallel_size=tp), "/unused",
                                               max_model_len=64, start_timeout_s=60)
    assert dict(settings.engine_args)["dtype"] == "float32" and "kv_cache_memory_bytes" in dict(settings.engine_args)
    return settings


def assert_gpu_server(launch: dict, gpus: str, tp: int) -> None:
    """The server process sees exactly ``gpus`` and was configured for GPUs where it runs."""
    args = " ".join(launch["cmd"])
    assert launch["env"].get("CUDA_VISIBLE_DEVICES") == gpus, launch["env"].get("CUDA_VISIBLE_DEVICES")
    assert "--dtype bfloat16" in args and "--gpu-memory-utilization 0.5" in args, args
    assert "--kv-cache-memory-bytes" not in args and f"--tensor-parallel-size {tp}" in args, args


def test_a_server_actor_runs_its_server_on_the_gpus_ray_gave_it(monkeypatch):
    import ray

    from megatron_rl.servers.ray_pool import ServerActor
    from megatron_rl_testing.fake_gpu_node import record_server_launches

    settings = driver_settings(tp=2)
    FakeGpuNode(monkeypatch, with_vllm=False)  # the server's node has GPUs, the driver had none
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["5", "4"])  # Ray's ids come unordered
    launches = record_server_launches(monkeypatch)
    actor = ServerActor(settings, 3, "key")
    actor.stop()
    assert_gpu_server(launches[0], "4,5", tp=2)


def test_a_server_actor_without_gpus_on_a_gpu_node_is_refused(monkeypatch):
    import ray

    from megatron_rl.servers.ray_pool import ServerActor
    from megatron_rl_testing.fake_gpu_node import record_server_launches

    settings = driver_settings(tp=1)
    FakeGpuNode(monkeypatch, with_vllm=False)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    launches = record_server_launches(monkeypatch)
    with pytest.raises(RuntimeError, match="got no GPU on a host with CUDA"):
        ServerActor(settings, 0, "key")
    assert launches == []


def test_torchrun_servers_take_the_hosts_gpus_after_the_trainers(monkeypatch):
    from megatron_rl.servers.fleet import ServerProcessPool
    from megatron_rl_testing.fake_gpu_node import record_server_launches

    settings = driver_settings(tp=2)
    node = FakeGpuNode(monkeypatch, with_vllm=False)
    launches = record_server_launches(monkeypatch)
    with node.process("launcher", {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "1"}):
        pool = ServerProcessPool(settings, 2)
        pool.close()
        assert sorted(launch["env"]["CUDA_VISIBLE_DEVICES"] for launch in launches) == ["4,5", "6,7"]
        for launch in launches:
            assert_gpu_server(launch, launch["env"]["CUDA_VISIBLE_DEVICES"], tp=2)
        with pytest.raises(ValueError, match=r"num_servers=3 vLLM servers of tensor_model_parallel_size=2 need 6 "
                                             r"GPUs beside the trainer's 4 on this host, which sees 8"):
            ServerProcessPool(settings, 3)


def test_ray_server_actors_ask_ray_for_rollout_tp_gpus(monkeypatch):
    """A Ray of 8 logical GPUs: each server's actor holds rollout-TP of them, no two the same, and its server
    process sees exactly those (init_ray sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: Ray does not)."""
    import ray

    from megatron_rl.controller import init_ray
    from megatron_rl.servers.ray_pool import RayServerPool
    from megatron_rl_testing.fake_gpu_node import LaunchRecordingServerActor

    class RecordingPool(RayServerPool):
        server_actor = ray.remote(max_restarts=0, max_concurrency=2)(LaunchRecordingServerActor)

    settings = driver_settings(tp=2)
    init_ray(num_cpus=2, num_gpus=8)
    try:
        pool = RecordingPool(settings, 2, cpus_per_server=0.5, start_timeout_s=120)
        try:
            wheres = [server.where for server in pool.servers]
        finally:
            pool.close()
    finally:
        ray.shutdown()
    assert [where["resources"].get("GPU") for where in wheres] == [2.0, 2.0]
    seen = [where["launches"][0]["env"]["CUDA_VISIBLE_DEVICES"] for where in wheres]
    gpus = [int(g) for visible in seen for g in visible.split(",")]
    assert len(gpus) == len(set(gpus)) == 4, seen
    for where, visible in zip(wheres, seen):
        assert_gpu_server(where["launches"][0], visible, tp=2)
