"""A CPU stand-in for NCCL's one rule that gloo does not enforce: a collective's tensors must be on the
GPU. A test tool: the product never imports it.

Inside ``with nccl_like():`` the process group answers ``get_backend() == "nccl"`` and every tensor
that would be on CUDA on a GPU machine carries a mark: tensors created with a CUDA ``device=`` (which
the CPU compatibility layer turns into CPU tensors), moved with ``.cuda()`` / ``.to("cuda")``, or
computed from marked tensors. Every tensor collective (all_reduce, broadcast, all_gather, ...) asserts
that all its tensors carry the mark, naming the collective, the tensor's shape and dtype, so a CPU
tensor handed to an NCCL collective fails here as it would crash there. Tensors that the scope did not
create (model parameters built before it) are unmarked: enter it around the code under test only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

MARK = "_megatron_rl_on_device"
TENSOR_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
    "isend", "irecv",
)


class NcclDeviceError(AssertionError):
    """A collective got a tensor that would be on the CPU under NCCL."""


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(obj)[0] if isinstance(leaf, torch.Tensor)]


def _mark(obj: Any) -> None:
    for tensor in _tensors(obj):
        try:
            setattr(tensor, MARK, True)
        except (AttributeError, RuntimeError):  # e.g. a tensor type without __dict__
            pass


def on_device(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, MARK, False))


class _MarkDeviceTensors(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wants_cuda = _is_cuda(kwargs.get("device"))
        if func in (torch.Tensor.to, torch.Tensor.cuda) and not wants_cuda:
            wants_cuda = func is torch.Tensor.cuda or any(_is_cuda(a) for a in args[1:])
            if wants_cuda and func is torch.Tensor.to:  # the CPU machine has no CUDA: stay, but marked
                args = (args[0], *[a for a in args[1:] if not _is_cuda(a)])
        if wants_cuda:
            kwargs = {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs
        if func is torch.Tensor.cuda:
            result = args[0]
        else:
            result = func(*args, **kwargs)
        if wants_cuda or any(on_device(t) for t in _tensors((args, kwargs))):
            _mark(result)
        return result


def _marking(factory):
    """A torch factory whose CUDA ``device=`` calls give marked tensors. Needed on top of the mode: the CPU
    compatibility layer wraps the same factories and turns their CUDA device into the CPU before torch (and
    so the mode) sees the call."""

    def create(*args: Any, **kwargs: Any) -> torch.Tensor:
        result = factory(*args, **kwargs)
        if _is_cuda(kwargs.get("device")):
            _mark(result)
        return result

    return create


def _checked(name: str, collective):
    def wrapper(*args: Any, **kwargs: Any):
        for tensor in _tensors((args, kwargs)):
            if not on_device(tensor):
                raise NcclDeviceError(
                    f"torch.distributed.{name}: tensor of shape {tuple(tensor.shape)} ({tensor.dtype}) is on the "
                    "CPU, but the process group's backend is NCCL, which needs CUDA tensors; create it on "
                    "megatron_rl.distributed.collectives.backend_device(group)"
                )
        return collective(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def nccl_like() -> Iterator[None]:
    """See the module docstring. Not thread-safe; for tests."""
    from megatron_rl.distributed.cpu_compat import FACTORIES

    saved = {name: getattr(dist, name) for name in TENSOR_COLLECTIVES if hasattr(dist, name)}
    saved_factories = {name: getattr(torch, name) for name in FACTORIES}
    saved_backend = dist.get_backend
    saved_cuda = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):  # CPU torch has no CUDA: the tensor stays, marked
        _mark(self)
        return self

    mode = _MarkDeviceTensors()
    try:
        for name, collective in saved.items():
            setattr(dist, name, _checked(name, collective))
        dist.get_backend = lambda group=None: "nccl"
        torch.Tensor.cuda = cuda
        for name, factory in saved_factories.items():
            setattr(torch, name, _marking(factory))
        with mode:
            yield
    finally:
        for name, collective in saved.items():
            setattr(dist, name, collective)
        dist.get_backend = saved_backend
        torch.Tensor.cuda = saved_cuda
        for name, factory in saved_factories.items():
            setattr(torch, name, factory)
