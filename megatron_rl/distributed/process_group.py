"""torch.distributed set-up from whatever launched us: torchrun, SLURM srun, or explicit arguments."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.distributed.device import bind_device, rank_place

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by the launcher."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "explicit" or "single" (no launcher: one process)


def first_slurm_host(nodelist: str) -> str:
    """First host of a compressed SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def read_launch_env(env: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Rank, world size and rendezvous address from torchrun's or SLURM's variables.

    torchrun (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) wins over SLURM
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_JOB_NODELIST); with neither, a single process.
    Under SLURM, MASTER_ADDR defaults to the job's first node and MASTER_PORT is derived from the
    job id so every task agrees without talking.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=_int_env(env, "RANK"),
            world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" in env:
            master_addr = env["MASTER_ADDR"]
        elif nodelist:
            master_addr = first_slurm_host(nodelist)
        else:
            raise ValueError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find rank 0")
        if "MASTER_PORT" in env:
            master_port = _int_env(env, "MASTER_PORT")
        else:
            master_port = 15000 + _int_env(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else 29500
        return LaunchEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=master_addr,
            master_port=master_port,
            source="slurm",
        )
    return LaunchEnv(0, 1, 0, "127.0.0.1", 29500, source="single")


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> LaunchEnv:
    """Initialise the default process group (idempotent) and return this process's place in it.

    Explicit arguments override the environment. The backend is nccl when CUDA is available, gloo
    otherwise. On CUDA the local rank selects the device. A hang in a collective fails after
    ``timeout`` instead of blocking forever.
    """
    launch = read_launch_env()
    explicit = any(v is not None for v in (rank, world_size, master_addr, master_port))
    launch = LaunchEnv(
        rank=launch.rank if rank is None else rank,
        world_size=launch.world_size if world_size is None else world_size,
        local_rank=launch.local_rank if local_rank is None else local_rank,
        master_addr=launch.master_addr if master_addr is None else master_addr,
        master_port=launch.master_port if master_port is None else master_port,
        source="explicit" if explicit else launch.source,
    )
    if not 0 <= launch.rank < launch.world_size:
        raise ValueError(f"rank {launch.rank} is outside world size {launch.world_size}")

    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (launch.rank, launch.world_size):
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but rank {launch.rank} of {launch.world_size} was requested"
            )
        return launch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # The GPU Ray assigned (all of a node's GPUs are visible to an actor when an engine spans several),
    # else the local rank; recorded for child processes on CPU too.
    bind_device(rank_place(launch.rank, launch.local_rank))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=timeout,
    )
    return launch
