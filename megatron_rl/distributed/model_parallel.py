"""Megatron-Core parallel state (TP, PP, VPP, CP, DP, and EP/ETP for MoE experts) with errors that say which
numbers clash."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.distributed.cpu_compat import CpuCompatHandle, install_cpu_compat


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension and this rank's coordinates in them."""

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    etp: int = 1


def check_parallel_sizes(world_size: int, tp: int, pp: int, cp: int = 1, vpp: int | None = None) -> int:
    """Validate the sizes and return the data-parallel size; every failure names the numbers."""
    for name, size in (("TP", tp), ("PP", pp), ("CP", cp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} size must be a positive integer, got {size!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {model_parallel}"
        )
    if vpp is not None:
        if pp < 2:
            raise ValueError(f"virtual pipeline size {vpp} needs PP >= 2, got PP={pp}")
        if vpp < 1:
            raise ValueError(f"virtual pipeline size must be >= 1, got {vpp}")
    return world_size // model_parallel


def check_expert_parallel_sizes(world_size: int, tp: int, pp: int, ep: int, etp: int | None) -> None:
    """Experts are laid out as ETP x EP x expert-DP inside each pipeline stage (Megatron's tp-ep-dp-pp,
    independent of the dense layers' TP x CP x DP): ETP * EP must divide the ranks of a stage."""
    etp = tp if etp is None else etp
    for name, size in (("EP", ep), ("ETP", etp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} size must be a positive integer, got {size!r}")
    per_stage = world_size // pp
    if per_stage % (ep * etp):
        raise ValueError(
            f"{world_size // pp} ranks per pipeline stage (world {world_size} / PP {pp}) are not divisible "
            f"by EP*ETP = {ep}*{etp} = {ep * etp}"
        )


class _ShimHold:
    """The CPU compatibility layer this module installed (``init_model_parallel``), held until
    ``destroy_model_parallel``: at most one install however often the state is set up again."""

    handle: CpuCompatHandle | None = None


_shims = _ShimHold()


def init_model_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 10,
    ep: int = 1,
    etp: int | None = None,
) -> ParallelLayout:
    """Set up Megatron's parallel groups on an initialised default process group and seed the RNGs.

    Without CUDA the CPU compatibility layer is installed first (and removed again by
    ``destroy_model_parallel``). Ranks are laid out in Megatron's default order tp-cp-ep-dp-pp.
    ``ep``/``etp``: expert parallel and expert tensor parallel sizes of MoE layers (ETP defaults to TP).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed() first")
    world_size = dist.get_world_size()
    dp = check_parallel_sizes(world_size, tp, pp, cp, vpp)
    check_expert_parallel_sizes(world_size, tp, pp, ep, etp)

    if _shims.handle is None:
        _shims.handle = install_cpu_compat()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        world_size=world_size,
        tp=tp,
        pp=pp,
        cp=cp,
        dp=dp,
        vpp=vpp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep=ep,
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups and the CPU shims installed by ``init_model_parallel``."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _shims.handle is not None:
        _shims.handle.uninstall()
        _shims.handle = None
