"""The rollout side of a run's ranks on a fake GPU node (fake_gpu_node.py): each rank's real
``ActorRolloutRefWorker._build_rollout`` in its own simulated process, without building the trainer's model."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import load_config
from megatron_rl.config.loader import typed_config
from megatron_rl.distributed.device import bind_device, rank_place
from megatron_rl_testing.fake_gpu_node import FakeGpuNode

__all__ = ["TOKEN_IDS", "StubActor", "build_ranks", "torchrun_envs"]

TOKEN_IDS = {"eos_token_id": 1, "pad_token_id": 0}


class StubActor:
    """What ``_build_rollout`` reads of the actor: its HF config's MoE flag and its parameters' dtype."""

    class engine:
        class hf_config:
            moe = False

        params_dtype = torch.bfloat16


def torchrun_envs(ranks: int, cuda_visible: str | None = None) -> list[dict[str, str]]:
    """The environment torchrun gives each of ``ranks`` ranks on one node (and a job's device mask)."""
    extra = {} if cuda_visible is None else {"CUDA_VISIBLE_DEVICES": cuda_visible}
    return [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), **extra}
            for r in range(ranks)]


def build_ranks(node: FakeGpuNode, monkeypatch: Any, *, engine: str, tp: int, envs: list[dict[str, str]]) -> list:
    """``ActorRolloutRefWorker._build_rollout`` of every rank with a colocated ``engine`` of rollout TP ``tp``, each
    in its own simulated process (its environment, its CUDA state, its device bound as init_distributed binds it);
    the all-gather of the ranks' places is the one collective, answered with what each rank's ``rank_place`` says.
    Returns each rank's replica."""
    from megatron_rl.workers.hybrid import ActorRolloutRefWorker

    cfg = load_config(overrides=[
        f"actor_rollout_ref.rollout.name={engine}", "actor_rollout_ref.rollout.mode=colocated",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}", "actor_rollout_ref.model.path=/unused",
        "actor_rollout_ref.rollout.weight_sync.verify_freq=0", f"trainer.n_gpus_per_node={len(envs)}",
    ])
    places = [rank_place(int(env["RANK"]), int(env["LOCAL_RANK"]), env) for env in envs]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(envs))
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), places))
    replicas = []
    for env, place in zip(envs, places):
        with node.process(f"rank{place.rank}", env):
            bind_device(place)
            worker = ActorRolloutRefWorker(typed_config(cfg))
            worker.actor = StubActor()
            replicas.append(worker._build_rollout(None, dict(TOKEN_IDS)))
    return replicas
