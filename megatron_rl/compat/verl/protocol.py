"""``verl.protocol`` on megatron_rl.protocol: ``DataProto`` with verl's whole API, and verl's module-level helpers.

megatron_rl.protocol.DataProto holds what megatron-rl's own code calls; the subclass here adds the rest of
verl's methods (rename, copy, to, padding, slice, sample_level_repeat, unfold_column_chunks, make_iterator,
to_tensordict / from_tensordict, serialize / deserialize, verl's pickling), so verl code and verl's own tests
run on it unchanged. Everything the base class returns from one of these (an index, a concat, a chunk) is of
this class too.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from megatron_rl import protocol
from megatron_rl.protocol import (
    DataProtoConfig,
    DataProtoItem,
    ProtocolError,
    check_lengths,
    collate_dicts,
    objects_equal,
    reduce_metrics,
    to_object_array,
)
from megatron_rl.protocol_codec import decode_rows, encode_rows

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "ProtocolError",
    "collate_dicts",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "reduce_metrics",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]


class DataProto(protocol.DataProto):
    """megatron-rl's DataProto plus the methods only verl's API needs."""

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> "DataProto":
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys")
        for o, n in zip(old, new):
            in_batch = o in self.batch.keys()
            part = self.batch if in_batch else self.non_tensor_batch if o in self.non_tensor_batch else None
            if part is None:
                raise ValueError(f"rename: no key {o!r} in batch or non_tensor_batch")
            if n in self.batch.keys() or n in self.non_tensor_batch:
                raise ValueError(f"rename: target key {n!r} already exists")
            part[n] = part.pop(o)
        return self

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """In place: append ``padding_size`` copies of the first row (``"first"``) or the last row."""
        if padding_size < 0:
            raise ProtocolError(f"padding: padding_size must be >= 0, got {padding_size}")
        if padding_size == 0:
            return
        if not len(self):
            raise ProtocolError("padding: cannot pad an empty DataProto")
        row = 0 if padding_candidate == "first" else len(self) - 1
        padded = self[np.concatenate([np.arange(len(self)), np.full(padding_size, row)])]
        object.__setattr__(self, "batch", padded.batch)
        self.non_tensor_batch = padded.non_tensor_batch

    def to(self, device: str | torch.device) -> "DataProto":
        object.__setattr__(self, "batch", self.batch.to(device))
        return self

    def copy(self) -> "DataProto":
        return self.from_parts(self.batch.clone(), {k: v.copy() for k, v in self.non_tensor_batch.items()},
                               copy.deepcopy(self.meta_info))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        return self[slice(start, end, step)]

    def check_consistency(self) -> None:
        check_lengths(self.batch, self.non_tensor_batch)

    def sample_level_repeat(self, repeat_times: Sequence[int] | torch.Tensor | np.ndarray) -> "DataProto":
        """Row i repeated repeat_times[i] times (rows stay in order; 0 drops a row)."""
        if isinstance(repeat_times, torch.Tensor):
            repeat_times = repeat_times.cpu().numpy()
        counts = np.asarray(list(repeat_times) if isinstance(repeat_times, tuple) else repeat_times)
        if counts.ndim != 1 or counts.shape[0] != len(self):
            raise ValueError(f"sample_level_repeat: repeat_times must hold one count per row ({len(self)}), "
                             f"got shape {counts.shape}")
        if counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0):
            raise ValueError(f"sample_level_repeat: repeat_times must be integers >= 0, got {counts.tolist()[:8]}")
        return self[np.repeat(np.arange(len(self)), counts)]

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> "DataProto":
        """verl's semantics: dim 1 of each ``split_keys`` field is cut into n_split chunks that become rows
        (row i -> rows i*n_split ...); every other field is repeated n_split times. A non-tensor field is
        split as verl's 2-D array of it: a column of equal-length sequences becomes a [rows * n_split,
        length / n_split] object array (row i*n_split + j holds chunk j of row i)."""
        if n_split < 1:
            raise ProtocolError(f"unfold_column_chunks: n_split must be >= 1, got {n_split}")
        split_keys = list(split_keys or ())
        n = len(self)
        batch = {}
        for k, v in self.batch.items():
            if k in split_keys:
                if v.dim() < 2 or v.shape[1] % n_split:
                    raise ProtocolError(f"unfold_column_chunks: batch[{k!r}] of shape {tuple(v.shape)} has no dim 1 "
                                        f"divisible by n_split={n_split}")
                batch[k] = v.reshape(n * n_split, v.shape[1] // n_split, *v.shape[2:])
            else:
                batch[k] = torch.repeat_interleave(v, n_split, dim=0)
        non_tensor = {}
        for k, v in self.non_tensor_batch.items():
            non_tensor[k] = _unfold_table(k, v, n_split) if k in split_keys else np.repeat(v, n_split, axis=0)
        return self.from_parts(TensorDict(batch, batch_size=[n * n_split], device=self.batch.device), non_tensor,
                               dict(self.meta_info))

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator["DataProto"]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` times; ``dataloader_kwargs={"shuffle": True}``
        shuffles each epoch (with ``seed``). Each mini-batch carries this meta_info."""
        if mini_batch_size < 1 or len(self) % mini_batch_size:
            raise ValueError(f"make_iterator: {len(self)} rows are not divisible by mini_batch_size={mini_batch_size}")
        kwargs = dict(dataloader_kwargs or {})
        shuffle = bool(kwargs.pop("shuffle", False))
        kwargs.pop("drop_last", None)
        if kwargs:
            raise ValueError(f"make_iterator: unsupported dataloader_kwargs {sorted(kwargs)} (supported: shuffle)")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return _mini_batches(self, mini_batch_size, epochs, shuffle, generator)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: the tensors, each non-tensor field as a NonTensorStack, meta_info as NonTensorData."""
        common = set(self.batch.keys()) & (set(self.non_tensor_batch) | set(self.meta_info))
        if common:
            raise ValueError(f"to_tensordict: keys {sorted(common)} are in more than one part")
        out = TensorDict(dict(self.batch.items()), batch_size=self.batch.batch_size, device=self.batch.device)
        for k, v in self.non_tensor_batch.items():
            out[k] = NonTensorStack.from_list([NonTensorData(item) for item in v])
        for k, v in self.meta_info.items():
            out[k] = NonTensorData(v)
        return out

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: Mapping[str, Any] | None = None,
                        num_batch_dims: int = 1) -> "DataProto":
        """Inverse of to_tensordict: tensors -> batch, NonTensorStack -> non_tensor_batch, NonTensorData -> meta_info."""
        if num_batch_dims != 1:
            raise ValueError(f"from_tensordict supports num_batch_dims=1, got {num_batch_dims}")
        meta = dict(meta_info or {})
        tensors, non_tensor = {}, {}
        for key in tensor_dict.keys():
            val = tensor_dict.get(key)
            if isinstance(val, NonTensorStack):
                non_tensor[key] = to_object_array(key, [elem.data if isinstance(elem, NonTensorData) else elem
                                                        for elem in val.tolist()])
            elif isinstance(val, NonTensorData):
                meta[key] = val.data
            elif isinstance(val, torch.Tensor):
                tensors[key] = val
            else:
                raise ValueError(f"from_tensordict: field {key!r} is a {type(val).__name__}, not a tensor or non-tensor")
        return cls(tensors, non_tensor, meta)

    def serialize(self) -> bytes:
        """Bytes that ``DataProto.deserialize`` reads back: tensors and JSON, nothing pickled (the disk format)."""
        return encode_rows(self.batch, self.non_tensor_batch, self.meta_info)

    @classmethod
    def deserialize(cls, data: bytes, name: str = "DataProto bytes") -> "DataProto":
        """Read ``serialize``'s bytes with ``torch.load(weights_only=True)``: no code runs whatever they hold;
        anything else is refused (ProtocolError naming ``name``)."""
        return decode_rows(cls, data, name)

    def __getstate__(self) -> tuple:
        """Pickling (Ray, multiprocessing): the TensorDict as is, or with
        VERL_DATAPROTO_SERIALIZATION_METHOD=numpy as ``serialize_tensordict``'s byte arrays (verl's
        option; no consolidated copy of the TensorDict is made)."""
        if os.getenv("VERL_DATAPROTO_SERIALIZATION_METHOD") == "numpy":
            return ("numpy", serialize_tensordict(self.batch)), self.non_tensor_batch, self.meta_info
        return ("tensordict", self.batch), self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple) -> None:
        (method, batch), non_tensor, meta = state
        if method not in ("numpy", "tensordict"):
            raise ProtocolError(f"DataProto state has unknown batch encoding {method!r}")
        object.__setattr__(self, "batch", deserialize_tensordict(batch) if method == "numpy" else batch)
        object.__setattr__(self, "non_tensor_batch", non_tensor)
        object.__setattr__(self, "meta_info", meta)


def _mini_batches(data: DataProto, size: int, epochs: int, shuffle: bool,
                  generator: torch.Generator | None) -> Iterator[DataProto]:
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=generator) if shuffle else torch.arange(len(data))
        for start in range(0, len(data), size):
            part = data[order[start:start + size]]
            part.meta_info = data.meta_info
            yield part


def _unfold_table(key: str, values: np.ndarray, n_split: int) -> np.ndarray:
    """unfold_column_chunks on a non-tensor field: the field as the 2-D array verl stores (a 1-D column of
    equal-length sequences is stacked first), dim 1 cut into n_split chunks that become rows."""
    if values.ndim < 2:
        for i, row in enumerate(values):
            if not isinstance(row, (list, tuple, np.ndarray)):
                raise ProtocolError(f"unfold_column_chunks: non_tensor_batch[{key!r}] row {i} is "
                                    f"{type(row).__name__}, not a sequence to split")
            if len(row) != len(values[0]):
                raise ProtocolError(f"unfold_column_chunks: non_tensor_batch[{key!r}] row {i} has length {len(row)}, "
                                    f"row 0 {len(values[0])}: the field is split as one 2-D array (verl)")
        values = np.array(values.tolist(), dtype=object) if len(values) else values.reshape(0, 0)
    if values.shape[1] % n_split:
        raise ProtocolError(f"unfold_column_chunks: non_tensor_batch[{key!r}] of shape {values.shape} has no dim 1 "
                            f"divisible by n_split={n_split}")
    return values.reshape(values.shape[0] * n_split, values.shape[1] // n_split, *values.shape[2:])


@dataclass
class DataProtoFuture:
    """verl's handle on DataProtos still being computed by Ray workers: ``get()`` waits for
    ``futures`` (Ray ObjectRefs of DataProtos), merges them with ``collect_fn`` (``DataProto.concat``)
    and, when set, applies ``dispatch_fn`` (e.g. "my chunk"). Nothing else may be done with it on the
    driver; pass it on to the next worker call or ``get()`` it."""

    collect_fn: Callable[[list["DataProto"]], "DataProto"]
    futures: list[Any]
    dispatch_fn: Callable[["DataProto"], "DataProto"] | None = None

    @staticmethod
    def concat(data: list[Any]) -> "DataProtoFuture":
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list["DataProtoFuture"]:
        """``chunks`` futures over the same results, the i-th resolving to ``collect(...).chunk(chunks)[i]``."""
        if chunks < 1:
            raise ProtocolError(f"DataProtoFuture.chunk: chunks must be >= 1, got {chunks}")
        return [DataProtoFuture(self.collect_fn, self.futures, _ChunkOf(i, chunks)) for i in range(chunks)]

    def get(self) -> "DataProto":
        import ray  # Ray: a heavy optional dependency, needed only where futures are resolved

        parts = ray.get(self.futures)
        bad = [type(p).__name__ for p in parts if not isinstance(p, protocol.DataProto)]
        if bad:
            raise ProtocolError(f"DataProtoFuture.get: the futures resolved to {bad}, not DataProtos")
        out = self.collect_fn(parts)
        return self.dispatch_fn(out) if self.dispatch_fn is not None else out


@dataclass(frozen=True)
class _ChunkOf:
    """Picklable "the i-th of n chunks" (a closure would not travel to Ray workers)."""

    index: int
    chunks: int

    def __call__(self, data: "DataProto") -> "DataProto":
        return data.chunk(self.chunks)[self.index]


def _deep_equal(a: Any, b: Any, _seen: Optional[set[tuple[int, int]]] = None) -> bool:
    """Equality that treats NaN == NaN and recurses into arrays, lists and dicts (verl's union rule).
    A pair of containers met again on the way down (a self-referencing object array) counts as equal
    there, so cycles end instead of recursing forever."""
    if isinstance(a, (np.ndarray, list, tuple, dict)):
        seen = set() if _seen is None else _seen
        if (id(a), id(b)) in seen:
            return True
        seen.add((id(a), id(b)))
    else:
        seen = _seen
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype != object and b.dtype != object:
            try:
                return bool(np.array_equal(a, b, equal_nan=True))
            except TypeError:
                return bool(np.array_equal(a, b))
        return all(_deep_equal(x, y, seen) for x, y in zip(a.ravel(), b.ravel()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_deep_equal(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_deep_equal(a[k], b[k], seen) for k in a)
    if _is_nan(a) and _is_nan(b):
        return True
    return type(a) is type(b) and objects_equal(a, b) if isinstance(a, str) or isinstance(b, str) else objects_equal(a, b)


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and x != x


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add tensor_dict2's tensors to tensor_dict1 (in place); a shared key must hold equal tensors."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ProtocolError(f"union_tensor_dict: batch sizes differ, {list(tensor_dict1.batch_size)} vs "
                         f"{list(tensor_dict2.batch_size)}")
    for key in tensor_dict2.keys():
        value = tensor_dict2[key]
        if key in tensor_dict1.keys():
            mine = tensor_dict1[key]
            if mine.shape != value.shape or not torch.equal(mine, value.to(mine.device)):
                raise ProtocolError(f"union_tensor_dict: {key!r} differs between the two TensorDicts")
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add tensor_dict2's arrays to tensor_dict1 (in place); a shared key must hold equal arrays (NaN == NaN)."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            mine = tensor_dict1[key]
            if not _deep_equal(np.asarray(mine), np.asarray(value)):
                raise ProtocolError(f"union_numpy_dict: {key!r} differs between the two dicts "
                                    f"(`{key}` in tensor_dict1 and tensor_dict2 are not the same object.)")
        tensor_dict1[key] = value
    return tensor_dict1


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """verl's module-level name for ``data.pad_to_divisor(size_divisor)``."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """verl's module-level name for ``data.unpad(pad_size)``."""
    return data.unpad(pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """[B, ...] -> [new_batch_size, B // new_batch_size, ...] on every field (batch_size becomes 2-D)."""
    n = len(data)
    if new_batch_size < 1 or n % new_batch_size:
        raise ValueError(f"fold_batch_dim: {n} rows are not divisible by new_batch_size={new_batch_size}")
    batch = data.batch.view(new_batch_size, -1)
    non_tensor = {k: np.reshape(v, (new_batch_size, -1, *v.shape[1:])) for k, v in data.non_tensor_batch.items()}
    return data.from_parts(batch, non_tensor, data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of fold_batch_dim: the first ``batch_dims`` dims become one row dim."""
    batch = data.batch
    if batch.batch_dims != batch_dims:
        batch = batch.clone(False)
        batch.auto_batch_size_(batch_dims=batch_dims)
    batch = batch.reshape(-1)
    n = batch.batch_size[0]
    non_tensor = {k: np.reshape(v, (n, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return data.from_parts(batch, non_tensor, data.meta_info)


def collate_fn(items: Sequence[DataProtoItem]) -> DataProto:
    """verl's collate_fn: DataProtoItems (``data[i]``) back into one DataProto (tensors stacked)."""
    if not items:
        raise ProtocolError("collate_fn needs at least one DataProtoItem")
    bad = [i for i, item in enumerate(items) if not isinstance(item, DataProtoItem)]
    if bad:
        raise ProtocolError(f"collate_fn takes DataProtoItems (data[i]); items {bad[:5]} are not "
                            "(use collate_dicts for dataset rows)")
    batch = torch.stack([item.batch for item in items]).contiguous()
    keys = list(items[0].non_tensor_batch)
    non_tensor = {k: to_object_array(k, [item.non_tensor_batch[k] for item in items]) for k in keys}
    return DataProto(batch, non_tensor)


def serialize_single_tensor(obj: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype name, shape, the bytes as a uint8 numpy array): picklable without torch's storage format."""
    data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data


def deserialize_single_tensor(arr: tuple[str, Sequence[int], Any]) -> torch.Tensor:
    dtype, shape, data = arr
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ProtocolError(f"deserialize_single_tensor: {dtype!r} is not a torch dtype")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], Optional[str], dict[str, tuple]]:
    """(batch_size, device or None, {key: single-tensor encoding, or (layout, [encodings]) for a
    nested tensor})."""
    items: dict[str, tuple] = {}
    for k, v in batch.items():
        if v.is_nested:
            items[k] = (str(v.layout).removeprefix("torch."), [serialize_single_tensor(t) for t in v.unbind()])
        else:
            items[k] = serialize_single_tensor(v)
    return tuple(batch.batch_size), (str(batch.device) if batch.device is not None else None), items


def deserialize_tensordict(arr: tuple) -> TensorDict:
    batch_size, device, items = arr
    tensors: dict[str, torch.Tensor] = {}
    for k, v in items.items():
        if len(v) == 3:
            tensors[k] = deserialize_single_tensor(v)
        elif len(v) == 2:
            layout, parts = v
            tensors[k] = torch.nested.as_nested_tensor([deserialize_single_tensor(p) for p in parts],
                                                       layout=getattr(torch, layout))
        else:
            raise ProtocolError(f"deserialize_tensordict: {k!r} has an encoding of {len(v)} parts (expected 2 or 3)")
    return TensorDict(tensors, batch_size=batch_size, device=device)
