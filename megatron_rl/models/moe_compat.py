"""Megatron-Core 0.16.1's MoE code without Transformer Engine: one name it leaves undefined.

``moe_utils.RouterGatingLinearFunction`` (the router's matmul) tests ``te_general_gemm is not None``, but
``te_general_gemm`` is only bound when Transformer Engine imports; without TE the test raises NameError
(CPU runs, or GPUs without TE). Binding it to None selects the plain ``torch.mm`` path the function
already has. The fused permute/router kernels are turned off by the builder (moe_permute_fusion /
moe_router_fusion false), so no other TE name is reached.
"""

from __future__ import annotations


def bind_missing_te_names() -> None:
    """Idempotent; changes nothing when Transformer Engine is installed (the name is then bound)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
