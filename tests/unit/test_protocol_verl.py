"""DataProto on tensordict.TensorDict with verl's API (issue 18): construction, metrics-merging concat,
serialisation, sample_level_repeat, fold/unfold, make_iterator, union helpers, padding helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from megatron_rl.compat.verl.protocol import (
    DataProto,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    reduce_metrics,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def make(n=4, offset=0):
    ids = torch.arange(offset, offset + 2 * n).view(n, 2)
    return DataProto.from_single_dict({"ids": ids, "uid": [f"u{offset + i}" for i in range(n)]}, meta_info={"t": 1.0})


def test_batch_is_a_tensordict_and_verl_construction_works():
    data = make(4)
    assert isinstance(data.batch, TensorDict) and list(data.batch.batch_size) == [4]
    td = TensorDict({"a": torch.zeros(3, 2)}, batch_size=[3])
    built = DataProto(batch=td, non_tensor_batch={"x": np.array(list("abc"), dtype=object)})
    assert built.batch is td and len(built) == 3
    assert isinstance(built[1:].batch, TensorDict) and list(built[1:].batch.batch_size) == [2]
    data.batch = {"other": torch.ones(4, 1)}  # assigning a dict converts it
    assert isinstance(data.batch, TensorDict) and list(data.batch.keys()) == ["other"]
    with pytest.raises(ValueError, match=r"batch\['a'\]=3, non_tensor_batch\['x'\]=2"):
        DataProto(batch=td, non_tensor_batch={"x": ["a", "b"]})


def test_to_and_from_tensordict_round_trip():
    data = make(3)
    td = data.to_tensordict()
    back = DataProto.from_tensordict(td)
    assert torch.equal(back.batch["ids"], data.batch["ids"])
    assert list(back.non_tensor_batch["uid"]) == ["u0", "u1", "u2"] and back.meta_info == {"t": 1.0}


def test_concat_merges_metrics_of_all_parts_and_refuses_conflicts():
    parts = [DataProto(meta_info={"metrics": {"loss": float(i)}, "step": 3}) for i in range(3)]
    merged = DataProto.concat(parts)
    assert merged.meta_info == {"metrics": {"loss": [0.0, 1.0, 2.0]}, "step": 3}
    assert reduce_metrics(merged.meta_info["metrics"]) == {"loss": 1.0}
    timed = DataProto.concat([DataProto(meta_info={"timing": {"gen": 1.0}}), DataProto(meta_info={"timing": {"gen": 2.5}})])
    assert timed.meta_info["timing"] == {"gen": 2.5}
    with pytest.raises(ValueError, match=r"meta_info\['step'\] differs between parts: 3 vs 4"):
        DataProto.concat([DataProto(meta_info={"step": 3}), DataProto(meta_info={"step": 4})])
    rows = DataProto.concat([make(2), make(3, offset=10)])
    assert len(rows) == 5 and list(rows.batch.batch_size) == [5]


def test_serialize_and_disk_round_trip(tmp_path):
    data = make(3)
    again = DataProto.deserialize(data.serialize())
    assert torch.equal(again.batch["ids"], data.batch["ids"]) and list(again.non_tensor_batch["uid"]) == ["u0", "u1", "u2"]
    path = tmp_path / "d.pt"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert loaded.meta_info == {"t": 1.0} and torch.equal(loaded.batch["ids"], data.batch["ids"])


def test_sample_level_repeat():
    out = make(3).sample_level_repeat([2, 0, 1])
    assert list(out.non_tensor_batch["uid"]) == ["u0", "u0", "u2"]
    assert out.batch["ids"][:, 0].tolist() == [0, 0, 4]
    with pytest.raises(ValueError, match=r"one count per row \(3\)"):
        make(3).sample_level_repeat([1, 1])


def test_fold_unfold_and_unfold_column_chunks():
    data = make(6)
    folded = fold_batch_dim(data, 2)
    assert list(folded.batch.batch_size) == [2, 3] and folded.non_tensor_batch["uid"].shape == (2, 3)
    back = unfold_batch_dim(folded, 2)
    assert torch.equal(back.batch["ids"], data.batch["ids"]) and list(back.non_tensor_batch["uid"]) == list(data.non_tensor_batch["uid"])
    chunks = make(2).unfold_column_chunks(2, split_keys=["ids"])
    assert chunks.batch["ids"].tolist() == [[0], [1], [2], [3]]
    assert list(chunks.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1"]


def test_make_iterator():
    data = make(4)
    seen = [mb.batch["ids"][:, 0].tolist() for mb in data.make_iterator(2, epochs=2)]
    assert seen == [[0, 2], [4, 6], [0, 2], [4, 6]]
    shuffled = [mb for mb in data.make_iterator(2, 1, seed=0, dataloader_kwargs={"shuffle": True})]
    assert sorted(sum((mb.batch["ids"][:, 0].tolist() for mb in shuffled), [])) == [0, 2, 4, 6]
    assert shuffled[0].meta_info == {"t": 1.0}
    with pytest.raises(ValueError, match="not divisible by mini_batch_size=3"):
        data.make_iterator(3, 1)


def test_union_helpers_and_padding_helpers():
    a = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    union_tensor_dict(a, TensorDict({"y": torch.zeros(2), "x": torch.ones(2)}, batch_size=[2]))
    assert sorted(a.keys()) == ["x", "y"]
    with pytest.raises(ValueError, match="'x' differs"):
        union_tensor_dict(a, TensorDict({"x": torch.zeros(2)}, batch_size=[2]))
    d = {"u": np.array([1.0, float("nan")], dtype=object)}
    union_numpy_dict(d, {"u": np.array([1.0, float("nan")], dtype=object), "v": np.array(["a", "b"], dtype=object)})
    assert sorted(d) == ["u", "v"]
    with pytest.raises(ValueError, match="'u' differs"):
        union_numpy_dict(d, {"u": np.array([2.0, 3.0], dtype=object)})
    padded, pad = pad_dataproto_to_divisor(make(5), 4)
    assert len(padded) == 8 and pad == 3 and len(unpad_dataproto(padded, pad)) == 5


def test_verl_code_runs_through_the_compat_namespace():
    from megatron_rl.compat.verl.protocol import DataProto as VerlDataProto, union_tensor_dict as u

    data = VerlDataProto.from_dict(tensors={"a": torch.arange(4)}, non_tensors={"b": np.arange(4)})
    assert data.select(batch_keys=["a"], deepcopy=True).batch["a"].tolist() == [0, 1, 2, 3]
    assert u is union_tensor_dict


def test_refusals_are_value_errors_and_verl_style_assertion_errors():
    from megatron_rl.protocol import ProtocolError

    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([DataProto(meta_info={"config": "A"}), DataProto(meta_info={"config": "B"})])
    with pytest.raises(ValueError):
        union_tensor_dict(TensorDict({"x": torch.ones(2)}, [2]), TensorDict({"x": torch.zeros(2)}, [2]))
    nan_rows = np.array([1.0, float("nan"), np.array([2, 3])], dtype=object)
    union_numpy_dict({"a": nan_rows}, {"a": nan_rows.copy()})  # NaN == NaN, nested arrays compared
    assert issubclass(ProtocolError, ValueError) and issubclass(ProtocolError, AssertionError)
    assert len(DataProto.from_dict({"a": torch.zeros(2)}, num_batch_dims=1, auto_padding=False)) == 2
