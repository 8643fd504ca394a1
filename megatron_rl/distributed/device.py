"""Which GPU this process owns, and binding to it.

A rank's GPU is named three ways: its node, its physical id on that node, and its index among the devices the
process can see (``CUDA_VISIBLE_DEVICES``), which is what ``torch.cuda.set_device`` and SGLang's
``base_gpu_id`` take. Under torchrun the local rank is the index. Under Ray the worker group passes the GPU id
Ray assigned (``MEGATRON_RL_GPU_ID``, from ``ray.get_gpu_ids()``) and the Ray node id
(``MEGATRON_RL_NODE_ID``): with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every actor sees all GPUs of its
node (an SGLang engine spans several), so the bundle index says nothing about the GPU.

``bind_device`` records the chosen index in ``MEGATRON_RL_DEVICE_INDEX`` too, so child processes and CPU
stand-ins of GPU software see which device this process selected.

``EngineDevices``: the GPUs of one rollout engine that this process starts (a vLLM engine's processes bind
``cuda:i`` of what they see, so they must see exactly the replica's GPUs): claimed for the engine's life, no
other engine of this process may take one of them, and ``mask()`` narrows ``CUDA_VISIBLE_DEVICES`` to them
while the engine's processes start.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DEVICE_INDEX_ENV", "GPU_ID_ENV", "NODE_ID_ENV", "EngineDevices", "RankPlace", "bind_device", "rank_place",
           "release_cached_memory", "rollout_on_cpu", "visible_gpus"]

GPU_ID_ENV = "MEGATRON_RL_GPU_ID"
NODE_ID_ENV = "MEGATRON_RL_NODE_ID"
DEVICE_INDEX_ENV = "MEGATRON_RL_DEVICE_INDEX"


@dataclass(frozen=True)
class RankPlace:
    """Where one trainer rank runs: its node, the physical id of its GPU on that node, and that GPU's index
    among the devices the process can see (what ``torch.cuda.set_device`` and SGLang's ``base_gpu_id`` take)."""

    rank: int
    node: str
    gpu: int
    device_index: int


def visible_gpus(env: Mapping[str, str], count: int) -> list[int]:
    """Physical ids of the GPUs this process sees: ``CUDA_VISIBLE_DEVICES`` if set, else 0..count-1."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None or value.strip() == "":
        return list(range(count))
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={value!r}: expected comma-separated GPU ids") from None


def rank_place(rank: int, local_rank: int, env: Mapping[str, str] = os.environ) -> RankPlace:
    """This process's node, physical GPU id and device index (see the module docstring)."""
    node = env.get(NODE_ID_ENV) or f"{socket.gethostname()}/{env.get('GROUP_RANK', env.get('NODE_RANK', '0'))}"
    if GPU_ID_ENV in env:
        gpu = int(env[GPU_ID_ENV])
        visible = visible_gpus(env, gpu + 1)
        if gpu not in visible:
            raise ValueError(
                f"rank {rank}: its GPU {gpu} ({GPU_ID_ENV}) is not among the visible devices "
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}"
            )
        return RankPlace(rank, node, gpu, visible.index(gpu))
    visible = visible_gpus(env, local_rank + 1)
    if local_rank >= len(visible):
        raise ValueError(
            f"rank {rank}: LOCAL_RANK={local_rank} but only {len(visible)} devices are visible "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return RankPlace(rank, node, visible[local_rank], local_rank)


def bind_device(place: RankPlace) -> None:
    """Select the place's GPU for this process (on CUDA) and record the choice for child processes."""
    os.environ[DEVICE_INDEX_ENV] = str(place.device_index)
    if torch.cuda.is_available():
        torch.cuda.set_device(place.device_index)


def release_cached_memory() -> None:
    """Give the memory this process's caching allocator holds reserved but unused back to the device, once the
    work queued on it is done (what training freed stays reserved until then). Every rank whose GPU a colocated
    rollout engine spans calls this before the engine allocates its KV cache and CUDA graphs there. Without
    CUDA there is nothing to synchronise and ``empty_cache`` does nothing (CPU stand-ins may model it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    torch.cuda.empty_cache()


class EngineDevices:
    """The physical GPUs ``gpus`` of one engine this process starts (``owner`` names it in errors), in the engine's
    order (its TP rank i runs on ``gpus[i]``). Refused when this process cannot see one of them, or when another
    live engine of this process holds one (two engines on one GPU). ``release()`` when the engine is gone."""

    _claims: dict[int, str] = {}  # physical GPU -> the owner holding it, in this process
    _lock = threading.Lock()  # claims, and os.environ while a mask is applied

    def __init__(self, gpus: Sequence[int], owner: str) -> None:
        self.gpus, self.owner = tuple(int(g) for g in gpus), owner
        if not self.gpus or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"{owner}: its GPUs must be distinct physical ids, got {list(self.gpus)}")
        visible = visible_gpus(os.environ, torch.cuda.device_count())
        hidden = [g for g in self.gpus if g not in visible]
        if hidden:
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(
                f"{owner}: its GPUs {list(self.gpus)} must be visible to the process that starts it, but GPU "
                f"{', '.join(map(str, hidden))} is not (CUDA_VISIBLE_DEVICES={mask!r}, {len(visible)} devices)")
        with self._lock:
            taken = {g: self._claims[g] for g in self.gpus if g in self._claims}
            if taken:
                holder = next(iter(taken.values()))
                theirs = sorted(g for g, o in self._claims.items() if o == holder)
                raise ValueError(f"{owner}: GPU {', '.join(map(str, taken))} already runs {holder} (GPUs {theirs}) "
                                 "in this process; two engines on one GPU are refused")
            self._claims.update({g: owner for g in self.gpus})

    def release(self) -> None:
        with self._lock:
            for gpu in self.gpus:
                if self._claims.get(gpu) == self.owner:
                    del self._claims[gpu]

    @contextlib.contextmanager
    def mask(self) -> Iterator[None]:
        """For the block, processes started from here see exactly these GPUs: ``CUDA_VISIBLE_DEVICES`` is the list
        (physical ids, as the variable names them) and ``MEGATRON_RL_DEVICE_INDEX`` 0, the first of them. This
        process's own view does not change: CUDA read the variable when it initialised, which happens here first
        if it had not yet. Both variables are restored after (unset again if they were)."""
        if torch.cuda.is_available():
            torch.cuda.current_device()  # initialise CUDA with the full view before the variable narrows
        keys = ("CUDA_VISIBLE_DEVICES", DEVICE_INDEX_ENV)
        with self._lock:
            saved = {key: os.environ.get(key) for key in keys}
            os.environ.update({"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus)), DEVICE_INDEX_ENV: "0"})
            try:
                yield
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value


# cfg: Any, as distributed sits below config in the import order (docs/architecture.md): PPOTrainerConfig
# or the DictConfig composed on it, read by attribute.
def rollout_on_cpu(cfg: Any) -> bool:
    """Whether the rollout engines run on CPU (``cfg``: the whole trainer config): trainer.device=cpu, or auto on a
    machine without CUDA that starts its own Ray (with ray_init.address the cluster's nodes decide, which this one
    cannot see)."""
    device = str(cfg.trainer.device)
    if device != "auto":
        return device == "cpu"
    if cfg.ray_init.address:
        return False
    return not torch.cuda.is_available()
