"""Weight-sync throughput on CPU: a ~100M-parameter Qwen2-shaped model into the HF engine.

Two sources, each against a plain ``torch.cat`` of the same tensors + ``copy_`` into a same-sized buffer
(the least memory traffic any sync into separate engine memory needs) in the same run:
- an HF ``state_dict`` in this process (timed by pytest-benchmark, best of 3);
- a Megatron actor at TP=2 (2 gloo ranks): ``export_hf_weights`` all-gathers each TP-sharded tensor,
  rank 0 pushes into its engine, rank 1 drains the export (timed inside the ranks, best of 2).
fp32 throughout (the CPU engine's dtype). Run:

    pytest benchmarks/test_weight_sync.py -s --benchmark-columns=min,mean,rounds
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.rollout import HFEngine, sync_weights

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
    from megatron_rl.models.testing import tiny_hf_config

    return tiny_hf_config("qwen2", **SHAPE)


def _best_of(rounds: int, fn) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _cat_copy_seconds(tensors: list[torch.Tensor], rounds: int) -> float:
    dst = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
    return _best_of(rounds, lambda: dst.copy_(torch.cat([t.reshape(-1) for t in tensors])))


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


def megatron_tp2_sync(config_dir: str) -> dict[str, float] | None:
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_gpt_model, export_hf_weights, load_hf_config

    init_model_parallel(tp=2)
    torch.manual_seed(0)
    chunks = build_gpt_model(load_hf_config(config_dir))
    if torch.distributed.get_rank() != 0:
        for _ in range(3):  # the export is collective: drain it in step with rank 0
            for _ in export_hf_weights(chunks):
                pass
        return None
    engine = HFEngine(RolloutConfig(response_length=8), config_dir)
    versions = iter(range(1, 100))
    sync_s = _best_of(
        2,
        lambda: sync_weights(
            export_hf_weights(chunks), engine, version=next(versions), bucket_bytes=BUCKET_BYTES
        ),
    )
    exported = {name: t.clone() for name, t in export_hf_weights(chunks)}
    held = engine.model.state_dict()
    for name, sent in exported.items():
        assert torch.equal(held[name], sent), name
    nbytes = sum(t.numel() * t.element_size() for t in exported.values())
    return {
        "nbytes": nbytes,
        "sync_s": sync_s,
        "plain_s": _cat_copy_seconds(list(exported.values()), rounds=2),
    }


@pytest.mark.distributed
def test_sync_from_megatron_tp2(tmp_path):
    _config().save_pretrained(str(tmp_path))
    result = run_multiprocess(megatron_tp2_sync, 2, str(tmp_path), timeout_s=300)[0]
    _report(
        "Megatron TP=2 (gloo all-gather) -> HFEngine", result["nbytes"], result["sync_s"], result["plain_s"]
    )
