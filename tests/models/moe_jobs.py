"""Rank jobs of test_moe.py (importable by spawned ranks): logits, export (and its counted traffic),
owned-expert reads and gradients of tiny Qwen3-MoE / Mixtral models at several TP / PP / EP / ETP layouts."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch

# (TP, PP, EP, ETP); ETP None = TP
GPUS_PER_NODE = 2  # for the traffic counter: 4 ranks are 2 simulated nodes
LAYOUTS_2 = [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (2, 1, 2, 1), (1, 2, 1, None)]
LAYOUTS_4 = [(2, 1, 2, None), (1, 2, 2, None)]


def _recorded_reads(monkeypatch_target) -> list[str]:
    names: list[str] = []
    original = monkeypatch_target.read

    def read(self, name, *args, **kwargs):
        names.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch_target.read = read
    return names


def _grads_by_hf_key(chunks) -> dict[str, torch.Tensor]:
    """Gradient of (logits * fixed weights).sum() on this rank's own rows, keyed by HF group key; grads of
    parameters replicated over the data-parallel group of their kind summed over it (what DDP does)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.models.api import position_ids_from_mask
    from megatron_rl.models.attention import causal_padding_mask
    from megatron_rl.models.layout import chunk_mappings

    input_ids, mask = batch()
    rank = parallel_state.get_data_parallel_rank()
    ids, mask = input_ids[rank::2], mask[rank::2]  # a different batch per data-parallel rank
    model = chunks[0]
    model.train()
    logits = model(ids, position_ids_from_mask(mask), causal_padding_mask(mask))
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))[: logits.shape[0]]
    (logits * weights * mask[..., None]).sum().backward()
    out = {}
    for mapping in chunk_mappings(model):
        grad = mapping.param.grad.clone()
        expert = mapping.group.expert is not None
        group = parallel_state.get_expert_data_parallel_group() if expert else parallel_state.get_data_parallel_group()
        dist.all_reduce(grad, group=group)
        out[mapping.group.key] = grad
    return out


def moe_checks(dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]]) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.weights import export_hf_weights
    from megatron_rl.models.hf_checkpoint import HFCheckpointReader
    from megatron_rl_testing.traffic_counter import count_traffic
    from megatron_rl.models.moe import local_experts

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}, "export_rank0": {}, "reads": {}, "grads": {}, "traffic": {}}
    reads = _recorded_reads(HFCheckpointReader)
    for tp, pp, ep, etp in layouts:
        init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
        key_layout = (tp, pp, ep, etp)
        for name, directory in dirs.items():
            reads.clear()
            chunks = build_from_hf(directory)
            owned = list(local_experts(chunks[0].hf_config.moe, ep, parallel_state.get_expert_model_parallel_rank()))
            out["reads"][name, key_layout] = (owned, sorted(set(reads)))
            logits = compute_full_logits(chunks, input_ids, attention_mask)
            if logits is not None:
                out["logits"][name, key_layout] = logits
            # small buckets: several expert buckets per layer and EP rank
            out["export"][name, key_layout] = [(n, t.clone()) for n, t in export_hf_weights(chunks, bucket_bytes=20_000)]
            out["export_rank0"][name, key_layout] = [
                (n, t.clone()) for n, t in export_hf_weights(chunks, bucket_bytes=20_000, consumers={0})
            ]
            with count_traffic(GPUS_PER_NODE) as counts:  # the collectives' bytes (plan/traffic.py's model)
                for _ in export_hf_weights(chunks, bucket_bytes=20_000):
                    pass
            out["traffic"][name, key_layout] = dict(counts)
            if tp == 1 and pp == 1:
                out["grads"][name, key_layout] = _grads_by_hf_key(chunks)
    out["rank"] = dist.get_rank()
    return out


def moe_actor_job(model_dir: str, steps: int) -> dict[str, Any]:
    """At EP=2 (2 ranks, DP=2), router losses on: the metrics of ``steps`` PPO updates; then, for an actor
    with ``megatron.freeze_router``, the largest change of each HF tensor over one update."""
    import sys
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from workers_jobs import actor_config, dp_shard, make_actor, training_batch, update, weights

    from megatron_rl.distributed import init_model_parallel

    init_model_parallel(tp=1, pp=1, ep=2)
    config = actor_config()
    megatron = replace(
        config.megatron,
        expert_model_parallel_size=2,
        override_transformer_config={"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001},
    )
    role = make_actor(model_dir, replace(config, megatron=megatron))
    metrics = [update(role, dp_shard(training_batch(seed=step))) for step in range(steps)]
    del role
    frozen = make_actor(model_dir, replace(config, megatron=replace(megatron, freeze_router=True)))
    before = weights(frozen)
    update(frozen, dp_shard(training_batch(seed=0)))
    change = {name: (tensor - before[name]).abs().max().item() for name, tensor in weights(frozen).items()}
    return {"metrics": metrics, "frozen_change": change}


def moe_sync_job(model_dir: str) -> dict[str, float]:
    """EP=2: export -> sync_weights -> an HF engine started from random weights; its log-probs vs the trainer's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
    from test_megatron_sync import _prompts, _trainer_log_prob_fn

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf
    from megatron_rl.weights import export_hf_weights, sync_weights, verify_sync
    from megatron_rl.rollout import HFEngine

    init_model_parallel(tp=1, pp=1, ep=2)
    chunks = build_from_hf(model_dir)
    torch.manual_seed(7)  # every rank's engine starts from the same random weights
    engine = HFEngine(RolloutConfig(response_length=6), model_dir)
    sync_weights(export_hf_weights(chunks), engine, version=1, bucket_bytes=16 << 10)
    return verify_sync(_trainer_log_prob_fn(chunks), engine, _prompts(), threshold=1e-5)
