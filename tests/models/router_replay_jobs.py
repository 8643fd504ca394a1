"""Rank jobs of test_router_replay.py: the HF engine's rollout (with its routing) scored and trained by a Megatron
actor with routing replay, at several layouts; plain tensors back to the test."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

RESPONSE_LENGTH = 5


def near_tied(model_dir: str, out_dir: str, spread: float) -> str:
    """A copy of ``model_dir`` whose routers' rows are one shared row plus ``spread`` x noise: router logits that
    nearly tie, so that tiny numerical differences between engine and trainer flip the top-k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                shared = param[0:1].clone()
                param.copy_(shared + spread * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def prompts(rows: int = 8, width: int = 7):
    from megatron_rl.protocol import DataProto

    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(2, width + 1, (rows,), generator=gen)
    lengths[0] = width
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    ids = torch.randint(1, 300, (rows, width), generator=gen) * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               meta_info={"seed": 5, "temperature": 1.0})


def rollout(model_dir: str) -> Any:
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.hf_engine import HFEngine

    config = OmegaConf.structured(RolloutConfig(name="hf", enable_rollout_routing_replay=True))
    engine = HFEngine(config, model_dir, weights_path=model_dir, device="cpu", response_length=RESPONSE_LENGTH)
    data = engine.generate_sequences(prompts())
    data.meta_info["temperature"] = 1.0
    gen = torch.Generator().manual_seed(2)
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    return data


def replay_job(model_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, packed: bool = False,
               recompute: bool = False, mode: str = "R3") -> dict[str, Any]:
    """Old log-probs and routing of the engine's rollout with and without replay; one update's metrics."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
    from workers_jobs import actor_config, dp_shard, make_actor, update

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models.moe_routing import recording_routing
    from megatron_rl.protocol import DataProto
    from megatron_rl.workers.forward import compute_log_probs
    from megatron_rl.workers.routing_replay import recorded_routed_experts

    init_model_parallel(tp=tp, pp=pp, ep=ep)
    data = dp_shard(rollout(model_dir))
    config = actor_config(tp=tp, pp=pp)
    overrides = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                 if recompute else {})
    megatron = replace(config.megatron, expert_model_parallel_size=ep, packed_sequences=packed,
                       override_transformer_config=overrides)
    megatron = replace(megatron, router_replay=replace(megatron.router_replay, mode=mode))
    role = make_actor(model_dir, replace(config, megatron=megatron, ppo_mini_batch_size=4))

    def scored(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        with recording_routing(role.engine) as recorder:
            out = compute_log_probs(role.engine, batch, role.log_prob_spec, 1.0, False, "test")
        return out["log_probs"], recorded_routed_experts(role.engine, recorder, batch)

    plain = DataProto.from_dict({k: v for k, v in data.batch.items() if k != "routed_experts"},
                                meta_info=dict(data.meta_info))
    result: dict[str, Any] = {"engine": data.batch["routed_experts"], "mask": data.batch["attention_mask"],
                              "response_mask": data.batch["response_mask"],
                              "rollout_log_probs": data.batch["rollout_log_probs"]}
    result["plain_log_probs"], result["plain_routing"] = scored(plain)
    if mode == "R3":
        result["replay_log_probs"], result["replay_routing"] = scored(data)
        old = role.compute_log_prob(data)
    else:  # R2: the old-log-prob pass records, the update replays
        old = role.compute_log_prob(plain)
        result["recorded"] = old.batch["routed_experts"]
        data = plain.union(DataProto.from_dict({"routed_experts": old.batch["routed_experts"]}))
    data.batch["old_log_probs"] = old.batch["old_log_probs"]
    result["metrics"] = update(role, data)
    return result
