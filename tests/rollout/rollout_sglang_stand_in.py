"""Stand-ins for the three SGLang symbols the adapter's tensor transport needs on the trainer side.

sglang cannot be installed on CPU machines, so the fake-server tests put these into ``sys.modules``
under SGLang's own module paths. They behave like sglang 0.5.23's: ``MultiprocessingSerializer.serialize``
is a ForkingPickler dump (base64 text when ``output_str``), ``FlattenedTensorMetadata`` is a dataclass with
the same fields, pickled by reference to ``sglang.srt.weight_sync.tensor_bucket`` exactly like the real
one. tests/rollout/test_sglang_contract.py checks the real wheel has these names and fields.
"""

from __future__ import annotations

import base64
import io
import sys
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


FlattenedTensorMetadata.__module__ = METADATA_MODULE


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode() if output_str else data


def install(monkeypatch) -> None:
    """Register the stand-in modules for the duration of one test."""
    modules = {
        name: types.ModuleType(name)
        for name in (
            "sglang",
            "sglang.srt",
            "sglang.srt.utils",
            "sglang.srt.utils.common",
            "sglang.srt.utils.patch_torch",
            "sglang.srt.weight_sync",
            METADATA_MODULE,
        )
    }
    modules["sglang"].__version__ = "0.5.23"
    modules["sglang.srt.utils.common"].MultiprocessingSerializer = MultiprocessingSerializer
    modules["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: (
        None
    )  # CUDA-only in SGLang
    modules[METADATA_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
