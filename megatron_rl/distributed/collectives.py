"""Which device a collective's tensors must live on.

NCCL moves only CUDA tensors and gloo only CPU ones; code that builds a tensor just to all-reduce a
number (a max difference, a flag) asks ``backend_device(group)`` instead of assuming CPU, so the same
line runs under gloo on a CPU machine and under NCCL on a cluster. ``megatron_rl_testing.nccl_like``
checks it on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """``cuda`` (this rank's current device) when ``group`` uses NCCL, else ``cpu``."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda")
    return torch.device("cpu")
