"""group_normalize (compiled CPU kernel) against the per-group reference and hand-computed values."""

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import reference

MODES = ["grpo", "grpo_mean", "rloo"]
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("groups, size", [(1, 2), (10, 80), (300, 1000)])
def test_parity_random(gen, mode, groups, size):
    scores = torch.randn(size, generator=gen)
    group_index = torch.randint(0, groups, (size,), generator=gen)  # interleaved, some groups of 1
    out = ops.group_normalize(scores, group_index, mode=mode)
    assert out.dtype == torch.float32 and out.shape == (size,)
    torch.testing.assert_close(out, reference.group_normalize(scores, group_index, mode=mode), **FP32_TOL)


def test_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0])
    group_index = torch.tensor([0, 0, 0, 1])  # group 1 is a singleton
    eps = 1e-6
    torch.testing.assert_close(
        ops.group_normalize(scores, group_index, mode="grpo"),
        torch.tensor([-1 / (1 + eps), 0.0, 1 / (1 + eps), 5 / (1 + eps)]),
    )
    torch.testing.assert_close(
        ops.group_normalize(scores, group_index, mode="grpo_mean"), torch.tensor([-1.0, 0.0, 1.0, 5.0])
    )
    # rloo: score minus the mean of the others; a singleton keeps its score
    torch.testing.assert_close(
        ops.group_normalize(scores, group_index, mode="rloo"), torch.tensor([-1.5, 0.0, 1.5, 5.0])
    )


@pytest.mark.parametrize("mode", MODES)
def test_binary_rewards_and_equal_scores(gen, mode):
    scores = (torch.rand(64, generator=gen) > 0.5).float()
    scores[:8] = 1.0  # group 0: all correct -> zero advantage (std 0 divides epsilon)
    group_index = torch.arange(64) // 8
    out = ops.group_normalize(scores, group_index, mode=mode, epsilon=1e-6)
    assert torch.all(out[:8] == 0)
    torch.testing.assert_close(out, reference.group_normalize(scores, group_index, mode=mode), **FP32_TOL)


def test_int32_ids_bf16_scores_and_empty(gen):
    scores = torch.randn(40, generator=gen).bfloat16()
    group_index = torch.randint(0, 5, (40,), generator=gen)
    torch.testing.assert_close(
        ops.group_normalize(scores, group_index.int(), mode="grpo"),
        reference.group_normalize(scores, group_index, mode="grpo"),
        **FP32_TOL,
    )
    assert ops.group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long), mode="rloo").shape == (0,)


@pytest.mark.parametrize(
    "scores, group_index, kw, error, match",
    [
        (torch.zeros(3), torch.tensor([0, -1, 1]), {"mode": "grpo"}, ValueError, r"got values in \[-1, 1\]"),
        (torch.zeros(3), torch.tensor([0, 7, 1]), {"mode": "grpo"}, ValueError, r"dense ids in \[0, B=3\)"),
        (torch.zeros(3), torch.tensor([0, 1, 1]), {"mode": "gspo"}, ValueError, "mode must be one of"),
        (torch.zeros(3), torch.tensor([0, 1]), {"mode": "grpo"}, ValueError, r"group_index shape \(2,\)"),
        (
            torch.zeros(3),
            torch.tensor([0.0, 1, 1]),
            {"mode": "grpo"},
            TypeError,
            "group_index must be int64",
        ),
        (torch.zeros(3, 2), torch.tensor([0, 1, 1]), {"mode": "grpo"}, ValueError, r"scores must be \[B\]"),
        (torch.zeros(3), torch.tensor([0, 1, 1]), {"mode": "grpo", "epsilon": -1}, ValueError, "epsilon"),
    ],
)
def test_bad_inputs(scores, group_index, kw, error, match):
    with pytest.raises(error, match=match):
        ops.group_normalize(scores, group_index, **kw)
