"""Rank jobs of test_context_parallel.py: one batch through the actor, critic and reward model at CP=1
(the reference, one rank) and CP=2 (TP=1 x CP=2 on two ranks, TP=2 x CP=2 with and without sequence
parallelism on four), packed sequences of uneven lengths, some shorter than the 2 x CP chunks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from workers_jobs import actor_config, critic_config, make_actor, make_critic, training_batch, update

from megatron_rl.config.schema import LossAggMode
from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

# Loss aggregation modes whose normalisers must count each token once across CP ranks.
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def cp_batch():
    """The worker tests' batch with rows 3 and 7 cut to 2 and 3 tokens: shorter than 2 x CP = 4 chunks."""
    data = training_batch()
    batch = data.batch
    response_len = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - response_len
    for row, response_tokens in ((3, 1), (7, 2)):
        mask = torch.zeros_like(batch["attention_mask"][row])
        mask[prompt_len - 1] = 1
        mask[prompt_len : prompt_len + response_tokens] = 1
        batch["attention_mask"][row] = mask
        batch["input_ids"][row] *= mask
        response_mask = mask[prompt_len:]
        batch["response_mask"][row] = response_mask
        batch["responses"][row] *= response_mask
        for key in ("advantages", "values", "returns"):
            batch[key][row] *= response_mask
    batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    return data


def _megatron(config, layout: dict[str, Any]):
    return replace(config, megatron=replace(config.megatron, packed_sequences=True, **layout))


def _grads(role) -> dict[str, torch.Tensor]:
    """The gradient each parameter received in the last optimizer step (Megatron's main_grad)."""
    return {name: param.main_grad.detach().clone() for chunk in role.engine.model
            for name, param in chunk.named_parameters() if param.requires_grad}


def _reward_model_scores(model_dir: str, layout: dict[str, Any], data) -> torch.Tensor:
    from megatron_rl.config.schema import RewardModelConfig
    from megatron_rl.workers import MegatronEngine
    from megatron_rl.workers.reward_model_role import RewardModelRole

    config = RewardModelConfig(enable=True, micro_batch_size_per_gpu=4)
    megatron = replace(config.megatron, packed_sequences=True, **layout)
    engine = MegatronEngine(model_dir, megatron, None, value_head=True, name="reward_model")
    rows = data.select(["input_ids", "attention_mask"])
    return RewardModelRole(engine, config).compute_rm_score(rows).batch["rm_scores"]


def cp_job(model_dir: str, critic_dir: str, cp: int, tp: int, sequence_parallel: bool = False, pp: int = 1,
           vpp: int | None = None) -> dict[str, Any]:
    """Everything the tests compare, at TP=``tp`` x CP=``cp`` x PP=``pp`` (VPP ``vpp``), DP=1."""
    init_model_parallel(tp=tp, cp=cp, pp=pp, vpp=vpp)
    layout = {"tensor_model_parallel_size": tp, "context_parallel_size": cp, "sequence_parallel": sequence_parallel,
              "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vpp}
    data = cp_batch()
    out: dict[str, Any] = {}
    for mode in AGG_MODES:
        config = _megatron(actor_config(loss_agg_mode=LossAggMode[mode]), layout)
        actor = make_actor(model_dir, config)
        if mode == AGG_MODES[0]:
            result = actor.compute_log_prob(data)
            out["log_probs"], out["entropys"] = result.batch["old_log_probs"], result.batch["entropys"]
        out[f"{mode}/metrics"] = update(actor, data)
        out[f"{mode}/grads"] = _grads(actor)
        out[f"{mode}/log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    if vpp is None:  # (a token budget cuts micro-batch counts the interleaved schedule may not take)
        dynamic = _megatron(actor_config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24), layout)
        out["dynamic/metrics"] = update(make_actor(model_dir, dynamic), data)
    critic = make_critic(critic_dir, _megatron(critic_config(), layout))
    out["values"] = critic.compute_values(data).batch["values"]
    out["critic/metrics"] = critic.update_critic(data).meta_info["metrics"]
    out["critic/grads"] = _grads(critic)
    out["rm_scores"] = _reward_model_scores(critic_dir, layout, data)
    destroy_model_parallel()
    return out


def window_job(model_dir: str, cp: int) -> torch.Tensor:
    """Log-probs of a sliding-window model at CP=``cp`` (keys further back than the window masked on every
    chunk, including the keys gathered from the other CP ranks)."""
    init_model_parallel(cp=cp)
    config = _megatron(actor_config(), {"context_parallel_size": cp})
    log_probs = make_actor(model_dir, config).compute_log_prob(cp_batch()).batch["old_log_probs"]
    destroy_model_parallel()
    return log_probs


# the tiny Qwen2 the activation measurements run (the planner's tests of CP and TP scaling)
ACTIVATION_SHAPE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 384,
                    "vocab_size": 512}


def activation_job(model_dir: str, cp: int, tp: int = 1) -> dict[str, Any]:
    """The activations one training step of one micro-batch keeps per rank at CP=``cp`` x TP=``tp`` (sequence
    parallel at TP > 1; measured: autograd's saved tensors) and the real lengths of its sequences."""
    from workers_batches import make_rl_batch

    from megatron_rl_testing.saved_activations import SavedActivations

    init_model_parallel(cp=cp, tp=tp)
    data = make_rl_batch(4, prompt_len=32, response_len=480, seed=3)
    layout = {"context_parallel_size": cp, "tensor_model_parallel_size": tp, "sequence_parallel": tp > 1}
    config = _megatron(actor_config(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4), layout)
    actor = make_actor(model_dir, config)  # rollout n 2: 4 responses, one mini-batch, one micro-batch
    with SavedActivations([p for chunk in actor.engine.model for p in chunk.parameters()]) as saved:
        update(actor, data)
    destroy_model_parallel()
    return {"bytes": saved.nbytes, "lengths": data.batch["attention_mask"].sum(dim=1).tolist()}


def moe_cp_job(model_dir: str, cp: int, ep: int) -> dict[str, Any]:
    """An MoE actor at CP=``cp`` x EP=``ep`` (the experts split over the CP ranks' expert-parallel group), the
    load-balancing loss on: log-probs, one update's metrics, every gradient (experts named by their global index),
    the update's change of each HF weight, the log-probs after it."""
    import re

    from megatron.core import parallel_state

    from workers_jobs import weights

    init_model_parallel(cp=cp, ep=ep)
    layout = {"context_parallel_size": cp, "expert_model_parallel_size": ep,
              "override_transformer_config": {"moe_aux_loss_coeff": 0.01}}
    data = cp_batch()
    actor = make_actor(model_dir, _megatron(actor_config(), layout))
    out: dict[str, Any] = {"log_probs": actor.compute_log_prob(data).batch["old_log_probs"]}
    before = weights(actor)
    out["metrics"] = update(actor, data)
    local = actor.engine.model[0].module.decoder.layers[0].mlp.experts.num_local_experts
    first = parallel_state.get_expert_model_parallel_rank() * local

    def global_name(name: str) -> str:
        return re.sub(r"local_experts\.(\d+)", lambda m: f"experts.{first + int(m.group(1))}", name)

    out["grads"] = {global_name(name): grad for name, grad in _grads(actor).items()}
    out["step"] = {name: tensor - before[name] for name, tensor in weights(actor).items()}
    out["log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    destroy_model_parallel()
    return out
