"""Megatron-Core 0.16.1's MoE and MLA code without Transformer Engine: one name it leaves undefined, one flag
it sets wrongly.

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


def disable_mla_te_check_without_te() -> None:
    """Megatron-Core 0.16.1's multi_latent_attention.py imports TELinear from extensions/transformer_engine.py,
    which without Transformer Engine defines its TE classes on a MagicMock: the import succeeds, the module sets
    ``HAVE_TE = True``, and ``MultiLatentAttention.__init__`` then calls ``isinstance(linear_proj, TELinear)``
    with a MagicMock instance, a TypeError. That flag only gates this FP8/FP4 TELinear test; it is set to what
    is true (TE absent). Idempotent; changes nothing when Transformer Engine is installed."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
