"""DataProto's verl row API (issue 18): data[i] is a DataProtoItem, collate_fn, auto-padding and uneven
chunks, tensor byte serialisation and pickling, cycles in union_numpy_dict, DataProtoFuture."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from megatron_rl import protocol
from megatron_rl.compat.verl.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    DataProtoItem,
    ProtocolError,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    union_numpy_dict,
)
from megatron_rl_testing.verl_oracle import verl_module


def rows(n: int, **kw) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n * 2).view(n, 2)}, {"uid": [f"u{i}" for i in range(n)]},
                               {"step": 3}, **kw)




@pytest.fixture
def no_global_padding(monkeypatch):
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)
    monkeypatch.setattr(protocol._DataProtoConfigMeta, "_config", {})


def test_an_int_index_is_one_row_and_collate_fn_rebuilds_the_batch():
    d = rows(4)
    item = d[1]
    assert isinstance(item, DataProtoItem) and item.meta_info is d.meta_info
    assert item.batch.batch_size == torch.Size([]) and item.batch["x"].tolist() == [2, 3]
    assert item.non_tensor_batch == {"uid": "u1"}
    back = collate_fn([d[i] for i in (3, 0)])
    assert back.batch["x"].tolist() == [[6, 7], [0, 1]] and list(back.non_tensor_batch["uid"]) == ["u3", "u0"]
    with pytest.raises(ProtocolError, match="DataProtoItems"):
        collate_fn([{"x": torch.zeros(2)}])


def test_uneven_chunk_is_refused_unless_padding_is_enabled(no_global_padding, monkeypatch):
    with pytest.raises(AssertionError, match="not divisible by 4"):  # ProtocolError: also a ValueError
        rows(6).chunk(4)
    sizes = [len(c) for c in rows(6, auto_padding=True).chunk(4)]  # this batch only
    assert sizes == [2, 2, 1, 1]
    assert [len(c) for c in rows(6, auto_padding=True)[np.arange(5)].chunk(3)] == [2, 2, 1]  # kept by indexing
    DataProtoConfig.auto_padding = True
    parts = rows(7).chunk(3)
    assert [len(c) for c in parts] == [3, 2, 2]
    assert torch.equal(DataProto.concat(parts).batch["x"], rows(7).batch["x"])
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert rows(5).is_padding_enabled()
    with pytest.raises(ProtocolError, match="must be a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_padding_appends_copies_of_the_first_or_last_row():
    d = rows(3)
    d.padding(2, "first")
    assert d.batch["x"][:, 0].tolist() == [0, 2, 4, 0, 0] and list(d.non_tensor_batch["uid"])[-1] == "u0"
    d = rows(3)
    d.padding(1)
    assert list(d.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u2"]
    with pytest.raises(ProtocolError, match="empty"):
        DataProto().padding(1)


def test_tensor_byte_serialisation_round_trips_dtypes_devices_and_nested():
    for t in (torch.randn(3, 4), torch.arange(6, dtype=torch.int16).view(2, 3), torch.rand(2, 2).bfloat16()):
        dtype, shape, data = serialize_single_tensor(t)
        assert isinstance(data, np.ndarray) and data.dtype == np.uint8
        assert torch.equal(deserialize_single_tensor((dtype, shape, data)), t)
    nested = torch.nested.as_nested_tensor([torch.ones(2, 3), torch.zeros(1, 3)])
    td = TensorDict({"n": nested, "r": torch.ones(2, 5)}, batch_size=[2], device="cpu")
    back = deserialize_tensordict(pickle.loads(pickle.dumps(serialize_tensordict(td))))
    assert back.batch_size == td.batch_size and str(back.device) == "cpu"
    assert [t.tolist() for t in back["n"].unbind()] == [t.tolist() for t in nested.unbind()]
    with pytest.raises(ProtocolError, match="not a torch dtype"):
        deserialize_single_tensor(("nonsense", (1,), np.zeros(4, np.uint8)))


@pytest.mark.parametrize("method", [None, "numpy"])
def test_pickling_keeps_all_three_parts(monkeypatch, method):
    if method:
        monkeypatch.setenv("VERL_DATAPROTO_SERIALIZATION_METHOD", method)
    else:
        monkeypatch.delenv("VERL_DATAPROTO_SERIALIZATION_METHOD", raising=False)
    d = rows(3)
    back = pickle.loads(pickle.dumps(d))
    assert torch.equal(back.batch["x"], d.batch["x"]) and list(back.non_tensor_batch["uid"]) == ["u0", "u1", "u2"]
    assert back.meta_info == {"step": 3}
    empty = pickle.loads(pickle.dumps(DataProto(batch=TensorDict({}, batch_size=[4]))))
    assert empty.batch.batch_size == torch.Size([4])


def test_union_numpy_dict_ends_on_self_referencing_arrays():
    a, b = np.array([None], dtype=object), np.array([None], dtype=object)
    a[0], b[0] = a, b
    union_numpy_dict({"k": a}, {"k": b})
    with pytest.raises(AssertionError, match="`k` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict({"k": a}, {"k": np.array([None], dtype=object)})


def test_unfold_column_chunks_splits_a_non_tensor_field_as_verls_2d_array():
    # verl stores a column of equal-length lists as a 2-D array and reshapes it: the chunks come back as
    # a [rows * n_split, length / n_split] array, not as a column of lists
    d = DataProto.from_dict({"x": torch.arange(8).view(2, 4)},
                            {"tags": [["a", "b", "c", "d"], ["e", "f", "g", "h"]], "uid": ["p", "q"]})
    out = d.unfold_column_chunks(2, split_keys=["x", "tags"])
    assert out.non_tensor_batch["tags"].shape == (4, 2)
    assert out.non_tensor_batch["tags"].tolist() == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    assert (out.non_tensor_batch["tags"] == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]).all()
    assert list(out.non_tensor_batch["uid"]) == ["p", "p", "q", "q"]
    assert out.batch["x"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a field already 2-D (fold_batch_dim makes them) is reshaped as it is
    folded = DataProto.from_dict({"x": torch.arange(4).view(2, 2)}, {"t": [["a", "b"], ["c", "d"]]})
    twice = folded.unfold_column_chunks(2, ["t"]).unfold_column_chunks(1, ["t"])
    assert twice.non_tensor_batch["t"].shape == (4, 1)


def test_unfold_column_chunks_matches_verl():
    verl_protocol = verl_module("verl.protocol")
    tensors = {"obs": torch.arange(12).view(3, 4), "keep": torch.arange(3)}
    non_tensors = {"labels": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]], "uid": ["a", "b", "c"]}
    ours = DataProto.from_dict(tensors, non_tensors, {"k": 1}).unfold_column_chunks(2, ["obs", "labels"])
    theirs = verl_protocol.DataProto.from_dict(tensors, non_tensors, {"k": 1}).unfold_column_chunks(2, ["obs", "labels"])
    for key in ("obs", "keep"):
        assert torch.equal(ours.batch[key], theirs.batch[key])
    for key in ("labels", "uid"):
        assert ours.non_tensor_batch[key].shape == theirs.non_tensor_batch[key].shape
        assert ours.non_tensor_batch[key].tolist() == theirs.non_tensor_batch[key].tolist()
    assert ours.meta_info == theirs.meta_info


def test_unfold_column_chunks_refuses_what_it_cannot_split():
    d = DataProto.from_dict({"x": torch.arange(6).view(2, 3)}, {"tags": [["a", "b"], ["c"]], "uid": ["p", "q"]})
    with pytest.raises(ProtocolError, match=r"non_tensor_batch\['uid'\] row 0 is str"):
        d.unfold_column_chunks(2, split_keys=["uid"])
    with pytest.raises(ProtocolError, match=r"non_tensor_batch\['tags'\] row 1 has length 1, row 0 2"):
        d.unfold_column_chunks(2, split_keys=["tags"])
    with pytest.raises(ProtocolError, match=r"batch\['x'\] of shape \(2, 3\) has no dim 1 divisible by n_split=2"):
        d.unfold_column_chunks(2, split_keys=["x"])
    odd = DataProto.from_dict({"x": torch.zeros(1, 2)}, {"t": [["a", "b", "c"]]})
    with pytest.raises(ProtocolError, match=r"non_tensor_batch\['t'\] of shape \(1, 3\) has no dim 1 divisible"):
        odd.unfold_column_chunks(2, split_keys=["t"])
    with pytest.raises(ProtocolError, match="n_split must be >= 1, got 0"):
        d.unfold_column_chunks(0)


class _Ref:
    """Stand-in ObjectRef: only ray.get (patched below) can open it, as with Ray."""

    def __init__(self, value):
        self._value = value


def test_data_proto_future_collects_then_dispatches(monkeypatch):
    import ray

    def fake_get(refs):
        assert all(isinstance(r, _Ref) for r in refs), "DataProtoFuture must hand ray.get the refs themselves"
        return [r._value for r in refs]

    monkeypatch.setattr(ray, "get", fake_get)
    future = DataProtoFuture.concat([_Ref(rows(2)), _Ref(rows(2))])
    assert future.get().batch["x"][:, 0].tolist() == [0, 2, 0, 2]
    halves = future.chunk(2)
    assert [h.get().batch["x"][:, 0].tolist() for h in halves] == [[0, 2], [0, 2]]
    pickle.dumps(halves[1])  # travels to a worker
    with pytest.raises(ProtocolError, match="not DataProtos"):
        DataProtoFuture.concat([_Ref("oops")]).get()
