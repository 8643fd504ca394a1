"""Run Megatron's optimizer on CPU when the CPU compatibility layer is active.

Measured with megatron-core 0.16.1 and CPU torch, outside what ``megatron_rl.distributed.cpu_compat``
covers: the optimizer wrappers allocate ``torch.tensor(..., device="cuda")`` (loss scale, norm
buffers) and ``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == "torch.cuda.FloatTensor"``.
``optimizer_device_scope()`` redirects both while the optimizer is built or stepped; with CUDA it is
a no-op.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_rl.distributed.cpu_compat import CudaToCpuMode, cpu_compat_installed


class _OptimizerCpuMode(CudaToCpuMode):
    """CUDA device arguments go to CPU, and a CPU tensor's ``.type()`` answers with the CUDA name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = args[0].type()  # this mode is off inside its own handler: no recursion
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return super().__torch_function__(func, types, args, kwargs)


def optimizer_device_scope() -> contextlib.AbstractContextManager:
    return _OptimizerCpuMode() if cpu_compat_installed() else contextlib.nullcontext()
