"""vLLM on a real GPU (skipped without CUDA or without vLLM's CUDA build): what the CPU harness
(tests/support/megatron_rl_testing/fake_gpu_node.py) models and only a GPU can confirm.

- placement: a colocated engine given its replica's GPUs allocates on those and on no other; with two GPUs, two
  engines of rollout TP 1 land on GPU 0 and GPU 1 (vLLM alone would put both on GPU 0: its worker i binds
  ``cuda:i`` of what it sees, vllm/v1/worker/gpu_worker.py);
- memory: the trainer's allocator holds 60% of the GPU cached when the engine starts and again when it wakes;
  vLLM refuses to start when free memory < gpu_memory_utilization x total (vllm/v1/worker/utils.py), so the
  start, the sleep, the wake and a generation go through only because the replica empties the cache first;
- weights: a sync goes through vLLM's CUDA IPC weight transfer (rollout/vllm/ipc.py) and reads back exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.vllm.contract import vllm_missing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(vllm_missing() is not None, reason=f"needs vLLM's CUDA build: {vllm_missing()}")]

UTILIZATION = 0.3


def _model(tmp_path):
    from megatron_rl_testing.vllm_support import tiny_model

    return tiny_model(tmp_path / "model", seed=1)


def _config(**overrides):
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig

    return RolloutConfig(name="vllm", gpu_memory_utilization=UTILIZATION, response_length=8, dtype="bfloat16",
                         weight_sync=WeightSyncConfig(bucket_size_mb=16, verify_freq=0), **overrides)


def _engine(model_dir, gpus):
    from megatron_rl.rollout.vllm import VLLMEngine
    from megatron_rl_testing.vllm_support import EOS, MAX_LEN, PAD

    return VLLMEngine(_config(), model_dir, max_model_len=MAX_LEN, eos_token_id=EOS, pad_token_id=PAD,
                      device="cuda", gpus=gpus, replica_index=gpus[0])


def _used_bytes() -> list[int]:
    return [total - free for free, total in (torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count()))]


def test_each_engine_allocates_on_its_replicas_gpu_only(tmp_path):
    model_dir = _model(tmp_path)
    gpus = list(range(min(2, torch.cuda.device_count())))
    before = _used_bytes()
    engines = [_engine(model_dir, [gpu]) for gpu in gpus]
    try:
        grown = [after - was for after, was in zip(_used_bytes(), before)]
        budget = UTILIZATION * torch.cuda.mem_get_info(0)[1]
        for gpu in gpus:  # each engine's budget (weights, activations, KV) on its own GPU, once
            assert 0.8 * budget < grown[gpu] < 1.5 * budget, f"GPU {gpu} grew by {grown[gpu] / 2**30:.1f} GiB: {grown}"
        for other in range(len(gpus), torch.cuda.device_count()):
            assert grown[other] < 2**30, f"GPU {other} holds no engine but grew by {grown[other] / 2**30:.1f} GiB"
        with pytest.raises(ValueError, match="two engines on one GPU"):
            _engine(model_dir, [gpus[0]])
    finally:
        for engine in engines:
            engine.shutdown()


def test_engine_starts_and_wakes_past_a_trainer_holding_60_percent_cached(tmp_path):
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.weights import RolloutReplica
    from megatron_rl_testing.vllm_support import EOS, PAD
    from transformers import AutoModelForCausalLM

    model_dir = _model(tmp_path)
    weights = [(n, p.detach().to(torch.bfloat16).cuda()) for n, p in
               AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]

    def hold_trainer_cache() -> None:  # freed by the trainer, still reserved by its caching allocator
        block = torch.empty(int(0.6 * torch.cuda.mem_get_info(0)[1]), dtype=torch.uint8, device="cuda")
        del block
        assert torch.cuda.memory_reserved() > 0.5 * torch.cuda.mem_get_info(0)[1]

    config = _config()
    hold_trainer_cache()
    replica = RolloutReplica(config, build_rollout_mesh([rank_place(0, 0)], 1), 0, lambda r: _engine(model_dir, r.gpus),
                             member_dtype=torch.bfloat16)
    try:
        replica.sync(lambda _plan: iter(weights), version=1)
        replica.release()  # sleep level 2: weights and KV cache go back
        hold_trainer_cache()
        replica.sync(lambda _plan: iter(weights), version=2)  # cache emptied, weights woken, loaded, KV woken
        from megatron_rl.protocol import DataProto

        ids = torch.tensor([[3, 4, 5, 6]])
        out = replica.generate(DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                    "position_ids": torch.arange(4)[None]},
                                                   meta_info={"eos_token_id": EOS, "pad_token_id": PAD}))
        assert out.meta_info["weight_version"] == 2 and out.batch["responses"].shape == (1, 8)
    finally:
        replica.shutdown()


def test_weights_arrive_over_cuda_ipc_and_read_back_exactly(tmp_path):
    """The CPU twin (tests/weights/test_vllm_ipc_sync.py) on a real engine: a sync of perturbed weights in 1 MiB
    buckets (layers split across buckets) goes through vLLM's own CUDA IPC weight transfer, nothing is staged in
    /dev/shm, and every served weight read back equals what was sent."""
    import os

    from transformers import AutoModelForCausalLM

    from megatron_rl.weights import sync_weights
    from megatron_rl_testing.vllm_support import assert_served_equal

    model_dir = _model(tmp_path)
    g = torch.Generator().manual_seed(5)
    sent = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
            for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    engine = _engine(model_dir, [0])
    shm = tmp_path / "shm"
    shm.mkdir()
    os.environ["MEGATRON_RL_SHM_DIR"] = str(shm)
    try:
        assert engine.ipc and engine.async_loads
        stats = sync_weights([(n, t.cuda()) for n, t in sent.items()], engine, version=1, bucket_bytes=1 << 20)
        assert stats.num_buckets > 1 and not os.listdir(shm)
        del os.environ["MEGATRON_RL_SHM_DIR"]
        assert_served_equal(engine.read_weights()[0], sent)
    finally:
        os.environ.pop("MEGATRON_RL_SHM_DIR", None)
        engine.shutdown()
