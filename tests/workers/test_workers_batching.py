"""Micro-batching, packing and batch checks of the Megatron roles (no Megatron, no processes)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from workers_batches import make_rl_batch

from megatron_rl.workers.batch_checks import check_batch, read_temperature
from megatron_rl.workers.micro_batches import (
    MicroBatchSpec,
    split_by_token_budget,
    split_fixed,
    split_micro_batches,
)
from megatron_rl.workers.packing import pack_micro_batch, real_token_counts


def cost(lengths, group) -> int:
    return len(group) * max(lengths[i] for i in group)


# ------------------------------------------------------------------ micro-batch splits
def test_split_fixed_keeps_order_and_covers_every_row():
    groups = split_fixed(7, 3)
    assert [g.tolist() for g in groups] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_split_fits_covers_and_uses_fewest_balanced_micro_batches(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, size=int(rng.integers(1, 7))).tolist()
    budget = int(rng.integers(max(lengths), 3 * max(lengths) + 1))
    groups = split_by_token_budget(lengths, budget)

    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    assert all(cost(lengths, g) <= budget for g in groups)
    # Brute force over every assignment of rows to k micro-batches: none needs fewer, and none with
    # as few has a smaller largest micro-batch.
    best = None
    for k in range(1, len(lengths) + 1):
        for labels in itertools.product(range(k), repeat=len(lengths)):
            parts = [[i for i, label in enumerate(labels) if label == j] for j in range(k)]
            if any(not p for p in parts) or any(cost(lengths, p) > budget for p in parts):
                continue
            largest = max(cost(lengths, p) for p in parts)
            best = largest if best is None else min(best, largest)
        if best is not None:
            assert len(groups) == k
            assert max(cost(lengths, g) for g in groups) == best
            return
    raise AssertionError("brute force found no split")


def test_token_budget_smaller_than_a_row_names_the_setting():
    with pytest.raises(
        ValueError, match=r"row 1 has 30 tokens, more than actor.ppo_max_token_len_per_gpu=20"
    ):
        split_by_token_budget([10, 30, 5], 20, "actor.ppo_max_token_len_per_gpu")


def test_spec_picks_the_split_and_rejects_bad_sizes():
    assert len(split_micro_batches([5] * 8, MicroBatchSpec(micro_batch_size=3))) == 3
    assert len(split_micro_batches([5] * 8, MicroBatchSpec(1, use_dynamic_bsz=True, max_token_len=20))) == 2
    with pytest.raises(ValueError, match="micro-batch size must be a positive int"):
        MicroBatchSpec(micro_batch_size=0)
    with pytest.raises(ValueError, match="max token length"):
        MicroBatchSpec(4, use_dynamic_bsz=True, max_token_len=0)


# ------------------------------------------------------------------ packing
def test_packing_removes_padding_and_locates_every_response_token():
    data = make_rl_batch(6, prompt_len=5, response_len=4, seed=1)
    batch = data.batch
    rows = torch.tensor([4, 1, 3])
    packed = pack_micro_batch(batch, rows, ("response_mask",))

    real = batch["attention_mask"][rows].bool()
    assert packed.input_ids.shape == (3, int(real.sum(1).max()))
    for i, row in enumerate(rows.tolist()):
        n = int(real[i].sum())
        assert torch.equal(packed.input_ids[i, :n], batch["input_ids"][row][real[i]])
        assert packed.attention_mask[i, :n].all() and not packed.attention_mask[i, n:].any()
    # the token after each predictor column is the response token it predicts
    assert torch.equal(packed.input_ids[packed.token_rows, packed.predictor_cols + 1], packed.labels)
    assert packed.labels.numel() == int(batch["response_mask"][rows].sum())
    # scatter puts per-token values back into the response layout, zeros on padding
    scattered = packed.scatter(packed.labels.float())
    assert torch.equal(scattered, (batch["responses"][rows] * batch["response_mask"][rows]).float())
    assert torch.equal(packed.fields["response_mask"], batch["response_mask"][rows])
    assert real_token_counts(batch) == batch["attention_mask"].sum(1).tolist()


def test_packing_to_a_fixed_shape_adds_empty_rows():
    batch = make_rl_batch(4, seed=2).batch
    packed = pack_micro_batch(batch, torch.tensor([0, 2]), shape=(3, 12))
    assert packed.input_ids.shape == (3, 12) and packed.num_rows == 2
    assert not packed.attention_mask[2].any() and (packed.token_rows < 2).all()
    with pytest.raises(ValueError, match="cannot hold 2 rows"):
        pack_micro_batch(batch, torch.tensor([0, 2]), shape=(1, 12))


# ------------------------------------------------------------------ batch checks
def test_a_good_batch_passes_and_reports_its_shape():
    shape = check_batch(make_rl_batch(3, prompt_len=4, response_len=2), ("advantages",), "update_actor")
    assert (shape.batch_size, shape.seq_len, shape.response_len) == (3, 6, 2)


def test_missing_field_is_named():
    data = make_rl_batch(3)
    data.pop(["advantages"])
    with pytest.raises(ValueError, match=r"missing \['advantages'\] for update_actor"):
        check_batch(data, ("advantages",), "update_actor")


@pytest.mark.parametrize("key", ["old_log_probs", "attention_mask", "position_ids"])
def test_wrong_length_is_named(key):
    data = make_rl_batch(3, prompt_len=4, response_len=2)
    data.batch[key] = data.batch[key][:, :-1]
    with pytest.raises(ValueError, match=rf"update_actor: batch\['{key}'\] has shape \(3, \d\), expected"):
        check_batch(data, ("old_log_probs",), "update_actor")


def test_inconsistent_batches_are_rejected_with_the_rows():
    data = make_rl_batch(4, seed=3)
    data.batch["responses"] = data.batch["responses"].clone()
    data.batch["responses"][2, 0] += 1
    with pytest.raises(
        ValueError, match=r"differs from the last 5 columns of batch\['input_ids'\] in rows \[2\]"
    ):
        check_batch(data, (), "compute_log_prob")

    data = make_rl_batch(4, seed=3)
    data.batch["attention_mask"][1, -1] = 0
    data.batch["response_mask"][1, -1] = 1
    with pytest.raises(ValueError, match=r"response_mask'\] is 1 where .* is 0 \(padding\) in rows \[1\]"):
        check_batch(data, (), "compute_log_prob")

    data = make_rl_batch(4, seed=3)
    data.batch["position_ids"] = torch.arange(data.batch["input_ids"].shape[1]).expand(4, -1).clone()
    with pytest.raises(ValueError, match=r"position_ids'\] must count the real tokens"):
        check_batch(data, (), "compute_log_prob")


def test_temperature_is_required_and_positive():
    data = make_rl_batch(2, temperature=0.6)
    assert read_temperature(data, "compute_log_prob") == 0.6
    data.meta_info["temperature"] = 0
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] must be a number > 0, got 0"):
        read_temperature(data, "compute_log_prob")
    del data.meta_info["temperature"]
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] is missing"):
        read_temperature(data, "compute_log_prob")
