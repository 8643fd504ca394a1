"""The export's TP step through the host's shared memory (megatron_rl.distributed.host_gather), gloo, 2 ranks.

What it must hold, like the all-gather it replaces: the consumer gets every rank's shard of every bucket
bit for bit even when the ranks run at different speeds (a slow consumer, a fast non-consumer that races
ahead into the next buckets or the next export: the slot reuse must not overwrite a bucket still being
read; two exports iterated together must not share the buffer), no TP all-gather
runs, and no file is left in /dev/shm. Off (``host_gather.enabled``) it falls back to gloo's all-gather.
At PP > 1 the buffer spans the model-parallel group and is the pipeline step too: no shard is broadcast.
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess

pytestmark = pytest.mark.distributed
BUCKET_BYTES = 8 << 10  # many small buckets: every slot is reused many times


def raced_exports(ckpt_dir: str) -> dict:
    from megatron_rl.distributed import host_gather, init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export_hf_weights, export_hf_weights_tensorwise, export

    init_model_parallel(tp=2)
    chunks = build_from_hf(ckpt_dir)
    rank = dist.get_rank()
    reference = {name: t.clone() for name, t in export_hf_weights_tensorwise(chunks)}
    calls = {"all_gather_single": 0, "all_gather_into_tensor": 0}
    originals = {name: getattr(dist, name) for name in calls if hasattr(dist, name)}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        received, buckets = {}, 0
        # rank 0 consumes slowly; rank 1 only drains, as fast as the barriers let it
        for name, tensor in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES, consumers={0}):
            received[name] = tensor
            buckets += 1
            if buckets % 3 == 0:
                time.sleep(0.02)
        shm_calls = dict(calls)
        # back-to-back exports: the fast non-consumer starts the next export (writing bucket 0) while the
        # consumer may still convert the previous export's last bucket; buckets sizes vary the last slot
        back_to_back = []
        convert = export._hf_bucket
        # the consumer converts slowly (it reads the shared rows late), so a writer that does not wait shows
        export._hf_bucket = lambda *a: (time.sleep(0.05), convert(*a))[1]
        for bucket_bytes in (BUCKET_BYTES, 12 << 10, 16 << 10, 24 << 10):
            back_to_back.append({n: t.clone() for n, t in export_hf_weights(chunks, bucket_bytes=bucket_bytes,
                                                                             consumers={0})})
        export._hf_bucket = convert
        # two exports iterated together: the second one must not share the first one's buffer
        zipped = [(a, b.clone()) for (a, _), (_, b) in zip(export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES),
                                                             export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES))]
        host_gather.enabled = False
        fallback = {name: t.clone() for name, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES)}
        host_gather.enabled = True
        fallback_calls = {k: calls[k] - shm_calls[k] for k in calls}
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out = {"shm_calls": shm_calls, "fallback_calls": fallback_calls, "tensors": len(received)}
    if rank == 0:
        out["mismatch"] = sorted(n for n, t in reference.items() if not torch.equal(received.get(n), t))
        out["fallback_mismatch"] = sorted(n for n, t in reference.items() if not torch.equal(fallback[n], t))
        out["missing"] = sorted(set(reference) - set(received))
        out["back_to_back_mismatch"] = sorted(n for got in back_to_back for n, t in reference.items()
                                              if not torch.equal(got[n], t))
        out["zipped_mismatch"] = sorted(n for n, t in zipped if not torch.equal(reference[n], t))
    dist.barrier()
    owner = [os.getpid()]  # rank 0 names the mapping after itself; another job's (pytest-xdist) is not ours
    dist.broadcast_object_list(owner, src=0)
    out["leftover_files"] = glob.glob(f"/dev/shm/megatron-rl-gather-{owner[0]}-*")
    return out


def raced_moe_export(ckpt_dir: str) -> list[str]:
    """TP=2, expert TP 1: expert buckets skip the TP step (each rank holds whole experts), so they publish no
    barrier; the fast non-consumer must still not write a row the slow consumer reads for an earlier bucket."""
    from megatron_rl.distributed import host_gather, init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export, export_hf_weights

    init_model_parallel(tp=2, etp=1)
    chunks = build_from_hf(ckpt_dir)
    host_gather.enabled = False
    reference = {name: t.clone() for name, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES)}
    host_gather.enabled = True
    convert = export._hf_bucket
    export._hf_bucket = lambda *a: (time.sleep(0.02), convert(*a))[1]  # the consumer reads the rows late
    try:
        received = {n: t.clone() for n, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES, consumers={0})}
    finally:
        export._hf_bucket = convert
    if dist.get_rank() != 0:
        return []
    return sorted(n for n, t in reference.items() if n not in received or not torch.equal(received[n], t))


def test_expert_buckets_without_a_tp_step_never_overwrite_a_row_being_read(tmp_path):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    assert run_multiprocess(raced_moe_export, 2, str(model), timeout_s=300)[0] == []


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("host_gather") / "qwen2", "qwen2", with_tokenizer=False)
    return run_multiprocess(raced_exports, 2, str(model), timeout_s=300)


def test_consumer_gets_every_shard_bit_for_bit_while_the_other_rank_races_ahead(results):
    rank0, rank1 = results
    assert rank0["tensors"] > 0 and not rank0["missing"]
    assert rank0["mismatch"] == [], rank0["mismatch"]
    assert rank1["tensors"] == 0  # not a consumer: takes part, yields nothing


def test_back_to_back_and_zipped_exports_never_overwrite_a_bucket_being_read(results):
    assert results[0]["back_to_back_mismatch"] == []
    assert results[0]["zipped_mismatch"] == []


def test_no_tp_all_gather_runs_and_nothing_is_left_in_dev_shm(results):
    for out in results:
        assert sum(out["shm_calls"].values()) == 0, out["shm_calls"]
        assert out["leftover_files"] == []


def test_switched_off_it_falls_back_to_gloo_all_gather_with_the_same_bytes(results):
    rank0 = results[0]
    assert sum(rank0["fallback_calls"].values()) > 0
    assert rank0["fallback_mismatch"] == []


def raced_pipeline_exports(ckpt_dir: str, tp: int, pp: int) -> dict:
    """Every rank consuming, then rank 0 only (slow, the others racing ahead), then back-to-back exports whose
    consumer converts late: each consumer gets the tensorwise export's bytes, and no shard crosses gloo."""
    from megatron_rl.distributed import host_gather, init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export, export_hf_weights, export_hf_weights_tensorwise

    init_model_parallel(tp=tp, pp=pp)
    chunks = build_from_hf(ckpt_dir)
    reference = {name: t.clone() for name, t in export_hf_weights_tensorwise(chunks)}
    moved = {"shard transfers": 0}
    originals = {name: getattr(dist, name) for name in ("broadcast", "isend", "irecv", "all_gather_single",
                                                         "all_gather_into_tensor") if hasattr(dist, name)}

    def counting(fn):
        def call(tensor, *args, **kwargs):  # object broadcasts (the buffer's name) are a few hundred bytes
            moved["shard transfers"] += tensor.numel() * tensor.element_size() > 1024
            return fn(tensor, *args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    rank, convert = dist.get_rank(), export._hf_bucket
    try:
        every = {n: t.clone() for n, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES)}
        rank0 = {}
        for k, (name, tensor) in enumerate(export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES, consumers={0})):
            rank0[name] = tensor.clone()
            if k % 3 == 0:
                time.sleep(0.02)
        export._hf_bucket = lambda *a: (time.sleep(0.02 if rank == 0 else 0), convert(*a))[1]
        late = [{n: t.clone() for n, t in export_hf_weights(chunks, bucket_bytes=b)} for b in (BUCKET_BYTES, 12 << 10)]
    finally:
        export._hf_bucket = convert
        for name, fn in originals.items():
            setattr(dist, name, fn)
    host_gather.enabled = False
    fallback = {n: t.clone() for n, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES)}
    host_gather.enabled = True
    got = [every, *late, fallback] + ([rank0] if rank == 0 else [])
    out = {"moved": moved["shard transfers"], "rank0_only_received": len(rank0),
           "mismatch": sorted({n for g in got for n, t in reference.items() if n not in g or not torch.equal(g[n], t)})}
    dist.barrier()
    owner = [os.getpid()]
    dist.broadcast_object_list(owner, src=0)
    out["leftover_files"] = glob.glob(f"/dev/shm/megatron-rl-gather-{owner[0]}-*")
    return out


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_pipeline_stages_share_the_buffer_and_broadcast_no_shard(tmp_path, tp, pp):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = make_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2", with_tokenizer=False)
    results = run_multiprocess(raced_pipeline_exports, tp * pp, str(model), tp, pp, timeout_s=300)
    for rank, out in enumerate(results):
        assert out["mismatch"] == [], (rank, out["mismatch"])
        assert out["moved"] == 0, (rank, out["moved"])
        assert out["leftover_files"] == []
    assert results[0]["rank0_only_received"] > 0 and all(r["rank0_only_received"] == 0 for r in results[1:])
