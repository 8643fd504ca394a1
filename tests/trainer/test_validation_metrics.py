"""Validation metrics: score, exact match (the scorer's acc) and response length, per data_source."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.protocol import DataProto
from megatron_rl.trainer.validation import validation_metrics


def _scored(with_mask: bool = True) -> DataProto:
    # four responses of two sources; the score sits on one token of each row
    scores = torch.zeros(4, 5)
    scores[:, 0] = torch.tensor([1.0, 0.5, 0.0, 1.0])
    tensors = {"token_level_scores": scores}
    if with_mask:
        tensors["response_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    return DataProto.from_dict(tensors, non_tensors={
        "data_source": np.array(["a", "a", "b", "b"], dtype=object),
        "acc": np.array([1.0, 0.0, 0.0, 1.0])})


def test_score_exact_match_and_length_per_source():
    metrics = validation_metrics(_scored(), n=2)
    assert metrics == pytest.approx({
        "val-core/a/reward/mean@2": 0.75, "val-core/a/acc/mean@2": 0.5, "val-aux/a/response_length/mean@2": 4.0,
        "val-core/b/reward/mean@2": 0.5, "val-core/b/acc/mean@2": 0.5, "val-aux/b/response_length/mean@2": 1.5})


def test_length_left_out_without_a_response_mask():
    metrics = validation_metrics(_scored(with_mask=False), n=2)
    assert not any("response_length" in key for key in metrics)
    assert metrics["val-core/a/reward/mean@2"] == pytest.approx(0.75)
