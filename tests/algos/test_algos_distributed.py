"""Split invariance across real data-parallel ranks: GlobalBatchInfo.from_masks all-reduces the counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl import algos
from megatron_rl.distributed.spawn import run_multiprocess

B, T, WORLD = 12, 7, 2


def full_batch():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)  # some empty responses
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    old = -torch.rand(B, T, generator=gen)
    log_prob = old + 0.3 * torch.randn(B, T, generator=gen)
    advantages = torch.randn(B, T, generator=gen)
    return old, log_prob, advantages, mask


def policy_grad(mode: str, rows: list[slice], global_batch: algos.GlobalBatchInfo) -> torch.Tensor:
    old, log_prob, adv, mask = full_batch()
    lp = log_prob.clone().requires_grad_(True)
    for s in rows:
        loss, _ = algos.compute_policy_loss_vanilla(
            old[s], lp[s], adv[s], mask[s], mode, global_batch=global_batch
        )
        loss.backward()
    return lp.grad


def rank_grads(modes: list[str]) -> dict[str, torch.Tensor]:
    """This rank's half of the batch in uneven micro-batches; gradients averaged over DP like Megatron DDP."""
    rank = dist.get_rank()
    micro = [slice(0, 4), slice(4, 6)] if rank == 0 else [slice(6, 7), slice(7, 12)]
    mask = full_batch()[3]
    info = algos.GlobalBatchInfo.from_masks(
        [mask[s] for s in micro], dp_group=dist.group.WORLD, dp_size=WORLD
    )
    grads = {}
    for mode in modes:
        grad = policy_grad(mode, micro, info)
        dist.all_reduce(grad)
        grads[mode] = grad / WORLD
    return grads


@pytest.mark.distributed
def test_gradient_over_two_dp_ranks_equals_one_batch():
    modes = list(algos.LOSS_AGG_MODES)
    per_rank = run_multiprocess(rank_grads, WORLD, modes, timeout_s=120)
    for mode in modes:
        expected = policy_grad(mode, [slice(0, B)], algos.LOCAL_BATCH)
        for grads in per_rank:
            torch.testing.assert_close(grads[mode], expected, atol=1e-6, rtol=1e-5, msg=mode)
