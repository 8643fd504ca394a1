"""The spawned rank of the DPO role tests (tests/workers/test_dpo_role.py): one process, TP=PP=DP=1."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.config.preference_schema import DPOConfig
from megatron_rl.config.schema import MegatronParallelConfig, OptimConfig, RefConfig
from megatron_rl.data.preference import PreferencePair, preference_batch
from megatron_rl.data.sft import SFTExample
from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
from megatron_rl.protocol import DataProto

LR = 1e-3
PAD = 256


def pairs(seed: int = 0, count: int = 5) -> list[PreferencePair]:
    """``count`` pairs of random tokens of different lengths, the loss mask on each side's tail (its answer)."""
    gen = torch.Generator().manual_seed(seed)

    def side(prompt: int, answer: int) -> SFTExample:
        ids = torch.randint(0, 250, (prompt + answer,), generator=gen).tolist()
        return SFTExample(ids, [0] * prompt + [1] * answer, "synthetic")

    out = []
    for i in range(count):
        prompt = 3 + i % 3
        out.append(PreferencePair(side(prompt, 2 + (i * 2) % 5), side(prompt, 1 + (i * 3) % 4), f"pair {i}"))
    return out


def batch() -> DataProto:
    return preference_batch(pairs(), PAD)


def dpo_job(model_dir: str, ref_dir: str, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case: one DPO step from ``model_dir`` against the frozen ``ref_dir``; its metrics and the policy's
    sequence log-probs after the step."""
    from megatron_rl.workers import MegatronEngine, ReferenceRole
    from megatron_rl.workers.micro_batches import MicroBatchSpec
    from megatron_rl.workers.preference import DPORole

    init_model_parallel(tp=1, pp=1)
    parallel = MegatronParallelConfig(tensor_model_parallel_size=1)
    reference = ReferenceRole(MegatronEngine(ref_dir, parallel, None, name="actor_rollout_ref.ref"), RefConfig())
    data, out = batch(), {}
    for name, case in cases.items():
        dpo = DPOConfig(**case["dpo"])
        engine = MegatronEngine(model_dir, parallel, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1e6))
        role = DPORole(engine, MicroBatchSpec(*case["micro_batch"]), None if dpo.loss_type == "simpo" else reference,
                       dpo)
        before = role.sequence_log_probs(data).batch["policy_logps"]
        out[name] = {"metrics": role.train_batch(data).meta_info["metrics"], "before": before,
                     "after": role.sequence_log_probs(data).batch["policy_logps"]}
    destroy_model_parallel()
    return out


def lora_job(model_dir: str) -> dict[str, Any]:
    """Two DPO steps of a LoRA actor whose reference is itself with the adapters off (``dpo.reference=auto`` with
    LoRA): the reference's sequence log-probs before and after, and the frozen base model's for comparison."""
    from megatron_rl.config.schema import LoRAConfig
    from megatron_rl.workers import MegatronEngine, ReferenceRole
    from megatron_rl.workers.micro_batches import MicroBatchSpec
    from megatron_rl.workers.preference import DPORole

    init_model_parallel(tp=1, pp=1)
    parallel = MegatronParallelConfig(tensor_model_parallel_size=1)
    data = batch()
    engine = MegatronEngine(model_dir, parallel, OptimConfig(lr=1e-2, weight_decay=0.0), lora=LoRAConfig(rank=4))
    role = DPORole(engine, MicroBatchSpec(3, False, 64), ReferenceRole(engine, RefConfig(), adapters_off=True),
                   DPOConfig(beta=0.5))
    out = {"ref_before": role.sequence_log_probs(data).batch["ref_logps"],
           "metrics": [role.train_batch(data).meta_info["metrics"] for _ in range(2)]}
    rows = role.sequence_log_probs(data).batch
    out |= {"ref_after": rows["ref_logps"], "policy_after": rows["policy_logps"]}
    base = DPORole(MegatronEngine(model_dir, parallel, OptimConfig(lr=1e-2)), MicroBatchSpec(10, False, 64),
                   ReferenceRole(MegatronEngine(model_dir, parallel, None, name="actor_rollout_ref.ref"), RefConfig()),
                   DPOConfig(beta=0.5))
    out["base"] = base.sequence_log_probs(data).batch["ref_logps"]
    destroy_model_parallel()
    return out


def two_rank_job(model_dir: str, ref_dir: str, case: dict[str, Any], tp: int = 1, pp: int = 1) -> dict[str, Any]:
    """``case``'s step on two ranks: TP=2 or PP=2 (policy and frozen reference at that layout, the whole batch), or
    DP=2 (each rank takes its half of the 10 rows, pair 2 split between them)."""
    from megatron.core import parallel_state

    from megatron_rl.workers import MegatronEngine, ReferenceRole
    from megatron_rl.workers.micro_batches import MicroBatchSpec
    from megatron_rl.workers.preference import DPORole

    init_model_parallel(tp=tp, pp=pp)
    parallel = MegatronParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    reference = ReferenceRole(MegatronEngine(ref_dir, parallel, None, name="actor_rollout_ref.ref"), RefConfig())
    engine = MegatronEngine(model_dir, parallel, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1e6))
    role = DPORole(engine, MicroBatchSpec(*case["micro_batch"]), reference, DPOConfig(**case["dpo"]))
    dp = parallel_state.get_data_parallel_world_size()
    shard = batch().chunk(dp)[parallel_state.get_data_parallel_rank()]
    out = {"metrics": role.train_batch(shard).meta_info["metrics"],
           "after": role.sequence_log_probs(shard).batch["policy_logps"], "pair_index": shard.batch["pair_index"]}
    destroy_model_parallel()
    return out
