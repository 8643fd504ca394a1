"""``verl.utils.py_functional.append_to_dict``: how verl collects per-micro-batch metrics."""

from __future__ import annotations

from typing import Any

from megatron_rl.compat.verl.utils.metric import Metric

__all__ = ["append_to_dict"]


def append_to_dict(data: dict[str, Any], new_data: dict[str, Any], prefix: str = "") -> None:
    """Append each value of ``new_data`` to ``data[prefix + key]`` (in place): lists extend, a
    ``Metric`` joins a Metric of its aggregation, anything else is appended to a list."""
    for key, value in new_data.items():
        name = key if key.startswith(prefix) else prefix + key
        if name not in data:
            data[name] = value.init_list() if isinstance(value, Metric) else []
        if isinstance(value, list):
            data[name].extend(value)
        else:
            data[name].append(value)
