"""DAPO dynamic sampling: drop prompt groups whose responses all scored the same (zero advantage,
zero gradient), so the update spends its batch on groups that carry signal."""

from __future__ import annotations

import numpy as np
import torch

from megatron_rl.algos.grouping import group_ids_from_uids
from megatron_rl.protocol import DataProto

# Metrics computed from the batch when non_tensor_batch has no field of that name.
_BATCH_METRICS = {
    "score": "token_level_scores",  # the reward's score sits on one token, so the row sum is the score
    "seq_reward": "token_level_scores",
    "seq_final_reward": "token_level_rewards",
}


def filter_zero_variance_groups(data: DataProto, metric: str = "score") -> tuple[DataProto, int]:
    """Keep the groups (responses sharing a uid) whose ``metric`` is not constant; groups of one are kept.

    metric: the per-response values in ``non_tensor_batch[metric]`` when present (reward extra info,
    as verl's DAPO reads it), else "score"/"seq_reward" = row sum of token_level_scores and
    "seq_final_reward" = row sum of token_level_rewards. Returns (kept rows in their original order, number of
    groups dropped). "Constant" is an exact max == min test: verl's ``np.std(...) > 0`` keeps some
    constant groups because the std of equal floats can round to 1e-17.
    """
    data.require("uid", where="filter_zero_variance_groups")
    values = _metric_values(data, metric)
    groups, num_groups = group_ids_from_uids(data.non_tensor_batch["uid"], len(data))
    group_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, groups, values, "amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, groups, values, "amin"
    )
    group_size = torch.bincount(groups, minlength=num_groups)
    keep_group = (group_max > group_min) | (group_size == 1)
    keep_rows = keep_group[groups].numpy()
    return data[np.nonzero(keep_rows)[0]], int((~keep_group).sum())


def _metric_values(data: DataProto, metric: str) -> torch.Tensor:
    if metric in data.non_tensor_batch:
        try:
            values = torch.from_numpy(np.asarray(data.non_tensor_batch[metric], dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise ValueError(f"non_tensor_batch[{metric!r}] must hold one number per response") from err
    elif metric in _BATCH_METRICS:
        key = _BATCH_METRICS[metric]
        data.require(key, where=f"filter_zero_variance_groups(metric={metric!r})")
        values = data.batch[key].detach().to("cpu", torch.float64).sum(dim=-1)
    else:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r} is neither one of {sorted(_BATCH_METRICS)} nor a "
            f"non_tensor_batch key; non_tensor_batch has {sorted(data.non_tensor_batch)}"
        )
    if bool(torch.isnan(values).any()):
        raise ValueError(
            f"filter_zero_variance_groups: metric {metric!r} is NaN for rows "
            f"{torch.nonzero(torch.isnan(values)).flatten()[:8].tolist()}"
        )
    return values
