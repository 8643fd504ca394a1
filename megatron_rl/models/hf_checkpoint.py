"""Lazy, sliced reads from an HF safetensors checkpoint (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointMismatchError(ValueError):
    """The checkpoint does not hold what the config promises (missing tensor, wrong shape, extras)."""


class HFCheckpointReader:
    """Reads only the requested slice of a tensor: ``read(name, dim, start, stop)``.

    File handles are opened on first use and kept; the header (names, shapes) is read without
    touching tensor data.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: self.model_dir / file for name, file in weight_map.items()}
        else:
            files = sorted(self.model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_FILE}) in {self.model_dir}")
            self._file_of = {}
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    self._file_of.update(dict.fromkeys(handle.keys(), file))
        self._handles: dict[Path, Any] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def file_of(self, name: str) -> str:
        return self._file_of[name].name

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointMismatchError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            if not file.is_file():
                raise FileNotFoundError(
                    f"{INDEX_FILE} in {self.model_dir} names missing file {file.name} (for {name!r})"
                )
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F32", "F8_E4M3", ...), from the header."""
        return self._slice(name).get_dtype()

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The whole tensor, or rows/columns ``[start, stop)`` along ``dim`` (0 or 1)."""
        view = self._slice(name)
        if dim is None:
            return view[:]
        if dim == 0:
            return view[start:stop]
        if dim == 1:
            return view[:, start:stop]
        raise ValueError(f"can only slice along dim 0 or 1, got {dim}")

    def validate(self, expected: dict[str, tuple[int, ...]], ignorable: frozenset[str] = frozenset()) -> None:
        """Every expected tensor present with its shape and nothing unknown; else one error listing all."""
        problems = []
        for name, shape in expected.items():
            if name not in self._file_of:
                problems.append(f"missing tensor {name!r} (expected shape {tuple(shape)})")
            elif self.shape(name) != tuple(shape):
                problems.append(
                    f"tensor {name!r} in {self.file_of(name)}: expected shape {tuple(shape)}, found {self.shape(name)}"
                )
        unknown = [
            n for n in self._file_of if n not in expected and n not in ignorable and "rotary_emb" not in n
        ]
        problems += [f"unexpected tensor {name!r} with shape {self.shape(name)}" for name in unknown]
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointMismatchError(
                f"checkpoint {self.model_dir} does not match its config.json:\n  {shown}{more}"
            )
