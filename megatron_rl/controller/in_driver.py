"""One-rank jobs in the driver's process: no Ray, no worker process (as TRL runs).

``trainer.launcher=ray`` with one rank and nothing else to place (no rollout servers, no asynchronous loop,
no reward-model workers, no Ray cluster named) has no second process for Ray to manage: starting Ray, spawning
one worker and importing torch / Megatron / transformers a second time there is most of its start-up. Such a
job runs its workers in the driver instead, on a world-size-1 gloo group with ``LocalWorkerGroup``, which is
how ``trainer.launcher=torchrun`` runs every rank; everything after start-up is the same code.
``MEGATRON_RL_ONE_RANK_RAY=1`` keeps a Ray worker anyway (e.g. to test the Ray path at one rank).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from megatron_rl.distributed.model_parallel import destroy_model_parallel
from megatron_rl.distributed.ports import free_port
from megatron_rl.distributed.process_group import init_distributed

if TYPE_CHECKING:  # the schema imports Hydra, which this module does not need at run time
    from megatron_rl.config.schema import PPOTrainerConfig

__all__ = ["FORCE_RAY_ENV", "enter_driver_rank", "ray_needed_for"]

FORCE_RAY_ENV = "MEGATRON_RL_ONE_RANK_RAY"


def ray_needed_for(cfg: PPOTrainerConfig, world_size: int) -> str | None:
    """Why this ``trainer.launcher=ray`` job needs Ray workers (the first reason), or None when it runs in the
    driver's process. ``world_size``: trainer.nnodes x trainer.n_gpus_per_node."""
    if cfg.trainer.launcher != "ray":
        return f"trainer.launcher={cfg.trainer.launcher}"
    rollout = cfg.actor_rollout_ref.rollout
    reasons = (
        (os.environ.get(FORCE_RAY_ENV, "0") not in ("", "0"), f"{FORCE_RAY_ENV}=1"),
        (world_size != 1, f"{world_size} ranks (trainer.nnodes x trainer.n_gpus_per_node)"),
        (cfg.ray_init.address is not None, f"ray_init.address={cfg.ray_init.address}"),
        (rollout.mode == "server", "actor_rollout_ref.rollout.mode=server"),
        (cfg.async_training.mode != "sync", f"async_training.mode={cfg.async_training.mode}"),
        (bool(cfg.reward_model.enable), "reward_model.enable=true"),
    )
    return next((why for needed, why in reasons if needed), None)


_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def enter_driver_rank() -> Callable[[], None]:
    """Make this process rank 0 of 1 (torchrun's variables, a process group on a free loopback port: gloo on CPU)
    and give torch the one thread a Ray rank gets (Ray sets OMP_NUM_THREADS=1 for its workers; on a small machine
    more threads only contend: 20x slower steps measured on a loaded 2-core machine); an OMP_NUM_THREADS the user
    set is kept. Returns what undoes it (groups, variables, threads), as a Ray worker's exit does: the next run
    in this process (tests, notebooks) starts as fresh as it would under Ray."""
    import torch
    import torch.distributed as dist

    if os.environ.get("WORLD_SIZE", "1") != "1" or os.environ.get("RANK", "0") != "0":
        raise RuntimeError(f"a one-rank run in the driver's process found RANK={os.environ.get('RANK')} "
                           f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} set: start it with trainer.launcher=torchrun "
                           "under torchrun, or unset them")
    if dist.is_initialized():
        raise RuntimeError("a one-rank run in the driver's process found torch.distributed already initialised "
                           "in it (another run still going in this process?)")
    saved_env = {k: os.environ.get(k) for k in _RANK_VARS}
    saved_threads = torch.get_num_threads()
    # a port of its own: a MASTER_PORT left in the environment may belong to another job on this machine
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=int(os.environ["MASTER_PORT"]),
                     local_rank=0)

    def leave() -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(saved_threads)

    return leave
