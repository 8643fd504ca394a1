"""Rank jobs of test_mtp_training.py: the actor's update with the multi-token-prediction layers built, trained
jointly, trained alone (detach_encoder) or frozen, in the padded and the packed (THD) layouts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workers_jobs import ROLLOUT_N, actor_config, training_batch, update, weights

from megatron_rl.config.schema import MTPConfig
from megatron_rl.distributed import init_model_parallel

# model.mtp settings by case: None = the layers not built
CASES = {
    "off": None,
    "frozen": MTPConfig(enable=True),
    "joint": MTPConfig(enable=True, enable_train=True, mtp_loss_scaling_factor=0.5),
    "detached": MTPConfig(enable=True, enable_train=True, detach_encoder=True, mtp_loss_scaling_factor=0.5),
}


def mtp_update_job(model_dir: str, tp: int, workdir: str) -> dict[str, Any]:
    """For each case and layout: the exported weights before and after one update, and its metrics; the joint
    padded run is then saved, loaded into a fresh actor and updated again next to the original."""
    from megatron_rl.workers import ActorRole, MegatronEngine

    init_model_parallel(tp=tp)
    data = training_batch()
    out: dict[str, Any] = {}
    for layout in ("padded", "packed"):
        for case, mtp in CASES.items():
            if layout == "packed" and case in ("off", "frozen"):
                continue
            config = actor_config(tp=tp)
            # no clipping: the gradient norm counts the MTP layer's gradients, and a clip factor that differs
            # between the cases would move the main model's update by Adam's float noise
            config = replace(config, optim=replace(config.optim, clip_grad=1e9),
                             megatron=replace(config.megatron, packed_sequences=layout == "packed",
                                              sequence_parallel=tp > 1))
            engine = MegatronEngine(model_dir, config.megatron, config.optim, mtp=mtp)
            actor = ActorRole(engine, config, rollout_n=ROLLOUT_N)
            before = weights(actor)
            metrics = update(actor, data)
            out[layout, case] = dict(before=before, after=weights(actor), metrics=metrics,
                                     sync_names=sorted(name for bucket in actor.export_buckets(
                                         actor_sync_plan()) for name, _ in bucket.named_tensors()))
            if (layout, case) == ("padded", "joint"):
                actor.save_checkpoint(f"{workdir}/joint")
                resumed = ActorRole(MegatronEngine(model_dir, config.megatron, config.optim, mtp=mtp), config,
                                    rollout_n=ROLLOUT_N)
                resumed.load_checkpoint(f"{workdir}/joint")
                second = training_batch(seed=5)
                out["resume"] = dict(loaded=weights(resumed), continued=(update(actor, second), weights(actor)),
                                     resumed=(update(resumed, second), weights(resumed)))
    return out


def actor_sync_plan():
    """The export plan the weight sync uses (weights/replica.py): the MTP layers left out."""
    from megatron_rl.weights.export import ExportPlan

    return ExportPlan(with_mtp=False)
