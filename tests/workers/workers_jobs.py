"""Multi-rank jobs of the worker tests. Each job runs many checks in one spawn (Megatron imports and
process start-up dominate the cost) and returns plain tensors/floats; the tests compare them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from workers_batches import make_rl_batch

from megatron_rl.config.schema import (
    ActorConfig,
    CriticConfig,
    MegatronParallelConfig,
    OptimConfig,
    RefConfig,
)
from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
from megatron_rl.protocol import DataProto

ROLLOUT_N = 2
MINI_BATCH_PROMPTS = 8  # x ROLLOUT_N = 16 responses: one mini-batch per update of a 16-row batch
BATCH_ROWS = 16
TEMPERATURE = 0.7


def parallel(tp: int = 1, pp: int = 1, vpp: int | None = None) -> MegatronParallelConfig:
    return MegatronParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )


def actor_config(tp: int = 1, pp: int = 1, vpp: int | None = None, **overrides: Any) -> ActorConfig:
    base = ActorConfig(
        ppo_mini_batch_size=MINI_BATCH_PROMPTS,
        ppo_micro_batch_size_per_gpu=4,
        ppo_max_token_len_per_gpu=40,
        clip_ratio=0.2,
        entropy_coeff=0.01,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        megatron=parallel(tp, pp, vpp),
    )
    return replace(base, **overrides)


def critic_config(tp: int = 1, **overrides: Any) -> CriticConfig:
    base = CriticConfig(
        ppo_mini_batch_size=MINI_BATCH_PROMPTS,
        ppo_epochs=1,
        ppo_micro_batch_size_per_gpu=4,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
        megatron=parallel(tp),
    )
    return replace(base, **overrides)


def make_actor(model_dir: str, config: ActorConfig):
    from megatron_rl.workers import ActorRole, MegatronEngine

    return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)


def make_critic(model_dir: str, config: CriticConfig):
    from megatron_rl.workers import CriticRole, MegatronEngine

    engine = MegatronEngine(model_dir, config.megatron, config.optim, value_head=True, name="critic")
    return CriticRole(engine, config, rollout_n=ROLLOUT_N)


def training_batch(seed: int = 0, rows: int = BATCH_ROWS, group: int = 1) -> DataProto:
    """A batch whose old log-probs are perturbed so the PPO ratio (and its clipping) is exercised;
    ``group`` consecutive rows share a prompt."""
    data = make_rl_batch(rows, seed=seed, temperature=TEMPERATURE, group=group)
    gen = torch.Generator().manual_seed(seed + 1)
    data.batch["old_log_probs"] = -5.0 + 0.3 * torch.randn(data.batch["old_log_probs"].shape, generator=gen)
    return data


def weights(role) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in role.export_buckets() for name, tensor in bucket.named_tensors()}


def dp_shard(data: DataProto) -> DataProto:
    """This rank's shard, as MEGATRON_COMPUTE_PROTO dispatch would give it."""
    from megatron.core import parallel_state

    return data.chunk(parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]


def error_message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error raised"


def update(role, data: DataProto) -> dict[str, float]:
    return role.update_actor(data).meta_info["metrics"]


# ---------------------------------------------------------------------------------------- world 1
def single_rank_job(model_dir: str, deep_model_dir: str, critic_dir: str, workdir: str) -> dict[str, Any]:
    """TP=PP=DP=1: the reference numbers, plus everything that needs only one rank."""
    from megatron_rl.workers import MegatronEngine, ReferenceRole

    init_model_parallel(tp=1, pp=1)
    out: dict[str, Any] = {}
    data = training_batch()

    actor = make_actor(model_dir, actor_config())
    log_probs = actor.compute_log_prob(data)
    out["log_probs"] = log_probs.batch["old_log_probs"]
    out["entropys"] = log_probs.batch["entropys"]
    dynamic = make_actor(model_dir, actor_config(use_dynamic_bsz=True))
    out["log_probs_dynamic"] = dynamic.compute_log_prob(data).batch["old_log_probs"]
    ref = ReferenceRole(
        MegatronEngine(model_dir, parallel(), name="actor_rollout_ref.ref"),
        RefConfig(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=24),
    )
    out["ref_log_prob"] = ref.compute_ref_log_prob(data).batch["ref_log_prob"]

    # Split invariance: micro-batch 4 (the reference), 1, and a token budget; two loss modes.
    for mode in ("token-mean", "seq-mean-token-mean"):
        for name, overrides in (
            ("micro4", {}),
            ("micro1", {"ppo_micro_batch_size_per_gpu": 1}),
            ("dynamic", {"use_dynamic_bsz": True}),
        ):
            role = make_actor(model_dir, actor_config(loss_agg_mode=mode, **overrides))
            out[f"{mode}/{name}/metrics"] = update(role, data)
            out[f"{mode}/{name}/weights"] = weights(role)

    # Resume: step 1, save, step 2 (the uninterrupted run; a fresh process resumes in resume_job).
    role = make_actor(model_dir, actor_config())
    update(role, data)
    role.save_checkpoint(f"{workdir}/resume_ckpt", extra={"data_position": 17})
    out["resume/step2_metrics"] = update(role, training_batch(seed=5))
    out["resume/step2_weights"] = weights(role)

    # PPO on a fixed batch with positive advantages raises those tokens' log-probs.
    role = make_actor(
        model_dir, actor_config(entropy_coeff=0.0, optim=OptimConfig(lr=1e-3, weight_decay=0.0))
    )
    fixed = make_rl_batch(BATCH_ROWS, seed=3, temperature=TEMPERATURE)
    fixed.batch["old_log_probs"] = role.compute_log_prob(fixed).batch["old_log_probs"]
    fixed.batch["advantages"] = fixed.batch["response_mask"].float()
    out["ppo/metrics"] = [update(role, fixed) for _ in range(3)]
    out["ppo/before"] = fixed.batch["old_log_probs"]
    out["ppo/after"] = role.compute_log_prob(fixed).batch["old_log_probs"]
    out["ppo/mask"] = fixed.batch["response_mask"]

    critic = make_critic(critic_dir, critic_config())
    out["critic/values"] = critic.compute_values(data).batch["values"]
    out["critic/metrics"] = [critic.update_critic(data).meta_info["metrics"] for _ in range(4)]

    deep = make_actor(deep_model_dir, actor_config())
    out["deep/log_probs"] = deep.compute_log_prob(data).batch["old_log_probs"]
    out["deep/metrics"] = update(deep, data)

    missing = training_batch()
    missing.pop(["advantages"])
    out["error/missing"] = error_message(lambda: actor.update_actor(missing))
    short = training_batch()
    short.batch["old_log_probs"] = short.batch["old_log_probs"][:, :-1]
    out["error/shape"] = error_message(lambda: actor.update_actor(short))
    no_temperature = training_batch()
    no_temperature.meta_info.clear()
    out["error/temperature"] = error_message(lambda: actor.compute_log_prob(no_temperature))
    destroy_model_parallel()
    return out


# ---------------------------------------------------------------------------------------- world 2
def two_rank_job(model_dir: str, deep_model_dir: str, critic_dir: str, workdir: str) -> dict[str, Any]:
    """The same numbers at TP=2, DP=2, PP=2 and PP=2 x VPP=2 (re-initialising the parallel state)."""
    out: dict[str, Any] = {}
    data = training_batch()

    init_model_parallel(tp=2)
    actor = make_actor(model_dir, actor_config(tp=2))
    out["tp2/log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    out["tp2/metrics"] = update(actor, data)
    out["tp2/weights"] = weights(actor)
    out["tp2/log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    actor.save_checkpoint(f"{workdir}/tp2_ckpt")
    critic = make_critic(critic_dir, critic_config(tp=2))
    out["tp2/values"] = critic.compute_values(data).batch["values"]

    init_model_parallel(tp=1)  # DP = 2: each rank gets half of the batch
    actor = make_actor(model_dir, actor_config(ppo_micro_batch_size_per_gpu=2))
    shard = dp_shard(data)
    out["dp2/log_probs"] = actor.compute_log_prob(shard).batch["old_log_probs"]
    out["dp2/metrics"] = update(actor, shard)
    out["dp2/weights"] = weights(actor)

    init_model_parallel(tp=1, pp=2)
    actor = make_actor(model_dir, actor_config(pp=2))
    out["pp2/log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    out["pp2/metrics"] = update(actor, data)
    out["pp2/weights"] = weights(actor)

    init_model_parallel(tp=1, pp=2, vpp=2)
    # 16 rows in micro-batches of 3: uneven micro-batches through the interleaved schedule
    actor = make_actor(deep_model_dir, actor_config(pp=2, vpp=2, ppo_micro_batch_size_per_gpu=3))
    out["vpp/log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    out["vpp/metrics"] = update(actor, data)
    destroy_model_parallel()
    return out


# ---------------------------------------------------------------------------------------- world 1, later
def resume_job(model_dir: str, workdir: str) -> dict[str, Any]:
    """A fresh process: load the TP=2 checkpoint at TP=1, and resume the single-rank run at step 2."""
    init_model_parallel(tp=1)
    out: dict[str, Any] = {}
    resharded = make_actor(model_dir, actor_config())
    resharded.load_checkpoint(f"{workdir}/tp2_ckpt")
    out["tp2_ckpt/log_probs"] = resharded.compute_log_prob(training_batch()).batch["old_log_probs"]

    resumed = make_actor(model_dir, actor_config())
    out["resume/extra"] = resumed.load_checkpoint(f"{workdir}/resume_ckpt")
    out["resume/step2_metrics"] = update(resumed, training_batch(seed=5))
    out["resume/step2_weights"] = weights(resumed)

    # A save that dies half-way leaves the checkpoint already at that path loadable and unchanged.
    out["crash/error"] = crash_during_save(resumed, f"{workdir}/resume_ckpt")
    reloaded = make_actor(model_dir, actor_config())
    reloaded.load_checkpoint(f"{workdir}/resume_ckpt")
    out["crash/metrics_after_reload"] = update(reloaded, training_batch(seed=5))
    destroy_model_parallel()
    return out


def crash_during_save(role, path: str) -> str:
    """Save over ``path`` with the tensor write failing after the temporary directory was filled."""
    from megatron.core import dist_checkpointing

    original = dist_checkpointing.save

    def write_then_die(state, directory, **kwargs):
        original(state, directory, **kwargs)
        raise OSError("disk full (simulated)")

    dist_checkpointing.save = write_then_die
    try:
        role.save_checkpoint(path)
    except OSError as err:
        return str(err)
    finally:
        dist_checkpointing.save = original
    return "no error raised"
