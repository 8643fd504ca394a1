"""DAPO dynamic sampling: groups whose responses all scored the same are dropped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from algos_data import outcome_rewards

from megatron_rl import algos
from megatron_rl.protocol import DataProto


def scored_batch(scores: list[float], uids: list) -> DataProto:
    mask = torch.ones(len(scores), 4)
    return DataProto.from_dict(
        {
            "token_level_scores": outcome_rewards(mask, torch.tensor(scores)),
            "response_mask": mask,
            "token_level_rewards": torch.zeros(len(scores), 4),
        },
        {"uid": np.array(uids, dtype=object), "row": np.arange(len(scores))},
    )


def test_drops_constant_groups_keeps_singletons_and_order():
    data = scored_batch(
        [0.1, 0.1, 0.1, 1, 0, 1, 0.7, 1, 1], ["a", "a", "a", "b", "b", "b", "lonely", "c", "c"]
    )
    kept, dropped = algos.filter_zero_variance_groups(data)
    assert dropped == 2  # "a" (0.1 three times: np.std says 1.4e-17, still constant) and "c"
    assert list(kept.non_tensor_batch["row"]) == [3, 4, 5, 6]
    assert kept.batch["token_level_scores"].shape == (4, 4)


def test_interleaved_int_uids_and_other_metrics():
    data = scored_batch([1, 0, 1, 1], [7, 8, 7, 8])
    data.non_tensor_batch["acc"] = np.array([1.0, 0.0, 0.0, 0.0], dtype=object)
    kept, dropped = algos.filter_zero_variance_groups(data)  # scores: uid 7 constant, uid 8 varies
    assert (list(kept.non_tensor_batch["row"]), dropped) == ([1, 3], 1)
    kept, dropped = algos.filter_zero_variance_groups(data, metric="acc")  # acc: uid 7 varies, uid 8 constant
    assert (list(kept.non_tensor_batch["row"]), dropped) == ([0, 2], 1)
    kept, dropped = algos.filter_zero_variance_groups(data, metric="seq_final_reward")  # all rewards 0
    assert (len(kept), dropped) == (0, 2)


def test_bad_metric_and_nan_are_reported():
    data = scored_batch([1, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match=r"metric 'score' is NaN for rows \[1\]"):
        algos.filter_zero_variance_groups(data)
    with pytest.raises(
        ValueError, match=r"filter_groups.metric='acc' is neither one of .* nor a non_tensor_batch key"
    ):
        algos.filter_zero_variance_groups(data, metric="acc")
