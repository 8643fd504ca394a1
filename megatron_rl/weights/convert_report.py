"""What each converter rank loaded of the MoE experts (the memory EP saves), and the line that reports it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankReport:
    """One rank's conversion: ``diff`` from ``--verify`` (None without it) and the expert tensors it loaded.

    ``coords`` = (PP rank, EP rank, ETP rank): ranks with equal coordinates hold the same expert shards
    (expert-data-parallel replicas), so the model's expert bytes are the sum over distinct coordinates."""

    rank: int
    diff: float | None
    expert_tensors: int
    expert_bytes: int
    coords: tuple[int, int, int]


def is_expert_tensor(name: str) -> bool:
    """A routed expert's weight in Megatron's names (``...mlp.experts.local_experts.3.linear_fc1.weight``);
    a shared expert (``mlp.shared_experts.``) is held whole by every EP rank and does not count."""
    return ".mlp.experts." in f".{name}"


def expert_load(named_tensors: Iterable[tuple[str, object]]) -> tuple[int, int]:
    """(count, bytes) of the expert tensors among ``named_tensors`` (non-tensor entries skipped)."""
    count = size = 0
    for name, tensor in named_tensors:
        if isinstance(tensor, torch.Tensor) and is_expert_tensor(name):
            count += 1
            size += tensor.numel() * tensor.element_size()
    return count, size


def rank_report(diff: float | None, experts: tuple[int, int]) -> RankReport:
    """This rank's report from ``expert_load``'s (count, bytes) (call with the parallel groups initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    count, size = experts
    coords = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    return RankReport(dist.get_rank(), diff, count, size, coords)


def gather_reports(report: RankReport) -> list[RankReport]:
    """Every rank's report on every rank, by rank (under torchrun each process only has its own)."""
    import torch.distributed as dist

    reports: list[RankReport | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return [r for r in reports if r is not None]


def expert_summary(reports: list[RankReport]) -> str | None:
    """``experts: a rank loaded at most N tensors, B of T bytes (fraction)``; None for a dense model."""
    distinct = {r.coords: r.expert_bytes for r in reports}
    total = sum(distinct.values())
    if total == 0:
        return None
    most = max(reports, key=lambda r: r.expert_bytes)
    return (
        f"experts: a rank loaded at most {most.expert_tensors} expert tensors, {most.expert_bytes} of the "
        f"model's {total} expert bytes ({most.expert_bytes / total:.3f})"
    )
