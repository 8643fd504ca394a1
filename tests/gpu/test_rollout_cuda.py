"""Rollout checks a lent GPU can run (skipped without CUDA). SGLang cannot be installed there, so these cover
what our colocated SGLang path relies on and a CPU cannot show:

- CUDA IPC with a fresh buffer per load (weights/sync.py, rollout/sglang/payload.py): a consumer
  process opens each bucket's IPC handle and copies from it asynchronously on a side stream, while the
  producer drops the bucket and allocates the next one at once; torch's CUDA IPC reference counting
  must keep the memory from being reused until the consumer released it (after its stream finished the
  copy, as torch's rules ask of the consumer), so every copy is exact;
- the HF engine colocated on the GPU: ``sleep()`` really gives device memory back and the next weight
  update brings the engine back with the new weights.
"""

from __future__ import annotations

import io
import multiprocessing

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS, NUMEL = 24, 1 << 22  # 24 buckets of 16 MiB


def _consumer(inbox, outbox) -> None:
    from multiprocessing.reduction import ForkingPickler

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    dst = torch.empty(NUMEL, device="cuda")
    sums = []
    for _ in range(BUCKETS):
        src = ForkingPickler.loads(inbox.get())  # opens the producer's CUDA IPC handle
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # the copy runs well after the producer moved on
            dst.copy_(src)
            sums.append(dst.double().sum())
        # torch's CUDA IPC rule: the consumer keeps the shared tensor until it is done with it. Releasing it
        # syncs only the *current* stream (StorageSharing.cpp, then the producer's ref counter drops and
        # ipc_collect may free the block); the copy was queued on `stream`, so that stream is synchronised
        # first, as a loader on a side stream must (before, the release raced the queued copy by construction).
        stream.synchronize()
        del src
    torch.cuda.synchronize()
    outbox.put([float(s) for s in sums])


def test_fresh_ipc_buffers_arrive_exactly_although_the_copy_runs_later():
    from multiprocessing.reduction import ForkingPickler

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(inbox, outbox))
    proc.start()
    expected = []
    for i in range(BUCKETS):
        bucket = torch.full((NUMEL,), float(i + 1), device="cuda")  # a fresh buffer per load
        torch.cuda.current_stream().synchronize()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
        inbox.put(buf.getvalue())
        expected.append(float(i + 1) * NUMEL)
        del bucket  # dropped at once; the next allocation must not reuse memory the consumer still reads
        torch.cuda.ipc_collect()
    got = outbox.get(timeout=300)
    proc.join(timeout=60)
    assert got == expected


def test_hf_engine_sleep_frees_memory_and_the_next_update_brings_it_back():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.protocol import DataProto

    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    engine = HFEngine(RolloutConfig(response_length=4, dtype="bfloat16"), config)
    source = AutoModelForCausalLM.from_config(config)
    engine.update_weights(source.state_dict().items(), version=0)
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < awake / 2
    engine.update_weights(AutoModelForCausalLM.from_config(config).state_dict().items(), version=1)
    assert torch.cuda.memory_allocated() >= awake * 0.9
    ids = torch.tensor([[5, 6, 7]], device="cuda")
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                   "position_ids": torch.arange(3, device="cuda")[None]})
    assert engine.generate_sequences(prompts).meta_info["weight_version"] == 1
