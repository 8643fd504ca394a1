"""Shims that let Megatron-Core 0.16.1 run on a machine without CUDA (gloo, CPU tensors).

Megatron-Core assumes a GPU in a handful of places. Measured on megatron-core 0.16.1 with a CPU-only
torch, these are the calls that fail and what this module answers instead:

* RNG tracker: ``CudaRNGStatesTracker.add/fork`` read and write CUDA generator states. We install
  Megatron's own inference tracker, whose ``add``/``fork`` are no-ops, so dropout and initialisation
  draw from the CPU generator.
* ``torch.cuda.current_device()``: used as ``device=`` when layers, rotary tables and pipeline
  receive buffers are allocated. Answered with ``torch.device("cpu")``.
* ``torch.cuda.synchronize()``: called after p2p communication and barriers. A no-op.
* ``Tensor.cuda()``: GPTModel moves the tied output-layer copy of the embedding to "cuda" before
  all-reducing it across pipeline stages (and dist_checkpointing moves exchanged shards). Returns
  the tensor unchanged.
* ``device="cuda"`` tensor creation: pipeline schedules (a token counter per step), the optimizers
  (``FP32Optimizer._scale``, ``found_inf``), gradient clipping. In megatron-core 0.16.1 these are all
  calls of torch's factory functions (``torch.tensor/zeros/ones/empty/empty_like/randn``, ...), so
  those functions are wrapped to turn a CUDA ``device=`` into CPU. Why not a ``TorchFunctionMode``
  (it was one): a mode sends every torch op of the thread through a Python handler, the HF engine's
  generation included — 8,000 calls and ~20 % of a demo-sized CPU step. The wrappers cost a dict
  look-up on factory calls only.
* ``tensor.type() == "torch.cuda.FloatTensor"`` checks in the optimizers and gradient clipping: only
  there, so ``workers.optimizer_device.optimizer_device_scope`` opens ``cuda_type_names()`` (``type()``
  answers with the CUDA name) while the optimizer is built or stepped.
* CUDA streams (MoE only): the all-to-all token dispatcher creates a side stream when it is built and
  copies its split sizes to the host on it (``torch.cuda.Stream()``, ``torch.cuda.stream(s)``,
  ``current_stream()``, ``wait_stream``, ``record_event().synchronize()``). On CPU every op is already
  synchronous and those tensors are host tensors, so the stream objects only need to exist: a no-op
  stream and event stand in for them.
* MoE all-to-all split sizes: the dispatcher hands its split sizes to ``all_to_all_single`` after
  ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors (to numpy). On CPU
  they stay tensors, and torch's ``all_to_all_single`` wants a sequence of ints (TypeError). The
  dispatcher's copy of the function is replaced by one that converts host tensors too, i.e. gives
  what the GPU path gives.

Everything is installed by one call, ``install_cpu_compat()``, which returns a handle (also a context
manager) that restores the originals; nesting is reference-counted, and the shims are process-wide.
With CUDA present the call changes nothing, so the same code runs on GPU clusters untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" to torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Inside: ``tensor.type()`` (no arguments) answers with the CUDA name, "torch.cuda.FloatTensor" for a
    CPU float tensor, which Megatron's optimizers and gradient clipping assert on. Patches the method (not
    a torch-function mode: that would put every op of the optimizer step through Python); process-wide
    while open, so keep it around the optimizer only. Nests."""
    original = torch.Tensor.type

    def type_with_cuda_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if args or kwargs or ".cuda." in result:  # a conversion, or already a CUDA name
            return result
        return result.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_with_cuda_name
    try:
        yield
    finally:
        torch.Tensor.type = original


# torch's factory functions that take ``device=`` (the ones megatron-core 0.16.1 calls with "cuda", and
# their siblings, so a new call site of the same kind is covered too)
FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
    "zeros_like", "ones_like", "empty_like", "full_like", "randn_like",
)
_CPU = torch.device("cpu")


def _factory_on_cpu(factory: Any) -> Any:
    """``factory`` with a CUDA ``device=`` (string, torch.device or ordinal) answered on the CPU."""

    def create(*args: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    create.__name__ = create.__qualname__ = factory.__name__
    create.__doc__ = factory.__doc__
    return create


def _host_splits_as_numpy(original: Any) -> Any:
    """``maybe_move_tensor_to_cpu`` that also returns host tensors as numpy when ``as_numpy`` is asked."""

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_synchronize(device: Any = None) -> None:
    """CPU ops are synchronous; nothing to wait for."""


def _cpu_get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.uint8)


def _cpu_set_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _tensor_stays_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


class _CpuEvent:
    """Stands in for torch.cuda.Event: CPU work is done when it was issued."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _CpuStream:
    """Stands in for torch.cuda.Stream (see the module docstring: MoE's token dispatcher)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(device: Any = None) -> _CpuStream:
    return _CPU_STREAM


class _cpu_stream_context:
    """``with torch.cuda.stream(s):`` on CPU: nothing to switch."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        pass


class CpuCompatHandle:
    """Undo token for ``install_cpu_compat``; usable as a context manager."""

    def __init__(self, active: bool):
        self.active = active
        self._released = False

    def uninstall(self) -> None:
        if self._released:
            return
        self._released = True
        if self.active:
            _release()

    def __enter__(self) -> CpuCompatHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


_lock = threading.Lock()
_install_count = 0
_saved: dict[str, Any] = {}


def cpu_compat_installed() -> bool:
    return _install_count > 0


def install_cpu_compat(force: bool = False) -> CpuCompatHandle:
    """Install the CPU shims when CUDA is unavailable (or ``force=True``, for tests).

    Returns a handle; ``handle.uninstall()`` (or leaving ``with install_cpu_compat():``) restores
    Megatron and torch exactly as they were once the last holder releases.
    """
    global _install_count
    if torch.cuda.is_available() and not force:
        return CpuCompatHandle(active=False)
    with _lock:
        if _install_count == 0:
            _apply()
        _install_count += 1
    return CpuCompatHandle(active=True)


def _apply() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    _saved["rng_tracker"] = (
        mcore_random._CUDA_RNG_STATE_TRACKER,
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Activation recompute (override_transformer_config.recompute_granularity) saves and restores the
    # "CUDA" RNG state around each checkpointed chunk; there is none on CPU (the CPU state is kept
    # by Megatron separately), so the device state is a placeholder and restoring it does nothing.
    _saved["cuda_rng"] = (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state)
    mcore_random._get_cuda_rng_state = _cpu_get_cuda_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_cuda_rng_state

    _saved["current_device"] = torch.cuda.current_device
    _saved["synchronize"] = torch.cuda.synchronize
    _saved["tensor_cuda"] = torch.Tensor.cuda
    _saved["streams"] = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = (
        _CpuStream, _cpu_current_stream, _cpu_stream_context
    )
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    torch.Tensor.cuda = _tensor_stays_on_cpu

    from megatron.core.transformer.moe import token_dispatcher

    _saved["moe_splits"] = token_dispatcher.maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _host_splits_as_numpy(_saved["moe_splits"])

    # torch's device context (``with torch.device("meta")``, which transformers builds models under) finds the
    # factory calls it must place by identity in a set made once, on first use: make it now, from the real
    # functions, or it would hold the wrappers and miss every call (they call the real ones): transformers'
    # meta-device init then made real tensors and left RoPE's inv_freq uninitialised (garbage logits)
    from torch.utils._device import _device_constructors

    _device_constructors()
    _saved["factories"] = {name: getattr(torch, name) for name in FACTORIES}
    for name, factory in _saved["factories"].items():
        setattr(torch, name, _factory_on_cpu(factory))


def _release() -> None:
    global _install_count
    with _lock:
        _install_count -= 1
        if _install_count > 0:
            return
        from megatron.core.tensor_parallel import random as mcore_random

        for name, factory in _saved.pop("factories").items():
            setattr(torch, name, factory)
        (
            mcore_random._CUDA_RNG_STATE_TRACKER,
            mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        ) = _saved.pop("rng_tracker")
        mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state = _saved.pop("cuda_rng")
        torch.cuda.current_device = _saved.pop("current_device")
        torch.cuda.synchronize = _saved.pop("synchronize")
        torch.Tensor.cuda = _saved.pop("tensor_cuda")
        torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = _saved.pop("streams")
        from megatron.core.transformer.moe import token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _saved.pop("moe_splits")
