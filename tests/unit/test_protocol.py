import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.compat.verl.protocol import DataProto
from megatron_rl.protocol import collate_dicts


def make(n: int, width: int = 3, offset: int = 0) -> DataProto:
    ids = torch.arange(offset, offset + n * width).view(n, width)
    return DataProto.from_single_dict(
        {
            "input_ids": ids,
            "mask": ids % 2 == 0,
            "uid": [f"u{offset + i}" for i in range(n)],
            "reward_model": [{"ground_truth": str(offset + i)} for i in range(n)],
        },
        meta_info={"temperature": 1.0},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert set(a.batch.keys()) == set(b.batch.keys()) and set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for k in a.batch.keys():
        assert torch.equal(a.batch[k], b.batch[k]), k
    for k in a.non_tensor_batch:
        assert list(a.non_tensor_batch[k]) == list(b.non_tensor_batch[k]), k


lengths = st.integers(min_value=1, max_value=40)


@settings(max_examples=40, deadline=None)
@given(n=lengths, size=st.integers(min_value=1, max_value=50))
def test_concat_of_split_is_identity(n, size):
    d = make(n)
    parts = d.split(size)
    assert all(len(p) <= size for p in parts)
    assert_same(DataProto.concat(parts), d)


@settings(max_examples=40, deadline=None)
@given(n=lengths, times=st.integers(min_value=1, max_value=5))
def test_repeat_interleave_keeps_copies_adjacent_and_aligned(n, times):
    d = make(n)
    r = d.repeat(times, interleave=True)
    assert len(r) == n * times
    for i in range(n):
        block = r[i * times : (i + 1) * times]
        assert set(block.non_tensor_batch["uid"]) == {f"u{i}"}
        assert all(torch.equal(row, d.batch["input_ids"][i]) for row in block.batch["input_ids"])
        assert all(rm == {"ground_truth": str(i)} for rm in block.non_tensor_batch["reward_model"])
    tiled = d.repeat(times, interleave=False)
    assert list(tiled.non_tensor_batch["uid"]) == list(d.non_tensor_batch["uid"]) * times


@settings(max_examples=30, deadline=None)
@given(n=lengths)
def test_union_of_disjoint_keys_is_order_independent(n):
    base = make(n)
    left = base.select(["input_ids"], ["uid"])
    right = base.select(["mask"], ["reward_model"])
    a = left.copy().union(right.copy())
    b = right.copy().union(left.copy())
    assert_same(a, b)


@settings(max_examples=40, deadline=None)
@given(n=lengths, chunks=st.integers(min_value=1, max_value=8))
def test_chunk_concat_round_trip_with_padding(n, chunks):
    d = make(n)
    padded, pad = d.pad_to_divisor(chunks)
    assert len(padded) % chunks == 0 and pad == (-n) % chunks
    parts = padded.chunk(chunks)
    assert len(parts) == chunks
    assert_same(DataProto.concat(parts).unpad(pad), d)


def test_getitem_variants():
    d = make(5)
    # an int gives one row (verl's DataProtoItem): the row's objects themselves, a TensorDict of batch_size []
    assert d[2].non_tensor_batch["uid"] == "u2" and d[2].batch.batch_size == torch.Size([])
    assert d[-1].non_tensor_batch["uid"] == "u4"
    assert [item.non_tensor_batch["uid"] for item in d] == [f"u{i}" for i in range(5)]  # iteration stops
    assert len(d[2:3]) == 1 and d[2:3].non_tensor_batch["uid"][0] == "u2"
    assert list(d[1:3].non_tensor_batch["uid"]) == ["u1", "u2"]
    assert list(d[torch.tensor([4, 0])].non_tensor_batch["uid"]) == ["u4", "u0"]
    assert list(d[np.array([True, False, True, False, False])].non_tensor_batch["uid"]) == ["u0", "u2"]
    with pytest.raises(IndexError):
        d[5]
    with pytest.raises(ValueError, match="out of range"):
        d[[0, 7]]


def test_length_mismatch_names_the_keys():
    with pytest.raises(ValueError, match=r"input_ids.*=3.*uid.*=2"):
        DataProto.from_single_dict({"input_ids": torch.zeros(3, 2), "uid": ["a", "b"]})


def test_union_conflict_names_the_key():
    a, b = make(3), make(3)
    b.batch["input_ids"] = b.batch["input_ids"] + 1
    with pytest.raises(ValueError, match="input_ids"):
        a.union(b)
    with pytest.raises(ValueError, match="lengths differ"):
        make(3).union(make(4).select(["mask"], []))


def test_concat_rejects_dtype_and_key_clash():
    a, b = make(2), make(2)
    b.batch["mask"] = b.batch["mask"].float()
    with pytest.raises(ValueError, match="mask.*mixed dtypes"):
        DataProto.concat([a, b])
    with pytest.raises(ValueError, match="keys"):
        DataProto.concat([make(2), make(2).select(["input_ids"], ["uid"])])


def test_select_pop_rename_reorder():
    d = make(4)
    with pytest.raises(ValueError, match="nope"):
        d.select(["nope"])
    popped = d.pop(batch_keys=["mask"], meta_info_keys=["temperature"])
    assert "mask" not in d.batch and "mask" in popped.batch and "temperature" not in d.meta_info
    d.rename("input_ids", "ids")
    assert "ids" in d.batch
    d.reorder(torch.tensor([3, 2, 1, 0]))
    assert list(d.non_tensor_batch["uid"]) == ["u3", "u2", "u1", "u0"]
    with pytest.raises(ValueError, match="permutation"):
        d.reorder([0, 0, 1, 2])
    with pytest.raises(ValueError, match="not divisible"):
        d.chunk(3)
    with pytest.raises(ValueError, match="missing \\['responses'\\] for update"):
        d.require("ids", "responses", where="update")


def test_pickles_and_moves():
    d = make(3)
    e = pickle.loads(pickle.dumps(d))
    assert_same(d, e)
    assert e.meta_info == {"temperature": 1.0}
    assert d.to("cpu").batch["input_ids"].device.type == "cpu"


def test_collate_dicts():
    rows = [{"x": torch.ones(2) * i, "s": {"k": i}} for i in range(3)]
    out = collate_dicts(rows)
    assert out["x"].shape == (3, 2) and out["s"][2] == {"k": 2}
    with pytest.raises(ValueError, match="'x'.*different shapes"):
        collate_dicts([{"x": torch.ones(2)}, {"x": torch.ones(3)}])
