"""``verl.utils.metric``: metric values tagged with how micro-batches and DP ranks combine them.

verl reports most metrics as the mean over micro-batches; a loss already divided by the mini-batch's
global token count must be summed instead (``AggregationType.SUM``), which is what ``Metric`` records.
(megatron-rl's own workers reduce with megatron_rl.workers.metrics; this module is for verl code.)
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Union

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]

Numeric = Union[int, float, torch.Tensor, np.ndarray]
_NUMERIC = (int, float, torch.Tensor, np.ndarray, np.number)


class AggregationType(Enum):
    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCE = {
    AggregationType.MEAN: np.mean, AggregationType.SUM: np.sum, AggregationType.MIN: np.min, AggregationType.MAX: np.max,
}


class Metric:
    """Values of one metric (one per micro-batch) and the aggregation that combines them."""

    def __init__(self, aggregation: str | AggregationType, value: Numeric | list[Numeric] | None = None) -> None:
        try:
            self.aggregation = AggregationType(aggregation)
        except ValueError:
            raise ValueError(
                f"Unsupported aggregation type: {aggregation!r} (one of {[a.value for a in AggregationType]})"
            ) from None
        self.values: list[Numeric] = []
        if value is not None:
            self.extend(value) if isinstance(value, list) else self.append(value)

    def append(self, value: Union[Numeric, "Metric"]) -> None:
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"Metric.append: a tensor of shape {tuple(value.shape)} is not a scalar")
            value = value.detach().item()
        if not isinstance(value, _NUMERIC) or isinstance(value, bool):
            raise ValueError(f"Metric.append: unsupported value type {type(value).__name__}")
        self.values.append(value)

    def extend(self, values: Union["Metric", list[Numeric]]) -> None:
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        return _REDUCE[self.aggregation](self.values)

    @classmethod
    def aggregate_dp(cls, metric_lists: list["Metric"]) -> float:
        """One value from every DP rank's Metric: sums and means are averaged over ranks first (each
        rank holds the same number of micro-batches), min / max are taken over all values."""
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        counts = [len(m.values) for m in metric_lists]
        if len(set(counts)) != 1:
            raise ValueError(
                f"All Metric instances must have the same number of values for dp aggregation: {counts}"
            )
        table = np.array([m.values for m in metric_lists])  # [dp, micro-batches]
        aggregation = metric_lists[0].aggregation
        if aggregation in (AggregationType.SUM, AggregationType.MEAN):
            return _REDUCE[aggregation](table.mean(axis=0))
        return _REDUCE[aggregation](table.flatten())

    @classmethod
    def from_dict(cls, data: dict[str, Numeric], aggregation: str | AggregationType) -> dict[str, "Metric"]:
        return {key: cls(aggregation, value) for key, value in data.items()}

    def init_list(self) -> "Metric":
        return Metric(self.aggregation)


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """In place (and returned): a ``Metric`` by its aggregation; a list by its name, as verl does
    (max if the name holds "max", min if "min", else the mean)."""
    for key, value in metrics.items():
        if isinstance(value, Metric):
            metrics[key] = value.aggregate()
        elif "max" in key:
            metrics[key] = np.max(value)
        elif "min" in key:
            metrics[key] = np.min(value)
        else:
            metrics[key] = np.mean(value)
    return metrics
