"""DataProto: the one container a sample travels in, from the dataloader to the weight sync.

Three parts, following verl's convention so users can move code across:
- ``batch``: a ``tensordict.TensorDict`` of tensors that share dim 0 (one row per sample; its
  ``batch_size`` is [len]); a plain dict given to the constructor or assigned later is converted,
- ``non_tensor_batch``: numpy object arrays of the same length (uid, data_source, raw prompts, ...),
- ``meta_info``: a plain dict for per-batch facts (temperature, global_steps, timing, ...).

Every operation checks lengths and keys and raises a ValueError that names the key and the sizes seen.

Note (as in verl): iterating a TensorDict yields rows; use ``data.batch.keys()`` for the keys.
``concat`` merges ``meta_info["metrics"]`` of all parts into a dict of lists (verl's rule; use
``reduce_metrics`` for means), ``meta_info["timing"]`` per key by max (the slowest part), and raises
on any other key whose values differ between parts.

As in verl: ``data[i]`` (an int) is a ``DataProtoItem`` (one row: a TensorDict with batch_size [],
the row's objects, the shared meta_info), any other index a DataProto; ``chunk(n)`` needs
``len % n == 0`` unless padding is enabled (``DataProtoConfig.auto_padding = True``, the
``VERL_AUTO_PADDING`` environment variable, or ``from_dict(..., auto_padding=True)`` for one batch),
in which case the chunks are as equal as possible (sizes differ by at most one).

The class holds what megatron-rl's own code calls. The rest of verl's API (rename, copy, to_tensordict,
make_iterator, DataProtoFuture, union_tensor_dict, ...) is megatron_rl.compat.verl.protocol's, a subclass
for verl code; the disk format is megatron_rl.protocol_codec's.
"""
from __future__ import annotations

import copy
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from megatron_rl.protocol_codec import ProtocolError, decode_rows, encode_rows

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoItem",
    "ProtocolError",
    "check_lengths",
    "collate_dicts",
    "objects_equal",
    "reduce_metrics",
    "to_object_array",
]

# The prompt tensors a rollout engine reads (prompts left-padded, verl's convention).
GENERATION_KEYS = ("input_ids", "attention_mask", "position_ids")

IndexLike = int | slice | torch.Tensor | np.ndarray | Sequence[int]


def to_object_array(key: str, value: Any) -> np.ndarray:
    """Store non-tensor fields as 1-D object arrays so per-row Python objects (dicts, lists) survive indexing."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"non_tensor_batch[{key!r}] must be 1-D, got shape {value.shape}")
        if value.dtype == object:
            return value
    items = list(value)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def check_lengths(batch: Mapping[str, torch.Tensor] | TensorDict, non_tensor: Mapping[str, np.ndarray]) -> int | None:
    """The number of rows every field agrees on (None without fields); a ValueError naming each field's count."""
    lengths: dict[str, int] = {}
    if isinstance(batch, TensorDict):
        if batch.batch_dims >= 1:
            keys = list(batch.keys())
            lengths[f"batch[{keys[0]!r}]" if keys else "batch"] = batch.batch_size[0]
        batch = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"batch[{key!r}] is a 0-d tensor; every batch tensor needs dim 0 = sample")
        lengths[f"batch[{key!r}]"] = value.shape[0]
    for key, value in non_tensor.items():
        lengths[f"non_tensor_batch[{key!r}]"] = len(value)
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise ValueError(f"DataProto fields disagree on the number of samples: {detail}")
    return next(iter(lengths.values()), None)


def _normalise_index(index: IndexLike, length: int) -> slice | np.ndarray:
    if isinstance(index, slice):
        return index
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    arr = np.asarray(index)
    if arr.dtype == bool:
        if arr.shape != (length,):
            raise ValueError(f"boolean index has shape {arr.shape}, expected ({length},)")
        return np.nonzero(arr)[0]
    if arr.dtype.kind not in "iu":
        raise ValueError(f"index must hold integers or booleans, got dtype {arr.dtype}")
    if arr.size and (arr.min() < -length or arr.max() >= length):
        raise ValueError(f"index out of range for DataProto of length {length}: min {arr.min()}, max {arr.max()}")
    return arr.reshape(-1)


def _as_tensordict(batch: Any, length: int | None) -> TensorDict:
    """A TensorDict with batch_size [n] from a dict, a TensorDict (batch_size filled in when empty) or None."""
    if batch is None:
        return TensorDict({}, batch_size=[length or 0])
    if isinstance(batch, TensorDict):
        if batch.batch_dims == 0:
            tensors = dict(batch.items())
            n = check_lengths(tensors, {}) if tensors else (length or 0)
            batch = TensorDict(tensors, batch_size=[n], device=batch.device)
        return batch
    if not isinstance(batch, Mapping):
        raise ValueError(f"DataProto.batch must be a TensorDict or a dict of tensors, got {type(batch).__name__}")
    n = check_lengths(batch, {})
    return TensorDict(dict(batch), batch_size=[n if n is not None else (length or 0)])


def _non_tensor_length(non_tensor: Mapping[str, np.ndarray]) -> int | None:
    return len(next(iter(non_tensor.values()))) if non_tensor else None


def _pick(src: Mapping[str, Any], keys: Iterable[str] | None, part: str) -> dict[str, Any]:
    """``select``'s view of one part: the named keys (all of them for None), a ValueError naming any missing."""
    names = list(src.keys())
    if keys is None:
        return {k: src[k] for k in names}
    keys = list(keys)
    missing = [k for k in keys if k not in names]
    if missing:
        raise ValueError(f"select: {part} has no keys {missing}; available: {sorted(names)}")
    return {k: src[k] for k in keys}


class _DataProtoConfigMeta(type):
    """``DataProtoConfig.auto_padding``: a process-wide switch (verl's), also on via VERL_AUTO_PADDING."""

    _config: dict[str, bool] = {}
    auto_padding_key = "_verl_auto_padding"  # the meta_info key that turns it on for one DataProto

    @property
    def auto_padding(cls) -> bool:
        by_env = os.getenv("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1")
        return by_env or cls._config.get(cls.auto_padding_key, False)

    @auto_padding.setter
    def auto_padding(cls, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ProtocolError(f"DataProtoConfig.auto_padding must be a bool, got {enabled!r}")
        cls._config[cls.auto_padding_key] = enabled


class DataProtoConfig(metaclass=_DataProtoConfigMeta):
    pass


@dataclass
class DataProtoItem:
    """One row of a DataProto (``data[i]``): ``batch`` a TensorDict with batch_size [], each
    non-tensor field's object for that row, and the DataProto's meta_info (shared, not copied)."""

    batch: Optional[TensorDict] = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataProto:
    batch: TensorDict = field(default_factory=lambda: TensorDict({}, batch_size=[0]))
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        non_tensor = {k: to_object_array(k, v) for k, v in (self.non_tensor_batch or {}).items()}
        if isinstance(self.batch, Mapping) or self.batch is None or isinstance(self.batch, TensorDict):
            check_lengths({} if self.batch is None or isinstance(self.batch, TensorDict) else self.batch, {})
        batch = _as_tensordict(self.batch, _non_tensor_length(non_tensor))
        object.__setattr__(self, "batch", batch)
        self.non_tensor_batch = non_tensor
        self.meta_info = dict(self.meta_info or {})
        check_lengths(self.batch, self.non_tensor_batch)
        if self.batch.batch_dims == 1 and not len(self.batch.keys()) and non_tensor:
            # an empty TensorDict takes the rows' count from the non-tensor fields
            object.__setattr__(self, "batch", TensorDict({}, batch_size=[_non_tensor_length(non_tensor)]))

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "batch" and "non_tensor_batch" in self.__dict__ and not isinstance(value, TensorDict):
            value = _as_tensordict(value, _non_tensor_length(self.non_tensor_batch))
        object.__setattr__(self, name, value)

    @classmethod
    def from_parts(cls, batch: TensorDict, non_tensor: dict[str, np.ndarray], meta: dict[str, Any]) -> "DataProto":
        """The three parts as they are, unchecked and uncopied: for parts that already agree (indexing,
        concat, verl's folds in the compat layer)."""
        out = object.__new__(cls)
        object.__setattr__(out, "batch", batch)
        object.__setattr__(out, "non_tensor_batch", non_tensor)
        object.__setattr__(out, "meta_info", meta)
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> "DataProto":
        """verl's signature; only num_batch_dims=1 is supported. ``auto_padding=True`` lets this
        DataProto (and what is indexed or chunked from it) be chunked unevenly (see ``chunk``)."""
        if num_batch_dims != 1:
            raise ProtocolError(f"DataProto.from_dict supports num_batch_dims=1 (one row dim), got {num_batch_dims}")
        meta = dict(meta_info or {})
        if auto_padding:
            meta[DataProtoConfig.auto_padding_key] = True
        return cls(dict(tensors or {}), dict(non_tensors or {}), meta)

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None,
                         auto_padding: bool = False) -> "DataProto":
        """Tensors go to ``batch``, everything else (lists, numpy arrays) to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, others, meta_info, auto_padding=auto_padding)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return check_lengths(self.batch, self.non_tensor_batch) or 0

    def _has_fields(self) -> bool:
        return bool(len(self.batch.keys())) or bool(self.non_tensor_batch)

    def __getitem__(self, index: IndexLike) -> "DataProto | DataProtoItem":
        length = len(self)
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            if not -length <= index < length:  # IndexError also ends ``for item in data``
                raise IndexError(f"index {index} out of range for DataProto of length {length}")
            return DataProtoItem(self.batch[int(index)], {k: v[index] for k, v in self.non_tensor_batch.items()},
                                 self.meta_info)
        idx = _normalise_index(index, length)
        torch_idx = idx if isinstance(idx, slice) else torch.from_numpy(idx.astype(np.int64))
        batch = self.batch[torch_idx]
        non_tensor = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        return self.from_parts(batch, non_tensor, dict(self.meta_info))

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}:{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.batch.items())
        return f"DataProto(len={len(self)}, batch=[{tensors}], non_tensor={list(self.non_tensor_batch)}, meta={list(self.meta_info)})"

    def require(self, *keys: str, where: str = "") -> None:
        """Raise a ValueError naming every missing field (checked before work starts, not deep inside it)."""
        missing = [k for k in keys if k not in self.batch.keys() and k not in self.non_tensor_batch]
        if missing:
            ctx = f" for {where}" if where else ""
            raise ValueError(
                f"DataProto is missing {missing}{ctx}; it has batch={sorted(self.batch.keys())} "
                f"non_tensor_batch={sorted(self.non_tensor_batch)}"
            )

    # ------------------------------------------------------------------ key-wise operations
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> "DataProto":
        """A view holding only the named keys (None keeps all of that part); deepcopy=True copies."""
        batch = TensorDict(_pick(self.batch, batch_keys, "batch"), batch_size=self.batch.batch_size,
                           device=self.batch.device)
        out = self.from_parts(
            batch,
            _pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
            _pick(self.meta_info, meta_info_keys, "meta_info"),
        )
        return copy.deepcopy(out) if deepcopy else out

    def pop(
        self,
        batch_keys: Iterable[str] | None = (),
        non_tensor_batch_keys: Iterable[str] | None = (),
        meta_info_keys: Iterable[str] | None = (),
    ) -> "DataProto":
        """Remove the named keys from self and return them as a new DataProto."""
        out = self.select(list(batch_keys or ()), list(non_tensor_batch_keys or ()), list(meta_info_keys or ()))
        for k in list(out.batch.keys()):
            del self.batch[k]
        for k in out.non_tensor_batch:
            del self.non_tensor_batch[k]
        for k in out.meta_info:
            del self.meta_info[k]
        return out

    def union(self, other: "DataProto") -> "DataProto":
        """Merge ``other`` into self. A key present in both must hold equal values, else a ValueError names it."""
        if self._has_fields() and other._has_fields():
            if len(self) != len(other):
                raise ValueError(f"union: lengths differ, {len(self)} vs {len(other)}")
        elif other._has_fields():  # a fieldless DataProto (metrics only) takes the other's rows
            object.__setattr__(self, "batch", TensorDict({}, batch_size=[len(other)], device=other.batch.device))
        for k, v in other.batch.items():
            if k in self.batch.keys():
                mine = self.batch[k]
                if mine.shape != v.shape or mine.dtype != v.dtype or not torch.equal(mine, v.to(mine.device)):
                    raise ValueError(f"union: batch[{k!r}] differs between the two DataProtos "
                                     f"({tuple(mine.shape)} {mine.dtype} vs {tuple(v.shape)} {v.dtype})")
            else:
                self.batch[k] = v
        for k, v in other.non_tensor_batch.items():
            if k in self.non_tensor_batch:
                mine = self.non_tensor_batch[k]
                if len(mine) != len(v) or any(not objects_equal(a, b) for a, b in zip(mine, v)):
                    raise ValueError(f"union: non_tensor_batch[{k!r}] differs between the two DataProtos")
            else:
                self.non_tensor_batch[k] = v
        for k, v in other.meta_info.items():
            if k in self.meta_info and not objects_equal(self.meta_info[k], v):
                raise ValueError(f"union: meta_info[{k!r}] differs: {self.meta_info[k]!r} vs {v!r}")
            self.meta_info[k] = v
        check_lengths(self.batch, self.non_tensor_batch)
        return self

    def pop_for_generation(self) -> "DataProto":
        """Take out what a rollout engine needs of a prompt batch: the left-padded prompt tensors are
        moved (the engine returns the full prompt+response tensors, which then join this batch); uid
        and raw_prompt, when present, are copied, and a vision-language prompt's images (verl's multi_modal_data,
        multi_modal_inputs); meta_info is shared."""
        self.require(*GENERATION_KEYS, where="generation")
        gen = self.pop(GENERATION_KEYS)
        for key in ("uid", "raw_prompt", "multi_modal_data", "multi_modal_inputs"):
            if key in self.non_tensor_batch:
                gen.non_tensor_batch[key] = self.non_tensor_batch[key]
        gen.meta_info = dict(self.meta_info)
        return gen

    # ------------------------------------------------------------------ row-wise operations
    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """interleave=True: a a b b (each prompt's copies adjacent, as GRPO groups need); False: a b a b."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        if interleave:
            idx = np.repeat(np.arange(n), repeat_times)
        else:
            idx = np.tile(np.arange(n), repeat_times)
        return self[idx]

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> "DataProto":
        """In-place permutation of the rows (verl semantics)."""
        idx = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices)
        if idx.shape != (len(self),) or not np.array_equal(np.sort(idx), np.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got shape {idx.shape}")
        reordered = self[idx]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def split(self, split_size: int) -> list["DataProto"]:
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    def is_padding_enabled(self) -> bool:
        """Uneven chunks allowed: this DataProto's meta_info says so, or DataProtoConfig.auto_padding."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False)) or DataProtoConfig.auto_padding

    def chunk(self, chunks: int) -> list["DataProto"]:
        """``chunks`` parts in row order. Equal parts only, unless padding is enabled
        (``is_padding_enabled``): then the first ``len % chunks`` parts hold one row more."""
        if chunks < 1:
            raise ProtocolError(f"chunks must be >= 1, got {chunks}")
        n = len(self)
        if n % chunks and not self.is_padding_enabled():
            raise ProtocolError(f"chunk: length {n} is not divisible by {chunks}; call pad_to_divisor({chunks}) first "
                                "or enable DataProtoConfig.auto_padding")
        base, extra = divmod(n, chunks)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(chunks)])
        return [self[int(bounds[i]) : int(bounds[i + 1])] for i in range(chunks)]

    @classmethod
    def concat(cls, data: Sequence["DataProto"]) -> "DataProto":
        """Rows of all parts in order. meta_info: ``metrics`` of every part merged into a dict of lists
        (verl's rule), ``timing`` merged per key by max, any other key must agree between parts."""
        if not data:
            raise ValueError("concat needs at least one DataProto")
        first = data[0]
        first_keys = set(first.batch.keys())
        for i, d in enumerate(data[1:], start=1):
            if set(d.batch.keys()) != first_keys or set(d.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"concat: item {i} has keys batch={sorted(d.batch.keys())} non_tensor={sorted(d.non_tensor_batch)}, "
                    f"item 0 has batch={sorted(first_keys)} non_tensor={sorted(first.non_tensor_batch)}"
                )
        batch = {}
        for k in first.batch.keys():
            parts = [d.batch[k] for d in data]
            dtypes = {p.dtype for p in parts}
            if len(dtypes) > 1:
                raise ValueError(f"concat: batch[{k!r}] has mixed dtypes {sorted(map(str, dtypes))}")
            tails = {tuple(p.shape[1:]) for p in parts}
            if len(tails) > 1:
                raise ValueError(f"concat: batch[{k!r}] has mismatched trailing shapes {sorted(tails)}")
            batch[k] = torch.cat(parts, dim=0)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        n = sum(len(d) for d in data)
        return cls.from_parts(TensorDict(batch, batch_size=[n], device=first.batch.device), non_tensor,
                              _merge_meta([d.meta_info for d in data]))

    def pad_to_divisor(self, divisor: int) -> tuple["DataProto", int]:
        """Pad by repeating leading rows so len is a multiple of ``divisor``; returns (padded, pad_size)."""
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}")
        n = len(self)
        pad = (-n) % divisor
        if pad == 0:
            return self, 0
        if n == 0:
            raise ValueError("pad_to_divisor: cannot pad an empty DataProto")
        idx = np.concatenate([np.arange(n), np.arange(pad) % n])
        return self[idx], pad

    def unpad(self, pad_size: int) -> "DataProto":
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"unpad: pad_size {pad_size} outside [0, {len(self)}]")
        return self[: len(self) - pad_size] if pad_size else self

    def select_idxs(self, idxs: IndexLike) -> "DataProto":
        return self[idxs]

    # ------------------------------------------------------------------ on disk (megatron_rl.protocol_codec)
    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Tensors + JSON, nothing pickled; a value JSON cannot hold exactly is refused (ProtocolError)."""
        with open(filepath, "wb") as f:
            f.write(encode_rows(self.batch, self.non_tensor_batch, self.meta_info))

    @classmethod
    def load_from_disk(cls, filepath: str | os.PathLike) -> "DataProto":
        """A file ``save_to_disk`` wrote; nothing in it is unpickled, so a planted file runs no code: one that
        does not parse as tensors + JSON is refused (ProtocolError naming it)."""
        with open(filepath, "rb") as f:
            return decode_rows(cls, f.read(), name=str(filepath))


def _merge_meta(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    all_metrics: list[Mapping[str, Any]] = []
    timing: dict[str, Any] = {}
    for meta in metas:
        for k, v in meta.items():
            if k == "metrics":
                if v is None:
                    continue
                all_metrics.extend(v if isinstance(v, list) else [v])
            elif k == "timing" and isinstance(v, Mapping):
                for name, seconds in v.items():
                    timing[name] = max(timing[name], seconds) if name in timing else seconds
            elif k in merged:
                if not objects_equal(merged[k], v):
                    raise ProtocolError(f"concat: meta_info[{k!r}] differs between parts: {merged[k]!r} vs {v!r} "
                                        f"(Conflicting values for meta_info key '{k}')")
            else:
                merged[k] = v
    if timing:
        merged["timing"] = timing
    if all_metrics:
        out: dict[str, list] = defaultdict(list)
        for m in all_metrics:
            for name, value in m.items():
                if isinstance(value, list):
                    out[name].extend(value)
                else:
                    out[name].append(value)
        merged["metrics"] = dict(out)
    return merged


def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Mean of each list-valued metric (what concat's merged ``meta_info["metrics"]`` holds); scalars kept."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (list, tuple)):
            out[k] = float(np.mean(v)) if len(v) else float("nan")
        else:
            out[k] = v
    return out


def objects_equal(a: Any, b: Any) -> bool:
    """Equality of two values a DataProto holds (tensors, arrays, any object) as one bool, never raising."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # a row's multi_modal_inputs: tensors by name
        return a.keys() == b.keys() and all(objects_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(objects_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not boolean: fall back to identity
        return a is b


def collate_dicts(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Collate per-sample dicts (a dataset's rows) into one dict for ``DataProto.from_single_dict``:
    tensors are stacked, everything else becomes an object array."""
    if not rows:
        raise ValueError("collate_dicts needs at least one row")
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], torch.Tensor):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"collate: field {key!r} has rows of different shapes {sorted(shapes)}")
            out[key] = torch.stack(values)
        else:
            out[key] = to_object_array(key, values)
    return out
