"""Spawned jobs of tests/workers/test_sft_role.py: one SFT optimizer step at each layout, returned as plain numbers."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.config.schema import MegatronParallelConfig, OptimConfig
from megatron_rl.data.sft import SFTExample, sft_batch
from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
from megatron_rl.protocol import DataProto

LR = 1e-2
PAD = 0


def conversations(vocab: int, rows: int = 8, seed: int = 0) -> DataProto:
    """Rows of 9-20 random tokens, each with two "assistant" spans under the loss mask (a multi-turn row), the last
    1-5 tokens long: rows hold different numbers of target tokens."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for row in range(rows):
        n = int(torch.randint(9, 21, (1,), generator=gen))
        ids = torch.randint(1, vocab, (n,), generator=gen).tolist()
        mask = [0] * n
        first = int(torch.randint(2, n // 2, (1,), generator=gen))
        mask[first:first + 3] = [1, 1, 1]
        last = int(torch.randint(1, 6, (1,), generator=gen))
        mask[n - last:] = [1] * last
        examples.append(SFTExample(ids, mask, f"row {row}"))
    return sft_batch(examples, PAD)


def make_role(model_dir: str, tp: int, pp: int, micro: int, dynamic: bool = False, **layout: Any):
    from megatron_rl.workers.engine import MegatronEngine
    from megatron_rl.workers.micro_batches import MicroBatchSpec
    from megatron_rl.workers.sft import SFTRole

    megatron = MegatronParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **layout)
    optim = OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1e9)
    return SFTRole(MegatronEngine(model_dir, megatron, optim), MicroBatchSpec(micro, dynamic, 24))


def weights(role) -> dict[str, torch.Tensor]:
    from megatron_rl.weights.export import ExportPlan, export_hf_buckets

    return {name: t.clone() for bucket in export_hf_buckets(role.engine.model, ExportPlan())
            for name, t in bucket.named_tensors()}


def dp_shard(data: DataProto) -> DataProto:
    from megatron.core import parallel_state

    return data.chunk(parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]


def step(model_dir: str, vocab: int, tp: int, pp: int, micro: int, dynamic: bool = False,
         shard: bool = False, **layout: Any) -> dict[str, Any]:
    init_model_parallel(tp=tp, pp=pp, cp=layout.get("context_parallel_size", 1))
    role = make_role(model_dir, tp, pp, micro, dynamic, **layout)
    data = conversations(vocab)
    before = role.token_log_probs(data).batch["log_probs"]
    metrics = role.train_batch(dp_shard(data) if shard else data).meta_info["metrics"]
    out = {"log_probs": before, "metrics": metrics, "weights": weights(role)}
    destroy_model_parallel()
    return out


def one_rank_job(model_dir: str, vocab: int) -> dict[str, Any]:
    """TP=PP=1 with micro-batches of 8 (the whole batch), of 3, token-budgeted (dynamic), and packed sequences."""
    return {"whole": step(model_dir, vocab, 1, 1, 8), "micro3": step(model_dir, vocab, 1, 1, 3),
            "dynamic": step(model_dir, vocab, 1, 1, 2, dynamic=True),
            "packed": step(model_dir, vocab, 1, 1, 3, packed_sequences=True)}


def two_rank_job(model_dir: str, vocab: int) -> dict[str, Any]:
    """TP=2, PP=2, DP=2 (each rank a half of the batch) and CP=2 (each rank a part of every sequence, packed) on
    the same batch."""
    return {"tp2": step(model_dir, vocab, 2, 1, 4), "pp2": step(model_dir, vocab, 1, 2, 2),
            "dp2": step(model_dir, vocab, 1, 1, 2, shard=True),
            "cp2": step(model_dir, vocab, 1, 1, 4, packed_sequences=True, context_parallel_size=2)}
