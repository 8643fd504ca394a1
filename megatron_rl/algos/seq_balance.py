"""Sequence-length balancing across data-parallel ranks (``trainer.balance_batch``, verl's ``_balance_batch``).

The data-parallel dispatch (controller/dispatch.py) hands rank r the r-th contiguous chunk of a batch, so a
batch whose long responses sit together gives one rank most of the tokens and the others wait for it. Here
the rows' lengths (``attention_mask`` sums) are split into ``k`` groups of equal row count with nearly equal
sums by the Karmarkar-Karp largest differencing method, and the batch's rows are permuted so that chunk r is
group r. Every row moves with all of its fields (tensors, ``uid`` and the other non-tensor fields), so
estimators that group by ``uid`` compute the same advantages.

The partition follows verl 0.9.1 (``verl/utils/seqlen_balancing.py``): equal-size KK over the rows sorted by
weight, each row weighted by ``24576 * L + L**2`` (a 7B dense block's linear and attention FLOPs), rows inside
a rank ordered short - long - short (verl's pipeline-bubble ordering); the metrics are verl's
``global_seqlen/*`` on the plain lengths. Pure Python; deterministic (every rank of a torchrun job computes the
same permutation).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

__all__ = [
    "balance_permutation",
    "karmarkar_karp_partitions",
    "row_seqlens",
    "seqlen_imbalance_metrics",
    "seqlen_workload",
]


def seqlen_workload(seqlens: Sequence[int]) -> list[int]:
    """verl's ``calculate_workload``: the relative cost of a row of ``L`` tokens, ``24576 * L + L**2``."""
    return [24576 * int(n) + int(n) ** 2 for n in seqlens]


class _State:
    """A partial partition: ``k`` sets of ``(index, weight)`` items, kept in decreasing order (sum, then item
    count, then the items). Ordered in the heap as verl orders it: the largest spread first, then the state
    whose largest set is larger."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[list[tuple[int, int]]]) -> None:
        self.sets = sorted(sets, key=_set_key, reverse=True)

    @property
    def spread(self) -> int:
        return _set_sum(self.sets[0]) - _set_sum(self.sets[-1])

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return _set_key(self.sets[0]) > _set_key(other.sets[0])


def _set_sum(items: list[tuple[int, int]]) -> int:
    return sum(w for _, w in items)


def _set_key(items: list[tuple[int, int]]) -> tuple:
    return (_set_sum(items), len(items), items)


def karmarkar_karp_partitions(weights: Sequence[int], k: int, *, equal_size: bool = True) -> list[list[int]]:
    """Indices of ``weights`` in ``k`` groups with nearly equal sums (largest differencing method).

    ``equal_size``: every group gets ``len(weights) / k`` rows (which must divide). The rows, sorted by weight,
    are taken ``k`` at a time as one partial partition each (one row per set); the two partial partitions with
    the largest spread are merged repeatedly, the heaviest set of one with the lightest of the other. Each
    group's indices are returned sorted, groups in decreasing order of their sums."""
    n = len(weights)
    if k < 1:
        raise ValueError(f"balance_batch: the number of partitions must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"balance_batch: {n} rows cannot fill {k} data-parallel ranks")
    if equal_size and n % k:
        raise ValueError(f"balance_batch: the batch of {n} rows does not divide into {k} data-parallel ranks of "
                         f"equal size; make the batch (train_batch_size * rollout.n) a multiple of the actor's "
                         f"DP size {k}")
    ordered = sorted((int(w), i) for i, w in enumerate(weights))
    step = k if equal_size else 1
    heap: list[_State] = []
    for offset in range(0, n, step):
        chunk = ordered[offset:offset + step]
        heapq.heappush(heap, _State([[(i, w)] for w, i in chunk] + [[] for _ in range(k - len(chunk))]))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        # a's heaviest set takes b's lightest, and so on: the differences cancel
        heapq.heappush(heap, _State([a.sets[i] + b.sets[k - 1 - i] for i in range(k)]))
    groups = [sorted(i for i, _ in items) for items in heap[0].sets]
    if any(not g for g in groups):
        raise ValueError(f"balance_batch: a partition of {n} rows into {k} came out empty")
    return groups


def balance_permutation(seqlens: Sequence[int], dp_size: int) -> tuple[list[int], list[list[int]]]:
    """The row order that gives DP rank r (the r-th contiguous chunk) the r-th balanced group, and the groups.

    Groups are partitioned on ``seqlen_workload`` (verl 0.9.1); inside a group the rows go short to long on
    the even positions and back on the odd ones (``[1, 3, 5, 4, 2]``), as verl orders them."""
    work = seqlen_workload(seqlens)
    groups = karmarkar_karp_partitions(work, dp_size, equal_size=True)
    ordered = []
    for group in groups:
        group = sorted(group, key=lambda i: (work[i], i))
        ordered.append(group[::2] + group[1::2][::-1])
    return [i for g in ordered for i in g], ordered


def seqlen_imbalance_metrics(seqlens: Sequence[int], groups: list[list[int]],
                             prefix: str = "global_seqlen") -> dict[str, float]:
    """verl's ``log_seqlen_unbalance``: token sums per DP rank before (contiguous chunks of the incoming order:
    ``min``, ``max``, ``minmax_diff``) and after (``balanced_min``, ``balanced_max``); ``mean`` per rank."""
    lens = [int(n) for n in seqlens]
    k = len(groups)
    size = len(lens) // k
    before = [sum(lens[o:o + size]) for o in range(0, len(lens), size)]
    after = [sum(lens[i] for i in g) for g in groups]
    return {
        f"{prefix}/min": float(min(before)),
        f"{prefix}/max": float(max(before)),
        f"{prefix}/minmax_diff": float(max(before) - min(before)),
        f"{prefix}/balanced_min": float(min(after)),
        f"{prefix}/balanced_max": float(max(after)),
        f"{prefix}/mean": float(sum(before) / k),
    }


def row_seqlens(attention_mask: torch.Tensor) -> list[int]:
    """Tokens per row: the attention mask's sum over everything but the first dimension."""
    return attention_mask.reshape(attention_mask.shape[0], -1).sum(-1).tolist()
