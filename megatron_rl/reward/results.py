"""Turn what a scorer returned (or how it failed) into per-sample results.

A scorer returns a number or a dict with ``"score"`` plus extras; a batched scorer returns a list of
those. Anything else — an exception, a timeout, a non-finite or non-numeric value, a list of the
wrong length — becomes a result with score 0 and an ``error`` saying what happened; a non-finite score is
also marked ``non_finite``, which the reward manager refuses (a scorer bug, not a sample's failure).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_rl.reward.pool import Outcome

__all__ = ["SampleResult", "result_of", "results_of"]


@dataclass(frozen=True)
class SampleResult:
    """One sample's score (0 when scoring failed) and the extras its scorer returned."""

    score: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the sample scored 0 instead of its scorer's value
    timed_out: bool = False
    non_finite: bool = False  # the scorer returned NaN or +-inf


def results_of(outcome: Outcome, n: int, batched: bool) -> list[SampleResult]:
    """One call's outcome -> its ``n`` per-sample results (a per-sample call has n == 1)."""
    if not outcome.ok:
        return [SampleResult(error=outcome.error, timed_out=outcome.timed_out) for _ in range(n)]
    if not batched:
        return [result_of(outcome.value)]
    values = outcome.value
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != n:
        got = (
            f"{type(values).__name__} of length {len(values)}"
            if hasattr(values, "__len__")
            else type(values).__name__
        )
        return [
            SampleResult(error=f"batched scorer returned {got}; expected a list of {n}") for _ in range(n)
        ]
    return [result_of(value) for value in values]


def result_of(value: Any) -> SampleResult:
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return SampleResult(error=f"scorer returned a dict without 'score' (keys: {sorted(value)})")
        extras = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):  # bool counts as 0/1, as in verl
        return SampleResult(
            error=f"scorer returned {type(value).__name__} {value!r:.60}; expected a number or a "
            f"dict with 'score'"
        )
    if not math.isfinite(value):
        return SampleResult(error=f"scorer returned a non-finite score {value}", non_finite=True)
    return SampleResult(float(value), extras)
