"""Run Megatron's optimizer on CPU when the CPU compatibility layer is active.

Measured with megatron-core 0.16.1 and CPU torch, outside what ``megatron_rl.distributed.cpu_compat``
covers on its own: ``clip_grad_by_total_norm_fp32`` and the optimizer wrappers assert
``grad.type() == "torch.cuda.FloatTensor"``. ``optimizer_device_scope()`` answers ``type()`` with the CUDA
name while the optimizer is built or stepped (their ``torch.tensor(..., device="cuda")`` allocations are
the layer's factory wrappers' job); with CUDA it is a no-op.
"""

from __future__ import annotations

import contextlib

from megatron_rl.distributed.cpu_compat import cpu_compat_installed, cuda_type_names


def optimizer_device_scope() -> contextlib.AbstractContextManager:
    return cuda_type_names() if cpu_compat_installed() else contextlib.nullcontext()
