"""Weight-sync throughput on CPU: a ~100M-parameter Qwen2-shaped model into the HF engine.

Two sources, each against a plain ``torch.cat`` of the same tensors + ``copy_`` into a same-sized buffer
(the least memory traffic any sync into separate engine memory needs) in the same run:
- an HF ``state_dict`` in this process (timed by pytest-benchmark, best of 3);
- a Megatron actor at TP=2, PP=2 and TP=2 x PP=2 (2-4 gloo ranks), through the previous tensorwise export
  (per tensor: TP all-gather, full-tensor pipeline broadcast) and the shard-first bucketed one
  (``export_hf_weights``: one pipeline broadcast + one TP all-gather per bucket, converted straight into a
  sealed bucket the engine loads as is); rank 0 pushes into its engine, the others drain the export (timed
  inside the ranks, best of 2), and the collectives of one sync on rank 0 are counted.
fp32 throughout (the CPU engine's dtype). Run:

    pytest benchmarks/test_weight_sync.py -s --benchmark-columns=min,mean,rounds
"""

from __future__ import annotations


import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.rollout import HFEngine
from megatron_rl.weights import sync_weights
from megatron_rl_testing.timing import best_seconds

SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "num_layers": 8,
    "num_heads": 12,
    "num_kv_heads": 4,
    "intermediate_size": 2048,
}
BUCKET_BYTES = 64 << 20


def _config():
    from megatron_rl_testing.tiny_models import tiny_hf_config

    return tiny_hf_config("qwen2", **SHAPE)


def _cat_copy_seconds(tensors: list[torch.Tensor], rounds: int) -> float:
    dst = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    return best_seconds(rounds, lambda: dst.copy_(torch.cat([t.reshape(-1) for t in tensors])))


def _report(label: str, nbytes: int, sync_s: float, plain_s: float) -> dict[str, float]:
    out = {
        "GB": nbytes / 1e9,
        "sync_GBps": nbytes / sync_s / 1e9,
        "cat_copy_GBps": nbytes / plain_s / 1e9,
        "sync_vs_cat_copy": plain_s / sync_s,
    }
    print(
        f"\n{label}: {out['GB']:.2f} GB, sync {out['sync_GBps']:.2f} GB/s, torch.cat+copy_ "
        f"{out['cat_copy_GBps']:.2f} GB/s (sync reaches {out['sync_vs_cat_copy']:.0%} of it)"
    )
    return out


def test_sync_from_hf_state_dict(benchmark):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(_config())
    state = {k: v.detach() for k, v in source.state_dict().items()}
    engine = HFEngine(RolloutConfig(response_length=8), _config())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert 90e6 < nbytes / 4 < 130e6  # ~100M parameters

    versions = iter(range(1, 100))
    benchmark.pedantic(
        lambda: sync_weights(state.items(), engine, version=next(versions), bucket_bytes=BUCKET_BYTES),
        rounds=3,
        iterations=1,
    )
    for name, tensor in state.items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    plain_s = _cat_copy_seconds(list(state.values()), rounds=3)
    benchmark.extra_info.update(
        _report("HF state_dict -> HFEngine", nbytes, benchmark.stats.stats.min, plain_s)
    )


def megatron_sync(config_dir: str, tp: int, pp: int) -> dict | None:
    """Both export paths, same run: rank 0 syncs into its HF engine, the other ranks drain the export in step
    (they materialise full tensors too, as colocated ranks do). Timed on rank 0, best of 2 per path."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl_testing.traffic_counter import count_traffic
    from megatron_rl.models import build_gpt_model, load_hf_config
    from megatron_rl.weights import export_hf_buckets, export_hf_weights, export_hf_weights_tensorwise
    from megatron_rl.weights.export import ExportPlan

    init_model_parallel(tp=tp, pp=pp)
    torch.manual_seed(0)
    chunks = build_gpt_model(load_hf_config(config_dir))
    exports = {
        "tensorwise": lambda: export_hf_weights_tensorwise(chunks),
        # the trainer's stream (workers/actor.py): sealed buckets the engine adopts; the same export as (name,
        # tensor) pairs would be copied into sync_weights' buckets, then into the engine (70 % instead of 96 %)
        "shard_first": lambda: export_hf_buckets(chunks, ExportPlan(bucket_bytes=BUCKET_BYTES)),
        # only rank 0 materialises (a server-mode sender; on CPU this also stops the other ranks' conversion
        # from competing for the same cores, which on a GPU cluster runs on their own GPUs)
        "shard_first_rank0": lambda: export_hf_buckets(chunks, ExportPlan(frozenset({0}), BUCKET_BYTES)),
    }
    rank0 = torch.distributed.get_rank() == 0
    engine = HFEngine(RolloutConfig(response_length=8), config_dir) if rank0 else None
    versions = iter(range(1, 100))
    out: dict = {}
    for path, export in exports.items():
        if rank0:
            with torch.no_grad():
                for p in engine.model.parameters():
                    p.zero_()  # so the check below shows this path delivered the weights

        def one_sync():
            if rank0:
                sync_weights(export(), engine, version=next(versions), bucket_bytes=BUCKET_BYTES)
            else:
                for _ in export():
                    pass
            torch.distributed.barrier()

        with count_traffic(8) as counts:
            one_sync()
        out[f"{path}_collectives"] = counts["collectives"]
        out[f"{path}_s"] = best_seconds(2, one_sync)
        # check: the engine holds the trainer's weights (both paths must deliver the same bytes)
        exported = {name: t.clone() for name, t in export_hf_weights(chunks)}
        if rank0:
            held = engine.model.state_dict()
            for name, sent in exported.items():
                assert torch.equal(held[name], sent), (path, name)
            out["nbytes"] = sum(t.numel() * t.element_size() for t in exported.values())
            plain = _cat_copy_seconds(list(exported.values()), rounds=2)
            out["plain_s"] = min(out.get("plain_s", plain), plain)
        del exported
        torch.distributed.barrier()
    return out if rank0 else None


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_sync_from_megatron(tmp_path, tp, pp):
    _config().save_pretrained(str(tmp_path))
    result = run_multiprocess(megatron_sync, tp * pp, str(tmp_path), tp, pp, timeout_s=900)[0]
    for path in ("tensorwise", "shard_first", "shard_first_rank0"):
        _report(
            f"Megatron TP={tp} PP={pp} {path} export ({result[f'{path}_collectives']} collectives on rank 0) -> HFEngine",
            result["nbytes"], result[f"{path}_s"], result["plain_s"],
        )
