"""Placement of colocated SGLang engines on a fake 8-GPU node (megatron_rl_testing.fake_gpu_node, its sglang.Engine
double): every engine runs on exactly its replica's GPUs, two engines never share one, and the double keeps
SGLang 0.5.23's device and memory rules.

SGLang's rule (python/sglang/srt/entrypoints/engine.py:935-939): TP worker i runs on device
``base_gpu_id + i * gpu_id_step`` of what the engine's processes see; an index beyond them fails
(srt/utils/common.py:436). ``base_gpu_id`` is therefore a device index of the leader's process, not a physical id.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl_testing.fake_gpu_node import GiB, FakeGpuNode
from megatron_rl_testing.rollout_ranks import build_ranks, torchrun_envs


@pytest.mark.parametrize("tp,ranks,cuda_visible", [
    (1, 8, None), (2, 8, None), (4, 8, None),
    (8, 8, None),  # one engine on the whole node: base_gpu_id 0 either way (the control)
    (2, 4, "4,5,6,7"),  # a job on the node's upper half: base_gpu_id is a device index (0, 2), not 4, 6
])
def test_every_colocated_sglang_engine_runs_on_exactly_its_replicas_gpus(monkeypatch, tp, ranks, cuda_visible):
    node = FakeGpuNode(monkeypatch, with_vllm=False, with_sglang=True)
    replicas = build_ranks(node, monkeypatch, engine="sglang", tp=tp, envs=torchrun_envs(ranks, cuda_visible))
    leaders = [r for r in replicas if r.is_leader]
    assert len(node.engines) == len(leaders) == ranks // tp
    assert [e.gpus for e in node.engines] == [r.replica.gpus for r in leaders]
    used = [g for e in node.engines for g in e.gpus]
    assert len(used) == len(set(used)) == ranks, f"engines share GPUs: {[e.gpus for e in node.engines]}"
    for replica in leaders:
        replica.engine.shutdown()


def test_under_ray_each_sglang_engine_follows_the_gpus_ray_gave_its_ranks(monkeypatch):
    node = FakeGpuNode(monkeypatch, with_vllm=False, with_sglang=True)
    gpu_of_rank = [2, 3, 0, 1, 6, 7, 4, 5]
    envs = [{**env, "MEGATRON_RL_GPU_ID": str(g), "MEGATRON_RL_NODE_ID": "n0"}
            for env, g in zip(torchrun_envs(8), gpu_of_rank)]
    replicas = build_ranks(node, monkeypatch, engine="sglang", tp=2, envs=envs)
    leaders = [r for r in replicas if r.is_leader]
    assert [e.gpus for e in node.engines] == [r.replica.gpus for r in leaders] == [(2, 3), (0, 1), (6, 7), (4, 5)]
    assert [e.kwargs["base_gpu_id"] for e in node.engines] == [2, 0, 6, 4]


def test_the_sglang_double_keeps_sglangs_device_and_memory_rules(monkeypatch):
    """The harness itself: device indices over CUDA_VISIBLE_DEVICES, an index beyond them refused, the KV cache
    mem_fraction_static x the free memory at start less the weights, release/resume by tag (a resume of a tag not
    released fails, weight_updater.py:389), and a resume into memory the trainer's cache holds fails."""
    node = FakeGpuNode(monkeypatch, with_vllm=False, with_sglang=True)
    import sglang  # the double, installed by the node

    args = {"tp_size": 2, "mem_fraction_static": 0.5, "enable_memory_saver": True}
    with node.process("leader", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}):
        with pytest.raises(AssertionError, match=r"TP worker 1: gpu_id 4 \(base_gpu_id=3\) < num_gpus 4 fails"):
            sglang.Engine(**args, base_gpu_id=3)
        torch.cuda.set_device(2)
        node.hold_tensors(20 * GiB)  # on GPU 6: the engine's base is the minimum free over its GPUs
        engine = sglang.Engine(**args, base_gpu_id=2)
        record = node.engines[0]
        assert record.gpus == (6, 7) and record.free_at_start == {6: 60 * GiB, 7: 80 * GiB}
        assert record.bytes_on[7] == {"weights": 2 * GiB, "kv_cache": 28 * GiB, "cuda_graph": 0}  # 0.5 x 60 - 2
        engine.release_memory_occupation(tags=None)  # no tags: all of them
        assert node.free_bytes(6) == 60 * GiB and node.free_bytes(7) == 80 * GiB
        with pytest.raises(KeyError):
            engine.resume_memory_occupation(tags=["bogus"])
        engine.resume_memory_occupation(tags=["weights"])
        node.hold_cache(50 * GiB)
        with pytest.raises(RuntimeError, match=r"out of memory: SGLang engine 0 resume\(kv_cache\)"):
            engine.resume_memory_occupation(tags=["kv_cache"])
        torch.cuda.empty_cache()
        engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
        assert node.free_bytes(6) == 30 * GiB and not record.asleep
        with pytest.raises(ValueError, match="Loaded weights leave no GPU memory for the KV cache under "
                                             r"--mem-fraction-static=0.02. Raise --mem-fraction-static above 0.02\d"):
            sglang.Engine(**{**args, "mem_fraction_static": 0.02}, base_gpu_id=0)
        engine.shutdown()
    assert node.free_bytes(7) == 80 * GiB
