"""CUDA IPC weight transfer on a CPU, for the ``vllm.LLM`` doubles: torch's export of a GPU tensor
(``megatron_rl.rollout.vllm.ipc.export_handle``) and vLLM 0.32's IPC weight-transfer engine in its workers, with
their rules.

Export (``install_export``): the exporting process's GPU is what the test says it is (``gpu_of``); the bytes go to
a file under ``root`` whose path is the handle, so another process of a multi-process test can open it, as
another process of a node opens a CUDA IPC handle. The file name carries the GPU the memory is on.

Consumer (``WeightTransferDouble``), as read in vllm 0.32.0:
- ``init_weight_transfer_engine`` needs an engine built with ``weight_transfer_config`` (v1/worker/gpu_worker.py
  ``_check_weight_transfer_engine``: "Weight transfer not configured"); the trainer's init info says ``packed``;
- ``start_weight_update`` while a session is active is refused (gpu_worker.py ``_start_weight_update``);
  ``update_weights`` and ``finish_weight_update`` without one are refused; a failed update closes the session
  (``update_weights``' except clause);
- each worker looks its own GPU's UUID up in the update's handles and fails with vLLM's message when it is missing
  (distributed/weight_transfer/packed_tensor.py ``packed_ipc_consumer``); packed mode takes one handle dict, not a
  list (ipc_engine.py ``receive_weights``);
- the buffer (a view at its offset in the exporter's storage, as ``rebuild_cuda_tensor`` makes it) is split by
  ``tensor_sizes`` from its start and each piece viewed as its dtype and shape by vLLM's own ``unpack_tensor`` (a
  wrong size or a piece off its dtype's alignment fails the view), then cloned; the init info and every update
  go through vLLM's own dataclasses (``IPCWeightTransferInitInfo``, ``IPCWeightTransferUpdateInfo``), after the
  worker extension's rebuild of the plain handles (``ipc.handle_args``).
A handle opened by a worker must have been made on that worker's GPU: a CUDA IPC handle names memory of one
device, and vLLM opens it on its own.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["WeightTransferDouble", "gpu_uuid", "install_export"]

_FILE = re.compile(r"^ipc_gpu(\d+)_")


def gpu_uuid(gpu: int) -> str:
    """The UUID ``torch.cuda.get_device_properties`` reports for physical GPU ``gpu`` on the fake node."""
    return f"GPU-fake-{gpu:04d}"


def install_export(setattr_: Callable[[Any, str, Any], None], root: str | os.PathLike, gpu_of: Callable[[], int]
                   ) -> None:
    """Replace ``ipc.export_handle`` (torch's ``reduce_tensor`` of a CUDA tensor and its device's UUID)."""
    from megatron_rl.rollout.vllm import ipc

    counter = itertools.count()

    def export_handle(flat: torch.Tensor) -> tuple[str, dict[str, Any]]:
        assert flat.dtype == torch.uint8 and flat.dim() == 1, (flat.dtype, flat.shape)
        gpu, offset = gpu_of(), flat.storage_offset()
        path = Path(root) / f"ipc_gpu{gpu}_{os.getpid()}_{next(counter)}"
        # the storage up to the view's end, so the rebuilt view sits at the same offset (alignment) as the real one
        torch.cat([torch.zeros(offset, dtype=torch.uint8), flat.detach()]).numpy().tofile(path)
        return gpu_uuid(gpu), {"size": [flat.numel()], "stride": [1], "offset": offset, "device": gpu,
                               "handle": str(path).encode(), "storage_size_bytes": offset + flat.numel(),
                               "storage_offset_bytes": 0, "ref_counter_handle": b"", "ref_counter_offset": 0,
                               "event_handle": b"", "event_sync_required": False}

    setattr_(ipc, "export_handle", export_handle)


class WeightTransferDouble:
    """The weight-transfer side of one vLLM engine whose TP worker i runs on physical GPU ``gpus[i]``."""

    def __init__(self, engine_kwargs: Mapping[str, Any], gpus: Sequence[int]) -> None:
        config = engine_kwargs.get("weight_transfer_config") or {}
        self.configured = config.get("backend") == "ipc"
        self.gpus = tuple(gpus)
        self.packed: bool | None = None  # set by init_weight_transfer_engine
        self.active = False
        self.sessions = 0  # finished ones
        self.received: dict[int, dict[str, torch.Tensor]] = {gpu: {} for gpu in self.gpus}

    def call(self, method: str, args: tuple, kwargs: Mapping[str, Any] | None) -> bool:
        """Run ``method`` if it is a weight-transfer RPC (True), else leave it to the caller (False)."""
        if method == "init_weight_transfer_engine":
            if not self.configured:
                raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config to enable "
                                   "weight transfer.")
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

            self.packed = IPCWeightTransferInitInfo(**dict(kwargs or {})["init_info"]).packed  # vLLM's own parse
        elif method == "start_weight_update":
            if self.packed is None:
                raise RuntimeError("start_weight_update before init_weight_transfer_engine")
            if self.active:
                raise RuntimeError("start_weight_update called while a weight update is already active. Call "
                                   "finish_weight_update first.")
            self.active = True
        elif method == "mrl_ipc_update":
            if not self.active:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            try:
                for update in args[0]:  # one per run of back-to-back tensors (ipc.bucket_payload)
                    for gpu in self.gpus:
                        self.received[gpu].update(self._open(update, gpu))
            except BaseException:
                self.active = False
                raise
        elif method in ("mrl_finish_ipc_update", "finish_weight_update"):
            if not self.active:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
            self.active = False
            self.sessions += 1
        else:
            return False
        return True

    def _open(self, update: Mapping[str, Any], gpu: int) -> list[tuple[str, torch.Tensor]]:
        """What the worker does with one update: the extension rebuilds torch's arguments (``ipc.handle_args``),
        vLLM parses the update (its own dataclass), looks its GPU's UUID up, rebuilds the buffer and unpacks it with
        its own ``unpack_tensor``, cloning each tensor."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        from megatron_rl.rollout.vllm.ipc import handle_args

        rebuilt = {uuid: handle_args(plain) for uuid, plain in update["ipc_handles"].items()}
        info = IPCWeightTransferUpdateInfo(**{**update, "ipc_handles": rebuilt})
        assert self.packed and isinstance(info.ipc_handles, dict), "packed mode takes one handle dict per update"
        uuid = gpu_uuid(gpu)
        if uuid not in info.ipc_handles:
            raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(info.ipc_handles)}")
        # rebuild_cuda_tensor's arguments: size, stride, offset, ..., handle, storage size (reductions.py)
        _, size, _, offset, _, _, _, handle, storage_bytes, *_ = info.ipc_handles[uuid]
        path = handle.decode()
        made_on = int(_FILE.match(os.path.basename(path)).group(1))
        assert made_on == gpu, f"the worker on GPU {gpu} opened a CUDA IPC handle of memory on GPU {made_on}"
        raw = torch.from_file(path, shared=False, size=int(storage_bytes), dtype=torch.uint8)
        packed = raw[offset:offset + size[0]][:sum(info.tensor_sizes)]  # packed_ipc_consumer's content
        dtypes = [getattr(torch, name) for name in info.dtype_names]
        return [(name, tensor.clone())
                for name, tensor in unpack_tensor(packed, info.names, info.shapes, dtypes, info.tensor_sizes)]
