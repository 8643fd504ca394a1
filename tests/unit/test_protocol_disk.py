"""DataProto.save_to_disk / load_from_disk (issue 33, item 1): the rows of an async run's checkpoint are stored
as tensors + JSON and read back with ``torch.load(weights_only=True)``, so a file planted in the run directory
cannot run code on resume; a file that does not parse is refused, naming it; every column type the loops use
(str/int/float/None/bool, lists, dicts, numpy scalars and arrays, tensors in meta_info) comes back exactly."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.compat.verl.protocol import DataProto
from megatron_rl.protocol import ProtocolError


class RunsCode:
    """A pickle payload: unpickling it runs ``code`` (here: writes a marker file)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def plant(path, marker) -> None:
    """What an attacker with write access to the run directory leaves: a file in the format load_from_disk read
    before issue 33 (torch.save of the three parts, pickled objects allowed) whose meta_info runs code."""
    torch.save({"batch": {"ids": torch.zeros(2, 3, dtype=torch.long)}, "batch_size": [2],
                "non_tensor_batch": {"uid": np.array(["a", "b"], dtype=object)},
                "meta_info": {"ahead_step": 2, "x": RunsCode(f"open({str(marker)!r}, 'w').write('ran')")}}, path)


def test_a_planted_pickle_is_refused_not_run(tmp_path):
    path, marker = tmp_path / "rollout_ahead.pkl", tmp_path / "marker"
    plant(path, marker)
    with pytest.raises(ProtocolError, match="rollout_ahead.pkl"):
        DataProto.load_from_disk(path)
    assert not marker.exists(), "loading the planted file ran its code"


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", b"PK\x03\x04truncated zip"])
def test_a_file_that_does_not_parse_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "rollout_buffer_0.pkl"
    path.write_bytes(content)
    with pytest.raises(ProtocolError, match=r"rollout_buffer_0\.pkl"):
        DataProto.load_from_disk(path)


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "d.pkl"
    DataProto.from_single_dict({"ids": torch.arange(6).view(3, 2), "uid": ["a", "b", "c"]}).save_to_disk(path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ProtocolError, match=r"d\.pkl"):
        DataProto.load_from_disk(path)


def _column(*items) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def _same(a, b) -> bool:
    """Equal with the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and all(_same(x, y) for x, y in zip(a.ravel(), b.ravel()))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, l) and _same(a[k], b[l]) for k, l in zip(a, b))
    if isinstance(a, (float, np.floating)) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_every_column_type_round_trips_exactly(tmp_path):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "tool_calls": None}]
    data = DataProto.from_single_dict({
        "input_ids": torch.arange(12).view(3, 4), "mask": torch.tensor([[True, False]] * 3),
        "logp": torch.randn(3, 4, dtype=torch.bfloat16),
        "uid": ["u0", "u1", "u2"],
        "raw_prompt": [messages, messages[:1], []],
        "reward_model": [{"ground_truth": "4", "style": "rule"}, {"ground_truth": None}, {}],
        "extra_info": [{"index": 0, "nested": {"k": [1, 2.5, None, True]}, 3: "int key", "t": (1, "a")},
                       {"score": float("nan"), "inf": -float("inf")}, None],
    }, meta_info={"global_steps": 3, "temperature": 1.0, "ahead_step": 2, "timing": {"gen": 0.25},
                  "metrics": {"loss": [0.1, 0.2]}, "eos": torch.tensor([1, 2]), "flag": False, "none": None})
    data.non_tensor_batch["weight_version"] = np.full(3, 7, dtype=np.int64)  # stored as np.int64 objects
    data.non_tensor_batch["scores"] = _column(np.float32(0.5), 1, np.array([1.5, 2.0], dtype=np.float32))
    data.non_tensor_batch["texts"] = _column(np.str_("x"), b"\x00bytes", np.array(["a", "bc"]))
    data.non_tensor_batch["objects"] = _column(np.array([{"a": 1}, [2]], dtype=object), np.bool_(True), -3)
    path = tmp_path / "rows.pkl"
    data.save_to_disk(path)
    back = DataProto.load_from_disk(path)
    assert list(back.batch.keys()) == list(data.batch.keys())
    for key in data.batch.keys():
        assert _same(back.batch[key], data.batch[key]), key
    assert list(back.non_tensor_batch) == list(data.non_tensor_batch)
    for key, column in data.non_tensor_batch.items():
        assert _same(back.non_tensor_batch[key], column), key
    assert _same(back.meta_info, data.meta_info)
    again = DataProto.deserialize(data.serialize())
    assert _same(again.meta_info, data.meta_info) and _same(again.non_tensor_batch["extra_info"],
                                                            data.non_tensor_batch["extra_info"])


def test_empty_and_row_less_batches_round_trip(tmp_path):
    for data in (DataProto(), DataProto(meta_info={"step": 1}),
                 DataProto.from_single_dict({"uid": np.array([], dtype=object)})):
        path = tmp_path / "empty.pkl"
        data.save_to_disk(path)
        back = DataProto.load_from_disk(path)
        assert len(back) == len(data) and back.meta_info == data.meta_info
        assert list(back.non_tensor_batch) == list(data.non_tensor_batch)


def test_an_object_that_json_cannot_hold_is_refused_at_save_naming_where(tmp_path):
    data = DataProto.from_single_dict({"uid": ["a"], "extra": [{"obj": object()}]})
    with pytest.raises(ProtocolError, match=r"non_tensor_batch\['extra'\].*object"):
        data.save_to_disk(tmp_path / "x.pkl")
    with pytest.raises(ProtocolError, match=r"meta_info.*RunsCode"):
        DataProto(meta_info={"x": RunsCode("pass")}).save_to_disk(tmp_path / "y.pkl")
