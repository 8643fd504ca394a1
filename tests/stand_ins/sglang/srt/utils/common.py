"""Stand-in of the serializer in ``sglang.srt.utils.common`` (own code, 0.5.23 behaviour + producer tag).

``serialize`` wraps the object as ``(ProducerTag(node, physical_gpu, pid), obj)``: the CPU analogue of a
CUDA IPC handle, which only means something on the producer's node and GPU. CPU tensors travel as named
shared memory (sharing strategy ``file_system``): the consumer maps the producer's memory and reads it
when it copies, not when the call was made.

Torch's ``file_system`` sharing goes through its shm manager (``torch_shm_manager``), whose client waits a
hard-coded 1 s for every answer ("Shared memory manager connection has timed out"): on a loaded machine that
fails a test for nothing SGLang does (its tensors travel as CUDA IPC handles, no manager). Every manager round
trip here (moving a tensor into shared memory, pickling, rebuilding it in the consumer) is therefore retried on
that error for up to ``SHM_RETRY_S`` seconds (``SGLANG_STAND_IN_SHM_RETRY_S``, default 120); anything else fails
at once, as before.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from sglang._stand_in.devices import ProducerTag, producer_tag
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

__all__ = ["MultiprocessingSerializer", "SafeUnpickler", "normalize_serialized_named_tensor_payload"]

_TORCH_REBUILD = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.nn.parameter", "Parameter"),
    ("builtins", "list"),
    ("builtins", "dict"),
    ("builtins", "tuple"),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
}
_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang._stand_in.devices", "ProducerTag"): ProducerTag,
}


SHM_RETRY_S = float(os.environ.get("SGLANG_STAND_IN_SHM_RETRY_S", "120"))


def _retry_shm(fn: Any) -> Any:
    """``fn()``, again while torch's shm manager times out (see the module docstring), up to SHM_RETRY_S."""
    deadline = time.monotonic() + SHM_RETRY_S
    delay = 0.05
    while True:
        try:
            return fn()
        except RuntimeError as exc:
            if "Shared memory manager" not in str(exc) or time.monotonic() >= deadline:
                raise
            print(f"sglang stand-in (pid {os.getpid()}): {exc}; retrying", file=sys.stderr, flush=True)
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


class SafeUnpickler(pickle.Unpickler):
    """Allow-list unpickler: torch rebuild functions, torch.Size/dtypes, FlattenedTensorMetadata and the
    stand-in's ProducerTag; every other global is refused (pickle.UnpicklingError naming it).

    Note: fd-passing storages (sharing strategy ``file_descriptor``) are refused — a file descriptor
    cannot cross processes that are not parent and child, just as a CUDA IPC handle cannot cross nodes.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _TORCH_REBUILD:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def _share(obj: Any) -> None:
    """Move CPU tensors into shared memory in place (no copy when they already live there)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and not obj.is_shared():
            _retry_shm(obj.share_memory_)
    elif isinstance(obj, dict):
        for value in obj.values():
            _share(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _share(value)


def normalize_serialized_named_tensor_payload(data: Any) -> bytes:
    if isinstance(data, str):
        return base64.b64decode(data, validate=True)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
            return data
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return data
    raise TypeError(
        "serialized_named_tensors entries must be base64 strings or bytes-like payloads, "
        f"got {type(data).__name__}"
    )


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        """ForkingPickler dump of ``(ProducerTag, obj)``; base64 text when ``output_str``."""
        torch.multiprocessing.set_sharing_strategy("file_system")
        _share(obj)
        def dump() -> bytes:
            buf = io.BytesIO()
            ForkingPickler(buf).dump((producer_tag(), obj))
            return buf.getvalue()

        data = _retry_shm(dump)
        return base64.b64encode(data).decode("utf-8") if output_str else data

    @staticmethod
    def deserialize(data: Any) -> Any:
        """The object that was serialized (the producer tag dropped)."""
        return MultiprocessingSerializer.deserialize_tagged(data)[1]

    @staticmethod
    def deserialize_tagged(data: Any) -> tuple[ProducerTag, Any]:
        """Stand-in only: ``(ProducerTag, obj)``; an untagged payload is refused."""
        raw = normalize_serialized_named_tensor_payload(data)
        loaded = _retry_shm(lambda: SafeUnpickler(io.BytesIO(raw)).load())
        if not (isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[0], ProducerTag)):
            raise pickle.UnpicklingError(
                "payload carries no producer tag: serialize it with the stand-in's "
                "sglang.srt.utils.common.MultiprocessingSerializer"
            )
        return loaded
