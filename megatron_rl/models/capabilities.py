"""What this Python environment can give Megatron, asked without importing Megatron-Core.

The planner (before launch) and the engine (when it builds) ask the same questions, so a setting the
engine would refuse is refused before any worker starts.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def fused_adam_source() -> str | None:
    """``transformer_engine`` or ``apex`` when that package's FusedAdam imports (the check
    Megatron-Core 0.16.1's distrib_optimizer.py makes for HAVE_APEX_OR_TE), else None."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401

        return "transformer_engine"
    except Exception:  # ImportError, or a TE build that fails to load its CUDA library
        pass
    try:
        from apex.optimizers import FusedAdam  # noqa: F401

        return "apex"
    except Exception:
        return None


DISTRIBUTED_OPTIMIZER_NEEDS = (
    "needs Transformer Engine or Apex (their FusedAdam): Megatron-Core 0.16.1's distributed optimizer "
    "with torch's Adam cannot load a checkpoint before its first step (the optimizer state 'step' is "
    "missing), so resuming would fail; neither transformer_engine.pytorch.optimizers.FusedAdam nor "
    "apex.optimizers.FusedAdam imports here"
)


def distributed_optimizer_blocker() -> str | None:
    """Why ``use_distributed_optimizer=true`` cannot be had here, or None when it can."""
    return None if fused_adam_source() is not None else DISTRIBUTED_OPTIMIZER_NEEDS
