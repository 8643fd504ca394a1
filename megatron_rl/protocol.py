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
"""
from __future__ import annotations

import base64
import copy
import io
import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch
from tensordict import TensorDict

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

# The prompt tensors a rollout engine reads (prompts left-padded, verl's convention).
GENERATION_KEYS = ("input_ids", "attention_mask", "position_ids")

IndexLike = int | slice | torch.Tensor | np.ndarray | Sequence[int]


def _to_object_array(key: str, value: Any) -> np.ndarray:
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


def _check_lengths(batch: Mapping[str, torch.Tensor] | TensorDict, non_tensor: Mapping[str, np.ndarray]) -> int | None:
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
            n = _check_lengths(tensors, {}) if tensors else (length or 0)
            batch = TensorDict(tensors, batch_size=[n], device=batch.device)
        return batch
    if not isinstance(batch, Mapping):
        raise ValueError(f"DataProto.batch must be a TensorDict or a dict of tensors, got {type(batch).__name__}")
    n = _check_lengths(batch, {})
    return TensorDict(dict(batch), batch_size=[n if n is not None else (length or 0)])


def _non_tensor_length(non_tensor: Mapping[str, np.ndarray]) -> int | None:
    return len(next(iter(non_tensor.values()))) if non_tensor else None


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
        non_tensor = {k: _to_object_array(k, v) for k, v in (self.non_tensor_batch or {}).items()}
        if isinstance(self.batch, Mapping) or self.batch is None or isinstance(self.batch, TensorDict):
            _check_lengths({} if self.batch is None or isinstance(self.batch, TensorDict) else self.batch, {})
        batch = _as_tensordict(self.batch, _non_tensor_length(non_tensor))
        object.__setattr__(self, "batch", batch)
        self.non_tensor_batch = non_tensor
        self.meta_info = dict(self.meta_info or {})
        _check_lengths(self.batch, self.non_tensor_batch)
        if self.batch.batch_dims == 1 and not len(self.batch.keys()) and non_tensor:
            # an empty TensorDict takes the rows' count from the non-tensor fields
            object.__setattr__(self, "batch", TensorDict({}, batch_size=[_non_tensor_length(non_tensor)]))

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "batch" and "non_tensor_batch" in self.__dict__ and not isinstance(value, TensorDict):
            value = _as_tensordict(value, _non_tensor_length(self.non_tensor_batch))
        object.__setattr__(self, name, value)

    @classmethod
    def _make(cls, batch: TensorDict, non_tensor: dict[str, np.ndarray], meta: dict[str, Any]) -> "DataProto":
        """Internal fast path: parts already checked (indexing, concat)."""
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
        return _check_lengths(self.batch, self.non_tensor_batch) or 0

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
        return DataProto._make(batch, non_tensor, dict(self.meta_info))

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

        def pick(src: Mapping[str, Any], keys: Iterable[str] | None, part: str) -> dict[str, Any]:
            names = list(src.keys())
            if keys is None:
                return {k: src[k] for k in names}
            keys = list(keys)
            missing = [k for k in keys if k not in names]
            if missing:
                raise ValueError(f"select: {part} has no keys {missing}; available: {sorted(names)}")
            return {k: src[k] for k in keys}

        batch = TensorDict(pick(self.batch, batch_keys, "batch"), batch_size=self.batch.batch_size,
                           device=self.batch.device)
        out = DataProto._make(
            batch,
            pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
            pick(self.meta_info, meta_info_keys, "meta_info"),
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
                if len(mine) != len(v) or any(not _objects_equal(a, b) for a, b in zip(mine, v)):
                    raise ValueError(f"union: non_tensor_batch[{k!r}] differs between the two DataProtos")
            else:
                self.non_tensor_batch[k] = v
        for k, v in other.meta_info.items():
            if k in self.meta_info and not _objects_equal(self.meta_info[k], v):
                raise ValueError(f"union: meta_info[{k!r}] differs: {self.meta_info[k]!r} vs {v!r}")
            self.meta_info[k] = v
        _check_lengths(self.batch, self.non_tensor_batch)
        return self

    def pop_for_generation(self) -> "DataProto":
        """Take out what a rollout engine needs of a prompt batch: the left-padded prompt tensors are
        moved (the engine returns the full prompt+response tensors, which then join this batch); uid
        and raw_prompt, when present, are copied; meta_info is shared."""
        self.require(*GENERATION_KEYS, where="generation")
        gen = self.pop(GENERATION_KEYS)
        for key in ("uid", "raw_prompt"):
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

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
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
        return DataProto._make(TensorDict(batch, batch_size=[n], device=first.batch.device), non_tensor,
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

    # ------------------------------------------------------------------ misc
    def to(self, device: str | torch.device) -> "DataProto":
        object.__setattr__(self, "batch", self.batch.to(device))
        return self

    def copy(self) -> "DataProto":
        return DataProto._make(self.batch.clone(),
                               {k: v.copy() for k, v in self.non_tensor_batch.items()},
                               copy.deepcopy(self.meta_info))

    # ------------------------------------------------------------------ verl's extras
    def select_idxs(self, idxs: IndexLike) -> "DataProto":
        return self[idxs]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "DataProto":
        return self[slice(start, end, step)]

    def check_consistency(self) -> None:
        _check_lengths(self.batch, self.non_tensor_batch)

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
        return DataProto._make(TensorDict(batch, batch_size=[n * n_split], device=self.batch.device), non_tensor,
                               dict(self.meta_info))

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None):
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

        def batches():
            for _ in range(epochs):
                order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
                for start in range(0, len(self), mini_batch_size):
                    part = self[order[start:start + mini_batch_size]]
                    part.meta_info = self.meta_info
                    yield part

        return iter(batches())

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: the tensors, each non-tensor field as a NonTensorStack, meta_info as NonTensorData."""
        from tensordict import NonTensorData, NonTensorStack

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
        from tensordict import NonTensorData, NonTensorStack

        if num_batch_dims != 1:
            raise ValueError(f"from_tensordict supports num_batch_dims=1, got {num_batch_dims}")
        meta = dict(meta_info or {})
        tensors, non_tensor = {}, {}
        for key in tensor_dict.keys():
            val = tensor_dict.get(key)
            if isinstance(val, NonTensorStack):
                non_tensor[key] = _to_object_array(key, [elem.data if isinstance(elem, NonTensorData) else elem
                                                         for elem in val.tolist()])
            elif isinstance(val, NonTensorData):
                meta[key] = val.data
            elif isinstance(val, torch.Tensor):
                tensors[key] = val
            else:
                raise ValueError(f"from_tensordict: field {key!r} is a {type(val).__name__}, not a tensor or non-tensor")
        return cls(tensors, non_tensor, meta)

    def serialize(self) -> bytes:
        """Bytes that ``DataProto.deserialize`` reads back: tensors and JSON, nothing pickled (see ``_encode_rows``)."""
        return _encode_rows(self)

    @classmethod
    def deserialize(cls, data: bytes, name: str = "DataProto bytes") -> "DataProto":
        """Read ``serialize``'s bytes with ``torch.load(weights_only=True)``: no code runs whatever they hold;
        anything else is refused (ProtocolError naming ``name``)."""
        return _decode_rows(cls, data, name)

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

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        with open(filepath, "wb") as f:
            f.write(self.serialize())

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> "DataProto":
        """A file ``save_to_disk`` wrote; nothing in it is unpickled, so a planted file runs no code: one that
        does not parse as tensors + JSON is refused (ProtocolError naming it)."""
        with open(filepath, "rb") as f:
            return DataProto.deserialize(f.read(), name=str(filepath))


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
        import ray

        parts = ray.get(self.futures)
        bad = [type(p).__name__ for p in parts if not isinstance(p, DataProto)]
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


class ProtocolError(ValueError, AssertionError):
    """A DataProto operation refused: a ValueError (megatron-rl) that is also what verl raises (AssertionError)."""


# ---------------------------------------------------------------- rows on disk: tensors + JSON, nothing pickled
# One torch.save (zip) file holding only what torch.load(weights_only=True) reads: {"format": ROWS_FORMAT,
# "tensors": [tensor, ...], "json": uint8 tensor}. The JSON holds the batch's keys (each with its index into
# "tensors"), the non-tensor columns and meta_info. Every JSON object in it is a tag, so values come back with
# their types: {"d": [[key, value], ...]} a dict (any key type, order kept), {"t": [...]} a tuple, {"f": "nan"}
# a non-finite float, {"a": dtype, "s": shape, "v": [...]} a numpy array, {"n": dtype, "v": x} a numpy scalar,
# {"b": base64} bytes, {"T": i} a tensor in meta_info or a column; lists, str, int, float, bool and None as is.
ROWS_FORMAT = "megatron_rl.DataProto/rows-v1"
_ARRAY_KINDS = "biufU"  # numpy dtypes JSON holds exactly (plus object arrays, element by element)


def _encode_value(value: Any, where: str, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype != object and value.dtype.kind not in _ARRAY_KINDS:
            raise ProtocolError(f"{where}: numpy dtype {value.dtype} cannot be stored (bool, int, float, str, object)")
        return {"a": value.dtype.str if value.dtype != object else "O", "s": list(value.shape),
                "v": [_encode_value(x, where, tensors) for x in value.ravel().tolist()]
                if value.dtype != object else [_encode_value(x, where, tensors) for x in value.ravel()]}
    if isinstance(value, np.generic):
        if value.dtype.kind not in _ARRAY_KINDS:
            raise ProtocolError(f"{where}: numpy scalar of dtype {value.dtype} cannot be stored")
        return {"n": value.dtype.str, "v": _encode_value(value.item(), where, tensors)}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"f": repr(float(value))}
    if isinstance(value, list):
        return [_encode_value(x, where, tensors) for x in value]
    if isinstance(value, tuple):
        return {"t": [_encode_value(x, where, tensors) for x in value]}
    if isinstance(value, dict):
        return {"d": [[_encode_value(k, where, tensors), _encode_value(v, f"{where}[{k!r}]", tensors)]
                      for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"T": len(tensors) - 1}
    raise ProtocolError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be stored on disk "
                        f"(str, int, float, bool, None, list, tuple, dict, bytes, numpy arrays/scalars, tensors)")


def _decode_value(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode_value(x, tensors) for x in value]
    if not isinstance(value, dict):
        return value
    (tag, body), *rest = value.items() if value else ((None, None),)
    if tag == "d":
        return {_decode_value(k, tensors): _decode_value(v, tensors) for k, v in body}
    if tag == "t":
        return tuple(_decode_value(x, tensors) for x in body)
    if tag == "f":
        return float(body)
    if tag == "b":
        return base64.b64decode(body)
    if tag == "T":
        return tensors[body]
    if tag == "n":
        return np.array(_decode_value(value["v"], tensors), dtype=np.dtype(body))[()]
    if tag == "a":
        items = [_decode_value(x, tensors) for x in value["v"]]
        if body != "O":
            return np.array(items, dtype=np.dtype(body)).reshape(value["s"])
        out = np.empty(len(items), dtype=object)
        for i, item in enumerate(items):
            out[i] = item
        return out.reshape(value["s"])
    raise ValueError(f"unknown tag {tag!r}")


def _encode_rows(data: "DataProto") -> bytes:
    tensors: list[torch.Tensor] = []
    batch = []
    for key in data.batch.keys(include_nested=True, leaves_only=True):
        tensors.append(data.batch.get(key))
        batch.append([list(key) if isinstance(key, tuple) else [key], len(tensors) - 1])
    doc = {"batch_size": list(data.batch.batch_size), "batch": batch,
           "non_tensor_batch": [[k, _encode_value(v, f"non_tensor_batch[{k!r}]", tensors)]
                                for k, v in data.non_tensor_batch.items()],
           "meta_info": _encode_value(data.meta_info, "meta_info", tensors)}
    text = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    buffer = io.BytesIO()
    torch.save({"format": ROWS_FORMAT, "tensors": tensors,
                "json": torch.frombuffer(bytearray(text), dtype=torch.uint8)}, buffer)
    return buffer.getvalue()


def _decode_rows(cls: type, raw: bytes, name: str) -> "DataProto":
    try:
        state = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as err:  # pickled objects (a file from before issue 33 or a planted one), not a torch file
        raise ProtocolError(f"{name} is refused: it is not the tensors + JSON that DataProto.save_to_disk writes "
                            f"(files that hold pickled objects are never loaded: that could run code). "
                            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    try:
        if not isinstance(state, dict) or state.get("format") != ROWS_FORMAT:
            raise ValueError(f"no format {ROWS_FORMAT!r}")
        tensors = state["tensors"]
        doc = json.loads(state["json"].numpy().tobytes().decode())
        batch = TensorDict({}, batch_size=doc["batch_size"])
        for key, index in doc["batch"]:
            batch.set(tuple(key) if len(key) > 1 else key[0], tensors[index])
        non_tensor = {k: _decode_value(v, tensors) for k, v in doc["non_tensor_batch"]}
        meta = _decode_value(doc["meta_info"], tensors)
    except Exception as err:
        raise ProtocolError(f"{name} is refused: it does not parse as DataProto rows ({type(err).__name__}: {err})"
                            ) from None
    out = cls(batch, non_tensor, meta)
    out.non_tensor_batch.update(non_tensor)  # as saved: the constructor would make a numeric column an object one
    return out


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
    return type(a) is type(b) and _objects_equal(a, b) if isinstance(a, str) or isinstance(b, str) else _objects_equal(a, b)


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
                if not _objects_equal(merged[k], v):
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


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and x != x


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
    return DataProto._make(batch, non_tensor, data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of fold_batch_dim: the first ``batch_dims`` dims become one row dim."""
    batch = data.batch
    if batch.batch_dims != batch_dims:
        batch = batch.clone(False)
        batch.auto_batch_size_(batch_dims=batch_dims)
    batch = batch.reshape(-1)
    n = batch.batch_size[0]
    non_tensor = {k: np.reshape(v, (n, *v.shape[batch_dims:])) for k, v in data.non_tensor_batch.items()}
    return DataProto._make(batch, non_tensor, data.meta_info)


def _objects_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
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
            out[key] = _to_object_array(key, values)
    return out


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
    non_tensor = {k: _to_object_array(k, [item.non_tensor_batch[k] for item in items]) for k in keys}
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
