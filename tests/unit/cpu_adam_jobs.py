"""Rank job of test_cpu_adam.py: one-rank MegatronEngines (gloo, CPU) built with optim.override_optimizer_config,
and what Megatron's optimizer they hold says."""

from __future__ import annotations

from typing import Any

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

PREFIX = "actor_rollout_ref.actor"


def _facts(engine) -> dict[str, Any]:
    (inner,) = engine.optimizer.chained_optimizers  # one rank, a dense model: one Megatron optimizer
    config = inner.config
    return {
        "wrapper": type(inner).__name__,
        "adam": type(inner.optimizer).__name__,
        "eps": sorted({group["eps"] for group in inner.optimizer.param_groups}),
        **{name: getattr(config, name) for name in ("adam_eps", "log_num_zeros_in_grad", "lr", "adam_beta1",
                                                      "optimizer_cpu_offload", "optimizer_offload_fraction",
                                                      "use_precision_aware_optimizer")},
    }


def optimizer_job(model_dir: str) -> dict[str, Any]:
    from megatron_rl.config.schema import MegatronParallelConfig, OptimConfig
    from megatron_rl.workers import MegatronEngine

    init_model_parallel(tp=1)
    out: dict[str, Any] = {}
    try:
        def engine(overrides: dict[str, Any]):
            optim = OptimConfig(lr=1e-3, betas=[0.8, 0.99], override_optimizer_config=overrides)
            return MegatronEngine(model_dir, MegatronParallelConfig(), optim, name=PREFIX)

        out["plain"] = _facts(engine({}))
        out["passed"] = _facts(engine({"adam_eps": 1e-6, "log_num_zeros_in_grad": True}))
        for name, overrides in (("cpu_adam", {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}),
                                ("owned", {"adam_beta1": 0.5})):
            try:
                engine(overrides)
                out[name] = "built"
            except ValueError as err:
                out[name] = str(err)
    finally:
        destroy_model_parallel()
    return out
