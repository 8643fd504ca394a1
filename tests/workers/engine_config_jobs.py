"""The TP=2 job of test_engine_config.py: one MegatronEngine per planner-affecting key, and what the
built TransformerConfig / optimizer / HF config holds. Runs in one spawn of two gloo ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from workers_jobs import actor_config, error_message, training_batch, update

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

PREFIX = "actor_rollout_ref.actor"


def _engine(model_dir: str, megatron_overrides: dict[str, Any], optim=True, **kwargs: Any):
    from megatron_rl.workers import MegatronEngine

    config = actor_config(tp=2)
    megatron = replace(config.megatron, **megatron_overrides)
    return MegatronEngine(model_dir, megatron, config.optim if optim else None, name=PREFIX, **kwargs)


def _config_facts(engine) -> dict[str, Any]:
    c = engine.config
    return {
        "sequence_parallel": c.sequence_parallel,
        "tensor_model_parallel_size": c.tensor_model_parallel_size,
        "recompute_granularity": c.recompute_granularity,
        "recompute_method": c.recompute_method,
        "recompute_num_layers": c.recompute_num_layers,
        "recompute_modules": list(c.recompute_modules or []),
        "layernorm_epsilon": c.layernorm_epsilon,
        "params_dtype": c.params_dtype,
        "use_distributed_optimizer": engine.use_distributed_optimizer,
    }


def _actor(engine, config):
    from workers_jobs import ROLLOUT_N

    from megatron_rl.workers import ActorRole

    return ActorRole(engine, config, rollout_n=ROLLOUT_N)


def _section(out: dict[str, Any], name: str, fn) -> None:
    """Run one check; a failure is recorded (``<name>/crash``) so the other checks still report."""
    import traceback

    try:
        out.update({f"{name}/{key}": value for key, value in fn().items()})
    except Exception:  # noqa: BLE001 - reported to the test that reads this section
        out[f"{name}/crash"] = traceback.format_exc()


def engine_config_job(model_dir: str) -> dict[str, Any]:
    init_model_parallel(tp=2)
    out: dict[str, Any] = {}
    data = training_batch()
    config = actor_config(tp=2)

    def baseline():
        actor = _actor(_engine(model_dir, {}), config)
        return {"facts": _config_facts(actor.engine),
                "log_probs": actor.compute_log_prob(data).batch["old_log_probs"],
                "metrics": update(actor, data)}

    def sequence_parallel():
        actor = _actor(_engine(model_dir, {"sequence_parallel": True}), config)
        return {"facts": _config_facts(actor.engine),
                "log_probs": actor.compute_log_prob(data).batch["old_log_probs"],
                "metrics": update(actor, data)}

    def full_recompute():
        full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        actor = _actor(_engine(model_dir, {"override_transformer_config": full}), config)
        return {"facts": _config_facts(actor.engine), "metrics": update(actor, data)}

    def other_recompute():
        block = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}
        selective = {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
        return {
            "block": _config_facts(_engine(model_dir, {"override_transformer_config": block}, optim=False)),
            "selective": _config_facts(_engine(model_dir, {"override_transformer_config": selective}, optim=False)),
        }

    def refused_fields():
        return {
            "typo": error_message(
                lambda: _engine(model_dir, {"override_transformer_config": {"recompute_granulrity": "full"}})),
            "derived": error_message(
                lambda: _engine(model_dir, {"override_transformer_config": {"num_layers": 4}})),
        }

    def override_config():
        # actor_rollout_ref.model.override_config: the HF config fields reach the built model.
        engine = _engine(model_dir, {}, override_config={"rms_norm_eps": 1e-3})
        return {"facts": _config_facts(engine), "hf_eps": engine.hf_config.rms_norm_eps,
                "log_probs": _actor(engine, config).compute_log_prob(data).batch["old_log_probs"]}

    def optimizers():
        # use_distributed_optimizer: reaches DDP and the optimizer, or fails with the reason.
        result: dict[str, Any] = {}
        try:
            dist_opt = _engine(model_dir, {"use_distributed_optimizer": True})
            result["built"] = type(dist_opt.optimizer).__name__
            result["facts"] = _config_facts(dist_opt)
        except RuntimeError as err:
            result["error"] = str(err)
        plain = _engine(model_dir, {"use_distributed_optimizer": False})
        result["plain_config"] = {
            key: getattr(plain.optimizer.config, key)
            for key in ("lr", "weight_decay", "clip_grad", "use_distributed_optimizer", "bf16")
        }
        return result

    def params_dtype():
        bf16 = _engine(model_dir, {"params_dtype": "bf16"}, optim=False)
        return {"facts": _config_facts(bf16), "param_dtype": next(bf16.model[0].parameters()).dtype}

    def offload():
        out = {}
        for key in ("param_offload", "optimizer_offload"):
            engine = _engine(model_dir, {key: True})
            out[key] = {"params": engine.offload.params, "optimizer": engine.offload.optimizer}
        return out

    for name, fn in (("baseline", baseline), ("sp", sequence_parallel), ("full", full_recompute),
                     ("recompute", other_recompute), ("refused", refused_fields),
                     ("override_config", override_config), ("optim", optimizers),
                     ("bf16", params_dtype), ("offload", offload)):
        _section(out, name, fn)
    destroy_model_parallel()
    return out
