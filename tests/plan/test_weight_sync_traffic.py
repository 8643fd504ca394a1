"""The weight-sync traffic model (megatron_rl.plan.traffic) against an instrumented run.

8 gloo ranks, actor TP=2 x PP=2 x DP=2 (Megatron order: rank = tp + 2 dp + 4 pp), mapped onto 2 simulated
nodes of 4 ranks (node = rank // 4: each pipeline stage is one node, as in the 70B preset). The
torch.distributed collectives are wrapped for the duration of one sync and count, per rank and link class,
the bytes each rank sends and receives (a broadcast sends the root's n bytes to each other member; an
all-gather each member's n bytes to every other member; gather / send / recv the obvious), plus the number of
tensor collectives. The counts must equal the model's exactly, for the shard-first export (into an HF engine
on every rank, which must then hold the checkpoint's weights bit for bit) and for the previous tensorwise one;
server mode (only rank 0 materialises) must send nothing to or from ranks outside rank 0's groups.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.traffic_counter import KEYS, count_traffic

GPUS_PER_NODE = 4
BUCKET_BYTES = 24 << 10


def instrumented_sync(ckpt_dir: str) -> dict:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import ExportPlan, export_hf_buckets, export_hf_weights, export_hf_weights_tensorwise
    from megatron_rl.rollout import HFEngine
    from megatron_rl.weights import sync_weights

    init_model_parallel(tp=2, pp=2)
    chunks = build_from_hf(ckpt_dir)
    engine = HFEngine(RolloutConfig(response_length=4), ckpt_dir)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    out: dict = {"rank": dist.get_rank()}
    dist.barrier()
    with count_traffic(GPUS_PER_NODE) as counts:
        stats = sync_weights(export_hf_buckets(chunks, ExportPlan(bucket_bytes=BUCKET_BYTES)), engine, version=1,
                             bucket_bytes=BUCKET_BYTES)
    out["shard_first"] = dict(counts)
    out["engine_buckets"] = stats.num_buckets
    out["engine_state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    dist.barrier()
    with count_traffic(GPUS_PER_NODE) as counts:
        for _ in export_hf_weights_tensorwise(chunks):
            pass
    out["tensorwise"] = dict(counts)
    dist.barrier()
    with count_traffic(GPUS_PER_NODE) as counts:
        server = [(n, t.clone()) for n, t in export_hf_weights(chunks, bucket_bytes=BUCKET_BYTES, consumers={0})]
    out["server"] = dict(counts)
    out["server_names"] = [n for n, _ in server]
    out["server_tensors"] = dict(server) if dist.get_rank() == 0 else None
    out["hf"] = chunks[0].hf_config
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    ckpt = make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2", seed=5, num_layers=4)
    return str(ckpt), run_multiprocess(instrumented_sync, 8, str(ckpt), timeout_s=900)


def _checkpoint(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt}/model.safetensors")


@pytest.mark.distributed
def test_counts_equal_the_model_and_the_engine_holds_the_checkpoint(run):
    from megatron_rl.plan.traffic import model_sync_traffic

    ckpt, results = run
    hf = results[0]["hf"]
    for path in ("shard_first", "tensorwise"):
        model = model_sync_traffic(hf, 2, 2, 2, GPUS_PER_NODE, path=path, dtype_bytes=4, bucket_bytes=BUCKET_BYTES)
        for result in results:
            rank = result["rank"]
            expected = {k: model.per_rank[rank][k] for k in KEYS}
            assert result[path] == expected, (path, rank, result[path], expected)
    first, old = results[0]["shard_first"], results[0]["tensorwise"]
    assert first["inter_recv"] > 0 and first["intra_recv"] > 0, first
    assert first["collectives"] < old["collectives"], (first, old)
    from megatron_rl.plan.traffic import _buckets, shard_groups

    export_buckets = len(_buckets(shard_groups(hf, 2, 2, 4), 2, BUCKET_BYTES))
    assert export_buckets > 4
    reference = _checkpoint(ckpt)
    for result in results:
        # each sealed export bucket went to the engine as is: one load per export bucket, no re-bucketing
        assert result["engine_buckets"] == export_buckets, (result["rank"], result["engine_buckets"])
        held = result["engine_state"]
        for name, tensor in reference.items():
            assert torch.equal(held[name], tensor), (result["rank"], name)


@pytest.mark.distributed
def test_server_mode_materialises_only_on_the_sender(run):
    ckpt, results = run
    reference = _checkpoint(ckpt)
    assert set(results[0]["server_names"]) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(results[0]["server_tensors"][name], tensor), name
    for result in results[1:]:
        assert result["server_names"] == [], result["rank"]
    # ranks 0 and 1: rank 0's TP group; 4 and 5: the stage-1 ranks of its pipeline groups. The others idle.
    for result in results:
        moved = sum(result["server"][k] for k in KEYS if k != "collectives")
        if result["rank"] in (0, 1, 4, 5):
            assert moved > 0, result
        else:
            assert moved == 0 and result["server"]["collectives"] == 0, result
    # rank 0 gets each stage-1 shard of its TP rank once (point to point), its TP peer's shards by a gather
    assert results[0]["server"]["inter_recv"] == results[0]["shard_first"]["inter_recv"]
    assert results[1]["server"]["intra_recv"] == 0
