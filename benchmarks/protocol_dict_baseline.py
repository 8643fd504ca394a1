# Frozen copy of megatron_rl/protocol.py before DataProto moved onto tensordict.TensorDict (issue 18):
# the baseline of benchmarks/test_protocol_ops.py. Not imported by the package.
"""DataProto: the one container a sample travels in, from the dataloader to the weight sync.

Three parts, following verl's convention so users can move code across:
- ``batch``: tensors that share dim 0 (one row per sample),
- ``non_tensor_batch``: numpy object arrays of the same length (uid, data_source, raw prompts, ...),
- ``meta_info``: a plain dict for per-batch facts (temperature, global_steps, timing, ...).

Every operation checks lengths and keys and raises a ValueError that names the key and the sizes seen.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["DataProto", "collate_dicts"]

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


def _check_lengths(batch: Mapping[str, torch.Tensor], non_tensor: Mapping[str, np.ndarray]) -> int | None:
    lengths: dict[str, int] = {}
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


@dataclass
class DataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = dict(self.batch or {})
        self.non_tensor_batch = {k: _to_object_array(k, v) for k, v in (self.non_tensor_batch or {}).items()}
        self.meta_info = dict(self.meta_info or {})
        _check_lengths(self.batch, self.non_tensor_batch)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> "DataProto":
        return cls(dict(tensors or {}), dict(non_tensors or {}), dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None) -> "DataProto":
        """Tensors go to ``batch``, everything else (lists, numpy arrays) to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, others, meta_info)

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return _check_lengths(self.batch, self.non_tensor_batch) or 0

    def __getitem__(self, index: IndexLike) -> "DataProto":
        length = len(self)
        if isinstance(index, (int, np.integer)):
            if not -length <= index < length:
                raise IndexError(f"index {index} out of range for DataProto of length {length}")
            index = slice(index, index + 1 if index != -1 else None)
        idx = _normalise_index(index, length)
        torch_idx = idx if isinstance(idx, slice) else torch.from_numpy(idx.astype(np.int64))
        batch = {k: v[torch_idx] for k, v in self.batch.items()}
        non_tensor = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensor, dict(self.meta_info))

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}:{tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.batch.items())
        return f"DataProto(len={len(self)}, batch=[{tensors}], non_tensor={list(self.non_tensor_batch)}, meta={list(self.meta_info)})"

    def require(self, *keys: str, where: str = "") -> None:
        """Raise a ValueError naming every missing field (checked before work starts, not deep inside it)."""
        missing = [k for k in keys if k not in self.batch and k not in self.non_tensor_batch]
        if missing:
            ctx = f" for {where}" if where else ""
            raise ValueError(
                f"DataProto is missing {missing}{ctx}; it has batch={sorted(self.batch)} "
                f"non_tensor_batch={sorted(self.non_tensor_batch)}"
            )

    # ------------------------------------------------------------------ key-wise operations
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> "DataProto":
        """A view holding only the named keys (None keeps all of that part)."""

        def pick(src: Mapping[str, Any], keys: Iterable[str] | None, part: str) -> dict[str, Any]:
            if keys is None:
                return dict(src)
            keys = list(keys)
            missing = [k for k in keys if k not in src]
            if missing:
                raise ValueError(f"select: {part} has no keys {missing}; available: {sorted(src)}")
            return {k: src[k] for k in keys}

        return DataProto(
            pick(self.batch, batch_keys, "batch"),
            pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
            pick(self.meta_info, meta_info_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_batch_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> "DataProto":
        """Remove the named keys from self and return them as a new DataProto."""
        out = self.select(list(batch_keys), list(non_tensor_batch_keys), list(meta_info_keys))
        for k in out.batch:
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
            part = self.batch if o in self.batch else self.non_tensor_batch if o in self.non_tensor_batch else None
            if part is None:
                raise ValueError(f"rename: no key {o!r} in batch or non_tensor_batch")
            if n in self.batch or n in self.non_tensor_batch:
                raise ValueError(f"rename: target key {n!r} already exists")
            part[n] = part.pop(o)
        return self

    def union(self, other: "DataProto") -> "DataProto":
        """Merge ``other`` into self. A key present in both must hold equal values, else a ValueError names it."""
        if len(self.batch) + len(self.non_tensor_batch) and len(other.batch) + len(other.non_tensor_batch):
            if len(self) != len(other):
                raise ValueError(f"union: lengths differ, {len(self)} vs {len(other)}")
        for k, v in other.batch.items():
            if k in self.batch:
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

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Exactly ``chunks`` equal parts; use pad_to_divisor first when len is not a multiple."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        if len(self) % chunks:
            raise ValueError(f"chunk: length {len(self)} is not divisible by {chunks}; call pad_to_divisor({chunks}) first")
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        if not data:
            raise ValueError("concat needs at least one DataProto")
        first = data[0]
        for i, d in enumerate(data[1:], start=1):
            if set(d.batch) != set(first.batch) or set(d.non_tensor_batch) != set(first.non_tensor_batch):
                raise ValueError(
                    f"concat: item {i} has keys batch={sorted(d.batch)} non_tensor={sorted(d.non_tensor_batch)}, "
                    f"item 0 has batch={sorted(first.batch)} non_tensor={sorted(first.non_tensor_batch)}"
                )
        batch = {}
        for k in first.batch:
            parts = [d.batch[k] for d in data]
            dtypes = {p.dtype for p in parts}
            if len(dtypes) > 1:
                raise ValueError(f"concat: batch[{k!r}] has mixed dtypes {sorted(map(str, dtypes))}")
            tails = {tuple(p.shape[1:]) for p in parts}
            if len(tails) > 1:
                raise ValueError(f"concat: batch[{k!r}] has mismatched trailing shapes {sorted(tails)}")
            batch[k] = torch.cat(parts, dim=0)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        meta: dict[str, Any] = {}
        for d in data:
            for k, v in d.meta_info.items():
                meta.setdefault(k, v)
        return DataProto(batch, non_tensor, meta)

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
        self.batch = {k: v.to(device) for k, v in self.batch.items()}
        return self

    def copy(self) -> "DataProto":
        return DataProto({k: v.clone() for k, v in self.batch.items()},
                         {k: v.copy() for k, v in self.non_tensor_batch.items()},
                         copy.deepcopy(self.meta_info))


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
