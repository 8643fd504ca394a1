"""Cut a batch into micro-batches: a fixed number of rows, or a token budget (``use_dynamic_bsz``).

A micro-batch is computed as a rectangle of ``rows x longest row`` tokens after its rows' padding is
removed (see ``packing.py``), so that rectangle is what the token budget bounds. The budgeted split
sorts rows by length (similar lengths share a micro-batch, so little padding is left), takes the
fewest micro-batches that fit the budget, and among those splits the one whose largest micro-batch
is smallest (balanced work per micro-batch).

Every function is deterministic in its inputs: all tensor/pipeline ranks of a data-parallel group
receive the same batch and so cut it identically.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MicroBatchSpec:
    """How a role cuts its batch. ``max_token_len`` bounds ``rows x longest row`` per micro-batch."""

    micro_batch_size: int
    use_dynamic_bsz: bool = False
    max_token_len: int = 16384

    def __post_init__(self) -> None:
        if self.use_dynamic_bsz:
            if not isinstance(self.max_token_len, int) or self.max_token_len < 1:
                raise ValueError(
                    f"max token length per micro-batch must be a positive int, got {self.max_token_len!r}"
                )
        elif not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"micro-batch size must be a positive int, got {self.micro_batch_size!r}")


def split_fixed(num_rows: int, micro_batch_size: int) -> list[np.ndarray]:
    """Consecutive groups of ``micro_batch_size`` rows (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        np.arange(start, min(start + micro_batch_size, num_rows))
        for start in range(0, num_rows, micro_batch_size)
    ]


def _greedy_groups(sorted_lengths: np.ndarray, cap: int) -> list[int]:
    """Start index of each group when rows (longest first) are added while rows x longest <= cap.

    Optimal in the number of groups: any sub-range of a feasible group is feasible, so taking as
    many rows as fit never hurts the rest.
    """
    starts, start = [], 0
    while start < len(sorted_lengths):
        starts.append(start)
        rows_that_fit = max(1, cap // max(int(sorted_lengths[start]), 1))
        start += rows_that_fit
    return starts


def _first_fit_decreasing(lengths: np.ndarray, order: np.ndarray, cap: int) -> list[list[int]]:
    """Packed sequences: rows (longest first) go into the first micro-batch whose total stays <= cap
    (a THD micro-batch computes the sum of its rows' lengths, not rows x longest)."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for row in order.tolist():
        length = int(lengths[row])
        for index, total in enumerate(totals):
            if total + length <= cap:
                groups[index].append(row)
                totals[index] += length
                break
        else:
            groups.append([row])
            totals.append(length)
    return groups


def split_by_token_budget(
    lengths: Sequence[int], max_tokens: int, what: str = "max_token_len", packed: bool = False
) -> list[np.ndarray]:
    """Row indices of each micro-batch so that rows x (longest row) <= ``max_tokens`` in every one
    (with ``packed``, the sum of the rows' lengths: what a THD micro-batch computes).

    ``lengths`` are the real-token counts of the rows. Raises naming ``what`` when a single row is
    longer than the budget.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or len(lengths) == 0:
        raise ValueError(
            f"split_by_token_budget needs a non-empty 1-D list of lengths, got shape {lengths.shape}"
        )
    if max_tokens < 1:
        raise ValueError(f"{what} must be >= 1, got {max_tokens}")
    longest = int(lengths.max())
    if longest > max_tokens:
        row = int(lengths.argmax())
        raise ValueError(
            f"row {row} has {longest} tokens, more than {what}={max_tokens}: raise {what} to at least the "
            "longest prompt + response"
        )
    order = np.argsort(-lengths, kind="stable")
    if packed:
        fewest = len(_first_fit_decreasing(lengths, order, max_tokens))
        low, high = max(longest, 1), max_tokens  # the most balanced packing with that many micro-batches
        while low < high:
            mid = (low + high) // 2
            if len(_first_fit_decreasing(lengths, order, mid)) <= fewest:
                high = mid
            else:
                low = mid + 1
        return [np.sort(np.asarray(g, dtype=np.int64)) for g in _first_fit_decreasing(lengths, order, low)]
    sorted_lengths = lengths[order]
    _greedy = _greedy_groups
    fewest = len(_greedy(sorted_lengths, max_tokens))
    # Smallest cap that still needs no more micro-batches: the most balanced split of that count.
    low, high = max(longest, 1), max_tokens
    while low < high:
        mid = (low + high) // 2
        if len(_greedy(sorted_lengths, mid)) <= fewest:
            high = mid
        else:
            low = mid + 1
    starts = _greedy(sorted_lengths, low) + [len(order)]
    return [np.sort(order[a:b]) for a, b in itertools.pairwise(starts)]


def split_micro_batches(
    lengths: Sequence[int], spec: MicroBatchSpec, what: str = "max_token_len", packed: bool = False
) -> list[np.ndarray]:
    """Row indices of each micro-batch under ``spec`` (fixed size or token budget; ``packed``: the budget
    bounds the sum of the rows' lengths)."""
    if spec.use_dynamic_bsz:
        return split_by_token_budget(lengths, spec.max_token_len, what, packed=packed)
    return split_fixed(len(lengths), spec.micro_batch_size)
