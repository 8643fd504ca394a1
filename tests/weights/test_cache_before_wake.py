"""Issue 49, item 4: the trainer's cached memory goes back to the GPU on every rank an engine spans before the
engine wakes its weights, and again before it wakes its KV cache, at every rollout TP (verl empties the cache
before ``resume(tags=["weights"])`` and before ``resume(tags=["kv_cache"])``). At rollout TP 1 the replica
used to hand its engine the buckets itself and never emptied the cache; at TP 2 only before the KV cache.

The engine is the real VLLMEngine over a vllm.LLM double with vLLM's sleep-mode rules (as in
test_vllm_sleep_order.py: vllm/v1/worker/gpu_worker.py ``sleep`` / ``wake_up(tags)``; nothing loads into
weights that are asleep). ``torch.cuda.empty_cache`` is recorded: it is what ``release_cached_memory`` calls."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.fake_cuda_ipc import WeightTransferDouble, install_export
from megatron_rl_testing.vllm_support import skip_without_vllm

skip_without_vllm()

LOG_ENV = "MRL_TEST_WAKE_LOG"


def _record(event: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.environ[LOG_ENV], "a") as log:
        log.write(f"{rank} {event}\n")


class RecordingLLM:
    """vllm.LLM as the engine uses it, with vLLM's sleep-mode state: level 2 releases weights and KV cache,
    ``wake_up(tags)`` brings back only what is asleep, and a load into sleeping weights is refused."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.asleep = kwargs, set()
        # GPU: vLLM's CUDA IPC weight transfer, TP worker i on the GPU of rank i
        self.transfer = WeightTransferDouble(kwargs, range(int(kwargs["tensor_parallel_size"])))
        _record("engine start")  # vLLM's start-up memory check reads free memory here (v1/worker/utils.py)

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs.get("enable_sleep_mode"), "sleep() on an engine built without enable_sleep_mode"
        self.asleep = {"weights", "kv_cache"}
        _record(f"sleep{level}")

    def wake_up(self, tags=None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        assert tags <= self.asleep, f"wake_up({sorted(tags)}) of memory that is not asleep"
        self.asleep -= tags
        _record("wake:" + ",".join(sorted(tags)))

    def collective_rpc(self, method, args=(), kwargs=None):
        if method != "init_weight_transfer_engine":  # at start, before any sleep
            assert "weights" not in self.asleep, "weights loaded into memory that is asleep"
        assert self.transfer.call(method, args, kwargs), f"{method}: not vLLM's CUDA IPC weight transfer"
        _record(method)
        return [0] * int(self.kwargs["tensor_parallel_size"])

    def reset_prefix_cache(self) -> None:
        pass


def _install_doubles(setattr_, log: str) -> None:
    import vllm

    os.environ[LOG_ENV] = log
    setattr_(vllm, "LLM", RecordingLLM)
    setattr_(torch.cuda, "empty_cache", lambda: _record("empty_cache"))
    setattr_(torch.cuda, "is_available", lambda: True)  # a GPU node: the sync goes over CUDA IPC
    setattr_(torch.cuda, "synchronize", lambda device=None: None)
    install_export(setattr_, os.path.dirname(log), lambda: dist.get_rank() if dist.is_initialized() else 0)


def _two_ranks(model_dir: str, log: str) -> None:
    _install_doubles(setattr, log)  # a process of its own
    _two_syncs(model_dir, rollout_tp=2)


def _two_syncs(model_dir: str, rollout_tp: int) -> None:
    """Sync, release for a training phase, sync again: the second sync wakes what the release put to sleep."""
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl.weights import RolloutReplica

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    places = [rank_place(r, r) for r in range(world)]
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=rollout_tp, response_length=4, dtype="float32",
                           weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=0))

    def build(_replica):
        return VLLMEngine(config, model_dir, max_model_len=16, eos_token_id=1, pad_token_id=0, device="cuda")

    replica = RolloutReplica(config, build_rollout_mesh(places, rollout_tp), rank, build,
                             member_dtype=torch.float32)
    weights = [(f"model.layers.{i}.mlp.weight", torch.full((64,), float(i))) for i in range(3)]
    try:
        replica.sync(lambda _plan: iter(weights), version=1)
        replica.release()
        _record("second sync")
        replica.sync(lambda _plan: iter(weights), version=2)
    finally:
        replica.shutdown()


def _events(log: str) -> list[tuple[int, str]]:
    return [(int(rank), event) for rank, event in (line.split(" ", 1) for line in open(log).read().splitlines())]


def _check_cache_emptied_before_each_wake(events: list[tuple[int, str]], ranks: list[int]) -> None:
    """Each rank, from its start of the second sync on, empties its cache once before the weights wake and once
    more before the KV cache wakes (a member may do that second time before the leader's wakes: it allocates
    nothing after its export, and the leader wakes the KV cache only once every rank has done it)."""
    order = [event for _, event in events]
    assert order.count("wake:weights") == 1 and order.count("wake:kv_cache") == 1, order
    weights, kv = order.index("wake:weights"), order.index("wake:kv_cache")
    for rank in ranks:
        start = events.index((rank, "second sync"))
        empties = [i for i, event in enumerate(events) if event == (rank, "empty_cache") and i > start]
        assert empties and empties[0] < weights, (
            f"rank {rank} did not empty its cache before the weights woke: {events}")
        assert len(empties) > 1 and empties[1] < kv, (
            f"rank {rank} did not empty its cache again before the KV cache woke: {events}")
    loads = [i for i, (_, event) in enumerate(events) if event == "mrl_ipc_update"]
    assert weights < loads[-1] < kv, f"the load must come between the two wakes: {events}"


def _check_cache_emptied_before_the_engine_starts(events: list[tuple[int, str]], ranks: list[int]) -> None:
    """vLLM refuses to start when free memory is below gpu_memory_utilization x total: the trainer's cached blocks
    (model build, checkpoint load) go back to every GPU the engine spans before the leader starts it."""
    start = events.index(next(e for e in events if e[1] == "engine start"))
    for rank in ranks:
        assert (rank, "empty_cache") in events[:start], (
            f"rank {rank} did not empty its cache before the engine started: {events}")


def test_rollout_tp1_empties_the_cache_before_weights_and_before_kv(tmp_path, monkeypatch):
    log = str(tmp_path / "events.log")
    monkeypatch.setenv(LOG_ENV, log)
    _install_doubles(monkeypatch.setattr, log)
    _two_syncs(str(tmp_path), rollout_tp=1)
    _check_cache_emptied_before_the_engine_starts(_events(log), ranks=[0])
    _check_cache_emptied_before_each_wake(_events(log), ranks=[0])


@pytest.mark.distributed
def test_rollout_tp2_empties_the_cache_on_both_ranks_before_weights_and_before_kv(tmp_path):
    log = str(tmp_path / "events.log")
    run_multiprocess(_two_ranks, 2, str(tmp_path), log, timeout_s=300)
    _check_cache_emptied_before_the_engine_starts(_events(log), ranks=[0, 1])
    _check_cache_emptied_before_each_wake(_events(log), ranks=[0, 1])
