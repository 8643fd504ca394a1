"""Training metrics that do not depend on how a mini-batch was split over micro-batches and ranks.

A micro-batch reports two kinds of numbers:
* ``totals``: its share of a mini-batch quantity that is already divided by the mini-batch's global
  count (the loss terms); the mini-batch value is the sum over micro-batches and DP ranks;
* ``token_means``: masked means over its own tokens (clip fractions, KL); the mini-batch value is
  their token-weighted mean.
The reduced metrics are identical on every rank (broadcast along the pipeline, all-reduced over DP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.workers.engine import MegatronEngine

_TOKENS = "__num_tokens__"


@dataclass
class StepMetrics:
    num_tokens: float
    totals: dict[str, float] = field(default_factory=dict)
    token_means: dict[str, float] = field(default_factory=dict)


def reduce_mini_batch(engine: MegatronEngine, per_micro: Sequence[StepMetrics]) -> dict[str, float]:
    """The mini-batch's metrics from its micro-batches' (present on the last pipeline stage)."""
    sums, token_mean_names = None, None
    if engine.is_last_stage:
        # totals add up; token means are weighted by tokens here and divided by the total below
        sums = {_TOKENS: sum(m.num_tokens for m in per_micro)}
        for m in per_micro:
            for name, value in m.totals.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            for name, value in m.token_means.items():
                sums[name] = sums.get(name, 0.0) + float(value) * m.num_tokens
        token_mean_names = {name for m in per_micro for name in m.token_means}
    sums, token_mean_names = engine.broadcast_object_from_last_stage((sums, token_mean_names))
    names = sorted(sums)
    values = torch.tensor([sums[name] for name in names], dtype=torch.float64, device=engine.device)
    dist.all_reduce(values, group=engine.dp_group)
    reduced = dict(zip(names, values.tolist()))
    tokens = max(reduced.pop(_TOKENS), 1.0)
    return {name: value / tokens if name in token_mean_names else value for name, value in reduced.items()}


def mean_over_steps(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the optimizer steps of an update call (verl reports the mean)."""
    if not steps:
        return {}
    names = sorted({name for step in steps for name in step})
    return {
        name: sum(step[name] for step in steps if name in step) / sum(name in step for step in steps)
        for name in names
    }
