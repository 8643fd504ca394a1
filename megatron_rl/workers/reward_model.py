"""RewardModelWorker: one rank of the reward model (a frozen, Megatron-sharded ``*ForSequenceClassification``),
and the worker group the reward function calls: its own Ray pool, or the trainer's processes under torchrun.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_rl.config import PPOTrainerConfig
from megatron_rl.controller import Dispatch, Worker, register
from megatron_rl.controller.deadlines import call_deadlines, collective_timeout_s
from megatron_rl.controller.local_group import LocalWorkerGroup
from megatron_rl.protocol import DataProto
from megatron_rl.workers.hybrid import setup_parallel_state, trainer_config


class RewardModelWorker(Worker):
    """``config`` is the whole trainer config (``PPOTrainerConfig``); the RM is ``reward_model``."""

    def __init__(self, config: PPOTrainerConfig) -> None:
        super().__init__()
        self.config = trainer_config(config, type(self).__name__)
        self.role = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        # megatron-core: the driver imports this module to start the group (trainer/reward_setup.py)
        from megatron_rl.workers import MegatronEngine
        from megatron_rl.workers.reward_model_role import RewardModelRole

        rm = self.config.reward_model
        setup_parallel_state(rm.megatron, collective_timeout_s(self.config))
        engine = MegatronEngine(rm.model.path, rm.megatron, None, value_head=True, name="reward_model",
                                override_config=rm.model.override_config)
        self.role = RewardModelRole(engine, rm)
        self.set_mesh(**engine.mesh_kwargs())

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """{"rm_scores": [B]} of RM token rows (input_ids, attention_mask)."""
        return self.role.compute_rm_score(data)


class StartedOnFirstCall:
    """Under torchrun the RM joins the parallel state the actor sets up, so it is built at its first use."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start = start
        self._group = None

    def compute_rm_score(self, data: DataProto) -> DataProto:
        if self._group is None:
            self._group = self._start()
        return self._group.compute_rm_score(data)


def colocated_with_actor(cfg: PPOTrainerConfig) -> bool:
    """Whether the Ray run puts the RM in the hybrid engine's processes (verl's enable_resource_pool=false)."""
    rm = cfg.reward_model
    return bool(rm.enable and not rm.judge.enable and not rm.enable_resource_pool)


def reward_model_group(cfg: PPOTrainerConfig, colocated: Any | None) -> tuple[Any | None, Callable[[], None]]:
    """THE place the reward model's worker group is made, for every placement, once the trainer's groups exist;
    returns it (None without a classifier RM) and what stops it. Colocated with the actor (Ray,
    ``reward_model.enable_resource_pool=false``): ``colocated``, the RM role of the hybrid engine's processes,
    its model built here. Under Ray with ``enable_resource_pool``: its own resource pool of
    ``reward_model.n_gpus_per_node`` x ``reward_model.nnodes`` ranks (0: the trainer's). Under torchrun: the
    trainer's processes, built at the first scoring (the actor's parallel state exists by then)."""
    if not cfg.reward_model.enable or cfg.reward_model.judge.enable:
        return None, lambda: None
    if colocated is not None:
        colocated.init_model()
        return colocated, lambda: None
    if cfg.trainer.launcher == "torchrun":
        def start() -> LocalWorkerGroup:
            group = LocalWorkerGroup(RewardModelWorker(config=cfg), "reward_model")
            group.init_model()
            return group

        return StartedOnFirstCall(start), lambda: None

    # Ray: a torchrun run never imports it
    from megatron_rl.controller import RayResourcePool, RayWorkerGroup, init_ray_from_config

    init_ray_from_config(cfg.ray_init)  # does nothing when Ray is already up
    rm = cfg.reward_model
    per_node, nodes = rm.n_gpus_per_node or cfg.trainer.n_gpus_per_node, rm.nnodes or cfg.trainer.nnodes
    # As the trainer's pool: a GPU per rank on a CUDA run, else GPUs only where the cluster has them.
    cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    pool = RayResourcePool([per_node] * nodes, use_gpu=True if cuda else None, name="reward_model_pool")
    group = RayWorkerGroup(pool, RewardModelWorker, init_args={"config": cfg}, name_prefix="reward_model",
                           timeout_s=cfg.ray_init.timeout_s, method_timeouts=call_deadlines(cfg))
    try:
        group.init_model()
    except BaseException:
        group.kill()
        pool.release()
        raise

    def close() -> None:
        group.kill()
        pool.release()

    return group, close
