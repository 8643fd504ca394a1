"""build_rollout_batch: per-sample token lists -> the rollout's [B, R] right-padded DataProto layout."""

import numpy as np
import pytest
import torch

from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import build_rollout_batch

PAD = 0


def _prompts() -> DataProto:
    ids = torch.tensor([[PAD, 5, 6], [7, 8, 9], [PAD, PAD, 4]])
    mask = (ids != PAD).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                               non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)},
                               meta_info={"step": 3})


def test_rows_of_different_lengths_are_right_padded_in_order():
    responses = [[11, 12], [], [13, 14, 15, 16]]
    log_probs = [[-0.5, -0.25], [], [-1.0, -2.0, -3.0, -4.0]]
    out = build_rollout_batch(_prompts(), responses, log_probs, response_length=4, pad_token_id=PAD,
                              weight_version=2, seconds=0.5)
    assert out.batch["responses"].tolist() == [[11, 12, PAD, PAD], [PAD] * 4, [13, 14, 15, 16]]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert out.batch["response_mask"].dtype == torch.long  # the prompts' attention_mask dtype
    assert out.batch["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0, 0], [0] * 4, [-1, -2, -3, -4]]
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    assert out.batch["input_ids"][0].tolist() == [PAD, 5, 6, 11, 12, PAD, PAD]
    assert out.batch["attention_mask"][2].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out.batch["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5]
    assert out.meta_info == {"step": 3, "weight_version": 2, "timing": {"generate_sequences": 0.5}}
    assert list(out.non_tensor_batch["uid"]) == ["a", "b", "c"]


@pytest.mark.parametrize("responses, log_probs, message", [
    ([[1], [2, 3, 4, 5, 6], [3]], [[0.0], [0.0] * 5, [0.0]],
     "sample 1: 5 response tokens and 5 log-probs for max length 4"),
    ([[1], [2], [3, 4]], [[0.0], [0.0], [0.0]], "sample 2: 2 response tokens and 1 log-probs"),
    ([[1], [2]], [[0.0], [0.0]], "2 responses / 2 log-prob rows for 3 prompts"),
])
def test_bad_rows_are_named(responses, log_probs, message):
    with pytest.raises(ValueError, match=message):
        build_rollout_batch(_prompts(), responses, log_probs, response_length=4, pad_token_id=PAD,
                            weight_version=0, seconds=0.0)


def test_repeated_prompt_rows_finds_runs_of_identical_consecutive_rows():
    from megatron_rl.rollout.batch_io import repeated_prompt_rows

    prompts = _prompts().batch
    keys = ("input_ids", "attention_mask", "position_ids")
    ids, mask, pos = (prompts[k].repeat_interleave(2, dim=0) for k in keys)
    ids, mask, pos = (torch.cat([t, t[:1]]) for t in (ids, mask, pos))  # row 0 once more, after the others
    firsts, inverse = repeated_prompt_rows(ids, mask, pos)
    assert firsts.tolist() == [0, 2, 4, 6] and inverse.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert torch.equal(ids[firsts][inverse], ids)
    p = _prompts().batch
    # all rows distinct
    assert repeated_prompt_rows(p["input_ids"], p["attention_mask"], p["position_ids"]) is None
