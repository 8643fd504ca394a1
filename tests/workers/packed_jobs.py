"""Rank jobs of test_packed_sequences.py: the same batch through padded, packed (THD) and shared-prompt
micro-batches."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workers_jobs import ROLLOUT_N, actor_config, training_batch, update

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

# consecutive rows sharing a prompt in the batch (GRPO's n): what megatron.share_prompts computes once
PROMPT_GROUP = 4
# layout -> the megatron keys that select it
LAYOUTS = {"padded": {}, "packed": {"packed_sequences": True}, "shared": {"share_prompts": True}}


def _actor(model_dir: str, config, **megatron: Any):
    from megatron_rl.workers import ActorRole, MegatronEngine

    config = replace(config, megatron=replace(config.megatron, **megatron))
    return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)


def _computed_tokens(actor, data) -> tuple[int, str]:
    from megatron_rl.workers.forward import pack_batch
    from megatron_rl.workers.micro_batches import MicroBatchSpec

    spec = MicroBatchSpec(actor.config.ppo_micro_batch_size_per_gpu, actor.config.use_dynamic_bsz,
                          actor.config.ppo_max_token_len_per_gpu)
    micro_batches = pack_batch(actor.engine, data, spec, (), "test")
    kinds = {"packed" if mb.is_thd else "shared" if mb.is_shared else "padded" for mb in micro_batches}
    return sum(mb.computed_tokens for mb in micro_batches), "/".join(sorted(kinds))


def _pair(model_dir: str, config, data, **megatron: Any) -> dict[str, Any]:
    out = {}
    for name, layout in LAYOUTS.items():
        actor = _actor(model_dir, config, **layout, **megatron)
        result = actor.compute_log_prob(data)
        out[f"{name}/log_probs"] = result.batch["old_log_probs"]
        out[f"{name}/entropys"] = result.batch["entropys"]
        out[f"{name}/metrics"] = update(actor, data)
        out[f"{name}/computed_tokens"] = _computed_tokens(actor, data)
    return out


def _critic_values(model_dir: str, layout: str, sequence_parallel: bool, data):
    import torch
    from workers_jobs import critic_config

    from megatron_rl.workers import CriticRole, MegatronEngine

    config = critic_config(tp=2)
    megatron = replace(config.megatron, sequence_parallel=sequence_parallel, **LAYOUTS[layout])
    torch.manual_seed(3)  # the same random value head for both layouts
    engine = MegatronEngine(model_dir, megatron, config.optim, value_head=True, name="critic")
    return CriticRole(engine, config, rollout_n=ROLLOUT_N).compute_values(data).batch["values"]


def packed_job(model_dir: str, deep_model_dir: str) -> dict[str, Any]:
    from workers_jobs import error_message

    data = training_batch(group=PROMPT_GROUP)
    out: dict[str, Any] = {"real_tokens": int(data.batch["attention_mask"].sum())}
    init_model_parallel(tp=2)
    for key, value in _pair(model_dir, actor_config(tp=2), data).items():
        out[f"tp2/{key}"] = value
    for key, value in _pair(model_dir, actor_config(tp=2), data, sequence_parallel=True).items():
        out[f"tp2_sp/{key}"] = value
    for sp in (False, True):
        for layout in LAYOUTS:
            out[f"critic_sp{int(sp)}/{layout}/values"] = _critic_values(model_dir, layout, sp, data)
    out["both_layouts_error"] = error_message(
        lambda: _actor(model_dir, actor_config(tp=2), packed_sequences=True, share_prompts=True))
    dynamic = actor_config(tp=2, use_dynamic_bsz=True)
    for key, value in _pair(model_dir, dynamic, data).items():
        out[f"tp2_dynamic/{key}"] = value
    init_model_parallel(tp=1, pp=2)
    for key, value in _pair(model_dir, actor_config(pp=2), data).items():
        out[f"pp2/{key}"] = value
    init_model_parallel(tp=1, pp=2, vpp=2)
    vpp = actor_config(pp=2, vpp=2, ppo_micro_batch_size_per_gpu=PROMPT_GROUP)  # whole groups: shared under VPP
    for key, value in _pair(deep_model_dir, vpp, data).items():
        out[f"vpp/{key}"] = value
    destroy_model_parallel()
    return out
