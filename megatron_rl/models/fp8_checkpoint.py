"""Dequantise an FP8 block-scaled HF checkpoint (DeepSeek-V3/R1, Kimi-K2) on load, one slice at a time.

Such a checkpoint's config.json says ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``; each quantised linear weight ``W`` ([out, in],
float8_e4m3fn) has a partner ``W_scale_inv`` ([ceil(out/128), ceil(in/128)], float32) holding one multiplier per
128x128 block (the last row / column of blocks partial). The dequantised weight is
``W.to(float32) * scale_inv[i // 128, j // 128]``, cast to the parameter's dtype: transformers' ``Fp8Dequantize``
(``dequantize=True``), DeepSeek's ``weight_dequant`` and mbridge compute the same product. Norms, embeddings,
lm_head, the router gate and its bias carry no scale and are read as stored.

``check_fp8_quantization`` refuses what this reader does not dequantise (another quant_method, format, activation
scheme or block shape) by ``quantization_config.<field>`` and file: preflight and the loader call it.
``FP8BlockDequantizer`` wraps an ``HFCheckpointReader``: reading rows / columns ``[start, stop)`` of a weight reads
only those fp8 rows / columns and the scale blocks covering them, so a TP shard never materialises the whole
fp32 tensor. The ``*_scale_inv`` tensors are consumed by their weights (never reported as unexpected).
Export (weight sync to the engines, HF saves) writes the parameters' dtype: nothing is re-quantised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron_rl.models.hf_checkpoint import CheckpointMismatchError, HFCheckpointReader
from megatron_rl.models.hf_config import UnsupportedModelError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
_SAFETENSORS_FP8 = "F8_E4M3"


def check_fp8_quantization(raw: Mapping[str, Any], source: str = "<config dict>") -> tuple[int, int] | None:
    """The (rows, cols) block of config.json's FP8 block quantisation, or None when the checkpoint is not
    quantised; anything else in ``quantization_config`` raises UnsupportedModelError naming the field and
    ``source``."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedModelError(
            f"{source}: quantization_config must be an object, got {type(qc).__name__}; only FP8 block-scaled "
            f"checkpoints (quant_method 'fp8' with weight_block_size) are read")
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(
            f"{source}: quantization_config.quant_method={method!r} is not supported; only FP8 block-scaled "
            f"checkpoints (quant_method 'fp8', DeepSeek-V3's format) are dequantised on load; dequantise the "
            f"checkpoint to bf16 first")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModelError(
            f"{source}: quantization_config.fmt={fmt!r} is not supported; only 'e4m3' (float8_e4m3fn) weights "
            f"are dequantised on load")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModelError(
            f"{source}: quantization_config.activation_scheme={scheme!r} is not supported; only 'dynamic' "
            f"(no stored activation scales) is read")
    block = qc.get("weight_block_size")
    if block is None:
        raise UnsupportedModelError(
            f"{source}: quantization_config.weight_block_size is missing; only block-scaled FP8 (e.g. "
            f"[128, 128], one weight_scale_inv per block) is dequantised on load, not per-tensor or "
            f"per-channel FP8")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"{source}: quantization_config.weight_block_size={block!r} must be two positive integers "
            f"[rows, cols] (DeepSeek-V3: [128, 128])")
    return int(block[0]), int(block[1])


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


class FP8BlockDequantizer:
    """``read(name, dim, start, stop, dtype=None)`` as ``HFCheckpointReader.read``, dequantising weights that
    have a ``<name>_scale_inv`` partner (to ``dtype``, float32 if None); other tensors are read as stored."""

    def __init__(self, reader: HFCheckpointReader, block: tuple[int, int]):
        self.reader = reader
        self.block = block
        names = set(reader.names())
        self._scale_of = {
            name[: -len(SCALE_SUFFIX)]: name for name in names
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in names
        }

    def scale_names(self) -> frozenset[str]:
        """The scale tensors its weights consume."""
        return frozenset(self._scale_of.values())

    def _where(self, name: str) -> str:
        return f"{name!r} in {self.reader.file_of(name)} ({self.reader.model_dir})"

    def validate(self) -> None:
        """Every scaled weight a 2-D float8_e4m3fn tensor whose scale is float32-like with one entry per block;
        no fp8 tensor without a scale. Reads only headers; one error listing all problems."""
        problems = []
        for name in self.reader.names():
            dtype = self.reader.dtype(name)
            scale = self._scale_of.get(name)
            if scale is None:
                if dtype == _SAFETENSORS_FP8 and not name.endswith(SCALE_SUFFIX):
                    problems.append(f"fp8 tensor {self._where(name)} has no {name + SCALE_SUFFIX!r}")
                continue
            shape = self.reader.shape(name)
            if dtype != _SAFETENSORS_FP8 or len(shape) != 2:
                problems.append(
                    f"{self._where(name)} has a {SCALE_SUFFIX} partner but is {dtype} of shape {shape}; "
                    f"expected a 2-D {_SAFETENSORS_FP8} (float8_e4m3fn) weight")
                continue
            expected = (_blocks(shape[0], self.block[0]), _blocks(shape[1], self.block[1]))
            found = tuple(self.reader.shape(scale))
            if found != expected:
                problems.append(
                    f"scale {self._where(scale)} has shape {found}; weight {name!r} of shape {shape} in "
                    f"{self.block[0]}x{self.block[1]} blocks (quantization_config.weight_block_size) needs "
                    f"{expected}")
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointMismatchError(
                f"FP8 checkpoint {self.reader.model_dir} cannot be dequantised:\n  {shown}{more}")

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        scale_name = self._scale_of.get(name)
        if scale_name is None:
            return self.reader.read(name, dim, start, stop)
        rows, cols = self.reader.shape(name)
        row_range, col_range = (0, rows), (0, cols)
        if dim is not None:
            extent = rows if dim == 0 else cols
            lo, hi, _ = slice(start, stop).indices(extent)
            if dim == 0:
                row_range = (lo, max(lo, hi))
            else:
                col_range = (lo, max(lo, hi))
        quantized = self.reader.read(name, dim, start, stop)
        if quantized.dtype != FP8_DTYPE:
            raise CheckpointMismatchError(f"{self._where(name)} is {quantized.dtype}, expected {FP8_DTYPE}")
        br, bc = self.block
        # only the scale blocks covering the slice: rows [r0 // br, ceil(r1 / br)) (or the columns')
        rb0, cb0 = row_range[0] // br, col_range[0] // bc
        if dim == 0:
            scales = self.reader.read(scale_name, 0, rb0, _blocks(row_range[1], br))
        elif dim == 1:
            scales = self.reader.read(scale_name, 1, cb0, _blocks(col_range[1], bc))
        else:
            scales = self.reader.read(scale_name)
        row_block = torch.arange(*row_range) // br - rb0
        col_block = torch.arange(*col_range) // bc - cb0
        # one multiplier per element of the slice (transformers: q.float() * s.float(), then the cast)
        per_element = scales.to(torch.float32)[row_block][:, col_block]
        out = quantized.to(torch.float32).mul_(per_element)
        return out if dtype is None or dtype == torch.float32 else out.to(dtype)
